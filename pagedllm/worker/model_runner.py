"""ModelRunner: SchedulerOutput -> flat input tensors -> forward -> logits at sampling rows -> [grammar mask] -> tokens.

The batch is the flat list of scheduled tokens, with no padding to the longest request. Requests with one
new token (decodes) come first so attention can treat them together; each request with several new tokens
(a prompt chunk) follows as its own segment. Logits are computed only where a token is sampled: the last
scheduled token of each request that reaches the end of its known tokens (a prompt chunk that stops short
samples nothing), plus every prompt position of requests that asked for prompt logprobs.
The step is two calls when some of its requests sample under a grammar (structured output): `execute_model` runs
the forward pass and keeps the logits, `sample_tokens(grammar_output)` masks the constrained rows and samples;
otherwise `execute_model` samples at once.
Speculative decoding: a request with draft tokens scheduled has logits at its last token and at each draft (k + 1
rows), and the rejection sampler returns its accepted drafts and one token more. After sampling, the n-gram
proposer drafts tokens for the requests the scheduler named (`num_spec_tokens_to_propose`); they return in
`ModelRunnerOutput.spec_token_ids`.
A pooling model (`--runner pooling`) samples nothing: worker/pooler_runner.py pools each request's hidden states
once its prompt is computed (an encoder's whole prompt in one step, without the KV cache).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_layout import KVCacheLayout, kv_cache_layout
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.engine.protocol import LogprobsLists
from pagedllm.lora.manager import LoRAManager
from pagedllm.model import hugepages
from pagedllm.model.attention.backends.base import CommonAttentionMetadata
from pagedllm.model.attention.selector import native_applies, select_attention_backend
from pagedllm.model.kernels import KernelDispatch, KernelsUnavailable, load_cpu_ops
from pagedllm.model.layers.linear import GENERATED_ROWS, PROMPT_ROWS, RowKinds
from pagedllm.model.loader import load_model
from pagedllm.model.step_plan import StepPlan
from pagedllm.sample.grammar_mask import apply_token_bitmask
from pagedllm.sample.sampler import Sampler, compute_token_logprobs
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.rejection_sampler import RejectionSampler
from pagedllm.structured_output import GrammarOutput
from pagedllm.worker.cpu_decode_runner import CpuDecodeRunner
from pagedllm.worker.input_batch import CachedRequestState, InputBatch
from pagedllm.worker.pooler_runner import PoolerRunner
from pagedllm.worker.sleep import MemorySleeper

logger = logging.getLogger(__name__)

FUSED_PROMPT_ROWS = 64  # the longest prompt chunk the fused decoder runs (ModelRunner._prompt_rows)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.device = device
        self.tp = tp or TensorParallelGroup()
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        # The kernels are chosen once, here: the attention backend, and the native CPU ops the layers pick up when
        # they are built (RMSNorm, SiLU-and-mul, rotary, few-row linears on panels) and the fused decoder.
        model_config = config.model_config
        bf16 = model_config.torch_dtype == torch.bfloat16
        cpu_ops = self._cpu_ops(torch.float32 if bf16 else model_config.torch_dtype)
        # --dtype bfloat16 on the native ops: the weights in bf16 (bf16 products, float32 sums), the model built in
        # float32 (activations, norms, KV cache). Without the native ops, plain torch runs everything in bf16.
        self.bf16_weights = bf16 and cpu_ops is not None
        # The KV cache's dtype follows --dtype as given (auto; bf16 for a GGUF run as stored), or --kv-cache-dtype.
        self.kv_dtype = config.cache_config.kv_dtype(model_config.torch_dtype, model_config.quantization == "gguf")
        if self.bf16_weights:
            model_config = replace(model_config, dtype="float32")
            logger.info(
                "dtype bfloat16: weights in bf16 panels, activations in float32; bf16 products %s",
                "in hardware (AVX512-BF16)" if cpu_ops.bf16_native() else "widened to float32 (no AVX512-BF16 here)",
            )
        logger.info("KV cache in %s", str(self.kv_dtype).removeprefix("torch."))
        self.model_config = model_config  # what the model runs in
        self.attn_backend = select_attention_backend(
            config.device_config.attention_backend, device, model_config.torch_dtype, cpu_ops
        )
        if self.attn_backend.name != "cpu_native":
            cpu_ops = None  # the torch backend is the reference path: plain torch throughout
        logger.info(
            "attention backend %s, native CPU ops %s", self.attn_backend.name, cpu_ops.isa if cpu_ops else "off"
        )
        kernels = KernelDispatch(attention=self.attn_backend, cpu=cpu_ops, tp=self.tp, bf16_weights=self.bf16_weights)
        # Prompt tokens' rows on quantized weights: the more precise de-quantized panels (model/layers/linear.py), or
        # with PAGEDLLM_PROMPT_INT8=1 int8 inputs as generated tokens' rows (llama.cpp's arithmetic; the faster
        # without AMX tiles: docs/quantization.md).
        quantized = model_config.quantization == "gguf" and cpu_ops is not None
        # (not a pooling model's prompts, which are all it computes: an encoder's rows are prompt rows alike)
        self.prompt_int8 = quantized and config.device_config.prompt_int8 and model_config.runner != "pooling"
        if self.prompt_int8:
            logger.info("prompt rows on quantized weights: int8 inputs, as generated rows (PAGEDLLM_PROMPT_INT8=1)")
        self.model = load_model(model_config, device, kernels)
        self.kv_layout = self._kv_layout(config.cache_config.hybrid_kv_cache)
        # A pooling model (worker/pooler_runner.py) pools its prompts' hidden states and never decodes; an encoder
        # keeps no KV cache and computes each prompt whole in one step.
        self.pooler = PoolerRunner(self.model, model_config, device) if model_config.runner == "pooling" else None
        # --enable-lora: every decoder linear gets adapter slots (lora/manager.py), which the layer path and the fused
        # decoder read (a prompt chunk of a request with an adapter runs layer by layer).
        self.lora_manager = LoRAManager(self.model, config.lora_config) if config.lora_config is not None else None
        self.decode_runner = (
            None if self.pooler else CpuDecodeRunner.create(self.model, cpu_ops, self.tp, self.prompt_int8)
        )
        # A request verifying its drafts in the fused decoder computes its logits in chunks of this many rows, each
        # row then bit for bit what plain decoding computes: a quantized LM head runs up to quant_dot_max_rows rows
        # on the int8 products of one row, any number of generated tokens where it is packed; a float32 head's one-row
        # kernel sums in another order than its several-row one (one row at a time); bf16 panels sum each row
        # alike whatever the rows (0: no chunks).
        head = getattr(self.model, "lm_head", None)  # none on a model with a score head (pooling)
        qweight = getattr(head, "qweight", None)
        if cpu_ops is None or head is None or getattr(head, "bf16_panels", None) is not None:
            self._logits_rows = 0
        elif qweight is not None:
            packed = qweight.packed_rows == qweight.out_features
            self._logits_rows = 0 if packed else int(cpu_ops.quant_dot_max_rows())
        else:
            self._logits_rows = 1
        # With the native ops, the sampler's step after logit bias and penalties runs natively for CPU rows (one
        # call: argmax, temperature, top-k, top-p, min-p, the draw; torch's choices but for rounding).
        self.sampler = Sampler(cpu_ops)
        # A request's prompt chunk of up to this many tokens runs in the fused decoder where it computes them as the
        # layer-by-layer path does (0: never): the uncached tail of a prefix-cache hit, a chat's next turn.
        runs = self.decode_runner is not None and self.decode_runner.runs_prompts()
        self._prompt_rows = FUSED_PROMPT_ROWS if runs else 0
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.rejection_sampler = RejectionSampler(cpu_ops)
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size, device, self.kv_layout.num_groups
        )
        self._pending: _PendingSample | None = None
        self._sleeper: MemorySleeper | None = None

    def lora_manager_or_raise(self) -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return self.lora_manager

    def _cpu_ops(self, dtype: torch.dtype):
        """The native CPU ops where they can apply (the CPU in float32, not turned off), else None; logged once."""
        dc = self.config.device_config
        if not native_applies(self.device, dtype) or dc.attention_backend == "torch":
            return None
        if not dc.cpu_kernels:
            logger.info("native CPU kernels turned off (PAGEDLLM_CPU_KERNELS=0): running on plain torch")
            return None
        try:
            return load_cpu_ops(dc.cpu_isa)
        except KernelsUnavailable as exc:
            logger.warning("%s; running on plain torch (slower)", exc)
            return None

    # ---- KV cache ----------------------------------------------------------------------------------

    def _kv_layout(self, hybrid: bool) -> KVCacheLayout:
        """The KV cache groups of the model's attention layers (core/kv_cache_layout.py); each layer learns its
        group (`kv_group`: the block table it reads). Layers whose keys differ in shape share no tensors: one group
        of them all, full attention in its block accounting."""
        layers = self.model.attention_layers()
        if not layers:  # an encoder: no KV cache; the scheduler's blocks are only accounting
            return kv_cache_layout([0])
        uniform = len({(a.num_kv_heads, a.head_dim) for a in layers}) == 1
        layout = kv_cache_layout([a.sliding_window for a in layers], hybrid and uniform)
        for attn, group in zip(layers, layout.layer_group):
            attn.kv_group = group
        if layout.hybrid:
            logger.info(
                "KV cache groups: %s (window 0: full attention), %d layers a block",
                ", ".join(f"{layout.layer_group.count(g)} layers window {w}" for g, w in enumerate(layout.windows)),
                layout.slots,
            )
        return layout

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block id: every layer's block, or, with KV cache groups, `slots` layers' blocks."""
        layers = self.model.attention_layers()
        if not layers:
            return 0  # an encoder keeps no KV cache
        per_layer = [2 * attn.num_kv_heads * attn.head_dim for attn in layers]
        per_token = sum(per_layer) if self.kv_layout.slots == len(layers) else per_layer[0] * self.kv_layout.slots
        return per_token * self.block_size * torch.finfo(self.kv_dtype).bits // 8

    def initialize_kv_cache(self, num_blocks: int) -> None:
        dtype = self.kv_dtype
        layout = self.kv_layout
        tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for attn, slot in zip(self.model.attention_layers(), layout.layer_slot):
            if slot not in tensors:  # cache tensor `slot` serves that layer of every group (the same shapes)
                shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
                # A fresh mapping, untouched until a block is first written, of normal pages: where THP defrag is
                # "madvise", huge pages faulted in mid-run stalled on compaction (1.9 s of a 20 s batched run,
                # against 0.5 s with normal pages), and decode attention was no faster on them (bench/RESULTS.md).
                tensors[slot] = (
                    hugepages.zeros(shape, dtype=dtype, device=self.device, huge=False),
                    hugepages.zeros(shape, dtype=dtype, device=self.device, huge=False),
                )
            attn.kv_cache = tensors[slot]

    # ---- sleep mode (worker/sleep.py) ------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the weights' and the KV cache's memory (the weights wait in the page cache, mapped from a
        temporary file); nothing may run until `wake_up`."""
        if self._sleeper is None:
            self._sleeper = MemorySleeper(self.model, self._kv_tensors)
        self._sleeper.sleep()

    def _kv_tensors(self) -> list[torch.Tensor]:
        return [t for attn in self.model.attention_layers() for t in (attn.kv_cache or ())]

    def wake_up(self) -> None:
        """The weights back where they were; the KV cache empty (zeros)."""
        if self._sleeper is not None:
            self._sleeper.wake_up()

    def shutdown(self) -> None:
        """The model is about to be dropped: memory a sleep mapped from its file becomes anonymous again (contents
        kept: the heap reuses what the model frees)."""
        if self._sleeper is not None:
            self._sleeper.close()
            self._sleeper = None

    # ---- one step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step's forward pass. Without constrained requests in it, sample too and return the output;
        with some, keep the logits and return None (sample_tokens follows)."""
        batch = self.input_batch
        batch.update(sched)
        if self.lora_manager is not None:  # a request's adapter, loaded when first met (or again, if dropped)
            for new in sched.scheduled_new_reqs:
                if new.lora_request is not None:
                    self.lora_manager.requests.setdefault(new.lora_request.lora_int_id, new.lora_request)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [])
        if self.pooler is not None and self.pooler.encoder:
            return self.pooler.run_encoder(batch, sched.num_scheduled_tokens)
        counts = sched.num_scheduled_tokens
        spec = sched.scheduled_spec_decode_tokens
        # Decodes first, shortest context first (so length groups are contiguous), then multi-token segments.
        decodes = sorted((r for r, n in counts.items() if n == 1), key=lambda r: batch.requests[r].num_computed_tokens)
        order = decodes + [r for r, n in counts.items() if n > 1]
        # The requests decoding (a decode token and its drafts, no prompt token) run in the fused decoder, each
        # token computed bit for bit as it would be alone: drafts are verified exactly as plain decoding computes
        # its tokens, and a request's output does not depend on what shares its steps. They go first; the other
        # requests (prompt tokens, recomputed output) run the model layer by layer after them, in the same order.
        # Then a request's short prompt chunk, where nothing else would run layer by layer: its tokens as the layer
        # path computes them, without a dozen dispatches a layer.
        fused_reqs = self._fused_requests(order, counts, spec)
        prompt_reqs = self._fused_prompt_requests(order, counts, set(fused_reqs))
        if fused_reqs or prompt_reqs:
            chosen = set(fused_reqs) | set(prompt_reqs)
            order = fused_reqs + prompt_reqs + [r for r in order if r not in chosen]
        states = [batch.requests[r] for r in order]
        n_tok = np.array([counts[r] for r in order], dtype=np.int64)
        starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)

        # Flat token arrays, vectorised over requests.
        total = int(n_tok.sum())
        cu = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(n_tok, out=cu[1:])
        req_idx = np.repeat(np.arange(len(order)), n_tok)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], n_tok) + np.repeat(starts, n_tok)
        tok_rows = rows[req_idx]
        input_ids = batch.token_ids[tok_rows, positions]
        # [groups, tokens]: each token's cache slot in every KV cache group's blocks
        slots = batch.block_table[:, tok_rows, positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        # Generated tokens' rows (decode tokens, drafts, recomputed output) run quantized weights on int8 inputs;
        # prompt tokens' rows on the more precise panels (model/layers/linear.py), or int8 too (prompt_int8).
        if self.prompt_int8:
            generated = torch.ones(total, dtype=torch.bool)
        else:
            generated = torch.from_numpy(positions >= np.repeat(batch.num_prompt_tokens[rows], n_tok))
        k = len(fused_reqs)
        lone_verify = k == 1 and len(order) == 1 and order[0] in spec
        parts = []
        # Each token's LoRA adapter slot (-1: none), its adapters put in slots for the whole step.
        token_slots = None
        if self.lora_manager is not None:
            request_ids = np.array([s.lora_id for s in states], dtype=np.int64)
            if request_ids.any():
                self.lora_manager.activate(set(request_ids.tolist()))
                token_slots = np.repeat(self.lora_manager.row_slots(request_ids), n_tok)

        def fused(a: int, b: int, prompt: bool = False) -> torch.Tensor:
            """The hidden states of requests a .. b - 1 of `order`, one call of the fused decoder."""
            t0, t1 = int(cu[a]), int(cu[b])
            width = -(-int((starts[a:b] + n_tok[a:b]).max()) // self.block_size)
            tables = np.ascontiguousarray(batch.block_table[:, rows[a:b], :width])  # [groups, b - a, width]
            step_slots = np.ascontiguousarray(slots[:, t0:t1])  # [groups, t1 - t0]
            args = [self._t(v) for v in (input_ids[t0:t1], positions[t0:t1], step_slots, tables, req_idx[t0:t1] - a)]
            if prompt:
                return self.decode_runner(*args, prompt=True)
            lora = None if token_slots is None else token_slots[t0:t1]
            if lora is not None and (lora >= 0).any():
                return self.decode_runner(*args, lora_slots=torch.from_numpy(np.ascontiguousarray(lora)))
            return self.decode_runner(*args)

        # The fused decoder reads the block tables itself; it takes at most max_rows rows a call, so the decoding
        # requests go in consecutive chunks of whole requests (each row is what it is alone, whatever its chunk).
        a = 0
        while a < k:
            b = a + 1
            while b < k and cu[b + 1] - cu[a] <= self.decode_runner.max_rows:
                b += 1
            parts.append(fused(a, b))
            a = b
        for j in range(k, k + len(prompt_reqs)):  # a prompt chunk a call
            parts.append(fused(j, j + 1, prompt=True))
        k += len(prompt_reqs)
        if k < len(order):
            t = int(cu[k])
            num_decodes = int(np.count_nonzero(n_tok[k:] == 1))  # the rest keeps its decodes first
            commons = [
                CommonAttentionMetadata(num_decodes, cu[k:] - t, starts[k:], slot, table, rows[k:], self.block_size)
                for slot, table in zip(slots[:, t:], batch.block_table)
            ]  # an attention layer reads its KV cache group's (layers/attention.py)
            metas = [self.attn_backend.build_metadata(common, self.device) for common in commons]
            meta = metas[0] if len(metas) == 1 else metas
            plan = StepPlan(self._t(positions[t:]), meta, RowKinds(generated[t:]), order[k:])
            if token_slots is not None:  # each row's adapter id (0: none) into the layers' slots
                self.lora_manager.prepare(np.repeat([s.lora_id for s in states[k:]], n_tok[k:]))
            try:
                parts.append(self.model(self._t(input_ids[t:]), plan))
            finally:
                if self.lora_manager is not None:
                    self.lora_manager.mapping.slots = []
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.pooler is not None:  # a pooling model: the step's hidden states are pooled, nothing is sampled
            return self.pooler.pool(order, states, starts, cu, hidden)

        # Which requests sample: those whose scheduled tokens reach the end of their known tokens. A request with
        # drafts has logits at its last known token and at each draft.
        sample_rows = [i for i, s in enumerate(states) if starts[i] + n_tok[i] >= s.num_tokens]
        drafts = [spec.get(order[i], []) for i in sample_rows] if spec else None
        logits = None
        if sample_rows:
            if len(sample_rows) == total:  # one token per request, every one sampled: all of hidden, in order
                index = None
            elif drafts is not None and len(sample_rows) == len(order) and total == len(order) + sum(map(len, drafts)):
                index = None  # every request verifies all its rows (its decode token and drafts): all of hidden
            elif drafts is None:
                index = cu[1:][sample_rows] - 1
            else:
                ends = cu[1:][sample_rows]
                index = np.concatenate([np.arange(e - 1 - len(d), e) for e, d in zip(ends, drafts)])
            if index is None:
                rows_to_sample, sampled = hidden, RowKinds(generated)
            else:
                rows_to_sample = hidden.index_select(0, torch.as_tensor(index, device=self.device))
                sampled = RowKinds(generated[torch.from_numpy(index)])
            if lone_verify and 0 < self._logits_rows < rows_to_sample.shape[0]:
                chunks = zip(rows_to_sample.split(self._logits_rows), sampled.split(self._logits_rows), strict=True)
                logits = torch.cat([self.model.compute_logits(c, kinds) for c, kinds in chunks])
            else:
                logits = self.model.compute_logits(rows_to_sample, sampled)
            if logits.dtype != torch.float32:
                logits = logits.float()
        prompt_lp = self._prompt_logprobs(states, starts, n_tok, cu, hidden)
        self._pending = _PendingSample(
            order, states, rows, sample_rows, logits, prompt_lp, drafts, sched.num_spec_tokens_to_propose
        )
        if sched.structured_output_request_ids:
            return None  # sample_tokens(grammar_output) samples, once the grammar bitmask is known
        return self.sample_tokens(None)

    def _fused_prompt_requests(self, order: list[str], counts: dict[str, int], taken: set[str]) -> list[str]:
        """The request whose prompt chunk the fused decoder runs ([] or one), where it is the step's only request
        besides those decoding (`taken`): at most `_prompt_rows` tokens, all of them prompt tokens. Several requests
        with prompt tokens run layer by layer together: a call de-quantizes every weight once for all its rows."""
        rest = [r for r in order if r not in taken]
        if not self._prompt_rows or len(rest) != 1:
            return []
        state = self.input_batch.requests[rest[0]]
        if state.lora_id:
            return []  # an adapter's prompt chunk runs layer by layer
        n = counts[rest[0]]
        limit = min(self._prompt_rows, self.decode_runner.max_rows)
        if 1 < n <= limit and state.num_computed_tokens + n <= self.input_batch.num_prompt_tokens[state.row]:
            return rest
        return []

    def _fused_requests(self, order: list[str], counts: dict[str, int], spec: dict[str, list[int]]) -> list[str]:
        """The requests of `order` (in its order) that run in the fused decoder, if there is one: those decoding (a
        decode token and its drafts, no prompt token) whose rows fit one call of it (execute_model runs them in as
        many calls as their rows need)."""
        if self.decode_runner is None:
            return []
        batch = self.input_batch
        chosen = []
        for r in order:
            state = batch.requests[r]
            if (
                counts[r] == 1 + len(spec.get(r, ()))
                and counts[r] <= self.decode_runner.max_rows
                and state.num_computed_tokens >= batch.num_prompt_tokens[state.row]
            ):
                chosen.append(r)
        return chosen

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step execute_model ran (its logits kept), first setting to -inf the logits of the tokens the
        grammar output does not allow in its requests' rows."""
        pending, self._pending = self._pending, None
        assert pending is not None, "sample_tokens without a step run by execute_model"
        sampled: list[list[int]] = [[] for _ in pending.order]
        logprobs: dict[str, object] = {}
        if pending.logits is not None:
            logits = pending.logits
            if grammar_output is not None and self.tp.rank == 0:  # only rank 0 samples (see _sample)
                self._apply_grammar(logits, pending, grammar_output)
            if pending.drafts is None:
                token_ids, lp_lists = self._sample(logits, pending.rows[pending.sample_rows])
                for j, i in enumerate(pending.sample_rows):
                    state = pending.states[i]
                    self.input_batch.append_token(state, token_ids[j])
                    sampled[i] = [token_ids[j]]
                    k = state.sampling_params.logprobs
                    if lp_lists is not None and k is not None:
                        logprobs[state.req_id] = _slice_lists(lp_lists, j, k)
            else:
                self._verify(logits, pending, sampled, logprobs)
        spec_tokens = self._propose(pending) if self.proposer is not None and pending.propose else {}
        return ModelRunnerOutput(pending.order, sampled, logprobs, pending.prompt_logprobs, spec_tokens)

    def _verify(
        self, logits: torch.Tensor, pending: _PendingSample, sampled: list[list[int]], logprobs: dict[str, object]
    ) -> None:
        """Sample a step with drafts: each sampling request's accepted drafts and one more token (the rejection
        sampler), appended to the batch, into `sampled` and `logprobs` (each token's as if decoded alone)."""
        assert pending.drafts is not None
        drafts = pending.drafts
        counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
        starts = np.zeros(len(drafts), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        rows = pending.rows[pending.sample_rows]
        # Position j of a request sees its first j drafts as output tokens: a seeded row draws at its output
        # position, and penalties, min_tokens and bad words read the drafts before it.
        draft_pos = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, dtype=np.int64)
        metadata = self.input_batch.sampling_metadata(np.repeat(rows, counts), self.vocab_size, draft_pos)
        for j, d in enumerate(drafts if not metadata.no_penalties or metadata.min_tokens or metadata.bad_words else ()):
            for pos in range(1, len(d) + 1):
                row = int(starts[j]) + pos
                metadata.output_token_ids[row] = metadata.output_token_ids[row] + d[:pos]
        if self.tp.rank == 0:
            tokens = self.rejection_sampler(logits, metadata, drafts, starts.tolist())
        else:
            tokens = [[] for _ in drafts]
        if self.tp.world_size > 1:
            tokens = self._broadcast_token_lists(tokens, counts)
        want = metadata.max_num_logprobs
        lp_lists = None
        if want is not None and self.tp.rank == 0:
            index = np.concatenate([np.arange(s, s + len(t)) for s, t in zip(starts, tokens)])
            flat = torch.tensor([t for ts in tokens for t in ts], device=logits.device)
            picked = logits.index_select(0, torch.as_tensor(index, device=logits.device))
            lp_lists = compute_token_logprobs(picked, flat, want).tolists()
        first = 0
        for j, i in enumerate(pending.sample_rows):
            state = pending.states[i]
            for token in tokens[j]:
                self.input_batch.append_token(state, token)
            sampled[i] = tokens[j]
            k = state.sampling_params.logprobs
            if lp_lists is not None and k is not None:
                logprobs[state.req_id] = _slice_lists(lp_lists, first, k, len(tokens[j]))
            first += len(tokens[j])

    def _broadcast_token_lists(self, tokens: list[list[int]], counts: np.ndarray) -> list[list[int]]:
        """Rank 0's token lists on every rank: one fixed-size tensor (a row per logits row, -1 past a list)."""
        flat = torch.full((int(counts.sum()),), -1, dtype=torch.int64, device=self.device)
        if self.tp.rank == 0:
            start = 0
            for ts, n in zip(tokens, counts.tolist()):
                flat[start : start + len(ts)] = torch.tensor(ts, dtype=torch.int64)
                start += n
        values = self._broadcast_ids(flat).tolist()
        out, start = [], 0
        for n in counts.tolist():
            out.append([t for t in values[start : start + n] if t >= 0])
            start += n
        return out

    def _propose(self, pending: _PendingSample) -> dict[str, list[int]]:
        """Draft tokens for the requests the scheduler named, from each one's tokens (sampled ones included)."""
        assert self.proposer is not None
        batch, out = self.input_batch, {}
        for req_id, k in pending.propose.items():
            state = batch.requests.get(req_id)
            if state is None or state.row < 0:
                continue
            drafts = self.proposer.propose(batch.token_ids[state.row, : state.num_tokens], k)
            if drafts:
                out[req_id] = drafts
        return out

    def _apply_grammar(self, logits: torch.Tensor, pending: _PendingSample, grammar: GrammarOutput) -> None:
        """-inf where a constrained request's bitmask rows have a 0 bit. Request r's logits rows follow those of the
        step's sampling requests before it (one each, and one per draft); its bitmask rows come in the same order
        under its repeated id (its first logits row, then one per draft); sample/grammar_mask.py applies them."""
        position, row = {}, 0
        for j, i in enumerate(pending.sample_rows):
            position[pending.order[i]] = row
            row += 1 + (len(pending.drafts[j]) if pending.drafts is not None else 0)
        targets: list[tuple[int, int]] = []
        seen: dict[str, int] = {}
        for k, r in enumerate(grammar.req_ids):
            if r in position:
                targets.append((position[r] + seen.get(r, 0), k))
                seen[r] = seen.get(r, 0) + 1
        if not targets:
            return
        words = grammar.as_array()
        picked = [k for _, k in targets]
        if picked != list(range(words.shape[0])):
            words = words[picked]
        apply_token_bitmask(logits, words, [j for j, _ in targets])

    def _sample(self, logits: torch.Tensor, rows: np.ndarray) -> tuple[list[int], LogprobsLists | None]:
        """The sampled token of each row of `logits` (and the batch's logprobs lists, or None). With tensor
        parallelism every rank holds the same full logits (the LM head gathers them), but only rank 0 samples:
        its tokens are broadcast to the others, so that the ranks never disagree (a sampler run on each rank could
        differ in the last bit between CPUs, and with it a sampled token); rank 0 alone reports logprobs."""
        if self.tp.rank == 0:
            out = self.sampler(logits, self.input_batch.sampling_metadata(rows, self.vocab_size))
            ids = out.sampled_token_ids
            lp_lists = out.logprobs.tolists() if out.logprobs is not None else None
        else:
            ids, lp_lists = torch.empty(len(rows), dtype=torch.int64, device=self.device), None
        if self.tp.world_size > 1:
            ids = self._broadcast_ids(ids.to(torch.int64).contiguous())
        return ids.tolist(), lp_lists

    def _broadcast_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's int64 token ids (or -1) on every rank. They travel as float32 through the shared-memory sum:
        exact below 2**24."""
        return self.tp.broadcast_token_ids(ids) if self.vocab_size < 1 << 24 else self.tp.broadcast(ids)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    def _prompt_logprobs(
        self,
        states: list[CachedRequestState],
        starts: np.ndarray,
        n_tok: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, object]:
        """For each prompt position p computed this step (p < prompt_len - 1): logprob of token p + 1."""
        result: dict[str, object] = {}
        for i, s in enumerate(states):
            k = s.sampling_params.prompt_logprobs
            prompt_len = len(s.prompt_token_ids)
            first = max(int(starts[i]), s.num_prompt_logprobs_done)
            end = min(int(starts[i] + n_tok[i]), prompt_len - 1)
            if k is None or first >= end:
                continue
            offset = int(cu[i]) + first - int(starts[i])
            idx = torch.arange(offset, offset + end - first, device=self.device)
            s.num_prompt_logprobs_done = end
            kinds = GENERATED_ROWS if self.prompt_int8 else PROMPT_ROWS
            logits = self.model.compute_logits(hidden.index_select(0, idx), kinds).float()
            targets = torch.tensor(s.prompt_token_ids[first + 1 : end + 1], device=self.device)
            result[s.req_id] = compute_token_logprobs(logits, targets, k).tolists()
        return result


@dataclass(slots=True)
class _PendingSample:
    """What execute_model leaves for sample_tokens: the step's requests and the logits of its sampling rows."""

    order: list[str]
    states: list[CachedRequestState]
    rows: np.ndarray  # batch row of each request, in `order`
    sample_rows: list[int]  # indices into `order` of the requests that sample
    logits: torch.Tensor | None  # [len(sample_rows) + number of drafts, vocab]
    prompt_logprobs: dict[str, object]
    drafts: list[list[int]] | None  # per sampling request, its draft tokens; None when the step has none
    propose: dict[str, int]  # req_id -> most draft tokens to propose after sampling


def _slice_lists(lists, row: int, k: int, num_rows: int = 1):
    """One request's rows [row, row + num_rows) of a batch LogprobsLists, keeping each chosen token and its top-k."""
    rows = range(row, row + num_rows)
    return LogprobsLists(
        token_ids=[lists.token_ids[r][: k + 1] for r in rows],
        logprobs=[lists.logprobs[r][: k + 1] for r in rows],
        ranks=[lists.ranks[r] for r in rows],
    )
