"""Model math against HF transformers: tiny random models of every supported architecture, float32 on CPU.

Each variant (Llama untied/tied, Llama with llama3 rope scaling in the transformers-5 `rope_parameters` form
and in the legacy top-level `rope_theta` + `rope_scaling` form, Mistral, Mistral and Qwen2 with sliding windows
shorter than the prompts (every layer, and the layers from max_window_layers on), Qwen2 with q/k/v biases, Qwen3
with q/k RMSNorm and head_dim != hidden/heads, Gemma 3 with local and global layers, SmolLM3 with layers without
rope, Granite with its four multipliers, Qwen2 with YaRN rope scaling, OLMo 2's post norms, Gemma, and the LayerNorm
models Starcoder2, StableLM and Phi-2, Phi-3 with fused projections, plain and with LongRoPE over part of each head)
must give, with
batched requests of mixed lengths:
  - greedy tokens identical to HF `generate`, for one big batch, for chunked prefill (16-token budget) with
    prefix caching off and on (prompts sharing a long prefix, across two calls), and under KV-cache pressure
    that forces preemption (counted from the scheduler stats of every step);
  - prompt and sample logprobs within 1e-4 of HF's log_softmax, chunked or not, also when preempted.
After every engine run the block pool is consistent and no block is left in use. The variants that only widen the
architectures (BREADTH_ONLY) skip the chunked-prefix and preemption runs, which the others cover for the scheduler.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.kernels import available_isas
from pagedllm.outputs import Logprob, RequestOutput
from tests.model_utils import (
    PHI3_LONGROPE,
    OracleProposer,
    PreemptionCounter,
    check_fused_matches_layer_path,
    check_fused_rows_are_lone_tokens,
    hf_greedy,
    hf_logprobs,
    load_hf_model,
    make_tiny_model,
    random_prompts,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# id -> (architecture, make_tiny_model kwargs). Distinct seeds: same-shaped variants get different weights.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(seed=1)),
    "llama-tied": ("LlamaForCausalLM", dict(seed=2, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaForCausalLM", dict(seed=3, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama3-rope-legacy-keys": (
        "LlamaForCausalLM",
        dict(seed=4, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, legacy_rope_keys=True, num_hidden_layers=2),
    ),
    "mistral": ("MistralForCausalLM", dict(seed=5)),
    # A window shorter than the prompts and generations below: every layer attends its last 24 keys.
    "mistral-window": ("MistralForCausalLM", dict(seed=8, sliding_window=24)),
    # Qwen2's window on the layers from max_window_layers on (layer_types), full attention below.
    "qwen2-window": (
        "Qwen2ForCausalLM",
        dict(seed=9, use_sliding_window=True, sliding_window=20, max_window_layers=1),
    ),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", dict(seed=6)),
    # YaRN over an original context shorter than the prompts (Qwen2.5's long-context setting)
    "qwen2-yarn": (
        "Qwen2ForCausalLM",
        dict(
            seed=13,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=1e6,
        ),
    ),
    "qwen3-qk-norm-tied": ("Qwen3ForCausalLM", dict(seed=7, tie_word_embeddings=True, head_dim=32)),
    # Gemma 3: local layers with a 12-token window and their own rope base around a global one, (1 + w) norms,
    # q/k norms, query_pre_attn_scalar apart from head_dim, GELU(tanh) MLP, scaled embeddings; tied as released.
    "gemma3": (
        "Gemma3ForCausalLM",
        dict(
            seed=10,
            tie_word_embeddings=True,
            rope_theta=1e6,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
        ),
    ),
    # Gemma 2: Gemma 3's layers without q/k norms, local and global layers alternating, soft-capped attention
    # logits and final logits (caps small enough to matter: test_gemma2_caps_matter)
    "gemma2": (
        "Gemma2ForCausalLM",
        dict(
            seed=23,
            tie_word_embeddings=True,
            sliding_window=12,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=10.0,
            final_logit_softcapping=3.0,
        ),
    ),
    # SmolLM3: layers 1 and 3 without rotary embedding (no_rope_layers 0)
    "smollm3-no-rope": ("SmolLM3ForCausalLM", dict(seed=11, num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0])),
    # Granite: embedding, residual, attention and logits multipliers away from 1
    "granite-multipliers": (
        "GraniteForCausalLM",
        dict(
            seed=12,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=0.5,
        ),
    ),
    # Gemma (1): Llama layers with (1 + w) norms, scaled embeddings, a GELU(tanh) gate; tied
    "gemma": ("GemmaForCausalLM", dict(seed=15, tie_word_embeddings=True)),
    # LayerNorm with biases: Starcoder2 (plain GELU MLP, biases everywhere, a window shorter than the prompts),
    # StableLM (partial rotary, q/k/v biases; sequential and parallel residual), Phi-2 (parallel attention and MLP,
    # partial rotary, a head with a bias)
    "starcoder2": ("Starcoder2ForCausalLM", dict(seed=16, tie_word_embeddings=True, sliding_window=20)),
    "stablelm": ("StableLmForCausalLM", dict(seed=17, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "stablelm-parallel": (
        "StableLmForCausalLM",
        dict(seed=18, partial_rotary_factor=0.5, use_parallel_residual=True, num_hidden_layers=2),
    ),
    "phi2": ("PhiForCausalLM", dict(seed=19, partial_rotary_factor=0.4)),
    # OLMo 2: post norms only, q/k norms over the whole projection
    "olmo2": ("Olmo2ForCausalLM", dict(seed=14)),
    # Phi-3: fused qkv_proj and gate_up_proj (split at load); with LongRoPE (short factors: the engine's 256 tokens
    # are within the original context, where transformers picks them too; an attention factor from 512 / 256) over
    # half of each head, as Phi-4-mini's partial rotary
    "phi3": ("Phi3ForCausalLM", dict(seed=21)),
    "phi3-longrope-partial": ("Phi3ForCausalLM", dict(seed=22, **PHI3_LONGROPE)),
    # mixture-of-experts MLPs on the fused experts kernel (tests/model/test_moe.py runs their scheduler paths)
    "mixtral": ("MixtralForCausalLM", dict(seed=31, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3-moe-dense-layer": (
        "Qwen3MoeForCausalLM",
        dict(seed=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, mlp_only_layers=[1]),
    ),
    "olmoe-clip": ("OlmoeForCausalLM", dict(seed=33, num_experts=8, num_experts_per_tok=2, clip_qkv=1.5)),
    # attention sinks, biases everywhere, alternating windows, the clamped SwiGLU experts
    "gpt-oss": ("GptOssForCausalLM", dict(seed=34, num_local_experts=8, num_experts_per_tok=2, sliding_window=16)),
}
# Architectures whose layers the fused decoder does not run (their decode steps take the layer path): none since the
# layer description (model/layers/description.py) covers every architecture here.
LAYER_PATH_ONLY: set[str] = set()

MAX_TOKENS = 32
ATOL = 1e-4
# One torch thread: these models are tiny (per-op overhead dominates) and the CPU is shared. In this process: the
# engine core process adds seconds of start-up per LLM and nothing an architecture changes (tests/engine cover it).
ENGINE: dict[str, Any] = dict(dtype="float32", num_threads=1, engine_client="inproc")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The HF reference runs in this process too; the engine's worker sets the process-wide count anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Variants whose architecture adds nothing to the scheduler's paths (no window, no new cache layout): they run every
# test but chunked prefill with prefix caching and preemption, which the other variants run for them, and of the
# tests with options only one (the native backend, chunked logprobs, five requests decoding) (the suite stays within
# CI's time on two cores).
BREADTH_ONLY = {
    "gemma2",
    "llama3-rope-legacy-keys",
    "qwen2-yarn",
    "smollm3-no-rope",
    "granite-multipliers",
    "gemma",
    "stablelm",
    "stablelm-parallel",
    "phi2",
    "olmo2",
    "phi3",
    "phi3-longrope-partial",
    "mixtral",
    "qwen3-moe-dense-layer",
    "olmoe-clip",
    "gpt-oss",
}


@pytest.fixture(params=list(VARIANTS), scope="module")
def model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> str:
    arch, kwargs = VARIANTS[request.param]
    return make_tiny_model(tiny_model_dir, arch, **kwargs)


def breadth_cases(options: list[Any], breadth: list[Any]) -> list[Any]:
    """(variant, option) cases for a test parametrized over `model_dir` (indirectly) and an option: every option for
    the variants that run everything, only the `breadth` options for the breadth-only ones (CI's time)."""
    return [
        pytest.param(v, o, id=f"{v}-{o}") for v in VARIANTS for o in options if v not in BREADTH_ONLY or o in breadth
    ]


@pytest.fixture(params=[v for v in VARIANTS if v not in BREADTH_ONLY], scope="module")
def full_model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> str:
    """The variants that also run chunked prefill with prefix caching, and preemption."""
    arch, kwargs = VARIANTS[request.param]
    return make_tiny_model(tiny_model_dir, arch, **kwargs)


@pytest.fixture()
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each call of the fused decoder (`CpuDecodeRunner.__call__`) in this process while the test runs."""
    from pagedllm.worker.cpu_decode_runner import CpuDecodeRunner

    calls: list[int] = []
    original = CpuDecodeRunner.__call__

    def counting(self: Any, *args: Any) -> Any:
        calls.append(args[0].numel())
        return original(self, *args)

    monkeypatch.setattr(CpuDecodeRunner, "__call__", counting)
    return calls


def _arch_of(folder: str) -> str:
    import json

    with open(Path(folder) / "config.json") as f:
        return json.load(f)["architectures"][0]


def require_native_kernels() -> None:
    """Skip where no compiler could have built the native kernels; fail where one could and they are missing."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler, so no native kernels")
    assert available_isas(), "the native CPU kernels are not built: run `make setup`"


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order
    return outs


def assert_matches_hf(folder: str, prompts: list[list[int]], outs: list[RequestOutput]) -> None:
    expected = hf_greedy(folder, prompts, MAX_TOKENS)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        got = list(out.outputs[0].token_ids)
        assert got == ref, f"prompt {i} (len {len(prompts[i])}): engine {got} != HF {ref}"


def assert_idle(llm: LLM) -> dict[str, Any]:
    inv = llm.check_invariants()  # raises AssertionError on a corrupt block pool
    assert inv["in_use"] == 0, inv
    assert inv["unfinished"] == 0, inv
    return inv


def shared_prefix_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two batches of six, four of each sharing a 70-token prefix; the second repeats prompts of the first
    (one of them block-aligned: a full hit but for its last block) and adds unrelated ones."""
    prefix, s1, s2, s3, s4, *other = random_prompts([70, 5, 13, 30, 9, 45, 3, 120, 17, 100], seed)
    first = [prefix + s1, prefix + s2, other[0], prefix[:64], other[1], other[2]]
    second = [prefix + s3, prefix + s2, prefix[:64], prefix[:40] + s4, other[3], other[4]]
    return first, second


@pytest.mark.parametrize(
    "model_dir, backend", breadth_cases(["cpu_native", "torch"], ["cpu_native"]), indirect=["model_dir"]
)
def test_greedy_batch_matches_hf(model_dir: str, backend: str) -> None:
    """Eight prompts of 3..150 tokens in one call (positions up to 181, past the llama3 original 64), with each
    attention backend: the native CPU kernels (one call over all decodes, layer by layer) and torch (gather + SDPA
    in length groups)."""
    if backend == "cpu_native":
        require_native_kernels()
    prompts = random_prompts([3, 9, 16, 17, 40, 64, 100, 150], seed=10)
    engine = dict(ENGINE, attention_backend=backend)
    with LLM(model_dir, **engine, max_model_len=256, kv_cache_memory_bytes="8MiB") as llm:
        outs = generate(llm, prompts, greedy())
        assert_idle(llm)
    assert_matches_hf(model_dir, prompts, outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("model_dir, num_prompts", breadth_cases([1, 5], [5]), indirect=["model_dir"])
def test_decode_steps_run_fused_and_match_hf(model_dir: str, num_prompts: int, fused_calls: list[int]) -> None:
    """Decode steps (no prompt token) run in the fused decoder (worker/cpu_decode_runner.py: one native call for
    all layers), for every variant: one request alone (every step a lone token), or several of different lengths
    sharing steps (each row attending to its own request's blocks), greedy output as HF's."""
    require_native_kernels()
    prompts = random_prompts([37, 5, 60, 18, 9][:num_prompts], seed=11)
    engine = dict(ENGINE, attention_backend="cpu_native")
    with LLM(model_dir, **engine, max_model_len=256, kv_cache_memory_bytes="8MiB") as llm:
        outs = generate(llm, prompts, greedy())
        assert_idle(llm)
        fused = llm.engine_core.engine_core.executor.worker.model_runner.decode_runner is not None
    assert_matches_hf(model_dir, prompts, outs)
    if _arch_of(model_dir) in LAYER_PATH_ONLY:  # declined by the fused decoder, never run in it
        assert not fused and fused_calls == []
        return
    # Every token after the prefill's first, all requests in each step (they prefill together and finish together).
    assert fused_calls == [num_prompts] * (MAX_TOKENS - 1)


def test_fused_decoder_float32_rows_are_lone_tokens(model_dir: str) -> None:
    """The fused decoder on float32 panels, for every variant: the tokens of several requests at once (23 rows, more
    than a block of the panel kernel, some requests with several consecutive tokens as when verifying drafts) give
    the same hidden states and KV cache contents, bit for bit, as each token alone; and decode rows give what the
    layer path (model/layers/decoder.py, run from the same layer description) computes for them, bit for bit."""
    require_native_kernels()
    if _arch_of(model_dir) in LAYER_PATH_ONLY:
        pytest.skip("this architecture's decode steps take the layer path (the fused decoder declines it)")
    engine = dict(ENGINE, attention_backend="cpu_native")
    with LLM(model_dir, **engine, max_model_len=256, kv_cache_memory_bytes="8MiB") as llm:
        check_fused_rows_are_lone_tokens(llm, [(37, 5), (12, 3), (70, 1), (5, 2), (20, 4), (9, 7), (100, 1)])
        check_fused_matches_layer_path(llm, [(37, 1), (12, 1), (70, 1), (5, 1), (100, 1)])


@pytest.mark.parametrize("max_rows", [None, 4], ids=["one-call", "chunks-of-4"])
def test_many_decoding_requests_run_fused(
    tiny_model_dir: Path, max_rows: int | None, fused_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every decoding request of a step runs in the fused decoder, never layer by layer, however many there are:
    more than the float32 panels' few-row bound of the layer-by-layer path (16) in one call, and more than one call
    takes (here made 4 rows) in several calls of whole requests. Each one's tokens are then those it decodes alone,
    whatever shares its steps: greedy output as each request's own run alone, and as HF's."""
    require_native_kernels()
    from pagedllm.model.layers.linear import PANEL_MAX_ROWS
    from pagedllm.worker import cpu_decode_runner

    if max_rows is not None:
        monkeypatch.setattr(cpu_decode_runner, "MAX_ROWS", max_rows)
    arch, kwargs = VARIANTS["llama"]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    num = PANEL_MAX_ROWS + 5
    prompts = random_prompts([3 + 5 * i % 41 for i in range(num)], seed=12)
    engine = dict(ENGINE, attention_backend="cpu_native")
    steps = 8
    with LLM(folder, **engine, max_model_len=256, kv_cache_memory_bytes="8MiB") as llm:
        together = generate(llm, prompts, greedy(steps))
        assert_idle(llm)
        # Every decode token of every request ran fused (the requests prefill in one step and decode together).
        assert sum(fused_calls) == num * (steps - 1)
        per_step = 1 if max_rows is None else -(-num // max_rows)
        assert len(fused_calls) == per_step * (steps - 1) and max(fused_calls) <= (max_rows or num)
        alone = [generate(llm, [p], greedy(steps))[0] for p in prompts]
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {i}: batched != alone"
    expected = hf_greedy(folder, prompts, steps)
    for i, (out, ref) in enumerate(zip(together, expected)):
        assert list(out.outputs[0].token_ids) == ref, f"prompt {i}: engine != HF"


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_chunked_prefill_shared_prefix_matches_hf(full_model_dir: str, prefix_caching: bool) -> None:
    """A 16-token budget splits every prompt; the second call re-sends prompts whose prefix is cached."""
    first, second = shared_prefix_prompts(seed=20)
    with LLM(
        full_model_dir,
        **ENGINE,
        max_model_len=256,
        block_size=8,
        kv_cache_memory_bytes="8MiB",
        max_num_batched_tokens=16,
        enable_prefix_caching=prefix_caching,
    ) as llm:
        outs1 = generate(llm, first, greedy())
        assert_idle(llm)
        outs2 = generate(llm, second, greedy())
        assert_idle(llm)
    assert_matches_hf(full_model_dir, first, outs1)
    assert_matches_hf(full_model_dir, second, outs2)
    cached = [o.num_cached_tokens for o in outs2]
    if prefix_caching:
        # Hits are whole blocks of 8, and never the whole prompt (its last token must be computed).
        assert all(0 < c < len(p) and c % 8 == 0 for c, p in zip(cached[:4], second)), cached
        assert cached[1] == 80 and cached[2] == 56, cached  # 83-token repeat; block-aligned 64-token repeat
    else:
        assert cached == [0] * len(second)


def full_blocks_bytes(model_dir: str, blocks: int, block_size: int) -> int:
    """The float32 KV cache memory of `blocks` blocks of every layer (with sliding-window layers in KV cache groups of
    their own, it holds more, smaller blocks: core/kv_cache_layout.py)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return blocks * block_size * config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_preemption_matches_hf(full_model_dir: str, prefix_caching: bool) -> None:
    """The memory of 13 blocks of 8 tokens for six requests of up to 92 tokens (12 blocks): the scheduler must
    preempt."""
    prefix, *rest = random_prompts([24, 7, 16, 20, 31, 40, 60], seed=30)
    prompts = [prefix + rest[0], rest[2], prefix + rest[1], rest[3], prefix + rest[4], rest[5]]
    assert max(len(p) for p in prompts) + MAX_TOKENS <= 96
    with LLM(
        full_model_dir,
        **ENGINE,
        max_model_len=96,
        block_size=8,
        kv_cache_memory_bytes=full_blocks_bytes(full_model_dir, 13, 8),
        max_num_batched_tokens=32,
        enable_prefix_caching=prefix_caching,
    ) as llm:
        with PreemptionCounter(llm) as counter:
            outs = generate(llm, prompts, greedy())
        inv = assert_idle(llm)
    assert counter.num_preemptions > 0, f"no preemption in {counter.num_steps} steps"
    if "num_preemptions" in inv:  # the engine's own running total, where it reports one
        assert inv["num_preemptions"] == counter.num_preemptions, (inv, counter.num_preemptions)
    assert_matches_hf(full_model_dir, prompts, outs)


def check_entries(dist: torch.Tensor, token: int, entries: dict[int, Logprob], k: int, where: str) -> None:
    """One position's engine dict (actual token + top-k) against HF's log-distribution `dist` [vocab]."""
    assert token in entries and len(entries) in (k, k + 1), (where, token, entries)
    for tid, lp in entries.items():
        assert math.isclose(lp.logprob, float(dist[tid]), abs_tol=ATOL), (where, tid, lp, float(dist[tid]))
    top = dist.topk(k + 1)
    if float(top.values[k - 1] - top.values[k]) > ATOL:  # no near-tie at the top-k boundary
        assert set(top.indices[:k].tolist()) <= set(entries), (where, top.indices.tolist(), entries)
    lp_tok = float(dist[token])
    if int(((dist - lp_tok).abs() <= ATOL).sum()) == 1:  # no other token within tolerance of it
        assert entries[token].rank == int((dist > lp_tok).sum()) + 1, (where, token, entries[token])


def check_sample_logprobs(ref: torch.Tensor, prompt: list[int], out: RequestOutput, k: int) -> None:
    """`ref` is hf_logprobs(prompt + output); its row len(prompt) - 1 + j is the distribution of token j."""
    gen = list(out.outputs[0].token_ids)
    slp = out.outputs[0].logprobs
    assert slp is not None and len(slp) == len(gen), f"{len(slp or [])} sample logprobs for {len(gen)} tokens"
    for j, token in enumerate(gen):
        check_entries(ref[len(prompt) - 1 + j], token, slp[j], k, f"output {j}")


def check_prompt_logprobs(ref: torch.Tensor, prompt: list[int], out: RequestOutput, k: int) -> None:
    """None for position 0, then position p's dict against row p - 1 of the HF reference."""
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt), f"{len(plp or [])} prompt logprobs for {len(prompt)}"
    assert plp[0] is None
    for p in range(1, len(prompt)):
        check_entries(ref[p - 1], prompt[p], plp[p], k, f"prompt {p}")


@pytest.mark.parametrize("model_dir, budget", breadth_cases([None, 16], [16]), indirect=["model_dir"])
def test_logprobs_match_hf(model_dir: str, budget: int | None) -> None:
    """prompt_logprobs=5 and logprobs=5; the same prompt twice (prefix caching must not skip positions)."""
    prompts = random_prompts([2, 17, 60, 130], seed=40)
    prompts.append(list(prompts[2]))
    with LLM(
        model_dir,
        **ENGINE,
        max_model_len=256,
        block_size=8,
        kv_cache_memory_bytes="8MiB",
        max_num_batched_tokens=budget,
        enable_prefix_caching=True,
    ) as llm:
        outs = generate(llm, prompts, greedy(max_tokens=8, logprobs=5, prompt_logprobs=5))
        assert_idle(llm)
        again = generate(llm, prompts[2:3], greedy(max_tokens=8, logprobs=5, prompt_logprobs=5))
        assert_idle(llm)
    for prompt, out in zip(prompts + prompts[2:3], outs + again):
        ref = hf_logprobs(model_dir, prompt + list(out.outputs[0].token_ids))
        check_prompt_logprobs(ref, prompt, out, k=5)
        check_sample_logprobs(ref, prompt, out, k=5)


def test_gemma2_caps_matter(tiny_model_dir: Path) -> None:
    """The gemma2 variant's soft-caps matter, so its HF-exact tests check the engine's: HF's greedy tokens without the
    attention cap differ from its tokens with it, and its log-probabilities without the final cap (a monotonic map of
    the logits, so the same tokens) differ by far more than the logprob tests' tolerance."""
    import copy

    arch, kwargs = VARIANTS["gemma2"]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    prompt = random_prompts([40], seed=62)[0]
    model = load_hf_model(folder)
    ids = torch.tensor([prompt])

    def greedy_tokens(m: Any) -> list[int]:
        with torch.inference_mode():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    uncapped = copy.deepcopy(model)
    uncapped.config.attn_logit_softcapping = None
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert greedy_tokens(uncapped) != greedy_tokens(model)
    uncapped = copy.deepcopy(model)
    uncapped.config.final_logit_softcapping = None
    with torch.inference_mode():
        a, b = (torch.log_softmax(m(ids).logits[0], -1) for m in (model, uncapped))
    assert float((a - b).abs().max()) > 100 * ATOL


WINDOWED = ["mistral-window", "qwen2-window", "gemma3", "starcoder2"]


@pytest.mark.parametrize(
    "variant, hybrid",
    [pytest.param(v, True, id=f"{v}-hybrid") for v in WINDOWED]
    + [pytest.param("gemma3", False, id="gemma3-all-blocks")],
)
def test_window_layers_hold_only_their_window(tiny_model_dir: Path, variant: str, hybrid: bool) -> None:
    """A 150-token prompt and 32 decode steps on a model with sliding-window layers: at every step the request holds,
    in each window KV cache group, only the blocks its next token sees (the rest dropped to the null block), all its
    blocks in full-attention groups; the tokens are HF's. `--disable-hybrid-kv-cache-manager`: every block kept."""
    arch, kwargs = VARIANTS[variant]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    prompt = random_prompts([150], seed=61)
    engine = dict(ENGINE, block_size=8, max_model_len=256, max_num_batched_tokens=64)
    with LLM(folder, **engine, disable_hybrid_kv_cache_manager=not hybrid) as llm:
        scheduler = llm.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        assert any(manager.windows) == hybrid
        held: list[tuple[int, int]] = []  # (tokens computed before the step, blocks held) of each step
        original = scheduler.schedule

        def schedule() -> Any:
            out = original()
            for req in scheduler.running:
                held.append((req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0),
                             manager.num_held_blocks(req.request_id)))  # fmt: skip
            return out

        scheduler.schedule = schedule
        outs = generate(llm, prompt, greedy())
        assert_idle(llm)
    assert_matches_hf(folder, prompt, outs)
    decode_steps = [(c, n) for c, n in held if c >= 150]
    assert len(decode_steps) >= MAX_TOKENS - 1
    for computed, n in decode_steps:  # the step computes the token at `computed`
        expected = 0
        for window in manager.windows:
            end = computed // 8 + 1  # the blocks up to the token's own
            expected += end - (0 if window == 0 else max(0, computed - window + 1) // 8)
        assert n == expected, (computed, n, expected, manager.windows)
    if hybrid:
        assert n < len(manager.windows) * (computed // 8 + 1)


@pytest.mark.parametrize("variant", [*WINDOWED, "gemma2"])
def test_speculative_drafts_match_hf(tiny_model_dir: Path, variant: str) -> None:
    """Speculative decoding on the window models (the hybrid KV cache dropping blocks while drafts are verified,
    accepted and rejected): prompts past the window, several requests sharing steps, greedy tokens HF's; drafts
    proposed, some accepted and some rejected."""
    arch, kwargs = VARIANTS[variant]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    prompts = random_prompts([40, 57, 75], seed=63)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    engine = dict(ENGINE, block_size=8, max_model_len=256, speculative_config=spec)
    with LLM(folder, **engine) as llm:
        core = llm.engine_core.engine_core
        core.executor.worker.model_runner.proposer = OracleProposer(prompts, hf_greedy(folder, prompts, MAX_TOKENS))
        outs = generate(llm, prompts, greedy())
        stats = core.scheduler.total_spec_stats
        assert_idle(llm)
    assert_matches_hf(folder, prompts, outs)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_logprobs_under_preemption_match_hf(full_model_dir: str) -> None:
    """A preempted request is recomputed: its prompt logprobs must still be one per prompt position."""
    prompts = random_prompts([30, 41, 52, 60], seed=50)
    with LLM(
        full_model_dir,
        **ENGINE,
        max_model_len=96,
        block_size=8,
        kv_cache_memory_bytes=full_blocks_bytes(full_model_dir, 13, 8),
        max_num_batched_tokens=32,
    ) as llm:
        with PreemptionCounter(llm) as counter:
            outs = generate(llm, prompts, greedy(logprobs=3, prompt_logprobs=3))
        assert_idle(llm)
    assert counter.num_preemptions > 0, f"no preemption in {counter.num_steps} steps"
    assert_matches_hf(full_model_dir, prompts, outs)
    refs = [hf_logprobs(full_model_dir, p + list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    for prompt, out, ref in zip(prompts, outs, refs):
        check_sample_logprobs(ref, prompt, out, k=3)
    for prompt, out, ref in zip(prompts, outs, refs):
        check_prompt_logprobs(ref, prompt, out, k=3)
