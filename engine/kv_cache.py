"""The KV cache tensor of one actor, shaped by the model (`model.kv_cache_shape`), and the block
gather/scatter the KV transport uses. Llama: [num_layers, 2, num_blocks, block_size, Hkv, head_dim].
"""

from __future__ import annotations

import torch

from engine.config import CacheConfig


def num_blocks_for(cache: CacheConfig, bytes_per_block: int, device: torch.device) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        budget = cache.max_cache_bytes
    return max(2, budget // bytes_per_block)


class KVCache:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers = shape[0]
        self.num_blocks = shape[2]
        self.block_size = shape[3]
        self.dtype = dtype
        self.device = self.tensor.device

    @property
    def bytes_per_block(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    # ---- BlockStore (kv_transfer) -----------------------------------------------------------
    def block_payload_shape(self, n_blocks: int) -> tuple[int, ...]:
        """[2, n, block_size, Hkv, D]: K and V of n blocks of one layer."""
        return (2, n_blocks, *self.tensor.shape[3:])

    def block_index(self, block_ids) -> torch.Tensor:
        if isinstance(block_ids, torch.Tensor):
            return block_ids
        return torch.as_tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def gather_blocks(self, layer: int, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        idx = self.block_index(block_ids)
        if out is None:
            return self.tensor[layer].index_select(1, idx)
        return torch.index_select(self.tensor[layer], 1, idx, out=out)

    def scatter_blocks(self, layer: int, block_ids, data: torch.Tensor) -> None:
        self.tensor[layer].index_copy_(1, self.block_index(block_ids), data.to(self.dtype))
