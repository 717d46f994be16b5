"""router/flow.py: a request's states and transitions, without Ray, actors or gRPC."""

from __future__ import annotations

import pytest

from tandem.router.flow import Event, FlowState, RequestFlow
from tandem.wire.errors import MigrationsExhausted
from tandem.wire.messages import (FinishReason, FirstToken, OutputError, SamplingParams, StepOutput, Usage,
                                  WorkerLostNotice)


def make_flow(prompt=(1, 2, 3, 4), max_tokens=8, **overrides) -> RequestFlow:
    return RequestFlow("r1", list(prompt), SamplingParams(max_tokens=max_tokens), **overrides)


def tokens(*ids, finish=None, usage=None) -> StepOutput:
    return StepOutput("r1", list(ids), "x" * len(ids), finish, usage)


def test_local_placement_streams_and_finishes_with_the_whole_requests_usage():
    flow = make_flow()
    flow.placed(remote=False)
    assert flow.state is FlowState.STREAMING
    assert flow.take(tokens(7)) is True and flow.take(tokens(8, 9)) is False
    usage = flow.finish(Usage(prompt_tokens=99, cached_prompt_tokens=2, completion_tokens=1), prefill_cached=0)
    assert flow.state is FlowState.FINISHED
    assert (usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens) == (4, 2, 3)


def test_remote_placement_takes_the_prefills_first_token_and_hands_it_over():
    flow = make_flow()
    flow.placed(remote=True)
    assert flow.state is FlowState.PREFILLING
    first = FirstToken(token_id=42, text="hi", rng_state=b"s")
    msg = flow.first_from_prefill(first, prefill_cached=0)
    assert (msg.token_ids, msg.text, msg.finished) == ([42], "hi", False)
    assert flow.state is FlowState.STREAMING and flow.handover is first and not flow.release_decode


def test_a_first_token_that_ends_the_request_releases_the_decode_actor():
    flow = make_flow()
    flow.placed(remote=True)
    msg = flow.first_from_prefill(FirstToken(42, "hi", FinishReason.STOP), prefill_cached=16)
    assert msg.finished and msg.usage.completion_tokens == 1 and msg.usage.cached_prompt_tokens == 16
    assert flow.release_decode and flow.handover is None


def test_first_token_is_first_once_across_a_migration_and_a_second_remote_prefill():
    """The defect: after a migration that prefilled remotely again, the second prefill's token was
    taken as the request's first (TTFT recorded and slow-logged twice)."""
    flow = make_flow()
    flow.placed(remote=True)
    assert flow.take(flow.first_from_prefill(FirstToken(42, "a"), 0)) is True
    assert flow.classify(OutputError("r1", "boom"), "d0") is Event.MIGRATE
    assert flow.migrate(OutputError("r1", "boom"), "d0") == "request_failed"
    flow.placed(remote=True)
    assert flow.take(flow.first_from_prefill(FirstToken(43, "b"), 0)) is False
    assert flow.out_ids == [42, 43]


def test_a_failed_remote_prefill_falls_back_to_streaming():
    flow = make_flow()
    flow.placed(remote=True)
    flow.prefill_fell_back()
    assert flow.state is FlowState.STREAMING
    with pytest.raises(RuntimeError, match="prefilling expected"):
        flow.first_from_prefill(FirstToken(1, "a"), 0)


def test_only_our_decode_actors_loss_moves_the_request_and_it_is_not_used_again():
    flow = make_flow()
    flow.placed(remote=False)
    assert flow.classify(WorkerLostNotice("d9", "gone"), "d0") is Event.IGNORE
    assert flow.classify(tokens(1), "d0") is Event.TOKENS
    lost = WorkerLostNotice("d0", "gone")
    assert flow.classify(lost, "d0") is Event.MIGRATE
    assert flow.migrate(lost, "d0") == "decode_lost"
    assert flow.lost == {"d0"} and flow.state is FlowState.PLACING and flow.migrations == 1


def test_continuation_extends_the_prompt_with_the_streamed_tokens():
    flow = make_flow(prompt=(1, 2), max_tokens=5)
    flow.placed(remote=False)
    flow.take(tokens(7, 8))
    ids, sp = flow.continuation()
    assert ids == [1, 2, 7, 8] and sp.max_tokens == 3
    flow.take(tokens(9, 10, 11))
    assert flow.continuation()[1].max_tokens == 1     # never below one token


def test_migrations_past_the_limit_fail_the_request():
    flow = make_flow(max_migrations=1)
    flow.placed(remote=False)
    flow.migrate(OutputError("r1", "one"), "d0")
    flow.placed(remote=False)
    with pytest.raises(MigrationsExhausted, match="after 1 migrations: two"):
        flow.migrate(OutputError("r1", "two"), "d1")
    assert flow.state is FlowState.FAILED


def test_a_refused_handover_comes_back_once_as_an_error():
    flow = make_flow()
    flow.placed(remote=True)
    flow.first_from_prefill(FirstToken(42, "a"), 0)
    flow.handover_refused("it no longer held the request")
    msg = flow.take_injected()
    assert isinstance(msg, OutputError) and "refused the first token" in msg.error
    assert flow.take_injected() is None
    assert flow.classify(msg, "d0") is Event.MIGRATE


def test_placing_twice_without_a_migration_is_refused():
    flow = make_flow()
    flow.placed(remote=False)
    with pytest.raises(RuntimeError, match="placing expected"):
        flow.placed(remote=False)
