"""How a KV transfer behaves (timeouts, message and window sizes, which data paths to try): one
frozen config, checked when made. No torch import, so the cluster's config (and the CLI that reads
it) can name it without loading the transport."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTransferConfig:
    timeout_s: float = 30.0          # longest wait for one message once a transfer has started
    start_timeout_s: float = 120.0   # longest wait from expect() to the first layer (prefill queue)
    connect_timeout_s: float = 60.0  # pair-group rendezvous, including the peer joining
    # Layers of one request that are ready together travel as one message of up to this many bytes
    # (one gather, one NCCL send, one scatter per layer on arrival); a single layer is never split.
    max_message_bytes: int = 256 << 20
    # Messages posted to one peer and not yet complete. The next message's control frame and send
    # are issued while earlier data is still on the wire; staging memory is bounded by
    # max_inflight_messages * max_message_bytes on each side.
    max_inflight_messages: int = 4
    # NCCL groups run their kernels on high-priority streams (see torch_dist._nccl_group).
    nccl_high_priority: bool = True
    # Where the receiver can map the sender's cache (two GPUs of one host: CUDA IPC over NVLink),
    # it copies the blocks straight out of it, block to block in one kernel, and the link carries
    # only control frames: no staging, gather, NCCL send or scatter (kv_transfer.direct_send).
    # Off, or where mapping fails, the data goes through the link (kv_transfer.streamed_send).
    direct_copy: bool = True
    # Control frames on a Unix socket between two actors of one host (~50 us a frame, against
    # ~0.3 ms through gloo); off, or between hosts, on the pair's gloo group.
    unix_frames: bool = True

    def __post_init__(self) -> None:
        for name in ("timeout_s", "start_timeout_s", "connect_timeout_s", "max_message_bytes",
                     "max_inflight_messages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv transfer config: {name} must be > 0, got {getattr(self, name)}")

    @property
    def window_bytes(self) -> int:
        """Bytes of messages in flight to (or from) one peer: each end's staging ring."""
        return self.max_inflight_messages * self.max_message_bytes
