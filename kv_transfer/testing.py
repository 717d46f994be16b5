"""A plain-tensor `BlockStore` for tests: the Llama cache layout, nothing else."""

from __future__ import annotations

import torch


class TensorBlockStore:
    """cache: [num_layers, 2, num_blocks, block_size, heads, head_dim]; a layer's payload for n
    blocks is [n, 2, block_size, heads, head_dim]."""

    def __init__(self, num_layers: int = 4, num_blocks: int = 16, block_size: int = 4,
                 num_heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", generator: torch.Generator | None = None):
        shape = (num_layers, 2, num_blocks, block_size, num_heads, head_dim)
        if generator is None:
            self.cache = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.cache = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = self.cache.device

    def gather_blocks(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        return self.cache[layer].index_select(1, idx).transpose(0, 1).contiguous()

    def scatter_blocks(self, layer: int, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.cache[layer].index_copy_(1, idx, data.transpose(0, 1))

    def block_payload_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (n_blocks, 2, *self.cache.shape[3:])

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        """[2, block_size, heads, head_dim] view, for asserting on."""
        return self.cache[layer, :, block_id]
