"""Which quantized checkpoints serve: a config.json `quantization_config` read into what the loader
needs, and everything else refused by name. No torch import (the router reads configs too).

Served: `quant_method: "fp8"` (Hugging Face's FP8 integration, vLLM/llm-compressor's and
AutoFP8's exports, DeepSeek-V3 and Qwen's FP8 releases) with dynamic activation scales and e4m3
weights, either with a `weight_scale` per tensor or per output channel, or with
`weight_block_size: [128, 128]` and one `weight_scale_inv` per block. Refused: other methods
(compressed-tensors, gptq, awq, bitsandbytes, ...), static activation scales, e5m2, other block
sizes, FP8 KV-cache scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANT_METHODS = ("fp8",)
BLOCK_SIZES = ((128, 128),)
# keys of an fp8 quantization_config that need no handling here (which modules stay unquantized
# comes from each tensor's dtype at load)
_KNOWN_KEYS = {"quant_method", "activation_scheme", "fmt", "weight_block_size", "ignored_layers",
               "modules_to_not_convert", "dequantize"}


class QuantConfigError(ValueError):
    """A quantization_config this engine does not implement; the message names the key and value."""


@dataclass(frozen=True)
class FP8Scheme:
    block_size: tuple[int, int] | None = None  # (rows, columns) per weight_scale_inv; None: weight_scale


def fp8_scheme(qcfg: Any) -> FP8Scheme:
    """config.json's quantization_config -> FP8Scheme, or QuantConfigError naming what is not served."""
    if not isinstance(qcfg, dict):
        raise QuantConfigError(f"quantization_config must be an object, got {qcfg!r}")
    method = qcfg.get("quant_method")
    if method not in QUANT_METHODS:
        raise QuantConfigError(f"quantization_config quant_method {method!r} is not supported "
                               f"(supported: {', '.join(QUANT_METHODS)}; or serve an unquantized checkpoint "
                               "with --quantization fp8)")
    act = qcfg.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise QuantConfigError(f"quantization_config activation_scheme {act!r} (static activation scales) is "
                               "not implemented (only 'dynamic')")
    fmt = qcfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"quantization_config fmt {fmt!r} is not implemented (only 'e4m3')")
    if qcfg.get("dequantize"):
        raise QuantConfigError("quantization_config dequantize=true is not implemented")
    if qcfg.get("kv_cache_scheme"):
        raise QuantConfigError(f"quantization_config kv_cache_scheme {qcfg['kv_cache_scheme']!r} "
                               "(an FP8 KV cache) is not implemented")
    unknown = sorted(set(qcfg) - _KNOWN_KEYS - {"kv_cache_scheme"})
    if unknown:
        raise QuantConfigError(f"quantization_config keys {unknown} are not implemented for quant_method 'fp8'")
    block = qcfg.get("weight_block_size")
    if block is None:
        return FP8Scheme()
    if not isinstance(block, (list, tuple)) or tuple(block) not in BLOCK_SIZES:
        raise QuantConfigError(f"quantization_config weight_block_size {block!r} is not implemented "
                               f"(only {[list(b) for b in BLOCK_SIZES]})")
    return FP8Scheme(block_size=tuple(block))


def quantization_config(block_size: tuple[int, int] | None) -> dict[str, Any]:
    """The quantization_config of an FP8 checkpoint (the inverse of fp8_scheme)."""
    d: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block_size is not None:
        d["weight_block_size"] = list(block_size)
    return d
