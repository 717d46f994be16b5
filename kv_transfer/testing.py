"""A plain-tensor `BlockStore` for tests: the engine's KV cache (Llama layout), filled with seeded
random values instead of a model's KV, plus a per-block view to assert on."""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache


class TensorBlockStore(KVCache):
    """cache: [num_layers, 2, num_blocks, block_size, heads, head_dim]; a layer's payload for n
    blocks is [2, n, block_size, heads, head_dim]."""

    def __init__(self, num_layers: int = 4, num_blocks: int = 16, block_size: int = 4,
                 num_heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", generator: torch.Generator | None = None):
        shape = (num_layers, 2, num_blocks, block_size, num_heads, head_dim)
        super().__init__(shape, dtype, device)
        if generator is not None:
            self.tensor.copy_(torch.randn(shape, generator=generator).to(dtype))
        self.cache = self.tensor

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """[2, block_size, heads, head_dim] view, for asserting on."""
        return self.cache[layer, :, block_id]
