"""Scheduler: decides every step which requests run and how many tokens each computes.

One token budget (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`). Running requests
are served first, in order, then waiting ones. A request computes `num_tokens - num_computed_tokens` tokens,
capped by what is left of the budget, so long prompts are split across steps (chunked prefill) and share
steps with decodes. A prefix-cache hit starts a request at the end of its cached blocks.

The waiting queue is one class per scheduling policy (`request_queue.py`): it orders admissions and picks
preemption victims, so nothing here depends on the policy's name. When the KV cache runs out, the request
the policy ranks lowest among those not yet scheduled this step (under FCFS the newest) is preempted: its
blocks are freed and it goes back to the waiting queue ahead of later arrivals, to be recomputed.
Requests already scheduled in a step are never preempted in it: blocks cached at their allocation might be
hit by others before they are computed.

The scheduler never touches tensors; `update_from_output` turns the worker's sampled tokens into
`EngineCoreOutputs` and retires finished requests.

Structured output (a StructuredOutputManager given): a constrained request waits outside the waiting queue
(WAITING_FOR_FSM) while its grammar compiles and joins the queue once it is ready; a grammar that failed finishes
its request alone (finish reason "error"). `structured_output_request_ids` of each SchedulerOutput lists, in
order, the requests that sample under a grammar in that step; `get_grammar_output` gives their bitmask rows, and
`update_from_output` advances each grammar with the sampled tokens, finishing a request whose grammar is complete.
The grammar follows the output tokens only, so preemption (recompute) and prefix-cache hits leave it as it is.

Speculative decoding (a SpeculativeConfig given): after sampling, the worker proposes draft tokens for the requests
`num_spec_tokens_to_propose` names (the DraftPolicy's choice, from the measured cost of steps of each length and
the request's acceptance rate: few or none where verifying costs more than it saves). A running request whose
known tokens are all computed but its last is scheduled with its drafts after it, as far as the budget,
`max_tokens` and `max_model_len` allow, and they are listed in `scheduled_spec_decode_tokens`.
The worker verifies them and returns the accepted drafts and one token more; `update_from_output` takes the rejected
drafts back out of `num_computed_tokens` (their KV slots stay allocated and are overwritten later; only blocks full
of known tokens are ever hashed, so the prefix cache never holds a draft) and checks the stop conditions token by
token, dropping tokens after one that finishes the request. Under a grammar, only the drafts it accepts are
scheduled, the bitmask has a row for each verified position, and the grammar advances by the tokens output.

Forced tokens (jump-forward), with or without speculative decoding: where a constrained request's grammar forces its
next tokens (a JSON key, the punctuation after it), up to `$PAGEDLLM_GRAMMAR_FORCED_DRAFTS` (8; 0: off) of them are
its drafts for the next step instead of the proposer's, verified as any drafts are: that step computes them beside
the request's own token, so they cost no step of their own, and the output is what plain decoding
would sample (under the grammar's mask a forced token has all the probability; where the tokenizer could split the
forced text another way, the verification decides). They stay out of the speculative-decoding stats and policy.

Pooling requests (a PoolingParams instead of sampling): scheduled as prompts are, they finish in the step that
computes their last prompt token, with the worker's pooled result (`ModelRunnerOutput.pooler_output`) in their
output. An encoder model's attention sees the whole prompt at once, so with `chunked_prefill` off a prompt is
admitted only into a step with room for all of it (the budget is at least max_model_len then). The express lane
(`schedule_express`, an encoder's only): the waiting requests of short API calls (`PoolingParams.call_tokens` at most
`express_tokens`) in a step of their own, which the engine core runs between two layers of the step in flight.

For metrics it stamps each request's events with the core's `time.monotonic()`: QUEUED when it arrives,
SCHEDULED whenever it is admitted from the waiting queue (again after a preemption; the front end keeps the
first), PREEMPTED when it is preempted. They travel with the request's next EngineCoreOutput.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, grammar_forced_drafts
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import RequestQueue, create_request_queue
from pagedllm.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.engine.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsLists,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedllm.spec_decode.policy import DraftPolicy
from pagedllm.structured_output import GRAMMAR_REFUSED

if TYPE_CHECKING:
    from pagedllm.structured_output import GrammarOutput, StructuredOutputManager


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_windows: tuple[int, ...] = (0,),
        max_loras: int = 0,
    ) -> None:
        """kv_windows: the sliding window of each KV cache group (0: full attention), from the worker's layout.
        max_loras: the most LoRA adapters among the running requests (--max-loras; 0: no adapters served)."""
        self.config = scheduler_config
        self.express_tokens = 0  # the express lane's bound (enable_express; 0: no lane)
        # Waiting requests of calls short enough for the express lane (those no longer waiting are dropped lazily).
        self._express_waiting: dict[str, Request] = {}
        self.max_loras = max_loras
        self.draft_policy = DraftPolicy(speculative_config) if speculative_config is not None else None
        self._spec_stats: SpecDecodingStats | None = SpecDecodingStats() if speculative_config is not None else None
        self.total_spec_stats = SpecDecodingStats()  # since the start (the reported ones reset at each report)
        self.structured_output_manager = structured_output_manager
        # A constrained request's next tokens, where its grammar forces them, go as drafts (at most this many).
        self.forced_drafts = grammar_forced_drafts() if structured_output_manager is not None else 0
        self.forced_draft_counts = [0, 0]  # forced drafts verified, and accepted, since the start
        # Constrained requests whose grammar is compiling, in arrival order.
        self.waiting_for_fsm: list[Request] = []
        # Outputs of requests finished outside a step's model run (a grammar that failed), sent with the next one.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, tuple(kv_windows)
        )
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Requests that left since the last SchedulerOutput: the worker forgets them.
        self._finished_req_ids: set[str] = set()
        self._num_preemptions = 0  # since the last stats report
        self._step_started: float | None = None  # when a step of decodes only was scheduled (draft policy)
        self.total_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("this engine core has no structured output manager")
            self.structured_output_manager.grammar_init(request)
            request.status = RequestStatus.WAITING_FOR_FSM
            self.waiting_for_fsm.append(request)
        else:
            self.waiting.add(request)
            call = request.pooling_params.call_tokens if request.pooling_params is not None else None
            if call is not None and call <= self.express_tokens:
                self._express_waiting[request.request_id] = request
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort); unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(status)
        found: dict[str, Request] = {}
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is not None and not req.is_finished:
                found[req_id] = req
        done = list(found.values())
        # Waiting ones leave the queue together: one pass over it, however many are aborted.
        self.waiting.remove_requests([r for r in done if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)])
        if any(r.status == RequestStatus.WAITING_FOR_FSM for r in done):
            self.waiting_for_fsm = [r for r in self.waiting_for_fsm if r.request_id not in found]
        for req in done:
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            req.status = status
            self._free_request(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_fsm) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_fsm)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready into the waiting queue; finish those whose grammar failed."""
        manager = self.structured_output_manager
        if manager is None or not self.waiting_for_fsm:
            return
        still: list[Request] = []
        for req in self.waiting_for_fsm:
            if not manager.ready(req):
                still.append(req)
                continue
            assert req.structured_output is not None
            if req.structured_output.error is not None:
                req.status = RequestStatus.FINISHED_ERROR
                req.stop_reason = req.structured_output.error
                self._pending_outputs.append(
                    EngineCoreOutput(
                        request_id=req.request_id,
                        new_token_ids=[],
                        finish_reason=req.get_finish_reason(),
                        stop_reason=req.stop_reason,
                        events=req.take_events(),
                    )
                )
                self._free_request(req)
            else:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
        self.waiting_for_fsm = still

    def wait_for_grammars(self, timeout: float) -> None:
        """When nothing else can run: block up to `timeout` s until a grammar being compiled is done."""
        if self.structured_output_manager is not None and self.waiting_for_fsm:
            self.structured_output_manager.wait_for_any(self.waiting_for_fsm, timeout)

    def _free_request(self, req: Request) -> None:
        if self.draft_policy is not None:
            self.draft_policy.forget(req.request_id)
        self.kv_cache_manager.free(req)
        self._finished_req_ids.add(req.request_id)
        self._express_waiting.pop(req.request_id, None)
        del self.requests[req.request_id]

    # ---- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        now = time.monotonic()  # the events of this schedule

        spec_tokens: dict[str, list[int]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n <= 0:
                i += 1
                continue
            # Drafts come after every running request's own token: they leave a token of the budget and a free
            # block for each running request after this one, so that they never cost another its step.
            later = len(self.running) - i - 1
            drafts = self._schedulable_drafts(req, n, budget - later)
            manager = self.kv_cache_manager
            if drafts and manager.get_num_free_blocks() - manager.num_new_blocks(req, n + len(drafts)) < later:
                drafts = []  # no room for the drafts: the request decodes plainly rather than preempt another
            new_blocks = manager.allocate_slots(req, n + len(drafts))
            while new_blocks is None:
                drafts = []
                victim = self._pick_victim(i)
                self._preempt(victim, now)
                preempted.add(victim.request_id)
                if victim is req:
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(req, n)
            if new_blocks is None:
                continue  # req itself was preempted; self.running[i] is now the next request
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_block_ids.append([[b.block_id for b in blocks] for blocks in new_blocks])
            cached.num_computed_tokens.append(req.num_computed_tokens)
            if drafts:
                spec_tokens[req.request_id] = drafts
                n += len(drafts)
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1

        # Admit waiting requests only when nothing was preempted: memory is tight otherwise. The running requests
        # use at most max_loras adapters: a request of another adapter waits (others behind it go first).
        loras = {r.lora_id for r in self.running if r.lora_id}
        skipped: list[Request] = []
        while not preempted and len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req.lora_id and req.lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
            n = self._num_new_tokens(req, budget, num_hit)
            if not self.config.chunked_prefill and n < req.num_tokens - num_hit:
                break  # an encoder's prompt runs whole in one step: it waits for a step with room for all of it
            if not self._admit(req, n, num_hit, hit_blocks, now, new_reqs, cached):
                break
            self.waiting.pop()
            if req.lora_id:
                loras.add(req.lora_id)
            num_scheduled[req.request_id] = n
            budget -= n
        for req in reversed(skipped):
            self.waiting.prepend(req)

        constrained: list[str] = []
        propose: dict[str, int] = {}
        policy = self.draft_policy
        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            so = req.structured_output
            samples = req.num_computed_tokens >= req.num_tokens
            if so is not None and so.reasoning_ended and samples:
                constrained.append(req_id)  # it samples this step, under its grammar
            if policy is not None and samples and (so is None or so.reasoning_ended):
                k = policy.num_to_propose(req_id, len(num_scheduled))
                if k > 0:
                    propose[req_id] = k
        total = sum(num_scheduled.values())
        # A step of decodes only (with or without drafts) is timed for the draft policy's cost model.
        decodes_only = (
            policy is not None
            and not new_reqs
            and all(n == 1 + len(spec_tokens.get(r, ())) for r, n in num_scheduled.items())
        )
        self._step_started = time.monotonic() if decodes_only and not preempted else None
        out = SchedulerOutput(
            new_reqs,
            cached,
            num_scheduled,
            total,
            self._finished_req_ids,
            preempted,
            constrained,
            spec_tokens,
            propose,
        )
        self._finished_req_ids = set()
        return out

    def _admit(
        self,
        req: Request,
        n: int,
        num_hit: int,
        hit_blocks: Any,
        now: float,
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
    ) -> bool:
        """Start a waiting request (still in the queue: the caller takes it out) with `n` tokens to compute after
        `num_hit` cached ones: its slots, its state, and what the worker is told (all of it when new, its blocks when
        resumed). False when the KV cache has no room for it."""
        new_blocks = self.kv_cache_manager.allocate_slots(req, n, num_hit, hit_blocks)
        if new_blocks is None:
            return False
        req.record_event(EngineCoreEventType.SCHEDULED, now)
        resumed = req.status == RequestStatus.PREEMPTED
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        self.running.append(req)
        block_ids = self.kv_cache_manager.get_group_block_ids(req.request_id)
        if resumed:
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(True)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(num_hit)
        else:
            new_reqs.append(
                NewRequestData(
                    req.request_id,
                    req.prompt_token_ids,
                    req.sampling_params,
                    req.eos_token_id,
                    block_ids,
                    num_hit,
                    req.pooling_params,
                    req.lora_request,
                )
            )
        return True

    def enable_express(self, max_tokens: int) -> bool:
        """Open the express lane (schedule_express) to calls of at most `max_tokens` prompt tokens; only an encoder's
        prompts, which are never chunked, take it. Whether it is open."""
        self.express_tokens = 0 if self.config.chunked_prefill else max_tokens
        return self.express_tokens > 0

    def schedule_express(self) -> SchedulerOutput | None:
        """An express step, run between two layers of an encoder's step (the engine core's express lane): the
        waiting requests of short calls (PoolingParams.call_tokens at most `express_tokens`: a query, not a batch of
        documents), by priority then arrival, as many as fit in `express_tokens` tokens and `max_num_seqs`. None
        when there are none. The step in flight is left as it is (its requests run, their tokens counted computed);
        the worker is told of the requests finished since then (earlier express steps' only: aborts wait for the
        end of the step), so that their rows are free again."""
        if not self._express_waiting:
            return None
        waiting = [r for r in self._express_waiting.values() if r.status == RequestStatus.WAITING]
        self._express_waiting = {r.request_id: r for r in waiting}  # the others were admitted or finished
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        now = time.monotonic()
        admitted: list[Request] = []
        total = 0
        for req in sorted(waiting, key=lambda r: (r.priority, r.arrival_time)):
            if total + req.num_tokens > self.express_tokens or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._admit(req, req.num_tokens, 0, None, now, new_reqs, cached):
                break
            req.num_computed_tokens = req.num_tokens
            del self._express_waiting[req.request_id]
            admitted.append(req)
            total += req.num_tokens
        if not admitted:
            return None
        self.waiting.remove_requests(admitted)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(new_reqs, cached, {r.request_id: r.num_tokens for r in admitted}, total, finished)

    def _schedulable_drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The request's drafts that fit this step (taking them: a draft is verified once or dropped). Only a
        request whose one uncomputed token is its last has any; the drafts and the token after them must fit the
        budget, max_tokens and max_model_len."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not drafts or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        drafts = drafts[: max(room, 0)]
        so = req.structured_output
        if drafts and so is not None:  # under a grammar: only the drafts it accepts (it is past any thinking)
            assert self.structured_output_manager is not None
            drafts = drafts[: self.structured_output_manager.validate_drafts(req, drafts)]
        return drafts

    def get_grammar_output(self, sched: SchedulerOutput) -> GrammarOutput | None:
        """The bitmask rows of the step's constrained requests (None when it has none)."""
        if not sched.structured_output_request_ids or self.structured_output_manager is None:
            return None
        reqs = [self.requests[r] for r in sched.structured_output_request_ids if r in self.requests]
        return self.structured_output_manager.grammar_bitmask(reqs, sched.scheduled_spec_decode_tokens)

    def _num_new_tokens(self, req: Request, budget: int, num_computed: int | None = None) -> int:
        computed = req.num_computed_tokens if num_computed is None else num_computed
        n = min(req.num_tokens - computed, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _pick_victim(self, first_unscheduled: int) -> Request:
        return self.waiting.pick_victim(self.running[first_unscheduled:])

    def _preempt(self, req: Request, now: float) -> None:
        self.running.remove(req)
        req.record_event(EngineCoreEventType.PREEMPTED, now)
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.prepend(req)

    # ---- after the model ran ---------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._step_started is not None and self.draft_policy is not None:
            self.draft_policy.observe_step(sched.total_num_scheduled_tokens, time.monotonic() - self._step_started)
            self._step_started = None
        for row, req_id in enumerate(result.req_ids):
            req = self.requests.get(req_id)
            if req is None:
                continue  # aborted while the step ran
            pooled = result.pooler_output.get(req_id)
            if pooled is not None:  # a pooling request's prompt is computed: it finishes with its result
                req.status = RequestStatus.FINISHED_STOPPED
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=[],
                        finish_reason=req.get_finish_reason(),
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        events=req.take_events(),
                        pooling_output=pooled,
                    )
                )
                self.running.remove(req)
                self._free_request(req)
                continue
            new_ids = result.sampled_token_ids[row]
            drafts = sched.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                new_ids = new_ids[: len(drafts) + 1]  # the accepted drafts and one token: nothing else was verified
                self._take_back_rejected(req, len(drafts), len(new_ids) - 1)
            finished = False
            # Token by token, as if decoded one at a time (several: accepted drafts): what follows a finishing token
            # (a stop, the length, a completed grammar) is not output.
            for k, token in enumerate(new_ids):
                req.append_output_token_ids([token])
                finished = self._check_stop(req)
                if req.structured_output is not None:
                    finished = self._advance_grammar(req, [token]) or finished
                if finished:
                    new_ids = new_ids[: k + 1]
                    break
            if drafts:  # the blocks the accepted drafts filled, now that their tokens are known
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            logprobs = result.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.ranks) > len(new_ids):  # tokens dropped after a finishing one
                n = len(new_ids)
                logprobs = LogprobsLists(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
            if not finished:
                req.spec_token_ids = result.spec_token_ids.get(req_id, [])
                req.drafts_forced = False
                if new_ids and req.structured_output is not None and self.forced_drafts:  # it sampled: decoding
                    assert self.structured_output_manager is not None
                    forced = self.structured_output_manager.forced_drafts(req, self.forced_drafts)
                    if forced:  # what the grammar forces beats any proposer's guess
                        req.spec_token_ids, req.drafts_forced = forced, True
            prompt_lp = result.prompt_logprobs.get(req_id)
            if new_ids or prompt_lp is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_ids,
                        new_logprobs=logprobs,  # type: ignore[arg-type]
                        new_prompt_logprobs=prompt_lp,  # type: ignore[arg-type]
                        finish_reason=req.get_finish_reason(),
                        stop_reason=req.stop_reason,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        events=req.take_events(),
                    )
                )
            if finished:
                self.running.remove(req)
                self._free_request(req)
        stats = self.make_stats(sched.total_num_scheduled_tokens)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _take_back_rejected(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """After a verification: the rejected drafts' slots are no longer computed tokens; stats and policy (those
        of the proposer's drafts: a grammar's forced ones are counted apart)."""
        num_accepted = max(num_accepted, 0)
        req.num_computed_tokens -= num_drafts - num_accepted
        if req.drafts_forced:
            self.forced_draft_counts[0] += num_drafts
            self.forced_draft_counts[1] += num_accepted
            return
        assert self.draft_policy is not None and self._spec_stats is not None
        self.draft_policy.record(req.request_id, num_drafts, num_accepted)
        for stats in (self._spec_stats, self.total_spec_stats):
            stats.num_drafts += 1
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += num_accepted
            per_pos = stats.num_accepted_tokens_per_pos
            if len(per_pos) < num_drafts:
                per_pos.extend([0] * (num_drafts - len(per_pos)))
            for k in range(num_accepted):
                per_pos[k] += 1

    def _advance_grammar(self, req: Request, new_ids: list[int]) -> bool:
        """Feed the sampled tokens to the request's grammar; True if that finished the request (the grammar is
        complete, or refused a token, which its mask makes impossible unless the backend fails)."""
        manager = self.structured_output_manager
        assert manager is not None
        if req.is_finished:  # stopped by EOS, a stop token or its length: nothing more to constrain
            return False
        if not manager.accept_tokens(req, new_ids):
            req.status = RequestStatus.FINISHED_ERROR
            req.stop_reason = GRAMMAR_REFUSED
            return True
        if manager.is_terminated(req):
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        if req.num_output_tokens >= params.min_tokens:
            if last == req.eos_token_id and not params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:  # type: ignore[operator]
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def make_stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_fsm),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions,
            num_scheduled_tokens=num_scheduled_tokens,
            spec_decoding_stats=self._spec_stats,
        )
        if self.max_loras:
            stats.running_lora_adapters = _count_adapters(self.running)
            stats.waiting_lora_adapters = _count_adapters([*self.waiting, *self.waiting_for_fsm])
        self._num_preemptions = 0
        if self._spec_stats is not None:
            self._spec_stats = SpecDecodingStats()
        return stats


def _count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    """Requests by LoRA adapter name (those with one)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts
