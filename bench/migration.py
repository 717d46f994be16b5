"""The pause a running stream sees when it moves to another decode worker with its KV
(KV-preserving migration), on a real local cluster: one prefill and two decode workers, streams
decoding on one of them, then `MoveSequences` one at a time (the first move over a decode pair
makes its KV link, the later ones reuse it).

A move pre-copies the sequence's full blocks while it keeps decoding, then pauses it and sends the
tail (decode_workers/moves.py). For each move: the moved stream's pause (the gap between its last
response from the old worker and its first from the new one, found by the time the router got the
pause notice, router/moving.py `complete`), its median gap before the move (one decode step of the
batch), the KV positions moved and how many of them went in the pre-copy, the pre-copy's and the
tail's transfer times as the sending worker timed them (send to the sender letting go), and the
issue's aim, pause / (2 steps + transfer) <= 1, where the transfer inside the pause is the tail's
(also shown against the whole transfer, pre-copy included). The last column is the longest gap of
any stream in the 1.5 s after the move began: on a shared machine it shows stalls that are not the
move's (all streams at once).

    python bench/migration.py                           # tiny-random, 4 streams, 1200 tokens each
    python bench/migration.py --model smollm2-135m --streams 4 --max-tokens 400
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

import ray

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.conftest; a PYTHONPATH layout wins

import tandem.router.generation as generation  # noqa: E402
from tandem.cluster.local import RunningCluster  # noqa: E402
from tandem.protos.tandem.v1 import admin_pb2  # noqa: E402
from tandem.protos.tandem.v1 import generation_pb2 as pb  # noqa: E402


class Stream(threading.Thread):
    def __init__(self, c: RunningCluster, i: int, max_tokens: int):
        super().__init__(daemon=True)
        self.c, self.i, self.max_tokens = c, i, max_tokens
        self.times: list[float] = []
        self.tokens = 0
        self.error: str | None = None
        self.request_id = ""

    def run(self) -> None:
        req = pb.GenerateRequest(prompt=f"stream {self.i}: " + " ".join(f"w{(self.i * 13 + k) % 89}" for k in range(40)),
                                 sampling=pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True))
        try:
            for r in self.c.stub.Generate(req, timeout=600):
                self.request_id = self.request_id or r.request_id
                self.tokens += len(r.token_ids)
                self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - reported
            self.error = repr(e)


MOVED: list[tuple[str, float]] = []     # (request id, when the router got its pause notice)


def _record_moves() -> None:
    """Note when the in-process router learns of each pause (`generation.complete`)."""
    complete = generation.complete

    async def noted(placer, flow, paused):
        MOVED.append((flow.request_id, time.perf_counter()))
        return await complete(placer, flow, paused)
    generation.complete = noted


def _wait(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.02)


_SENT = ("sequences_migrated", "kv_tokens_migrated", "kv_tokens_precopied", "move_precopy_seconds", "move_tail_seconds")


def _sent(c: RunningCluster, wid: str) -> dict[str, float]:
    s = c.worker_stats()[wid]
    return {k: getattr(s, k) for k in _SENT}


def measure_move(c: RunningCluster, streams: list[Stream], source: str, target: str, label: str) -> dict:
    moves0 = len(MOVED)
    sent0 = _sent(c, source)
    moved_in0 = c.worker_stats()[target].sequences_migrated_in
    t0 = time.perf_counter()
    paused = c.admin.MoveSequences(admin_pb2.MoveSequencesRequest(worker_id=source, count=1), timeout=30).paused
    if not paused:
        raise RuntimeError(f"{label}: nothing left decoding on {source} to move (longer streams: --max-tokens)")
    _wait(lambda: c.worker_stats()[target].sequences_migrated_in > moved_in0, 60)
    time.sleep(0.5)                       # a few steps after the move (the tail's send released)
    sent = {k: v - sent0[k] for k, v in _sent(c, source).items()}
    n = max(1, sent["sequences_migrated"])
    precopy, tail = sent["move_precopy_seconds"] / n, sent["move_tail_seconds"] / n
    rid, noticed = MOVED[moves0]
    s = next(s for s in streams if s.request_id == rid)
    last = max(t for t in s.times if t <= noticed)
    pause = min(t for t in s.times if t > noticed) - last
    step = statistics.median(b - a for a, b in zip(s.times, s.times[1:]) if t0 - 2.0 <= a and b <= last)
    anyone = max((b - a for x in streams for a, b in zip(x.times, x.times[1:]) if t0 <= a <= t0 + 1.5), default=0.0)
    return {"move": label, "paused": paused, "stream": s.i, "pause_ms": 1e3 * pause, "step_ms": 1e3 * step,
            "any_gap_ms": 1e3 * anyone,
            "positions": sent["kv_tokens_migrated"] / n, "precopied": sent["kv_tokens_precopied"] / n,
            "precopy_ms": 1e3 * precopy, "tail_ms": 1e3 * tail, "pause_over_aim": pause / (2 * step + tail),
            "pause_over_whole": pause / (2 * step + precopy + tail)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1200)
    ap.add_argument("--out", default=None, help="JSON results here")
    ap.add_argument("--log", action="store_true", help="the router's log of each move (INFO) on stderr")
    args = ap.parse_args(argv)
    if args.log:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("tandem.router.moving").setLevel(logging.INFO)
    _record_moves()
    ray.init(num_cpus=8, resources={"tandem_prefill": 64, "tandem_decode": 64}, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR")
    c = RunningCluster({"model.name": args.model, "cache.num_blocks": 1024, "decode.local_prefill_threshold": 10_000,
                        "prefill.replicas": 1, "decode.replicas": 2})
    try:
        # every stream on decode-0: decode-1 serves prefill only while they start
        ray.get(c.cluster.controller.set_role.remote("decode-1", "prefill", "bench: keep new streams off"), timeout=10)
        time.sleep(0.6)
        streams = [Stream(c, i, args.max_tokens) for i in range(args.streams)]
        for s in streams:
            s.start()
        _wait(lambda: all(s.tokens >= 30 for s in streams), 120)
        ray.get(c.cluster.controller.set_role.remote("decode-1", "decode", "bench: the target"), timeout=10)
        time.sleep(0.6)
        rows = [measure_move(c, streams, "decode-0", "decode-1", "first (new link)")]
        for k in range(1, args.streams - 1):
            rows.append(measure_move(c, streams, "decode-0", "decode-1", f"move {k + 1} (link made)"))
        for s in streams:
            s.join(600)
        errors = [s.error for s in streams if s.error]
    finally:
        c.close()
        ray.shutdown()
    print(f"\nKV-preserving moves, {args.model}, {args.streams} streams of {args.max_tokens} tokens, "
          f"decode-0 -> decode-1 (CPU, gloo)")
    print("| move | KV positions (pre-copied) | pause ms | step ms | pre-copy ms | tail ms | pause / (2 steps + tail) "
          "| pause / (2 steps + pre-copy + tail) | longest gap, any stream ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['move']} | {r['positions']:.0f} ({r['precopied']:.0f}) | {r['pause_ms']:.1f} | {r['step_ms']:.2f} "
              f"| {r['precopy_ms']:.1f} | {r['tail_ms']:.1f} | {r['pause_over_aim']:.2f} | {r['pause_over_whole']:.2f} "
              f"| {r['any_gap_ms']:.1f} |")
    print(f"errors: {errors or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "errors": errors}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
