"""The tensor-parallel process group of one worker and the collectives a forward uses.

One group per process (vLLM's `get_tp_group()`): `init_tensor_parallel` joins it, `current_group`
returns it to the engine and the model's parallel layers. Rank 0 is the driver (scheduler,
sampler, KV transfer); `broadcast_object` carries a step's inputs from it to the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.wire.errors import ConfigError

_GROUP: TPGroup | None = None
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class TPGroup:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None only for a world of one
    # the step messages' group: gloo on the host even when `group` is NCCL (vLLM's cpu_group), so
    # a step's inputs never wait for the device queue nor pass through device memory; with no
    # timeout to speak of, since ranks 1..N-1 wait in it for as long as the worker is idle (a dead
    # rank 0 closes its sockets, and Ray ends its ranks with it)
    cpu_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place: the sum over ranks of `x` (the partial outputs of a row-parallel linear)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world * n], rank r's part at r * n (vocab shards of logits)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (a pickled step message; rank 0 passes it, the others None)."""
        box, group = [obj], self.cpu_group
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: str = "cpu",
                         timeout_s: float = 600.0) -> TPGroup:
    """Join the worker's group (every rank calls this with the same `init_method`, e.g.
    tcp://host:port of rank 0) and make it this process's current group. `timeout_s` bounds the
    forward's collectives; the wait for the next step has none (an idle worker is fine)."""
    global _GROUP
    if not 0 <= rank < world_size:
        raise ConfigError(f"tensor parallel: rank {rank} outside a world of {world_size}")
    if world_size == 1:
        _GROUP = TPGroup(0, 1, None)
        return _GROUP
    backend = backend_for(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    messages = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _GROUP = TPGroup(rank, world_size, dist.group.WORLD, messages)
    return _GROUP


def current_group(world_size: int) -> TPGroup:
    """This process's group, checked to have `world_size` ranks."""
    if world_size == 1:
        return TPGroup(0, 1, None)
    if _GROUP is None or _GROUP.world_size != world_size:
        have = "none" if _GROUP is None else f"a group of {_GROUP.world_size}"
        raise ConfigError(f"engine: tensor_parallel_size {world_size} needs this process to join a "
                          f"group of {world_size} ranks first (init_tensor_parallel); it has {have}")
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    if _GROUP is not None and _GROUP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = None
