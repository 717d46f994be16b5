"""One-line factories for worker unit tests (vLLM's tests/v1/core/utils.py `create_scheduler` is
the model): a real engine on the tiny-random model, workers joined by the in-process fake network
(kv_transfer/fake.py, faults injectable per link), and a clock the test moves by hand. Every
keyword a worker's constructor takes can be overridden."""

from __future__ import annotations

import threading

from tandem.decode_workers.worker import DecodeWorker
from tandem.engine.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.fake import FakeNetwork
from tandem.prefill_workers.worker import PrefillWorker
from tandem.workers.worker import PoolWorker

FAST = KVTransferConfig(connect_timeout_s=2.0, timeout_s=2.0, start_timeout_s=5.0)


class FakeClock:
    """Monotonic seconds that move only when the test says (`advance`)."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def create_engine(num_blocks: int = 64, **overrides) -> LLMEngine:
    """The tiny-random model (2 layers, 64 wide) on CPU, `num_blocks` 16-token KV blocks."""
    cfg = dict(model="tiny-random", cache=CacheConfig(num_blocks=num_blocks), warmup=False)
    return LLMEngine(EngineConfig(**{**cfg, **overrides}))


def create_prefill_worker(network: FakeNetwork | None = None, worker_id: str = "prefill-0",
                          **overrides) -> PrefillWorker:
    network = network or FakeNetwork()
    kwargs = dict(engine=create_engine(), connector=network.connector(worker_id), transfer_config=FAST)
    return PrefillWorker(worker_id, **{**kwargs, **overrides})


def create_decode_worker(network: FakeNetwork | None = None, worker_id: str = "decode-0",
                         **overrides) -> DecodeWorker:
    """Remote prefill on offer for uncached parts over 16 tokens (`local_prefill_threshold`)."""
    network = network or FakeNetwork()
    kwargs = dict(engine=create_engine(), connector=network.connector(worker_id), transfer_config=FAST,
                  local_prefill_threshold=16)
    return DecodeWorker(worker_id, **{**kwargs, **overrides})


def create_pool_worker(network: FakeNetwork | None = None, worker_id: str = "worker-0", pool: str = "decode",
                       **overrides) -> PoolWorker:
    """A worker of both parts (tandem.workers) starting in `pool`'s role; remote prefill on offer
    for uncached parts over 16 tokens, as `create_decode_worker`."""
    network = network or FakeNetwork()
    kwargs = dict(engine=create_engine(), connector=network.connector(worker_id), transfer_config=FAST,
                  local_prefill_threshold=16)
    return PoolWorker(worker_id, pool, **{**kwargs, **overrides})
