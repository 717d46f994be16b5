"""A plain-tensor `BlockStore` for tests: the engine's KV cache (Llama layout), filled with seeded
random values instead of a model's KV, plus a per-block view to assert on; and `InProcessRanks`, a
tensor-parallel worker's ranks 1..N-1 in this process."""

from __future__ import annotations

import uuid

import torch

from tandem.engine.kv_cache import KVCache


class TensorBlockStore(KVCache):
    """cache: [num_layers, 2, num_blocks, block_size, heads, head_dim]; a layer's payload for n
    blocks is [2, n, block_size, heads, head_dim]."""

    def __init__(self, num_layers: int = 4, num_blocks: int = 16, block_size: int = 4,
                 num_heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                 shareable: bool = False):
        """shareable: on CPU, `share` hands out in-process handles, so two stores of one test
        process take the direct-copy path (CUDA stores share across processes anyway)."""
        shape = (num_layers, 2, num_blocks, block_size, num_heads, head_dim)
        super().__init__(shape, dtype, device)
        if generator is not None:
            self.tensor.copy_(torch.randn(shape, generator=generator).to(dtype))
        self.cache = self.tensor
        self.shareable = shareable

    def share(self, tensor: torch.Tensor | None = None) -> bytes | None:
        tensor = self.tensor if tensor is None else tensor
        if tensor.device.type == "cuda" or not self.shareable:
            return super().share(tensor)
        key = uuid.uuid4().hex.encode()
        _IN_PROCESS[key] = tensor
        return key

    def open_shared(self, handle: bytes) -> torch.Tensor:
        if handle in _IN_PROCESS:
            return _IN_PROCESS[handle]
        return super().open_shared(handle)

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """[2, block_size, heads, head_dim] view, for asserting on."""
        return self.cache[layer, :, block_id]


_IN_PROCESS: dict[bytes, torch.Tensor] = {}     # TensorBlockStore.share on CPU: one test process


class InProcessRanks:
    """RankEnds' view of ranks 1..N-1 when they live in this process (tests, bench/reshard_cpu.py):
    each rank a RankTransport, every call answered at once."""

    def __init__(self, transports):
        self.transports = transports

    def call(self, rank, op, *args):
        return self.transports[rank].call(op, *args)

    post = call

    def ask(self, rank, op, *args, then=None):
        return _Answered(self.call, rank, op, *args)


class _Answered:
    """An answer computed at once (ranks in this process)."""

    def __init__(self, call, *args):
        try:
            self.value, self.error = call(*args), None
        except Exception as e:  # noqa: BLE001 - raised again by get, as a Ray call's error is
            self.value, self.error = None, e

    def ready(self):
        return True

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value
