"""The KV data path's NCCL calls, made directly on the communicator torch.distributed built.

c10d's `ProcessGroupNCCL.send`/`recv` spend 50-220 us of host time per call (measured on the H200
pair, docs/benchmarks.md: a Work object, its events, the flight recorder, the watchdog's queue) on
top of NCCL's own ~10 us. A transfer posts one send per message on the prefill actor and one receive
per message on the decode actor, all on the control path's critical chain, so that bookkeeping was
the largest single host cost left in a transfer. vLLM's pynccl takes the same route.

What stays with torch.distributed: the rendezvous, the communicator's creation and its abort (a
link that times out or breaks aborts the group as before, which ends any kernel still waiting
here). What moves here: `ncclSend`/`ncclRecv` of a link's data, each on the link's own stream
after the poster's current stream, completion read from a CUDA event.

Used only when both ends could load the same libnccl torch loaded and found the communicator
(`DirectNccl.attach`, negotiated through the store at connect); otherwise, or with
`KVTransferConfig.direct_nccl` off, the link keeps c10d's calls.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import torch

from kv_transfer.base import KVTransferError, KVTransferTimeout

log = logging.getLogger(__name__)

_NCCL_UINT8 = 1                  # ncclDataType_t: bytes, whatever the tensor holds
_NCCL_SUCCESS, _NCCL_IN_PROGRESS = 0, 7
_POLL_S = 50e-6
_lib: Any = None
_lib_error = ""


def load_library() -> Any:
    """The libnccl this process already loaded (torch's), or None with the reason logged once. A
    second copy of the library would not know torch's communicators, so only a library already
    mapped into the process qualifies, and its version must be the one torch reports."""
    global _lib, _lib_error
    if _lib is not None or _lib_error:
        return _lib
    try:
        path = next((line.split()[-1] for line in open("/proc/self/maps")
                     if "libnccl" in line and line.rstrip().endswith((".so", ".so.2"))), None)
        if path is None:
            raise OSError("no libnccl mapped into this process (torch links NCCL statically?)")
        lib = ctypes.CDLL(path)
        version = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(version)) != _NCCL_SUCCESS:
            raise OSError("ncclGetVersion failed")
        torch_version = torch.cuda.nccl.version()
        v = version.value
        ours = (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)
        if tuple(torch_version[:3]) != ours:
            raise OSError(f"{path} is NCCL {ours}, torch uses {tuple(torch_version)}")
        for name in ("ncclSend", "ncclRecv"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclCommGetAsyncError.restype = ctypes.c_int
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        _lib = lib
    except Exception as exc:  # noqa: BLE001 - any failure means: keep c10d's calls
        _lib_error = f"{type(exc).__name__}: {exc}"
        log.info("direct NCCL calls unavailable, KV data goes through c10d: %s", _lib_error)
    return _lib


def unavailable_reason() -> str:
    return _lib_error


class DirectNccl:
    """One link's data operations on its communicator, from one thread at a time."""

    def __init__(self, lib: Any, comm: int, peer_rank: int, device: torch.device):
        if device.index is None:             # "cuda": the current device, as torch reads it
            device = torch.device("cuda", torch.cuda.current_device())
        self.lib, self.comm, self.peer_rank, self.device = lib, ctypes.c_void_p(comm), peer_rank, device
        self.stream = torch.cuda.Stream(device)
        self.closed = False     # set by the link before it aborts the communicator

    @classmethod
    def attach(cls, group: Any, peer_rank: int, device: torch.device) -> "DirectNccl | None":
        """The group's communicator for `device`, which must already exist (a collective made
        it), or None."""
        lib = load_library()
        if lib is None:
            return None
        get = getattr(group, "_comm_ptr", None)
        comm = int(get()) if callable(get) else 0
        if not comm:
            log.info("direct NCCL calls unavailable: the group exposes no communicator")
            return None
        return cls(lib, comm, peer_rank, device)

    def post(self, send: bool, tensor: torch.Tensor, what: str) -> "DirectOp":
        """After the work queued on the caller's current stream, on this link's stream."""
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise KVTransferError(f"{what}: tensor must be contiguous on {self.device}")
        start = time.monotonic()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        fn = self.lib.ncclSend if send else self.lib.ncclRecv
        rc = fn(tensor.data_ptr(), tensor.numel() * tensor.element_size(), _NCCL_UINT8,
                self.peer_rank, self.comm, self.stream.cuda_stream)
        if rc not in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
            raise KVTransferError(f"{what} failed: {self.error_string(rc)}")
        end = torch.cuda.Event()
        end.record(self.stream)
        return DirectOp(self, end, what, start)

    def async_error(self) -> str:
        err = ctypes.c_int(0)
        if self.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(err)) != _NCCL_SUCCESS:
            return "ncclCommGetAsyncError failed"
        return "" if err.value in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS) else self.error_string(err.value)

    def error_string(self, rc: int) -> str:
        return f"NCCL error {rc}: {self.lib.ncclGetErrorString(rc).decode(errors='replace')}"


class DirectOp:
    """A posted direct send or receive (`link.Pending`): complete when its end event is."""

    def __init__(self, nccl: DirectNccl, end: torch.cuda.Event, what: str, start: float):
        self.nccl, self.end, self.what, self.start = nccl, end, what, start
        self._complete = False

    def done(self) -> bool:
        if self._complete:
            return True
        if self.nccl.closed:      # an aborted kernel ends too: its event says nothing of the data
            raise KVTransferError(f"{self.what}: the link was closed")
        self._complete = self.end.query()
        return self._complete

    def wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else self.start + timeout
        polls = 0
        while not self.done():
            polls += 1
            if polls % 200 == 0:              # ~every 10 ms: a peer's failure surfaces here
                err = self.nccl.async_error()
                if err:
                    raise KVTransferError(f"{self.what} failed: {err}")
            if deadline is not None and time.monotonic() > deadline:
                raise KVTransferTimeout(f"{self.what} not complete after {time.monotonic() - self.start:.3g}s")
            time.sleep(_POLL_S)

    def order_current_stream(self) -> bool:
        torch.cuda.current_stream(self.nccl.device).wait_event(self.end)
        return True
