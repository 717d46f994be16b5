"""The KV cache tensor of one actor, shaped by the model (`model.kv_cache_shape`), and the block
gather/scatter the KV transport uses. Llama: [num_layers, 2, num_blocks, block_size, Hkv, head_dim];
latent attention (engine.mla): [num_layers, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope].
Everything here works per block over the planes it finds (dim 1), so both move the same way.
"""

from __future__ import annotations

import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.engine.config import CacheConfig
from tandem.engine.kernels import triton_available


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
        self._use_triton: bool | None = None     # decided on the first block copy

    @property
    def bytes_per_block(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    # ---- BlockStore (kv_transfer) -----------------------------------------------------------
    def block_payload_shape(self, n_blocks: int) -> tuple[int, ...]:
        """[P, n, block_size, Hkv, D]: K and V (P = 2) of n blocks of one layer; with latent
        attention its one plane (P = 1, Hkv = 1, D = kv_lora_rank + qk_rope_head_dim)."""
        return (self.tensor.shape[1], n_blocks, *self.tensor.shape[3:])

    def block_index(self, block_ids) -> torch.Tensor:
        """Block ids as a long tensor on the cache's device, copied on the current stream. From
        pageable memory, so the host first waits for that stream to drain: the KV transport copies
        on a stream it keeps idle (`kv_transfer.base.device_index`). Not through pinned memory:
        a pinned allocation serializes the device's streams, so a decode step would wait for a KV
        receive that waits on the prefill actor."""
        if isinstance(block_ids, torch.Tensor):
            return block_ids
        return torch.as_tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def gather_layers(self, layers: range, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """[len(layers), 2, n, block_size, Hkv, D]: those blocks of consecutive layers, one kernel
        (the layers' K and V planes are one dimension of a view of the cache)."""
        idx = self.block_index(block_ids)
        shape = (len(layers), *self.block_payload_shape(len(idx)))
        if self.uses_triton_copy():
            from tandem.engine.kernels.block_copy import copy_blocks  # noqa: PLC0415 (triton loads only where kernels run)

            out = torch.empty(shape, dtype=self.dtype, device=self.device) if out is None else out
            copy_blocks(self.tensor, layers, idx, out, to_buf=True)
            return out
        src = self.tensor[layers.start:layers.stop].flatten(0, 1)
        if out is None:
            return src.index_select(1, idx).view(shape)
        torch.index_select(src, 1, idx, out=out.view(-1, *shape[2:]))
        return out

    def scatter_layers(self, layers: range, block_ids, data: torch.Tensor) -> None:
        """Write `data` (shaped like `gather_layers`' result) into those blocks, one kernel."""
        idx = self.block_index(block_ids)
        if self.uses_triton_copy() and data.dtype == self.dtype and data.is_contiguous():
            from tandem.engine.kernels.block_copy import copy_blocks  # noqa: PLC0415 (triton loads only where kernels run)

            copy_blocks(self.tensor, layers, idx, data, to_buf=False)
            return
        dst = self.tensor[layers.start:layers.stop].flatten(0, 1)
        dst.index_copy_(1, idx, data.to(self.dtype).flatten(0, 1))

    # ---- direct copies between two caches on one host (kv_transfer, CUDA IPC over NVLink) ------
    def share(self, tensor: torch.Tensor | None = None) -> bytes | None:
        """A handle through which another process on this host maps `tensor` (default: the whole
        cache), for `open_shared`; None where this cache cannot be shared (CPU). CUDA IPC: the
        mapping stays valid while the peer holds it, even past this process's exit."""
        tensor = self.tensor if tensor is None else tensor
        if tensor.device.type != "cuda":
            return None
        return pickle.dumps(reduce_tensor(tensor)[1])

    def open_shared(self, handle: bytes) -> torch.Tensor:
        """Map a peer's `share` handle into this process (once per link: ~15 ms on an H200).
        The handle comes from a peer actor of this deployment over its private link."""
        if self.device.type != "cuda":
            raise RuntimeError("a CPU cache cannot map a peer's memory")
        args = list(pickle.loads(handle))
        args[6] = self.device.index or 0   # the peer's device number means nothing here
        return rebuild_cuda_tensor(*args)

    def copy_from_peer(self, peer: torch.Tensor, layers: range, src_index: torch.Tensor,
                       dst_index: torch.Tensor) -> None:
        """This cache's blocks `dst_index` of `layers` <- the same layers' blocks `src_index` of
        `peer` (another cache of this layout, mapped by `open_shared`), one kernel, on the current
        stream: the receiver's side of a direct KV copy. `src_index` may live in the peer's memory
        (its id arena), unseen here: ids are clamped into the peer's cache, so a bad one copies a
        wrong block but never reads outside it."""
        if self.uses_triton_copy():
            from tandem.engine.kernels.block_copy import copy_cache_blocks  # noqa: PLC0415 (triton loads only where kernels run)

            # the layouts were compared when the peer was mapped: no checks on the transfer's path
            copy_cache_blocks(peer, self.tensor, layers, src_index, dst_index, check=False)
            return
        src_index = src_index.to(peer.device).clamp(0, peer.shape[2] - 1)   # as the kernel does
        src = peer[layers.start:layers.stop].index_select(2, src_index)
        self.tensor[layers.start:layers.stop].index_copy_(2, dst_index, src.to(self.device))

    def uses_triton_copy(self) -> bool:
        """Block copies through engine.kernels.block_copy: on CUDA, where Triton is installed."""
        if self._use_triton is None:
            self._use_triton = self.device.type == "cuda" and triton_available()
        return self._use_triton

    def gather_blocks(self, layer: int, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
        data = self.gather_layers(range(layer, layer + 1), block_ids,
                                  None if out is None else out.unsqueeze(0))
        return data[0]

    def scatter_blocks(self, layer: int, block_ids, data: torch.Tensor) -> None:
        self.scatter_layers(range(layer, layer + 1), block_ids, data.unsqueeze(0))
