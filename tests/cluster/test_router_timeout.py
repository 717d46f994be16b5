"""A decode actor whose router stops polling (crashed, or cut off) aborts that router's requests,
frees their KV and keeps one error per request for the router, while other routers' requests
decode on. Real DecodeWorker and engine (smollm2-135m on CPU); no Ray needed."""

from __future__ import annotations

import threading
import time

from tandem.decode_workers.worker import DecodeWorker
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.wire.messages import DecodeReserve, OutputError, SamplingParams, StepOutput


def _until(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_silent_router_loses_its_requests_and_their_kv():
    # ~20+ ms steps: long requests stay running
    # (512 KV blocks hold the three requests; the default sizes the cache from memory, 2 GiB on CPU)
    engine = LLMEngine(EngineConfig(model="smollm2-135m", cache=CacheConfig(num_blocks=512)))
    w = DecodeWorker("decode-t", engine, router_timeout_s=0.6)
    stop = threading.Event()
    live_out: list = []

    def live_router():                       # polls like ClusterView's pump
        while not stop.is_set():
            live_out.extend(w.get_outputs("r-live", 0.05))

    t = threading.Thread(target=live_router, daemon=True)
    t.start()
    try:
        sampling = SamplingParams(max_tokens=1500, ignore_eos=True)
        for i in range(2):
            w.reserve(DecodeReserve(f"dead-{i}", "r-dead", list(range(3 + i, 40 + i)), sampling))
        w.reserve(DecodeReserve("live-0", "r-live", list(range(50, 90)), sampling))
        _until(lambda: w.stats().router_timeouts == 2)
        assert w.held() == {"live-0": "in_engine"}              # the live router's request goes on
        # both read in one loop call: the live request grows a block between two separate reads
        used, live_blocks = w.loop.run(lambda: (w.engine.allocator.num_used_blocks,
                                                len(w.engine.scheduler.requests["live-0"].block_ids)))
        assert used == live_blocks                                 # the dead router's KV is free
        # the router comes back: it finds an error for each request instead of a token stream
        back = w.get_outputs("r-dead", 0.5)
        assert sorted(m.request_id for m in back) == ["dead-0", "dead-1"]
        assert all(isinstance(m, OutputError) and "did not poll" in m.error for m in back)
        # and serves again: a new request from it is not expired on the spot
        w.reserve(DecodeReserve("dead-2", "r-dead", list(range(7, 30)), SamplingParams(max_tokens=3, ignore_eos=True)))
        got: list = []
        _until(lambda: got.extend(w.get_outputs("r-dead", 0.05)) or any(getattr(m, "finished", False) for m in got))
        assert sum(len(m.token_ids) for m in got if isinstance(m, StepOutput)) == 3
        assert any(isinstance(m, StepOutput) and m.token_ids for m in live_out)
    finally:
        stop.set()
        t.join(5)
        w.shutdown()
