"""Reading a Hugging Face model directory: config.json through the model registry
(engine.architectures), the EOS set, and the safetensors files, checked against the tensors the
architecture needs before any weight is read.

`check_model_dir` reads only config.json and the safetensors headers (milliseconds, no weights), so
a command can refuse a checkpoint before it starts a cluster; `load_model` (engine.weights) runs the
same checks in every worker, so none reports ready on a checkpoint it would serve wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.engine.architectures import (UnsupportedModelError, check_tensors, config_from_hf, eos_ids,
                                         expected_tensors)
from tandem.engine.config import ModelConfig
from tandem.engine.quant.checkpoint import ScaleError, split_scales


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object")
    return data


def read_model_config(path: Path) -> ModelConfig:
    """config.json -> ModelConfig (refusing what the decoder does not implement), with the EOS set
    of config.json and generation_config.json together (instruct models often list their
    end-of-turn token in the second only)."""
    cfg = config_from_hf(_read_json(path / "config.json"), str(path / "config.json"))
    eos = list(cfg.eos_token_ids)
    if (path / "generation_config.json").exists():
        gen = _read_json(path / "generation_config.json")
        eos += [t for t in eos_ids(gen.get("eos_token_id")) if t not in eos]
    return ModelConfig(**{**cfg.__dict__, "eos_token_ids": tuple(eos)})


def _weight_files(path: Path) -> list[Path]:
    """The files an index names (Mistral's repositories also ship consolidated.safetensors, in
    another naming, beside the sharded Hugging Face files), else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" ({', '.join(other)} cannot be read: convert to safetensors)" if other else ""
        raise UnsupportedModelError(f"{path}: no *.safetensors files{hint}")
    return files


def tensor_index(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, file) of every tensor in the directory's safetensors files (headers only)."""
    index: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                if name in index:
                    raise UnsupportedModelError(f"{f}: tensor {name!r} is also in {index[name][1]}")
                index[name] = (tuple(handle.get_slice(name).get_shape()), str(f))
    return index


def check_model_dir(path: Path) -> ModelConfig:
    """The directory's ModelConfig, once its config and tensor set are known to serve correctly."""
    cfg = read_model_config(path)
    found = tensor_index(path)
    if cfg.quant_method is not None:  # an FP8 checkpoint: its scale tensors, then the weights
        try:
            found = split_scales(cfg, found, expected_tensors(cfg))
        except ScaleError as e:
            raise UnsupportedModelError(str(e)) from None
    check_tensors(cfg, found)
    return cfg


def load_tensors(path: Path, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, on `device` in `dtype`."""
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        tensors.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(str(f)).items()})
    return tensors
