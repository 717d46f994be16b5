"""The contract of a KV transfer: what moves (`TransferSpec`), the states it passes through
(`TransferState`), how it fails (typed errors), and the two ends (`KVSender`, `KVReceiver`).

A transfer moves the KV of some layers of one request from blocks of the sender's cache into
blocks the receiver reserved, layer by layer, in the order of `spec.layers`. The owner of each end
learns of the end of a transfer by polling; blocks are handed back through `on_release`, which the
transport calls exactly once per transfer, on the owner's thread, from inside poll/wait/abort/reap:

- receiver: on FAILED or ABORTED (on DONE the blocks now hold the request's KV and stay reserved);
- sender: on every terminal state (DONE, FAILED, ABORTED): the transport no longer reads the blocks.
"""

from __future__ import annotations

import abc
import enum
import math
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from tandem.kv_transfer.spec import TransferSpec

ReleaseCallback = Callable[[str], None]


class TransferState(enum.Enum):
    WAITING = "waiting"            # registered, no layer has moved yet
    TRANSFERRING = "transferring"  # at least one layer moved, not all
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


class KVTransferError(RuntimeError):
    """A transfer failed: peer gone, protocol violation, layout mismatch."""


class KVTransferTimeout(KVTransferError):
    """A wait ran past its deadline (slow or hung peer, or the caller's own timeout)."""


class KVTransferAborted(KVTransferError):
    """One side aborted the transfer."""


def layer_runs(layers: list[int]) -> list[tuple[int, range]]:
    """Split a message's layers into runs of consecutive layer numbers: (offset in the message,
    layers). A prefill's layers 0..L-1 are one run, so a message is one gather and one scatter."""
    runs: list[tuple[int, range]] = []
    for i, layer in enumerate(layers):
        if runs and runs[-1][1].stop == layer:
            runs[-1] = (runs[-1][0], range(runs[-1][1].start, layer + 1))
        else:
            runs.append((i, range(layer, layer + 1)))
    return runs


def device_index(store: "BlockStore", block_ids: "list[int] | tuple[int, ...]", stream: Any,
                 user: Any, pinned: "PinnedIndexRing | None" = None) -> torch.Tensor:
    """`block_ids` as an index on the store's device, for kernels queued on stream `user`. On
    CUDA the copy runs on `stream`, one the caller keeps idle, and `user` is ordered after it.
    With a `pinned` ring the ids go through page-locked memory, an asynchronous copy of a few
    microseconds; without it (or when they do not fit) from pageable memory, which waits for
    `stream` to drain (hence an idle one: on `user`, which waits for the wire or for a prefill's
    layers, that would block the transport's thread) and costs ~100 us of host time."""
    if stream is None:
        return store.block_index(list(block_ids))
    with torch.cuda.stream(stream):
        host = pinned.take(block_ids, stream) if pinned is not None else None
        index = store.block_index(host.to(store.device, non_blocking=True) if host is not None
                                  else list(block_ids))
        if host is not None:
            pinned.copied(stream)
    user.wait_stream(stream)
    return index


def machine_id() -> str:
    """This machine's identity for a direct copy's same-host check: the kernel's boot id (shared by
    the containers of one node, different on every other machine), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class PinnedIndexRing:
    """Page-locked memory for block-id copies, allocated once when a transport thread starts (a
    pinned allocation serializes the device's streams, so never on a transfer's path): `slots`
    slots of up to `slot_ids` ids, reused in turn once the copy out of a slot has completed.
    One thread only."""

    def __init__(self, slots: int = 8, slot_ids: int = 16384):
        self.slot_ids = slot_ids
        self._mem = torch.empty((slots, slot_ids), dtype=torch.long, pin_memory=True)
        self._np = self._mem.numpy()         # the same memory: ids go in with one numpy store
        self._events: list[Any] = [None] * slots
        self._next = 0

    def take(self, block_ids: "list[int] | tuple[int, ...]", stream: Any) -> torch.Tensor | None:
        """The ids in a pinned slot (None: too many for one), for a copy queued next on `stream`."""
        n = len(block_ids)
        if n > self.slot_ids:
            return None
        event = self._events[self._next]
        if event is not None:
            event.synchronize()          # the copy out of this slot, long done in practice
        self._np[self._next, :n] = block_ids
        return self._mem[self._next, :n]

    def copied(self, stream: Any) -> None:
        """The copy out of the slot just taken is queued on `stream`."""
        event = torch.cuda.Event()
        event.record(stream)
        self._events[self._next] = event
        self._next = (self._next + 1) % len(self._events)


@runtime_checkable
class BlockStore(Protocol):
    """The KV cache of one actor, layout-agnostic: the transport only gathers and scatters whole
    blocks of a run of consecutive layers (one kernel per message, not one per layer). Llama: a
    layer's payload for n blocks is [2, n, block_size, Hkv, D] (K and V, blocks on dim 1: one
    index_select of a view of the cache, no transpose copy); an MLA cache would have one latent per
    token instead. `block_ids` may be a list or a long tensor on the store's
    device (the transport builds that index once per transfer, not once per layer)."""
    num_layers: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device

    def gather_layers(self, layers: range, block_ids: "list[int] | torch.Tensor",
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Contiguous copy of those blocks of consecutive `layers`, [len(layers),
        *block_payload_shape(n)]; into `out` (a contiguous tensor of that shape, e.g. a message
        buffer) if given."""
        ...

    def scatter_layers(self, layers: range, block_ids: "list[int] | torch.Tensor", data: torch.Tensor) -> None:
        """Write `data` (shaped like `gather_layers`' result) into those blocks of `layers`."""
        ...

    def block_index(self, block_ids: "list[int] | torch.Tensor") -> torch.Tensor:
        """Block ids as a long tensor on the store's device, built without waiting for the
        device (the transport builds one per transfer and end, not one per message)."""
        ...

    def block_payload_shape(self, n_blocks: int) -> tuple[int, ...]:
        ...

    # ---- direct copies (kv_transfer.direct_send / direct_recv) --------------------------------
    # `tensor` is the whole cache, [num_layers, 2, num_blocks, block_size, Hkv, D]: a receiver
    # compares a mapped peer cache's layout with it.
    tensor: torch.Tensor

    def share(self, tensor: torch.Tensor | None = None) -> bytes | None:
        """A handle through which another process of this host maps `tensor` (default: the whole
        cache); None where it cannot be shared (then the data goes through the link)."""
        ...

    def open_shared(self, handle: bytes) -> torch.Tensor:
        """Map a peer's `share` handle into this process; raises where it cannot."""
        ...

    def copy_from_peer(self, peer: torch.Tensor, layers: range, src_index: torch.Tensor,
                       dst_index: torch.Tensor) -> None:
        """This cache's blocks `dst_index` of `layers` <- the same layers' blocks `src_index` of
        `peer` (a mapped cache of this layout), one kernel on the current stream; source ids are
        clamped into the peer's cache."""
        ...


class KVSender(abc.ABC):
    """The prefill end. `begin(spec)` registers a transfer; `send_layer` queues one layer as soon
    as its KV is written (prefill streams layer L while computing L+1) and returns at once; the
    bytes move on a background thread per peer. `send(spec)` is begin + every layer."""

    @abc.abstractmethod
    def begin(self, spec: TransferSpec) -> None: ...

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int, ready_event: Any = None) -> None:
        """Queue `layer`, which must be the next one of the spec's layers. `ready_event`: a CUDA
        event recorded after the layer's KV was written; the copy waits on it on a side stream
        (None: the caller's current stream at this call). Ignored on CPU."""

    def send(self, spec: TransferSpec) -> None:
        self.begin(spec)
        for layer in spec.layers:
            self.send_layer(spec.request_id, layer)

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferState:
        """Non-blocking. Raises KeyError for an unknown (or long-forgotten) request."""

    @abc.abstractmethod
    def progress(self, request_id: str) -> tuple[int, int]:
        """(layers whose data has left, layers in the spec)."""

    @abc.abstractmethod
    def wait(self, request_id: str, timeout: float) -> TransferState:
        """Block until terminal; DONE is returned, FAILED/ABORTED raise the typed error. On
        timeout the transfer fails (KVTransferTimeout) and its blocks are released."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop sending; the receiver learns in-band and releases its blocks. Idempotent."""

    @abc.abstractmethod
    def reap(self) -> list[tuple[str, TransferState]]:
        """Run pending release callbacks; return transfers that became terminal since last reap."""

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(abc.ABC):
    """The decode end. `expect(spec)` posts the receive of a transfer into reserved blocks; layers
    must arrive in the spec's order and are scattered as they arrive, on a background thread."""

    @abc.abstractmethod
    def expect(self, spec: TransferSpec) -> None: ...

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferState:
        """Non-blocking; also fails transfers past their deadline (KVTransferTimeout)."""

    @abc.abstractmethod
    def progress(self, request_id: str) -> tuple[int, int]:
        """(layers received, layers expected)."""

    @abc.abstractmethod
    def wait(self, request_id: str, timeout: float) -> TransferState:
        """Block until terminal; DONE is returned, FAILED/ABORTED raise the typed error. On
        timeout the transfer fails (KVTransferTimeout) and on_release runs."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Release the blocks now (on_release runs before this returns, unless a layer is being
        scattered into them at this instant: then right after it lands, at the next poll/reap);
        late data for the request is discarded and the sender is told to stop. Idempotent."""

    @abc.abstractmethod
    def reap(self) -> list[tuple[str, TransferState]]:
        """Run pending release callbacks, fail expired transfers; return transfers that became
        terminal since the last reap (the decode loop admits DONE ones)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class StagingRing:
    """Message buffers of one transport thread, carved in FIFO order from one allocation of
    `capacity` bytes made on first use (the window: max_inflight_messages * max_message_bytes). So
    a transfer makes no device allocation: on a miss the caching allocator calls cudaMalloc, and a
    device allocation (like a pinned one) serializes the device's streams, so the actor's next
    engine step would wait for whatever is in flight there, a KV receive waiting on a prefill
    among them. Both ends retire messages in the order they took them, so a ring fits: buffers
    of any size (batches smaller than the window, messages of a partial batch) without
    fragmentation. A buffer that does not fit gets a tensor of its own. One thread only."""

    ALIGN = 512

    @dataclass(eq=False)
    class Lease:
        start: int
        end: int
        done: bool = False

    def __init__(self, capacity: int, device: torch.device):
        self.capacity, self.device = capacity, device
        self._leases: deque[StagingRing.Lease] = deque()
        self._mem: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> "tuple[torch.Tensor, StagingRing.Lease | None]":
        """A contiguous buffer of that shape and its lease (None: a tensor of its own)."""
        nbytes = math.prod(shape) * dtype.itemsize
        placed = self._step(self._state(), nbytes)
        if placed is None:
            return torch.empty(shape, dtype=dtype, device=self.device), None
        if self._mem is None:
            self._mem = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        at = placed[0]
        lease = StagingRing.Lease(at, at + nbytes)
        self._leases.append(lease)
        return self._mem[at:at + nbytes].view(dtype).view(shape), lease

    def memory(self) -> torch.Tensor:
        """The ring's one allocation (made now if not yet): what a direct copy shares."""
        if self._mem is None:
            self._mem = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self._mem

    def give(self, lease: "StagingRing.Lease | None") -> None:
        """Nothing queued reads or writes that buffer any more (any order; space is reclaimed
        from the oldest and the newest ends)."""
        if lease is None:
            return
        lease.done = True
        while self._leases and self._leases[0].done:
            self._leases.popleft()
        while self._leases and self._leases[-1].done:
            self._leases.pop()

    def fits(self, sizes: list[int]) -> bool:
        """Would buffers of these byte sizes, taken in order now, all come from the ring?"""
        state = self._state()
        for n in sizes:
            placed = self._step(state, n)
            if placed is None:
                return False
            state = placed[1]
        return True

    @property
    def idle(self) -> bool:
        return not self._leases

    def _state(self) -> tuple[int, int, bool] | None:
        """None when empty, else (head: where the next buffer would start, tail: the oldest's
        start, wrapped: the newest lie before the oldest)."""
        if not self._leases:
            return None
        newest, oldest = self._leases[-1], self._leases[0]
        return _align(newest.end, self.ALIGN), oldest.start, newest.start < oldest.start

    def _step(self, state: tuple[int, int, bool] | None, n: int) -> tuple[int, tuple[int, int, bool]] | None:
        """Where a buffer of n bytes goes in `state`, and the state after it; None: no room."""
        if n > self.capacity:
            return None
        if state is None:
            return 0, (_align(n, self.ALIGN), 0, False)
        head, tail, wrapped = state
        if not wrapped and head + n <= self.capacity:
            return head, (_align(head + n, self.ALIGN), tail, False)
        if not wrapped:
            return (0, (_align(n, self.ALIGN), tail, True)) if n <= tail else None
        return (head, (_align(head + n, self.ALIGN), tail, True)) if head + n <= tail else None


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def plan_messages(n_layers: int, per_msg: int) -> list[int]:
    """How many layers each message of `n_layers` ready layers carries: as few messages of at most
    `per_msg` layers as possible, of sizes within one layer of each other. (Measured on the H200
    pair: a small first or last message to shorten the gather before the wire or the scatter after
    it made an 8k transfer 5-10% slower; every extra message costs ~0.3 ms of host time.)"""
    k = -(-n_layers // per_msg)
    return [n_layers // k + (i < n_layers % k) for i in range(k)]
