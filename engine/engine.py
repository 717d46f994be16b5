"""The engine: requests in, tokens out. One step is schedule -> run -> postprocess.

Knows token ids and text only at its edges: `add_request` takes a prompt, token ids or chat
messages and validates them before any KV is allocated; `step` returns, per request that advanced,
the new token ids, the new text and, when it ends, the finish reason and usage.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.stats import EngineStats
from tandem.engine.step_trace import StepTrace
from tandem.engine.block_manager import BlockAllocator
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import MAX_GRAPH_QUERY_LEN, batch_buckets
from tandem.engine.inflight import InFlight, feed_pending
from tandem.engine.kv_cache import KVCache, num_blocks_for
from tandem.engine.logprobs import step_logprobs
from tandem.engine.mla import check_engine_config
from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel.loading import load_engine_model
from tandem.engine.parallel.shard import start_shards
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler
from tandem.engine.scheduler import Scheduler
from tandem.engine.speculative.speculator import build_speculator
from tandem.engine.tokenizer import IncrementalDetokenizer, find_stop
from tandem.engine.warmup import WARMUP_SHAPES, warm_up
from tandem.wire.errors import InvalidRequestError
from tandem.wire.messages import FinishReason, FirstToken, SamplingParams, TokenLogprob, Usage


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # a prefill-only request's first output token, as the decode actor continues from it
    first: FirstToken | None = None
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), model=None, tokenizer=None, *,
                 draft_model=None, proposer=None):
        """`draft_model` (a model of the same vocabulary) or `proposer` (any `Proposer`) override
        what `config.speculative` would build; a `proposer` turns speculation on by itself."""
        self.config = config
        if model is None:  # tensor parallel: rank 0's shard (the caller started the other ranks)
            model, tokenizer, _ = load_engine_model(config)
        self.model, self.tokenizer = model, tokenizer
        self.model_config = model.config
        check_engine_config(model.config, config)  # what latent attention does not serve
        # the cache follows the model's own dtype and device (a caller may hand in a model)
        weight = model.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        bs = config.cache.block_size
        bytes_per_block = int(torch.Size(model.kv_cache_shape(1, bs)).numel()) * dtype.itemsize
        num_blocks = num_blocks_for(config.cache, bytes_per_block, device)
        self.kv_cache = KVCache(model.kv_cache_shape(num_blocks, bs), dtype, device)
        self.allocator = BlockAllocator(num_blocks, bs, config.cache.enable_prefix_caching)
        self.max_model_len = model.config.max_position_embeddings
        self.scheduler = Scheduler(config.scheduler, self.allocator, self.max_model_len)
        self.runner = ModelRunner(model, self.kv_cache, device,
                                  cuda_graphs=None if config.tensor_parallel_size == 1 else False,
                                  graph_batch_sizes=batch_buckets(config.scheduler.max_num_seqs))
        self.shards = start_shards(config, self.runner, num_blocks)  # tensor parallel: steps go to ranks 1..N-1
        self.sampler = Sampler()
        self.speculator = None
        if config.speculative.enabled or proposer is not None:
            self.speculator = build_speculator(config.speculative, model, self.sampler, num_blocks=num_blocks,
                                               block_size=bs, dtype=config.dtype, seed=config.seed,
                                               draft_model=draft_model, proposer=proposer,
                                               max_rows=None if self.runner.graphs is None else MAX_GRAPH_QUERY_LEN)
        self.detok: dict[str, IncrementalDetokenizer] = {}
        # overlap the host's work with the device's (engine.inflight): on by default on CUDA, for
        # one model on one device (tensor-parallel ranks replay the host's token ids)
        self.overlap = device.type == "cuda" and config.tensor_parallel_size == 1
        self._inflight: InFlight | None = None   # the launched step whose tokens are not read yet
        self._outputs: list[RequestOutput] = []  # resolved, for the next `step` to return
        self._post_s = 0.0                       # post-processing time since the last step's summary
        self.stats = EngineStats()
        self.last_step: tuple = ()  # what the latest step ran; last_step_summary() reads it
        self.trace = StepTrace.from_env()
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                 messages: list[dict[str, str]] | None = None) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise InvalidRequestError("give exactly one of prompt, prompt_token_ids or messages")
        if messages is not None:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if prompt is not None:
            if not prompt:
                raise InvalidRequestError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        return list(prompt_token_ids)

    def validate(self, ids: list[int], sampling: SamplingParams, prefill_only: bool = False) -> None:
        """`prefill_only`: this engine holds the prompt and its first output token only (a prefill
        actor), so only they must fit its cache; the decode actor checks the rest."""
        if not ids:
            raise InvalidRequestError("the prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens; the model's context is "
                                      f"{self.max_model_len}, leaving no room for output")
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len}; lower max_tokens to at most {self.max_model_len - len(ids)}")
        need = self.allocator.blocks_needed(len(ids) + (1 if prefill_only else sampling.max_tokens))
        if need > self.allocator.num_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens needs {need} KV blocks but this worker's cache holds "
                f"{self.allocator.num_blocks}; send a shorter prompt or lower max_tokens")

    def add_request(self, request_id: str | None = None, *, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None, messages: list[dict[str, str]] | None = None,
                    sampling: SamplingParams | None = None, prefill_only: bool = False) -> Request:
        req = self.make_request(request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                messages=messages, sampling=sampling, prefill_only=prefill_only)
        self.scheduler.add(req)
        return req

    def make_request(self, request_id: str | None = None, *, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None, messages: list[dict[str, str]] | None = None,
                     sampling: SamplingParams | None = None, prefill_only: bool = False) -> Request:
        """A validated request, not yet scheduled (`add_request` schedules it; a decode actor
        receiving KV reserves blocks for it first, then calls `scheduler.add_ready`)."""
        sampling = sampling or SamplingParams()
        ids = self.tokenize(prompt, prompt_token_ids, messages)
        self.validate(ids, sampling, prefill_only)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, ids, sampling, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                      prefill_only=prefill_only)
        if not prefill_only:
            self.detok[rid] = IncrementalDetokenizer(self.tokenizer, ids)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        self._release(request_id)
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self._outputs)

    def _release(self, rid: str) -> None:
        self.sampler.release(rid)
        self.detok.pop(rid, None)
        if getattr(self, "speculator", None) is not None:
            self.speculator.release(rid)  # frees a draft model's blocks at once

    # ---- one step ---------------------------------------------------------------------------
    def _graph_counts(self) -> tuple[int, int, int]:
        """(CUDA graphs captured, graph-shaped steps run eagerly because their shape was not
        captured yet: DecodeGraphs.capture_after, such steps run on the piecewise graphs instead:
        capture_split_after) so far; a step that raises one did that."""
        graphs = self.runner.graphs
        return (graphs.captures, graphs.eager_runs, graphs.split_runs) if graphs is not None else (0, 0, 0)

    def step(self, layer_done=None, after_launch=None) -> list[RequestOutput]:
        """One engine step. `layer_done(layer, scheduled)` runs after each layer's KV is written
        (prefill actors stream that layer of the requests this step completes). `after_launch(wait_device)`
        runs once the step's kernels are queued, before the host waits for them; `wait_device()` blocks
        until they are done (None on CPU). On a GPU that is most of a long prefill step: time a serving
        loop can spend on calls that do not touch the running step (EngineLoop.call_mid_step).
        With `overlap` (default on CUDA), a plain decode step's tokens stay on the device: the call returns
        the outputs of the step before (engine.inflight), so the host schedules, prepares and post-processes
        while the GPU computes. Steps whose inputs need the host's tokens (speculative drafts, layer_done,
        prefill-only requests, seeded sampling, penalties on a CPU) resolve within the call."""
        t0 = time.perf_counter()
        if self.speculator is not None or self.sampler.penalties.needs_host(self.scheduler.running, self.runner.device):
            self.settle()            # its proposals, and penalties on a CPU (engine.penalties), read every token
        drafts = {} if self.speculator is None else self.speculator.propose(self.scheduler.running,
                                                                            self.scheduler.requests)
        sched = self.scheduler.schedule({rid: len(d) for rid, d in drafts.items()})
        self.stats.preemptions += len(sched.preempted)
        if sched.empty:
            self.settle()
            return self.take_outputs()
        t1 = time.perf_counter()
        batch = self.runner.prepare(sched, {rid: d.token_ids for rid, d in drafts.items()},
                                    {rid: d.parents for rid, d in drafts.items() if d.is_tree})
        if self._inflight is not None:
            feed_pending(batch, sched.scheduled, self._inflight)
        hook = (lambda layer: layer_done(layer, sched)) if layer_done is not None else None
        graphs_before = self._graph_counts()
        # prefill positions counted now, before the scheduler advances the requests
        prefill = self.stats.count_prompts(sched.scheduled)
        if self.trace is not None:
            self.trace.begin(time.time() - (time.perf_counter() - t0), sched.scheduled)
        t2 = time.perf_counter()
        logits = self.sampler.penalties.apply_to_step(self.runner.execute(batch, hook), batch.logits_owner,
                                              self.scheduler.requests)
        launched = None if self.speculator is not None else self._sample(sched, batch, logits)
        t3 = time.perf_counter()
        self._count_step(sched)
        prev, self._inflight = self._inflight, None
        keep = (launched is not None and self.overlap and layer_done is None and launched.tokens is not None
                and not any(s.request.prefill_only for s in sched.scheduled))
        if after_launch is not None:  # serve calls until the step resolved now is done on the device
            after_launch(prev.waiter() if prev is not None else None if keep else self._device_waiter())
        if prev is not None:
            self._resolve(prev)
        if launched is None:
            produced = self._verify(sched, batch, logits, drafts)
            self._postprocess_all(produced, logits, batch.logits_owner)
        elif keep:
            self._inflight = launched
        else:
            self._resolve(launched)
        t4, post, self._post_s = time.perf_counter(), self._post_s, 0.0
        # host time per phase: "sample" includes waiting for the device to finish the step whose
        # tokens are read now (overlapped: the one before); "output" is detokenizing them
        phases = (t1 - t0, t2 - t1, t3 - t2, t4 - t3 - post, post)
        captured, uncaptured, split = (now > then for now, then in zip(self._graph_counts(), graphs_before))
        self.last_step = (len(sched.scheduled), sched.num_tokens, prefill, batch.graph_key, captured, phases)
        if self.trace is not None:      # engine.step_trace: off unless $TANDEM_STEP_TRACE_DIR is set
            self.trace.end(keep, self.scheduler.has_work(), captured, uncaptured, split)
        return self.take_outputs()

    def _sample(self, sched, batch, logits) -> InFlight:
        """Sample the step's tokens (on the device unless a row draws from its own seeded
        generator) and advance the scheduler to count them as placeholders."""
        params = [(rid, self.scheduler.requests[rid].sampling) for rid, _ in batch.logits_owner]
        if params and self.sampler.needs_host(params):
            launched = InFlight(sched, batch.logits_owner, logits, None, self.sampler.sample(logits, params))
        else:
            tokens = self.sampler.sample_batch(logits, params) if params else logits.new_empty(0, dtype=torch.long)
            launched = InFlight(sched, batch.logits_owner, logits, tokens)
        self.scheduler.advance(sched)
        return launched

    def _resolve(self, step: InFlight) -> None:
        sampled = {rid: t for (rid, _), t in zip(step.owners, step.token_ids())}
        produced = self.scheduler.resolve(step.sched, sampled)
        self._postprocess_all(produced, step.logits, step.owners)

    def _postprocess_all(self, produced, logits, owners) -> None:
        t0 = time.perf_counter()
        logprobs = step_logprobs(produced, logits, owners)   # {} unless a request asked
        for req, new in produced:
            out = self._postprocess(req, new, logprobs.get(req.request_id))
            if out.finished and self.speculator is not None:
                self.speculator.release(out.request_id)
            self._outputs.append(out)
        self._post_s += time.perf_counter() - t0

    def settle(self) -> None:
        """Resolve a step still on the device; the next `step` returns its outputs. Callers that
        need every request's tokens on the host between steps (pause, speculation) call this."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._resolve(step)

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs resolved by `settle` (or a step) not yet returned; `step` returns them too."""
        outs, self._outputs = self._outputs, []
        return outs

    def _count_step(self, sched) -> None:
        self.stats.steps += 1
        self.stats.tokens_computed += sched.num_tokens
        per = self.stats.per_request_computed
        for s in sched.scheduled:
            rid = s.request.request_id
            per[rid] = per.get(rid, 0) + s.num_new_tokens

    def _device_waiter(self):
        """after_launch's wait_device for a step resolved now: None on CPU."""
        if self.kv_cache.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done.synchronize

    def last_step_summary(self) -> dict[str, Any]:
        """What the latest step ran, for a slow-step log: sequences, tokens, prompt tokens among
        them, the CUDA graph it replayed (None: eager), whether it captured that graph, and the
        host milliseconds of each phase (`sample` includes the wait for the device: a long one
        there means the GPU was slow or waiting; a long `execute` means the launches were)."""
        if not self.last_step:
            return {}
        seqs, tokens, prefill, key, captured, phases = self.last_step
        return {"seqs": seqs, "tokens": tokens, "prefill_tokens": prefill,
                "graph": str(key) if key is not None else None, "captured": captured,
                "ms": dict(zip(("schedule", "prepare", "execute", "sample", "output"),
                               (round(1e3 * x, 1) for x in phases)))}

    def _verify(self, sched, batch, logits, drafts) -> list[tuple[Request, list[int]]]:
        """Speculative counterpart of sampling + `update_from_output`: accept drafts, cut at stop
        strings as one-token-at-a-time decoding would, roll back rejected KV, count usage."""
        granted = {s.request.request_id: drafts[s.request.request_id].head(s.num_draft_tokens)
                   for s in sched.scheduled if s.num_draft_tokens}
        sampled, accepted, moves = self.speculator.verify(logits, batch.logits_owner, granted, self.scheduler.requests)
        self.speculator.move_kv(self.kv_cache.tensor, self.scheduler.requests, moves)  # tree drafts
        for rid, new in sampled.items():
            sampled[rid] = self._cut_at_stop(self.scheduler.requests[rid], new)
        produced = self.scheduler.update_from_output(sched, sampled)
        for req, kept in produced:
            k = len(granted.get(req.request_id, ()))
            if k:
                # the first accepted tokens of `kept` are drafts; EOS, max_tokens or a stop may end it early
                n = min(accepted[req.request_id], len(kept))
                req.num_draft_tokens += k
                req.num_accepted_draft_tokens += n
                req.num_draft_steps += 1
                self.stats.draft_tokens += k
                self.stats.accepted_draft_tokens += n
                self.stats.draft_seq_steps += 1
        return produced

    def _cut_at_stop(self, req: Request, new: list[int]) -> list[int]:
        """The shortest prefix of `new` whose text completes a stop string (all of `new` if none):
        plain decoding would have stopped there, so the tokens after it are never output."""
        stops = req.sampling.stop
        if len(new) < 2 or not stops:
            return new
        detok = self.detok[req.request_id]
        # a scratch copy of the detokenizer's undecoded tail and the text a stop could start in
        scratch = IncrementalDetokenizer(self.tokenizer)
        scratch.ids = detok.ids[detok.prefix_offset:]
        scratch.read_offset = detok.read_offset - detok.prefix_offset
        scratch.text = detok.text[max(0, len(detok.text) - max(map(len, stops)) + 1):]
        for i, tok in enumerate(new[:-1]):
            scratch.add([tok])
            if any(s in scratch.text for s in stops):
                return new[:i + 1]
        return new

    def _postprocess(self, req: Request, new: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        if req.prefill_only:  # KV computed; the caller hands the blocks on, then frees them
            first = self._first_output(req, new[0], logprobs[0] if logprobs else None) if new else None
            self._release(req.request_id)
            return RequestOutput(req.request_id, new, first.text if first else "", finished=True,
                                 finish_reason=req.finish_reason, usage=self.usage(req), first=first)
        detok = self.detok[req.request_id]
        detok.add(new)
        if req.finished:
            detok.flush()
        stops = req.sampling.stop
        end = len(detok.text)
        if stops:
            hit = find_stop(detok.text, stops, detok.emitted)
            if hit is not None:
                detok.text = detok.text[:hit]
                end = hit
                if not req.finished:
                    self.scheduler.finish(req, FinishReason.STOP)
            elif not req.finished:
                # hold back what could be the start of a stop string completed by later tokens
                end = max(detok.emitted, end - (max(map(len, stops)) - 1))
        text = detok.text[detok.emitted:end]
        detok.emitted = max(detok.emitted, end)
        out = RequestOutput(req.request_id, new, text, new_logprobs=logprobs)
        if req.finished:
            out.finished, out.finish_reason = True, req.finish_reason
            out.usage = self.usage(req)
            self._release(req.request_id)
        return out

    def _first_output(self, req: Request, tok: int, logprob: TokenLogprob | None) -> FirstToken:
        """What the first output token of a prefill-only request gives its client, decided as the
        decode path would: its text (held back where a stop string could be starting), whether it
        ends the request (EOS, max_tokens, the context, a stop string), and the sampler's state
        after the draw, so a seeded request's later draws on the decode actor are the ones a
        single engine would make."""
        sp = req.sampling
        reason = None
        if not sp.ignore_eos and tok in req.eos_token_ids:
            reason = FinishReason.STOP
        elif sp.max_tokens <= 1 or req.num_prompt_tokens + 1 >= self.max_model_len:
            reason = FinishReason.LENGTH
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        detok.add([tok])
        if reason is not None:
            detok.flush()
        text = detok.text
        if sp.stop:
            hit = find_stop(text, sp.stop, 0)
            if hit is not None:
                text, reason = text[:hit], FinishReason.STOP
            elif reason is None:
                text = text[:max(0, len(text) - (max(map(len, sp.stop)) - 1))]
        g = self.sampler.generators.get(req.request_id)
        return FirstToken(tok, text, reason, bytes(g.get_state().numpy()) if g is not None else None, logprob)

    def accept_first_token(self, req: Request, first: FirstToken) -> None:
        """A request whose prompt KV a prefill actor computed (num_computed_tokens == prompt) takes
        the first output token that actor sampled (`RequestOutput.first`, already streamed to the
        client): it is appended, its text counted as emitted, the sampler continues from the
        prefill's state; the next step computes it and samples the second token."""
        tok = first.token_id
        req.output_token_ids.append(tok)
        detok = self.detok[req.request_id]
        detok.add([tok])
        detok.emitted = len(first.text)
        if first.rng_state is not None:
            g = torch.Generator()
            g.set_state(torch.frombuffer(bytearray(first.rng_state), dtype=torch.uint8))
            self.sampler.generators[req.request_id] = g

    # ---- moving a running sequence with its KV (decode_workers/moves.py) ----------------------
    def pause(self, request_id: str) -> Request | None:
        """Between steps: take a decoding request out of the batch, keeping its KV blocks, sampler
        and detokenizer state, to move it (`handoff`, then `drop_paused`) or put it back
        (`resume`). None when it is not decoding (prefilling, waiting, finished, unknown)."""
        self.settle()                # its last token must be on the host
        return self.scheduler.detach(request_id)

    def resume(self, req: Request) -> None:
        self.scheduler.add_ready(req)

    def handoff(self, req: Request) -> FirstToken:
        """A paused request as another engine continues it (`accept_first_token` there, over the
        KV of every token but the last): its last token, the part of that token's text already
        emitted (text held back here for a stop string stays held back there), the sampler state."""
        tok, detok = req.output_token_ids[-1], self.detok[req.request_id]
        pending = len(detok.text) - detok.emitted
        there = IncrementalDetokenizer(self.tokenizer, req.all_token_ids[:-1])
        there.add([tok])
        g = self.sampler.generators.get(req.request_id)
        return FirstToken(tok, there.text[:max(0, len(there.text) - pending)], None,
                          bytes(g.get_state().numpy()) if g is not None else None)

    def drop_paused(self, req: Request) -> None:
        """A paused request is done here (moved, or aborted): its blocks and state go."""
        self._release(req.request_id)
        self.allocator.free(req)

    @staticmethod
    def usage(req: Request) -> Usage:
        return Usage(prompt_tokens=req.num_prompt_tokens, cached_prompt_tokens=req.num_cached_prompt_tokens,
                     completion_tokens=len(req.output_token_ids), draft_tokens=req.num_draft_tokens,
                     accepted_draft_tokens=req.num_accepted_draft_tokens, draft_steps=req.num_draft_steps)

    # ---- start-up ---------------------------------------------------------------------------
    @property
    def wants_warmup(self) -> bool:
        """config.warmup, where None means: on CUDA (CPU has no kernels to compile or graphs)."""
        w = self.config.warmup
        return self.kv_cache.device.type == "cuda" if w is None else w

    def warmup(self, shapes: tuple[tuple[int, int], ...] = WARMUP_SHAPES, decode_tokens: int = 12,
               seed: int = 0) -> dict[str, Any]:
        """Compile every kernel variant and capture the decode graphs before serving
        (`engine.warmup.warm_up`, which says how); returns what ran and how long it took."""
        return warm_up(self, shapes, decode_tokens, seed)

    # ---- offline ----------------------------------------------------------------------------
    def generate(self, requests: list[dict[str, Any]], arrivals: list[int] | None = None) -> list[dict[str, Any]]:
        """Run requests (dicts with prompt / prompt_token_ids / messages and sampling fields)
        through continuous batching; request i joins at step `arrivals[i]` (default 0).
        Returns one dict per request, in input order."""
        arrivals = arrivals or [0] * len(requests)
        pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
        results: dict[str, dict[str, Any]] = {}
        order: list[str] = []
        step = 0
        while pending or self.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                r = requests[i]
                sp = SamplingParams(**{k: (tuple(v) if k == "stop" else v) for k, v in r.items()
                                       if k in SamplingParams.__dataclass_fields__})
                req = self.add_request(r.get("request_id", f"gen-{i}"), prompt=r.get("prompt"),
                                       prompt_token_ids=r.get("prompt_token_ids"), messages=r.get("messages"),
                                       sampling=sp)
                order.append(req.request_id)
                results[req.request_id] = {"request_id": req.request_id, "prompt_token_ids": req.prompt_token_ids,
                                           "token_ids": [], "text": ""}
            for out in self.step():
                res = results[out.request_id]
                res["token_ids"].extend(out.new_token_ids)
                res["text"] += out.new_text
                if out.new_logprobs is not None:
                    res.setdefault("logprobs", []).extend(out.new_logprobs)
                if out.finished:
                    res["finish_reason"] = out.finish_reason.value
                    res["usage"] = vars(out.usage)
            step += 1
        return [results[rid] for rid in order]
