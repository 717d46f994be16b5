"""Readiness (router/health.py): SERVING only while a request can be served end to end."""

import asyncio

from tandem.router.health import NOT_SERVING, SERVING, HealthFollower, readiness
from tandem.wire.cluster import WorkerEntry


def w(wid, pool, state="ready", role=""):
    return WorkerEntry(wid, pool, state, role=role)


def test_a_ready_decode_serving_worker_is_needed():
    assert not readiness([])[0]
    assert not readiness([w("p0", "prefill")])[0]
    assert not readiness([w("p0", "prefill"), w("d0", "decode", "starting"), w("d1", "decode", "draining")])[0]
    assert not readiness([w("d0", "decode", role="prefill")])[0]          # lent away: it only prefills
    assert readiness([w("d0", "decode")]) == (True, "decode ready, prefill local")
    assert readiness([w("p0", "prefill", role="mixed")])[0]              # a prefill worker that also decodes
    assert not readiness([w("d0", "decode")], reachable=lambda _: False)[0]


class FakeServicer:
    def __init__(self):
        self.calls = []

    async def set(self, svc, status):
        self.calls.append((svc, status))


def test_the_follower_sets_each_change_once():
    async def run():
        s = FakeServicer()
        f = HealthFollower(s, ("", "gen"))
        for workers in ([w("d0", "decode")], [w("d0", "decode")], [], [], [w("d1", "decode")]):
            f.follow(workers)
            await asyncio.sleep(0)
        return s.calls

    calls = asyncio.run(run())
    assert calls == [("", SERVING), ("gen", SERVING), ("", NOT_SERVING), ("gen", NOT_SERVING),
                     ("", SERVING), ("gen", SERVING)]
