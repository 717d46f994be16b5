"""The `tandem` command line: `generate` (offline, through the engine), and the cluster commands
(`up`, `chat`, `status`, ...) as they land. Errors a user can fix print one line and exit 2."""

from __future__ import annotations

import argparse
import json
import sys

from tandem.cluster import commands
from tandem.engine.config import SPECULATIVE_METHODS, CacheConfig, EngineConfig, SpeculativeConfig
from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import SamplingParams


def _read_prompt_file(path: str) -> list[dict]:
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InvalidRequestError(f"{path}:{n}: each line must be a JSON object")
            keys = [k for k in ("prompt", "messages", "prompt_token_ids") if k in obj]
            if len(keys) != 1:
                raise InvalidRequestError(f"{path}:{n}: give exactly one of prompt, messages, prompt_token_ids")
            allowed = {"prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p",
                       "top_k", "seed", "stop", "ignore_eos", "request_id", "presence_penalty",
                       "frequency_penalty", "repetition_penalty"}
            unknown = set(obj) - allowed
            if unknown:
                raise InvalidRequestError(f"{path}:{n}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
            try:  # the sampling values, checked here so an error names its line
                SamplingParams(**{k: tuple(v) if k == "stop" else v for k, v in obj.items()
                                  if k in SamplingParams.__dataclass_fields__})
            except (InvalidRequestError, TypeError) as e:
                raise InvalidRequestError(f"{path}:{n}: {e}") from None
            reqs.append(obj)
    if not reqs:
        raise InvalidRequestError(f"{path}: no requests")
    return reqs


def cmd_generate(args) -> int:
    from tandem.engine.parallel.local import start_local_engine  # noqa: PLC0415 - torch loads only for offline generation

    if args.prompt_file:
        reqs = _read_prompt_file(args.prompt_file)
    else:
        reqs = [{"prompt": args.prompt}]
    for r in reqs:
        if args.max_tokens is not None:
            r.setdefault("max_tokens", args.max_tokens)
        if args.temperature is not None:
            r.setdefault("temperature", args.temperature)
        if args.seed is not None:
            r.setdefault("seed", args.seed)
    cache = CacheConfig(num_blocks=args.num_blocks) if args.num_blocks else CacheConfig()
    spec = SpeculativeConfig(method=args.speculative, num_tokens=args.num_speculative_tokens,
                             draft_model=args.draft_model, draft_num_layers=args.draft_layers,
                             suffix_tree_nodes=args.speculative_tree_nodes)
    engine = start_local_engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=cache,
                                    speculative=spec, tensor_parallel_size=args.tensor_parallel,
                                    quantization=args.quantization))
    # validate everything before running anything
    for r in reqs:
        sp = SamplingParams(**{k: (tuple(v) if k == "stop" else v) for k, v in r.items()
                               if k in SamplingParams.__dataclass_fields__})
        engine.validate(engine.tokenize(r.get("prompt"), r.get("prompt_token_ids"), r.get("messages")), sp)
    if args.json or len(reqs) > 1:
        for res in engine.generate(reqs):
            if args.json:
                print(json.dumps(res))
            else:
                print(res["text"])
        return 0
    # one prompt, human output: stream as tokens arrive
    r = reqs[0]
    sp = SamplingParams(**{k: v for k, v in r.items() if k in SamplingParams.__dataclass_fields__})
    engine.add_request("cli", prompt=r.get("prompt"), sampling=sp)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving on Ray")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="run prompts offline through the engine")
    g.add_argument("--model", default="smollm2-135m")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", help="JSON Lines: prompt | messages | prompt_token_ids, + sampling fields")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true", help="one JSON object per request, in input order")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="ranks per model, one local process each (gloo on CPU, NCCL on CUDA)")
    g.add_argument("--quantization", help="weight quantization: none (the default) or fp8 (FP8 e4m3 weights, per-channel scales, quantized at load)")
    g.add_argument("--num-blocks", type=int, help="KV cache size in blocks (default: from memory)")
    g.add_argument("--speculative", default="off", choices=SPECULATIVE_METHODS,
                   help="speculative decoding: n-gram prompt lookup, suffix drafts (the request's own tokens "
                        "and recent outputs), or a draft model (--draft-model or --draft-layers); output is "
                        "the same as without")
    g.add_argument("--num-speculative-tokens", type=int, default=5, metavar="K",
                   help="the most draft tokens per sequence per step (default 5)")
    g.add_argument("--speculative-tree-nodes", type=int, default=0, metavar="N",
                   help="with --speculative suffix: draft trees of up to N nodes (2-63), verified in one "
                        "pass, instead of single continuations (default 0: chains)")
    g.add_argument("--draft-model", help="with --speculative draft: a model with the same vocabulary")
    g.add_argument("--draft-layers", type=int, metavar="N",
                   help="with --speculative draft: draft with the model's own first N layers")
    g.set_defaults(func=cmd_generate)

    commands.register(sub)  # the cluster commands register themselves
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidRequestError as e:
        print(f"tandem: invalid request: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
