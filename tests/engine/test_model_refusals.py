"""What the engine refuses to serve, and how the refusal reaches a user: a checkpoint whose
architecture, config values or tensor set the decoder does not implement fails at load with a
message naming the thing and the file (`resolve_model_dir`, which every load and `tandem up` go
through before anything starts), and `tandem generate` / `tandem up` print it as one line and
exit 2. Each case starts from a tiny checkpoint transformers wrote (tests/engine/families.py)
and breaks one thing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tandem.engine.architectures import UnsupportedModelError
from tandem.engine.weights import resolve_model_dir
from tests.engine.families import build_family_dir


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """family -> a directory transformers wrote; copy before changing it."""
    root = tmp_path_factory.mktemp("pristine")
    return {f: (build_family_dir(f, root / f), root / f)[1] for f in ("llama", "qwen2", "qwen3")}


def _copy(pristine, family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(pristine[family], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path, name):
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


def _qwen2_labelled_llama(p):  # the defect issue 24 reports: Qwen2's biases silently dropped
    _edit_config(p, architectures=["LlamaForCausalLM"], model_type="llama")


CASES = {
    # name: (family, break it, (where, what) the message names)
    "unknown-architecture": ("llama", lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]),
                             ("config.json", "architecture 'GPT2LMHeadModel' is not supported")),
    "unused-tensor": ("qwen2", _qwen2_labelled_llama,
                      ("model.safetensors", "'model.layers.0.self_attn.k_proj.bias' is not used by LlamaForCausalLM")),
    "missing-tensor": ("qwen3", lambda p: _drop_tensor(p, "model.layers.1.self_attn.k_norm.weight"),
                       ("model.safetensors", "'model.layers.1.self_attn.k_norm.weight' that Qwen3ForCausalLM "
                                             "needs is missing")),
    "rope-type": ("llama", lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                       "rope_theta": 1e4}),
                  ("config.json", "rope_scaling type 'yarn'")),
    "qwen2-sliding": ("qwen2", lambda p: _edit_config(p, use_sliding_window=True),
                      ("config.json", "use_sliding_window=True is not implemented for Qwen2ForCausalLM")),
    "tied-but-lm-head": ("llama", lambda p: _edit_config(p, tie_word_embeddings=True),
                         ("model.safetensors", "'lm_head.weight' is not used by LlamaForCausalLM (config.json "
                                               "has tie_word_embeddings true)")),
    "untied-no-lm-head": ("qwen2", lambda p: _edit_config(p, tie_word_embeddings=False),
                          ("model.safetensors", "'lm_head.weight' that Qwen2ForCausalLM needs is missing")),
    "shape": ("qwen3", lambda p: _edit_config(p, head_dim=16),
              ("model.safetensors", "'model.layers.0.self_attn.q_proj.weight' has shape [128, 64]")),
    "quantized": ("llama", lambda p: _edit_config(p, quantization_config={"quant_method": "gptq"}),
                  ("config.json", "quantization_config quant_method 'gptq' is not supported")),
    "activation": ("qwen3", lambda p: _edit_config(p, hidden_act="gelu"),
                   ("config.json", "hidden_act='gelu' (only silu) is not implemented")),
    "heads": ("qwen3", lambda p: _edit_config(p, num_key_value_heads=3),
              ("config.json", "num_heads (4) must be a multiple of num_kv_heads (3)")),
    "attention-bias": ("qwen3", lambda p: _edit_config(p, attention_bias=True),
                       ("config.json", "attention_bias=True is not implemented for Qwen3ForCausalLM")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_load_naming_the_thing_and_the_file(case, pristine, tmp_path):
    family, break_it, (where, what) = CASES[case]
    path = _copy(pristine, family, tmp_path)
    resolve_model_dir(str(path))  # serves before the change
    break_it(path)
    with pytest.raises(UnsupportedModelError) as err:
        resolve_model_dir(str(path))
    msg = str(err.value)
    assert what in msg and str(path / where) in msg and "\n" not in msg, msg


def test_tokenizer_json_is_required(pristine, tmp_path):
    from tandem.engine.weights import load_tokenizer

    path = _copy(pristine, "llama", tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedModelError, match="no tokenizer.json"):
        load_tokenizer(str(path))


def _tandem(*args, timeout=120):
    run = subprocess.run([sys.executable, "-m", "tandem.cluster.cli", *args], capture_output=True, text=True,
                         timeout=timeout)
    return run.returncode, run.stderr.strip().splitlines()


def test_generate_and_up_print_one_line_and_exit_2(pristine, tmp_path):
    path = _copy(pristine, "qwen2", tmp_path)
    _qwen2_labelled_llama(path)
    for args in (["generate", "--prompt", "hi"], ["up", "--port", "0", "--metrics-port", "0"]):
        rc, err = _tandem(args[0], "--model", str(path), *args[1:])
        assert rc == 2 and len(err) == 1, (args[0], rc, err[-5:])
        assert err[0].startswith("tandem: ") and "is not used by LlamaForCausalLM" in err[0]
        assert str(path / "model.safetensors") in err[0]


@pytest.mark.parametrize("command", ["generate", "up"])
def test_tensor_parallel_and_quantization_are_refused_until_built(command):
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
    for flag, value, needle in (("--tensor-parallel", "4", "tensor_parallel_size 4 does not divide the 2 KV heads"),
                                ("--quantization", "int4", "quantization 'int4' is not implemented")):
        rc, err = _tandem(command, "--model", "tiny-random", flag, value, *extra)
        assert rc == 2 and len(err) == 1 and needle in err[0], (command, flag, rc, err[-5:])


def test_an_index_names_the_weight_files(pristine, tmp_path):
    """Mistral's repositories ship consolidated.safetensors (other names) beside the sharded files:
    with model.safetensors.index.json only the files it names are read."""
    import torch

    path = _copy(pristine, "llama", tmp_path)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    with pytest.raises(UnsupportedModelError, match="consolidated.safetensors: tensor 'layers.0.attention.wq"):
        resolve_model_dir(str(path))
    names = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    resolve_model_dir(str(path))


def test_a_path_that_is_no_model_says_what_it_lacks(tmp_path):
    from tandem.engine.weights import ModelNotFoundError
    with pytest.raises(ModelNotFoundError, match="is a directory without a config.json"):
        resolve_model_dir(str(tmp_path))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file but not a .gguf one"):
        resolve_model_dir(str(tmp_path / "model.bin"))
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        resolve_model_dir("no-such-model")
