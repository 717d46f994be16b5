"""Resharding KV by head between workers of different tensor-parallel sizes: which rank of the
sender sends which of its KV heads to which rank of the receiver (`head_routes`, pure), the
rank-level transfers one worker-level spec becomes (`rank_specs`), and the view of a rank's cache
that holds only the heads one peer rank sends or gets (`HeadSliceStore`).

Rank r of a worker of N ranks holds the model's KV heads [r * H/N, (r + 1) * H/N) (H: the model's
KV heads; engine.parallel.sharding), at local positions 0..H/N-1, and every rank has the same block
ids. A transfer from a worker of S ranks to one of D ranks is therefore one transfer per pair of
ranks whose head ranges overlap, each moving the overlap, with the worker-level spec's block ids
and layers unchanged: S = D pairs rank r with rank r (whole local caches), S = 2 -> D = 1 sends
each half to rank 0, S = 1 -> D = 2 sends each half from rank 0. Each pair is an ordinary transfer
between two actors (`rank_actor_id`), over the ordinary sender and receiver.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tandem.kv_transfer.spec import TransferSpec
from tandem.wire.errors import ConfigError

_RANK_SEP = "/tp"


@dataclass(frozen=True)
class HeadRoute:
    """Heads `heads` (the model's numbering) go from rank `src_rank` of the sender, where they
    are local heads `src_heads`, to rank `dst_rank` of the receiver, local heads `dst_heads`."""
    src_rank: int
    dst_rank: int
    heads: range
    src_heads: range
    dst_heads: range


def check_reshardable(num_kv_heads: int, src_tp: int, dst_tp: int) -> None:
    """Refuse, by name, a pair of tensor-parallel sizes whose KV cannot be resharded by whole
    heads (each rank must hold whole KV heads: no replication over ranks)."""
    for name, tp in (("sender", src_tp), ("receiver", dst_tp)):
        if tp < 1:
            raise ConfigError(f"KV resharding: the {name}'s tensor_parallel_size must be >= 1, got {tp}")
        if num_kv_heads % tp:
            raise ConfigError(f"KV resharding: the {name}'s tensor_parallel_size {tp} does not divide the "
                              f"model's {num_kv_heads} KV heads (KV heads replicated over ranks are not "
                              "implemented)")


def head_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every (sender rank, receiver rank) pair whose KV heads overlap, with the overlap; ordered
    by receiver rank, then sender rank. Together they cover each head exactly once."""
    check_reshardable(num_kv_heads, src_tp, dst_tp)
    per_src, per_dst = num_kv_heads // src_tp, num_kv_heads // dst_tp
    routes = []
    for d in range(dst_tp):
        for s in range(src_tp):
            lo, hi = max(s * per_src, d * per_dst), min((s + 1) * per_src, (d + 1) * per_dst)
            if lo < hi:
                routes.append(HeadRoute(s, d, range(lo, hi), range(lo - s * per_src, hi - s * per_src),
                                        range(lo - d * per_dst, hi - d * per_dst)))
    return routes


def rank_actor_id(worker_id: str, rank: int) -> str:
    """The transport's id of a worker's rank: rank 0 is the worker itself."""
    return worker_id if rank == 0 else f"{worker_id}{_RANK_SEP}{rank}"


def split_actor_id(actor_id: str) -> tuple[str, int]:
    """rank_actor_id's inverse: -> (worker id, rank)."""
    worker, sep, rank = actor_id.rpartition(_RANK_SEP)
    if sep and rank.isdigit():
        return worker, int(rank)
    return actor_id, 0


def route_between(num_kv_heads: int, src_tp: int, dst_tp: int, src_rank: int, dst_rank: int) -> HeadRoute | None:
    """The route from one rank to another, None when they share no head."""
    for r in head_routes(num_kv_heads, src_tp, dst_tp):
        if (r.src_rank, r.dst_rank) == (src_rank, dst_rank):
            return r
    return None


def rank_specs(spec: TransferSpec, num_kv_heads: int, src_tp: int, dst_tp: int) -> list[tuple[HeadRoute, TransferSpec]]:
    """The rank-level transfers a worker-level spec becomes. Between workers of equal sizes a
    rank's transfer keeps the worker-level request id (each pair has its own link); otherwise a
    receiver rank may get several and a sender rank send several, so each is named
    `<request>@<src rank>.<dst rank>`."""
    out = []
    for route in head_routes(num_kv_heads, src_tp, dst_tp):
        rid = spec.request_id if src_tp == dst_tp else f"{spec.request_id}@{route.src_rank}.{route.dst_rank}"
        out.append((route, dataclasses.replace(
            spec, request_id=rid, sender_id=rank_actor_id(spec.sender_id, route.src_rank),
            receiver_id=rank_actor_id(spec.receiver_id, route.dst_rank))))
    return out


class HeadSliceStore:
    """A BlockStore over local heads `heads` of a rank's cache (the transport's
    `block_payload_shape` and gathers and scatters see only those heads). It cannot be shared
    for direct copies: a peer's data for it goes through the link."""

    def __init__(self, cache, heads: range):
        self.cache, self.heads = cache, heads
        self.num_layers, self.num_blocks = cache.num_layers, cache.num_blocks
        self.dtype, self.device = cache.dtype, cache.device
        # [layers, 2, blocks, block_size, len(heads), head_dim]: a view, not contiguous
        self.tensor = cache.tensor[..., heads.start:heads.stop, :]

    def block_payload_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (2, n_blocks, *self.tensor.shape[3:])

    def block_index(self, block_ids) -> torch.Tensor:
        return self.cache.block_index(block_ids)

    def gather_layers(self, layers: range, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        idx = self.block_index(block_ids)
        src = self.tensor[layers.start:layers.stop]   # [layers, 2, blocks, bs, h, D], strided in h
        if out is None:
            return src.index_select(2, idx)
        torch.index_select(src, 2, idx, out=out)      # one pass: strided reads, contiguous writes
        return out

    def scatter_layers(self, layers: range, block_ids, data: torch.Tensor) -> None:
        idx = self.block_index(block_ids)
        self.tensor[layers.start:layers.stop].index_copy_(2, idx, data.to(self.dtype))

    def share(self, tensor: torch.Tensor | None = None) -> bytes | None:
        return None

    def open_shared(self, handle: bytes) -> torch.Tensor:
        raise RuntimeError("a head slice of a cache cannot map a peer's cache (resharded KV goes through the link)")

    def copy_from_peer(self, peer, layers, src_index, dst_index) -> None:
        raise RuntimeError("a head slice of a cache takes no direct copies")
