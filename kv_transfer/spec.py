"""What one KV transfer moves, from which actor's blocks to which: the spec the router hands to both
ends. Torch-free, so the router builds specs without loading the transport."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TransferSpec:
    """Move `layers` (in this order) of `request_id` from `src_block_ids` of `sender_id`'s cache
    into `dst_block_ids` of `receiver_id`'s cache; the blocks cover `num_tokens` token positions.
    Both ends get the same spec (the router hands it to both); src and dst ids pair up by index.
    `request_id` names one attempt: a retry or another chunk of chunked prefill gets its own id
    (e.g. "req-7/2"), so late data of an old attempt can never land in the new one's blocks.
    The receiver never reads `src_block_ids`: its copy may leave them empty (the decode actor
    registers the receive when it reserves, before the prefill actor has picked its blocks)."""
    request_id: str
    sender_id: str
    receiver_id: str
    layers: tuple[int, ...]
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "src_block_ids", tuple(int(x) for x in self.src_block_ids))
        object.__setattr__(self, "dst_block_ids", tuple(int(x) for x in self.dst_block_ids))
        if not self.request_id or len(self.request_id) > 256:
            raise ValueError(f"transfer spec: request_id must be 1..256 chars, got {self.request_id!r}")
        if not self.sender_id or not self.receiver_id or self.sender_id == self.receiver_id:
            raise ValueError(f"transfer spec: need two distinct actor ids, got "
                             f"{self.sender_id!r} -> {self.receiver_id!r}")
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ValueError(f"transfer spec: layers must be distinct and >= 0, got {self.layers}")
        if not self.dst_block_ids or (self.src_block_ids and len(self.src_block_ids) != len(self.dst_block_ids)):
            raise ValueError(f"transfer spec: {len(self.src_block_ids)} src blocks vs "
                             f"{len(self.dst_block_ids)} dst blocks")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError("transfer spec: dst block ids repeat")
        if self.num_tokens < 0:
            raise ValueError(f"transfer spec: num_tokens must be >= 0, got {self.num_tokens}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_msg(self) -> dict[str, Any]:
        """A msgpack-able dict (ints, strings, lists)."""
        return {"request_id": self.request_id, "sender_id": self.sender_id,
                "receiver_id": self.receiver_id, "layers": list(self.layers),
                "src_block_ids": list(self.src_block_ids), "dst_block_ids": list(self.dst_block_ids),
                "num_tokens": self.num_tokens}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> "TransferSpec":
        return cls(**{k: msg[k] for k in ("request_id", "sender_id", "receiver_id", "layers",
                                          "src_block_ids", "dst_block_ids", "num_tokens")})
