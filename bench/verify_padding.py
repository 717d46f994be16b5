"""What a served decode step pays for speculation: the engine pads every sequence's query to the
step's widest draft (the kernels' query tile, a CUDA graph's shape), so one sequence drafting k
tokens costs the whole batch. Times, per batch and context, a plain decode step, a step in which
every sequence verifies k drafts, and one in which only the first does (`tandem profile`'s
decode / verify / padded samples), and prints them side by side.

    python bench/verify_padding.py --model llama3-8b-random --device cuda --dtype bfloat16 \
        --merge bench/perf/h200-llama3-8b-profile.json -o /tmp/profile-padded.json
    tandem profile --from /tmp/profile-padded.json -o /tmp/profile.json   # refit with them

`--merge P -o OUT`: P's samples with its decode and verify samples replaced by this run's, and
the padded ones added (its prefill, transfer, whole-step and mixed-step timings kept).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.cluster.profiling import SIZES, profile_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafts", default="1,3,5", help="draft tokens k of the verifying sequences")
    ap.add_argument("--merge", help="a `tandem profile -o` JSON whose decode and verify samples these replace")
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    sizes = SIZES["large" if a.device.startswith("cuda") else "small"]
    drafts = tuple(int(k) for k in a.drafts.split(","))
    samples = profile_engine(a.model, a.device, a.dtype, prefill_lengths=(), contexts=(), batches=sizes["batches"],
                             decode_contexts=sizes["decode_contexts"], draft_tokens=drafts)
    t = {(kind, f[0], f[1] // f[0], f[2] if len(f) > 2 else 0): s for kind, f, s in samples if kind != "transfer"}
    print(f"{'batch':>5} {'context':>7} {'k':>2} {'plain ms':>9} {'all draft k':>11} {'one drafts k':>12} "
          f"{'one / plain':>11}")
    for (kind, b, ctx, k), s in sorted(t.items(), key=lambda x: (x[0][2], x[0][1], x[0][3])):
        if kind != "verify":
            continue
        plain, one = t[("decode", b, ctx, 0)], t.get(("padded", b, ctx, k), s)
        print(f"{b:5} {ctx:7} {k:2} {plain * 1e3:9.2f} {s * 1e3:11.2f} {one * 1e3:12.2f} {one / plain:11.2f}")
    if a.merge and a.output:
        prev = json.loads(Path(a.merge).read_text())
        keep = [x for x in prev["samples"] if x[0] not in ("decode", "verify", "padded")]
        prev["samples"] = keep + [[k, list(f), s] for k, f, s in samples if k != "transfer"]
        Path(a.output).write_text(json.dumps(prev, indent=1))
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
