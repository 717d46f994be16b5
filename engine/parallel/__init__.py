"""Tensor parallelism inside one worker: N ranks, one process each, every rank holding 1/N of each
layer's heads and MLP columns and 1/N of the vocabulary, and 1/N of the KV heads in its own cache.

- `group.py`: the process group (gloo on CPU, NCCL on CUDA) and the three collectives a forward
  uses (all-reduce, all-gather, broadcast of a step's inputs).
- `sharding.py`: which slice of each Hugging Face tensor a rank holds, the rank's ModelConfig, and
  `load_rank_model` (shard the bf16/fp32 tensors first; any quantization acts on the shard).
- `layers.py`: the vocab-parallel embedding and LM head, and `make_parallel`, which turns a
  single-device decoder built from the rank's config into its tensor-parallel shard.
- `shard.py`: rank 0's `StepBroadcaster` (the engine's runner sends it each step's host inputs)
  and `ShardWorker`, the loop the other ranks run: receive a step, run the same forward.
"""
