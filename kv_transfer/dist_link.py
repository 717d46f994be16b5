"""One pair's torch.distributed link, seen from one side (`DistLink`, a `link.PeerLink`): control
frames on the pair's Unix socket or its gloo group, data on its gloo (CPU) or NCCL (GPU) group,
and the posted operations (`_DistOp`, a `link.Pending`) both ends poll. `torch_dist` makes the
pairs (rendezvous, groups, the frame socket); this module only moves bytes over one.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from tandem.kv_transfer.base import KVTransferError, KVTransferTimeout
from tandem.kv_transfer.link import FRAME_BYTES, decode_frame, encode_frame, frame_bytes, frame_tail_bytes

if TYPE_CHECKING:
    from tandem.kv_transfer.torch_dist import DistConnector

_TAG_FRAME, _TAG_DATA = 1, 2
_IDLE_WAIT_S = 7 * 24 * 3600.0        # "forever" for a receive posted while idle
_NCCL_POLL_S = 50e-6


class DistLink:
    """One pair's groups, seen from one side. `ctrl` is gloo; `data` is `ctrl` on CPU, NCCL on GPU."""

    def __init__(self, connector: "DistConnector", peer_id: str, receiver_nonce: str, base: str,
                 gen: int, rank: int, ctrl: Any, data: Any, frames: "socket.socket | None" = None):
        self.connector, self.peer_id, self.receiver_nonce = connector, peer_id, receiver_nonce
        self.base, self.gen, self.rank, self.peer_rank = base, gen, rank, 1 - rank
        self.ctrl, self.data = ctrl, data
        self.frames = frames          # the Unix socket frames travel on (None: the gloo group)
        self.device = connector.device
        self.backend = connector.backend
        self._closed = False

    def send_frame(self, msg: dict[str, Any], timeout: float) -> None:
        if self.frames is not None:
            self._sock_io(lambda: self.frames.sendall(frame_bytes(msg)), timeout,
                          "control frame send")
            return
        frame = encode_frame(msg)
        parts = [frame] if frame.numel() == FRAME_BYTES else [frame[:FRAME_BYTES], frame[FRAME_BYTES:]]
        ops = [self._post(lambda p=p: self.ctrl.send([p], self.peer_rank, _TAG_FRAME),
                          "gloo", "control frame send") for p in parts]
        for op in ops:                       # one tag: the tail arrives right behind its head
            op.wait(timeout)

    def recv_frame(self, timeout: float | None) -> dict[str, Any]:
        head = self._recv_bytes(FRAME_BYTES, timeout)
        try:
            tail = frame_tail_bytes(head)
            if tail:        # right behind its head, on the socket or the same gloo tag
                head += self._recv_bytes(tail, self.connector.config.timeout_s)
            return decode_frame(head)
        except ValueError as exc:
            raise KVTransferError(f"link to {self.peer_id!r}: {exc}") from None

    def _recv_bytes(self, n: int, timeout: float | None) -> bytearray:
        """The next n bytes of frames: read off the socket, or one gloo message of that size."""
        if self.frames is not None:
            buf = bytearray(n)
            self._sock_io(lambda: self._recv_exactly(buf), timeout, "control frame receive")
            return buf
        buf = torch.empty(n, dtype=torch.uint8)
        self._post(lambda: self.ctrl.recv([buf], self.peer_rank, _TAG_FRAME),
                   "gloo", "control frame receive").wait(timeout)
        return bytearray(buf.numpy().tobytes())

    def _recv_exactly(self, into: bytearray) -> None:
        view, got = memoryview(into), 0
        while got < len(view):
            n = self.frames.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the peer closed the link")
            got += n

    def _sock_io(self, io, timeout: float | None, what: str) -> None:
        if self._closed or self.frames is None:
            raise KVTransferError(f"link to {self.peer_id!r} is closed")
        try:
            self.frames.settimeout(timeout)
            io()
        except socket.timeout:
            raise KVTransferTimeout(f"link to {self.peer_id!r}: {what} timed out after {timeout:.3g}s") from None
        except (OSError, ConnectionError) as exc:
            raise KVTransferError(f"link to {self.peer_id!r}: {what} failed: {str(exc)[:200]}") from None

    def send_verdict(self, direct: bool, why: str) -> None:
        self.connector.store.set(f"{self.base}/g{self.gen}/direct", ("1" if direct else "0") + why[:300])

    def wait_verdict(self, timeout: float) -> tuple[bool, str]:
        key = f"{self.base}/g{self.gen}/direct"
        try:
            self.connector.store.wait([key], timedelta(seconds=timeout))
            value = self.connector.store.get(key).decode()
        except Exception as exc:
            raise KVTransferTimeout(f"link to {self.peer_id!r}: no answer to hello in {timeout:.3g}s: "
                                    f"{str(exc)[:200]}") from None
        return value[:1] == "1", value[1:]

    def isend_data(self, tensor: torch.Tensor) -> "_DistOp":
        return self._post(lambda: self.data.send([tensor], self.peer_rank, _TAG_DATA),
                          self.backend, f"send of {tensor.numel() * tensor.element_size()} B")

    def irecv_data(self, tensor: torch.Tensor) -> "_DistOp":
        return self._post(lambda: self.data.recv([tensor], self.peer_rank, _TAG_DATA),
                          self.backend, f"receive of {tensor.numel() * tensor.element_size()} B")

    def send_data(self, tensor: torch.Tensor, timeout: float) -> None:
        self.isend_data(tensor).wait(timeout)

    def recv_data(self, tensor: torch.Tensor, timeout: float) -> None:
        self.irecv_data(tensor).wait(timeout)

    def close(self, broken: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if broken and self.rank == 1:     # tell the sender, which checks before each transfer
            self.connector._mark_broken(self.base, self.gen)
        if self.frames is not None:       # wakes a frame receive blocked on it, here and there
            try:
                self.frames.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.frames.close()
        if self.data is not self.ctrl:
            _abort_nccl(self.data)
        # Dropping the last reference destroys the gloo context, which closes its sockets: that is
        # what wakes the peer's posted receive (ProcessGroupGloo.abort() does not, in torch 2.13).
        self.ctrl = self.data = None
        self.connector._forget(self)
        gc.collect()

    def _post(self, post, backend: str, what: str) -> "_DistOp":
        if self._closed:
            raise KVTransferError(f"link to {self.peer_id!r} is closed")
        start = time.monotonic()
        failure = None
        try:
            work = post()
        except Exception as exc:     # keep no traceback alive: it would pin the group's sockets
            failure = str(exc)[:300]
        if failure is not None:
            raise KVTransferError(f"link to {self.peer_id!r}: {what} failed: {failure}")
        return _DistOp(self, work, backend, what, start)


class _DistOp:
    """A posted gloo or NCCL operation. Errors come out as KVTransferError/KVTransferTimeout
    with no live traceback (which would pin the group's sockets).

    Polling differs by backend: an NCCL work's is_completed() reads its end event, but a gloo
    send/recv work only learns it is complete inside wait() (torch 2.13), even when the bytes are
    already there. So the first done() on a gloo op hands the wait() to a daemon thread and then
    reads the thread's result."""

    def __init__(self, link: DistLink, work: Any, backend: str, what: str, start: float):
        self.link, self.work, self.backend, self.what, self.start = link, work, backend, what, start
        self._complete = False
        self._waiter: threading.Thread | None = None
        self._waited = threading.Event()
        self._failure: tuple[bool, str] | None = None

    def done(self) -> bool:
        if self._complete:
            return True
        if self.work is None:
            raise KVTransferError(f"link to {self.link.peer_id!r}: {self.what} already failed")
        if self.backend == "gloo":
            if self._waiter is None:
                self._waiter = threading.Thread(target=self._wait_in_background, daemon=True,
                                                name=f"kv-wait-{self.link.peer_id}")
                self._waiter.start()
            if not self._waited.is_set():
                return False
            self._finish(self._failure)
            return True
        failure = None
        try:
            if not self.work.is_completed():
                return False
            self.work.wait()          # completed: returns at once, or raises the op's error
        except Exception as exc:
            failure = (False, str(exc)[:300])
        self._finish(failure)
        return True

    def wait(self, timeout: float | None) -> None:
        if self._complete:
            return
        if self.work is None:
            raise KVTransferError(f"link to {self.link.peer_id!r}: {self.what} already failed")
        timeout = _IDLE_WAIT_S if timeout is None else timeout
        if self._waiter is not None:   # a background wait() owns the work
            if not self._waited.wait(max(0.0, self.start + timeout - time.monotonic())):
                self._finish((True, "not complete"))
            self._finish(self._failure)
            return
        failure = None
        try:
            if self.backend == "gloo":
                self.work.wait(timedelta(seconds=timeout))
            else:       # NCCL's wait() only orders streams; poll the host-visible completion
                while not self.work.is_completed():
                    if time.monotonic() - self.start > timeout:
                        raise TimeoutError("NCCL op not complete")
                    time.sleep(_NCCL_POLL_S)
                self.work.wait()          # raises the op's error, if any
        except Exception as exc:
            failure = (isinstance(exc, TimeoutError) or "Timed out" in str(exc)
                       or time.monotonic() - self.start >= timeout, str(exc)[:300])
        self._finish(failure)

    def order_current_stream(self) -> bool:
        if self.backend != "nccl":
            return False
        self.work.wait()              # NCCL: the current stream waits for the op's end event
        return True

    def _wait_in_background(self) -> None:
        work = self.work
        try:
            work.wait(timedelta(seconds=_IDLE_WAIT_S))
        except Exception as exc:
            self._failure = ("Timed out" in str(exc), str(exc)[:300])
        work = None
        self._waited.set()

    def _finish(self, failure: tuple[bool, str] | None) -> None:
        self.work = None
        if failure is None:
            self._complete = True
            return
        waited = time.monotonic() - self.start
        msg = f"link to {self.link.peer_id!r}: {self.what} failed after {waited:.3g}s: {failure[1]}"
        raise (KVTransferTimeout if failure[0] else KVTransferError)(msg)


def _abort_nccl(pg: Any) -> None:
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                continue
