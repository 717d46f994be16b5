"""The adaptive layout's role policy on a real cluster (real Ray, controller, gRPC router, KV over
gloo; the tiny random model on CPU): three mixed workers, the router placing each prompt by the cost
model, the controller planning roles on the demand its workers report. Under a prompt-heavy load
(long prompts, few output tokens, many at once) the policy lends a worker to prefill, and prompts
are prefilled on it; once the load turns decode-heavy (short prompts, long outputs) it returns it.
Every request succeeds, greedy outputs are token-exact against the offline engine, no KV block is
left held.

The perf model is written here, not profiled: its coefficients put the policy's lend/return
boundary where this load crosses it on any CPU that keeps up with it. The prompt-heavy phase is
open loop (a fixed arrival rate of long prompts), so the prompt tokens per second the controller
measures are the arrival rate's, not the machine's speed; the decode-heavy phase keeps a dozen
sequences decoding. The assertions are what the policy must do, with generous timeouts."""

from __future__ import annotations

import json
import random
import threading
import time

import ray

from tandem.cluster.config import ADAPTIVE
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.perf_model import PerfModel

VOCAB = 512                    # tiny-random's
LONG, LONG_OUT = 600, 4        # the prompt-heavy phase: 600-token prompts, 4 tokens out
SHORT, SHORT_OUT = 16, 96      # the decode-heavy phase
ARRIVAL_S = 0.1                # prompt-heavy: one long prompt every 0.1 s (6000 prompt tokens/s)
STREAMS = 12                   # decode-heavy: sequences decoding at once
BACKGROUND = 4                 # prompt-heavy: sequences decoding beside the long prompts
# Service times the policy plans with (seconds). A decode step costs 40 ms and 4 ms per sequence
# against a 60 ms TPOT SLO; a prompt token costs 100 us, so 6000 prompt tokens/s is a fifth of each
# of three mixed workers' time, which stretches their steps past the SLO, and 0.6 of one
# prefill-only worker: lending one wins (by 0.05-0.13 of an SLO for 4500-9000 tokens/s beside 3-8
# decoding sequences). Decoding a dozen sequences on two workers instead of three costs 8 ms more
# per step: with few prompts, returning it wins (by 0.06-0.13). TTFT SLO 500 ms: a prompt on the
# prefill-only worker skips the decode step it would share locally, a gain the router sees.
PERF = PerfModel(prefill_base_s=0.002, prefill_per_token_s=1e-4, prefill_attn_s=0.0, decode_base_s=0.04,
                 decode_per_seq_s=0.004, decode_per_ctx_token_s=0.0, transfer_base_s=0.001,
                 transfer_per_token_s=0.0, request_overhead_s=0.01, remote_overhead_s=0.01,
                 max_batch=64, max_step_tokens=2048, block_tokens=16)
SLO_TTFT_MS, SLO_TPOT_MS = 500, 60


def _ids(i: int, n: int) -> list[int]:
    rng = random.Random(f"adaptive-{i}")
    return [rng.randrange(3, VOCAB) for _ in range(n)]


class Load:
    """Requests on threads; each index's prompt and max_tokens are recorded for the reference."""

    def __init__(self, cluster):
        self.c, self.asked, self.results, self.errors, self.threads = cluster, {}, {}, [], []
        self._next, self._lock = 0, threading.Lock()

    def _take(self, n: int, out: int) -> int:
        with self._lock:
            i, self._next = self._next, self._next + 1
            self.asked[i] = (_ids(i, n), out)
        return i

    def _run(self, i: int) -> None:
        ids, out = self.asked[i]
        try:
            self.results[i] = self.c.generate(prompt_token_ids=ids, max_tokens=out, ignore_eos=True,
                                              timeout=300)[0]
        except Exception as e:  # noqa: BLE001 - every error fails the test
            self.errors.append((i, repr(e)))

    def spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def open_loop(self, until) -> None:
        """Long prompts at a fixed rate (in this thread) until `until()`."""
        t = time.monotonic()
        while not until():
            self.spawn(self._run, self._take(LONG, LONG_OUT))
            t += ARRIVAL_S
            time.sleep(max(0.0, t - time.monotonic()))

    def closed_loop(self, until, streams: int = STREAMS) -> None:
        """`streams` threads, each sending short prompts with long outputs back to back until `until()`."""
        def stream():
            while not until():
                self._run(self._take(SHORT, SHORT_OUT))
        for _ in range(streams):
            self.spawn(stream)

    def join(self, timeout_s: float = 300) -> None:
        for t in self.threads:
            t.join(timeout_s)


def _role_log(c):
    return ray.get(c.cluster.controller.role_log.remote(), timeout=10)


def _changes(c, to_role: str) -> list:
    return [x for x in _role_log(c) if x.to_role == to_role]


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_the_role_policy_lends_a_worker_under_prompt_load_and_returns_it_after(make_cluster, tmp_path, capsys):
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps({"perf_model": PERF.to_dict()}))
    c = make_cluster({**ADAPTIVE, "model.name": "tiny-random", "cache.num_blocks": 2048, "prefill.replicas": 0,
                      "decode.replicas": 3, "router.perf_model": str(perf), "router.slo_ttft_ms": SLO_TTFT_MS,
                      "router.slo_tpot_ms": SLO_TPOT_MS, "roles.period_s": 2.0, "roles.min_hold_s": 3.0,
                      "roles.margin": 0.05, "roles.window_s": 4.0,
                      # this load steps past the TPOT SLO on purpose (that is what makes lending a
                      # worker win); the batch guard would shed some of it, and every request of
                      # this test must be served (the guard's own test: tests/cluster/test_client.py)
                      "router.batch_guard": False})
    load, t0 = Load(c), time.monotonic()
    lent_at: list[float] = []

    def prompt_heavy_done() -> bool:
        # go on 6 s past the first lend, so prompts are placed on the lent worker; 45 s at most
        if not lent_at and _changes(c, "prefill"):
            lent_at.append(time.monotonic())
        return time.monotonic() - t0 > 45 or bool(lent_at and time.monotonic() - lent_at[0] > 6)

    load.closed_loop(prompt_heavy_done, BACKGROUND)
    load.open_loop(prompt_heavy_done)
    switched, t1 = time.time(), time.monotonic()
    load.closed_loop(lambda: bool(_changes(c, "mixed")) or time.monotonic() - t1 > 45)
    load.join()
    log = _role_log(c)
    counters = dict(c.routers[0][1].counters)
    stats = c.worker_stats()
    used = c.wait_idle()
    with capsys.disabled():
        print(f"\n{len(load.asked)} requests; router: {counters}")
        for x in log:
            print(f"  {x.at_unix_s:.1f} {x.worker_id} {x.from_role} -> {x.to_role}: {x.reason}")
        print("  remote prefills per worker:", {w: s.prefills for w, s in stats.items()})

    assert not load.errors, load.errors[:5]
    ref = LLMEngine(EngineConfig(model="tiny-random", cache=CacheConfig(num_blocks=4096))).generate(
        [{"prompt_token_ids": ids, "max_tokens": out, "ignore_eos": True} for ids, out in
         (load.asked[i] for i in range(len(load.asked)))])
    assert [load.results.get(i) for i in range(len(load.asked))] == [r["token_ids"] for r in ref]
    why = [(x.to_role, x.reason) for x in log]
    lends = [x for x in log if x.to_role == "prefill"]
    assert lends and lends[0].reason.startswith("lend a worker to prefill") and lends[0].at_unix_s < switched, why
    back = [x for x in log if x.to_role == "mixed" and x.at_unix_s > switched]
    assert back and back[0].reason.startswith("return a prefill worker to decode"), why
    assert counters.get("cost_remote", 0) > 0 and sum(s.prefills for s in stats.values()) > 0, counters
    assert used and all(v == 0 for v in used.values()), used
