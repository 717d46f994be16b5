"""torch.distributed point-to-point links between actors: gloo between CPU caches, NCCL between GPU
caches, one code path (the backend follows the cache's device).

Pairs, not a world: each (sender id, receiver id) gets its own 2-rank group, made on first use and
cached, the sender rank 0 (a pair is directional: on NCCL, one communicator carrying sends both
ways between the same two ranks could deadlock). The process groups are built directly (`ProcessGroupGloo(store, rank,
2, timeout)`, `ProcessGroupNCCL(store, rank, 2, options)`) so no process-global default group is
touched and one actor can hold any number of pairs. Rendezvous goes through one TCPStore that the
controller hosts, under a per-pair PrefixStore:

    kv/nonce/<actor id>                          each process's incarnation (uuid), set at start
    kv/pair/<sender>/<receiver>/<r nonce>/gens   generation counter (store.add by the sender)
    kv/pair/.../offer                            the generation the sender is rendezvousing on
    kv/pair/.../g<gen>/{gloo,nccl}/...           that generation's group rendezvous keys
    kv/pair/.../g<gen>/broken                    set by a receiver that gave that generation up
    kv/pair/.../g<gen>/uds, uds_ok               the sender's host and frame socket; whether the
                                                 receiver connected to it
    kv/pair/.../g<gen>/direct                    the receiver's answer to the direct-copy offer
    kv/abort/<sender>/<receiver>/<request id>    a receiver's abort, read by the sender
    kv/epoch/<receiver>                          a counter the receiver bumps when it starts, marks a
                                                 pair broken or posts an abort

The sender picks each generation (a fresh counter value per connect) and offers it; the receiver
joins the newest offer it has not used before. So a restarted sender (same id, new process) or a
rebuilt link never meets stale keys: the receiver waits for an offer newer than the generation that
broke. A restarted receiver has a new nonce, hence a fresh key space; the sender checks the
receiver's nonce and the `broken` mark before each transfer, so it rebuilds instead of failing:
three lookups, unless the receiver's epoch counter (one lookup) shows nothing changed since the
last time it did.

Control frames travel on a Unix socket between the two processes when they share a host (made at
connect, next to the groups: a frame costs a syscall and a wake-up, ~50 us, where a gloo send and
receive cost ~0.3 ms, which sat on every transfer's critical path), else on the gloo group (CPU):
either way an idle receiver keeps a frame receive posted, which costs a blocked thread, where on
NCCL it would be a kernel spinning on the GPU. On GPU
actors the data goes on a second, NCCL, group of the same pair, only after its frame announced it.
The store is used for rendezvous and the rare abort notice, never per layer: it is one central
server and each lookup is a round trip to it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tandem.kv_transfer.base import BlockStore, KVTransferError, KVTransferTimeout, ReleaseCallback
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.dist_link import DistLink
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender

def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def start_rendezvous_store(host: str = "127.0.0.1", port: int = 0,
                           timeout_s: float = 300.0) -> tuple[dist.TCPStore, int]:
    """Host the store (the controller does this once); workers get "host:port"."""
    store = dist.TCPStore(host, port, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port


def connect_store(address: str, timeout_s: float = 60.0) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)



class DistConnector:
    """One per actor process; owns its pair groups. Thread-safe."""

    def __init__(self, self_id: str, store: dist.Store | str, device: torch.device | str,
                 config: KVTransferConfig = KVTransferConfig(), tp_size: int = 1):
        """`tp_size`: this worker's tensor_parallel_size, published for its peers (`peer_tp`)."""
        self.self_id = self_id
        self.tp_size = tp_size
        self._peer_tp: dict[str, int] = {}
        self.config = config
        self.store = connect_store(store, config.connect_timeout_s) if isinstance(store, str) else store
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.nonce = uuid.uuid4().hex[:12]
        self.store.set(f"kv/nonce/{self_id}", self.nonce)
        self.store.set(f"kv/tp/{self_id}", str(tp_size))
        self._bump_epoch()                     # a restart: senders check this pair afresh
        self.links_created = 0
        self._joined: dict[str, int] = {}     # receiver: peer -> last generation joined
        self._live: list[DistLink] = []
        self._lock = threading.Lock()

    def set_store(self, address: str) -> None:
        """Rendezvous through another store from now on (a restarted controller's): this actor's
        nonce is published there again, so the links it has stay current; new links (and links
        re-made after an error) meet there. The pair groups already made never touch a store."""
        store = connect_store(address, self.config.connect_timeout_s)
        with self._lock:
            self.store = store
            self._joined.clear()       # the new store's offers start again from 1
        store.set(f"kv/nonce/{self.self_id}", self.nonce)
        store.set(f"kv/tp/{self.self_id}", str(self.tp_size))
        self._bump_epoch()

    def peer_tp(self, worker_id: str) -> int:
        """A peer worker's tensor_parallel_size (as it published it; a worker id keeps its pool's)."""
        size = self._peer_tp.get(worker_id)
        if size is None:
            size = self._peer_tp[worker_id] = int(self._get(f"kv/tp/{worker_id}", self.config.connect_timeout_s))
        return size

    def group_count(self) -> int:
        """Pairs currently connected (each is one gloo group, plus one NCCL group on GPU)."""
        with self._lock:
            return len(self._live)

    def connect(self, peer_id: str, as_sender: bool) -> DistLink:
        timeout = self.config.connect_timeout_s
        try:
            if as_sender:
                receiver_nonce = self._get(f"kv/nonce/{peer_id}", timeout)
                base = f"kv/pair/{self.self_id}/{peer_id}/{receiver_nonce}"
                gen = int(self.store.add(f"{base}/gens", 1))
                self.store.set(f"{base}/offer", str(gen))
            else:
                receiver_nonce = self.nonce
                base = f"kv/pair/{peer_id}/{self.self_id}/{receiver_nonce}"
                gen = self._newer_offer(base, self._joined.get(peer_id, 0), timeout)
                self._joined[peer_id] = gen
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(f"rendezvous with {peer_id!r}: store: {exc}") from None
        rank = 0 if as_sender else 1
        prefix = f"{base}/g{gen}/"
        try:
            ctrl = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "gloo", self.store), rank, 2,
                                         timedelta(seconds=timeout))
            data = ctrl if self.backend == "gloo" else _nccl_group(
                dist.PrefixStore(prefix + "nccl", self.store), rank, timeout,
                self.config.nccl_high_priority)
            frames = _frame_socket(self.store, prefix, as_sender, timeout, self.config.unix_frames)
            link = DistLink(self, peer_id, receiver_nonce, base, gen, rank, ctrl, data, frames)
        except Exception as exc:
            if as_sender:      # withdraw the offer, so a receiver arriving later waits for the next
                self._withdraw_offer(base, gen)
            raise KVTransferError(f"rendezvous with {peer_id!r} (generation {gen}) failed: "
                                  f"{str(exc)[:300]}") from None
        if self.backend == "nccl":     # make the NCCL communicator now, not on the first layer
            probe = torch.zeros(1, device=self.device)
            try:
                (link.send_data if as_sender else link.recv_data)(probe, timeout)
            except KVTransferError:
                link.close(broken=True)
                raise
        with self._lock:
            self._live.append(link)
            self.links_created += 1
        return link

    def is_current(self, link: DistLink) -> bool:
        """Sender side, once per transfer: two store lookups."""
        try:
            return (self.store.get(f"kv/nonce/{link.peer_id}").decode() == link.receiver_nonce
                    and not self.store.check([f"{link.base}/g{link.gen}/broken"]))
        except Exception:
            return False

    def peer_epoch(self, peer_id: str) -> int | None:
        try:
            return int(self.store.add(f"kv/epoch/{peer_id}", 0))
        except Exception:
            return None

    def post_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None:
        self.store.set(_abort_key(sender_id, receiver_id, request_id), "1")
        self._bump_epoch()        # after the key: a sender that sees the new epoch finds it

    def abort_posted(self, sender_id: str, receiver_id: str, request_id: str) -> bool:
        try:
            return self.store.check([_abort_key(sender_id, receiver_id, request_id)])
        except Exception:
            return False

    def clear_abort(self, sender_id: str, receiver_id: str, request_id: str) -> None:
        self.store.delete_key(_abort_key(sender_id, receiver_id, request_id))

    def _get(self, key: str, timeout: float) -> str:
        self.store.wait([key], timedelta(seconds=timeout))
        return self.store.get(key).decode()

    def _newer_offer(self, base: str, used: int, timeout: float) -> int:
        """Receiver: wait until the sender offers a generation newer than the last one we used."""
        deadline = time.monotonic() + timeout
        key = f"{base}/offer"
        while True:
            if self.store.check([key]):
                gen = int(self.store.get(key))
                if gen > used:
                    return gen
            if time.monotonic() > deadline:
                raise KVTransferTimeout(f"rendezvous: no new offer under {base} in {timeout:.3g}s")
            time.sleep(0.01)

    def _withdraw_offer(self, base: str, gen: int) -> None:
        try:
            self.store.compare_set(f"{base}/offer", str(gen), "0")
        except Exception:
            pass

    def _mark_broken(self, base: str, gen: int) -> None:
        try:
            self.store.set(f"{base}/g{gen}/broken", "1")
            self._bump_epoch()
        except Exception:
            pass

    def _bump_epoch(self) -> None:
        self.store.add(f"kv/epoch/{self.self_id}", 1)

    def _forget(self, link: DistLink) -> None:
        with self._lock:
            self._live = [x for x in self._live if x is not link]


def make_dist_sender(actor_id: str, store: BlockStore, rendezvous: "dist.Store | str | DistConnector",
                     config: KVTransferConfig = KVTransferConfig(),
                     on_release: ReleaseCallback | None = None, on_transition=None) -> LayerStreamSender:
    """`rendezvous`: "host:port" of the controller's store, a store, or this actor's connector
    (one DistConnector per actor process: a second one would publish a second nonce)."""
    return LayerStreamSender(store, _connector(actor_id, rendezvous, store, config), config,
                             on_release=on_release or (lambda _rid: None), on_transition=on_transition)


def make_dist_receiver(actor_id: str, store: BlockStore, rendezvous: "dist.Store | str | DistConnector",
                       config: KVTransferConfig = KVTransferConfig(),
                       on_release: ReleaseCallback | None = None,
                       on_transition=None) -> LayerStreamReceiver:
    return LayerStreamReceiver(store, _connector(actor_id, rendezvous, store, config), config,
                               on_release=on_release or (lambda _rid: None), on_transition=on_transition)


def _connector(actor_id: str, rendezvous: Any, store: BlockStore,
               config: KVTransferConfig) -> DistConnector:
    if isinstance(rendezvous, DistConnector):
        if rendezvous.self_id != actor_id or rendezvous.device != store.device:
            raise ValueError(f"connector is for {rendezvous.self_id!r} on {rendezvous.device}")
        return rendezvous
    return DistConnector(actor_id, rendezvous, store.device, config)


def _frame_socket(store: dist.Store, prefix: str, as_sender: bool, timeout: float,
                  wanted: bool) -> "socket.socket | None":
    """The pair's frame socket when both ends share a host: the sender listens on an abstract
    Unix address (no file to clean up) and publishes it with its host name; the receiver connects
    if the host is its own, and both learn the outcome through the store. None: frames go by gloo."""
    if as_sender:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            name = f"\0tandem-kv-{uuid.uuid4().hex}"
            listener.bind(name)
            listener.listen(1)
            store.set(prefix + "uds", f"{socket.gethostname() if wanted else ''}|{name[1:]}")
            store.wait([prefix + "uds_ok"], timedelta(seconds=timeout))
            if store.get(prefix + "uds_ok") != b"1":
                return None
            listener.settimeout(timeout)
            sock, _ = listener.accept()
        finally:
            listener.close()
    else:
        store.wait([prefix + "uds"], timedelta(seconds=timeout))
        host, name = store.get(prefix + "uds").decode().split("|", 1)
        sock = None
        if wanted and host == socket.gethostname():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect("\0" + name)
            except OSError:            # another network namespace: gloo it is
                sock.close()
                sock = None
        store.set(prefix + "uds_ok", "1" if sock is not None else "0")
        if sock is None:
            return None
    sock.settimeout(None)
    return sock


def _abort_key(sender_id: str, receiver_id: str, request_id: str) -> str:
    return f"kv/abort/{sender_id}/{receiver_id}/{request_id}"


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _nccl_group(store: dist.Store, rank: int, timeout_s: float, high_priority: bool) -> Any:
    opts = dist.ProcessGroupNCCL.Options()
    # NCCL's few CTAs first in line for SMs: otherwise, queued behind a gather, scatter or model
    # kernel of thousands of blocks, each message waits for that kernel to drain
    opts.is_high_priority_stream = high_priority
    opts._timeout = timedelta(seconds=4 * timeout_s)
    # We time every op out ourselves and abort the pair; the NCCL watchdog's default reaction to a
    # hung op is to tear the whole process down, which would take the actor's other work with it.
    with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0"):
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
