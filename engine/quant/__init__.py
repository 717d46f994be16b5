"""Weight quantization: FP8 (e4m3) weights with per-channel or block scales.

- `scheme`: which checkpoints' `quantization_config` serve (no torch import; the router reads it).
- `fp8`: quantize / dequantize a weight, and the FP8 matmul `engine.linear.Linear` runs.
- `checkpoint`: FP8 checkpoints' scale tensors: checked against the model, copied into its layers.

Quantizing at load (`EngineConfig.quantization = "fp8"`) happens in engine.build, one layer at a
time after the layer's weights are in place, so peak memory stays near the FP8 model's size.
This package itself imports nothing.
"""
