"""Mixture-of-experts models (model/layers/moe.py, models/mixtral.py, qwen3_moe.py, olmoe.py).

The MoE layer against a per-token reference (every token's experts computed one by one in float64), over steps whose
rows pick the same expert, leave experts unpicked, and pick every expert; routing with and without renormalisation; the
checkpoint layouts (one tensor per expert, or all experts stacked as transformers 5 holds them). Then tiny random HF
models of each architecture (HF's eager experts as the reference), greedy token for token over a batch of prompts, with
chunked prefill over cached prefixes, with preemption, with speculative drafts accepted and rejected, and at TP=2 for
the architectures that split (OLMoE's q/k norms span every head: one rank, a clear error at two).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.linear import PROMPT_ROWS
from pagedllm.model.layers.moe import MoEMLP, route
from tests.model_utils import OracleProposer, PreemptionCounter, hf_greedy, make_tiny_model, random_prompts

MAX_TOKENS = 24
ENGINE: dict[str, Any] = dict(dtype="float32", num_threads=1, engine_client="inproc", max_model_len=256)

# gpt-oss's rope (factor 32, beta_fast 32, beta_slow 1, truncate false) over an original context of 64 tokens
GPT_OSS_YARN = dict(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=64
)
# Tiny MoE shapes: 8 experts, 2 or 3 per token, experts narrower than the dense MLP.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", dict(seed=31, num_local_experts=8, num_experts_per_tok=2)),
    # a dense layer among the sparse ones (mlp_only_layers), renormalised top-3, q/k norms per head
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        dict(
            seed=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding (16) and full layers alternating, YaRN rope (truncate
    # false); a biased router taking the top 2 logits then a softmax; biased experts with the clamped SwiGLU
    "gpt-oss": (
        "GptOssForCausalLM",
        dict(seed=34, num_local_experts=8, num_experts_per_tok=2, sliding_window=16, rope_scaling=GPT_OSS_YARN),
    ),
    # top-k weights not renormalised; q/k norms over the whole projection, clamped q, k and v
    "olmoe": (
        "OlmoeForCausalLM",
        dict(seed=33, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=1.5),
    ),
}


@pytest.fixture(params=list(VARIANTS), scope="module")
def moe_dir(request: pytest.FixtureRequest, tiny_model_dir: Path) -> str:
    arch, kwargs = VARIANTS[request.param]
    return make_tiny_model(tiny_model_dir, arch, **kwargs)


def _layer(experts: int, top_k: int, renormalize: bool, seed: int) -> MoEMLP:
    layer = MoEMLP(24, 20, experts, top_k, renormalize)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return layer


def _per_token(layer: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its experts one by one, in float64."""
    logits = x.double() @ layer.gate.weight.double().T
    probs = torch.softmax(logits, dim=-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = layer.w2_weight.shape[2]
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], layer.top_k)
        if layer.renormalize:
            w = w / w.sum()
        for weight, e in zip(w, ids.tolist()):
            gu = layer.w13_weight[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += weight * (layer.w2_weight[e].double() @ h)
    return out


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
def test_moe_layer_matches_per_token_reference(renormalize: bool) -> None:
    """Rows that share an expert, experts no row picks (one row), every expert picked (many rows)."""
    layer = _layer(experts=6, top_k=2, renormalize=renormalize, seed=1)
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 24, generator=g)
        _, ids = route(layer.gate(x, PROMPT_ROWS), 2, renormalize)
        if rows == 1:
            assert len(set(ids.flatten().tolist())) == 2  # four of six experts unpicked
        if rows == 40:
            assert set(ids.flatten().tolist()) == set(range(6))  # every expert picked, most by several rows
        got = layer(x, PROMPT_ROWS)
        torch.testing.assert_close(got.double(), _per_token(layer, x), atol=1e-5, rtol=1e-5)


def test_routing_weights() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.5, -2.0, 0.0]])
    w, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [1, 0]]
    torch.testing.assert_close(w.sum(-1), torch.ones(2))
    torch.testing.assert_close(w[0, 0] / w[0, 1], torch.tensor(1.0).exp())  # logits 2 and 1
    raw, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))


def test_stacked_and_per_expert_checkpoints_load_alike() -> None:
    """One tensor per expert (gate_proj, up_proj, down_proj) or all experts stacked (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]); a wrong shape or an expert out of range is a ValueError naming it."""
    g = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(4, 2 * 20, 24, generator=g), torch.randn(4, 24, 20, generator=g)
    stacked, single = MoEMLP(24, 20, 4, 2, True), MoEMLP(24, 20, 4, 2, True)
    stacked.weight_loader(stacked.w13_weight, gate_up, None, "gate_up_proj")
    stacked.weight_loader(stacked.w2_weight, down, None, "down_proj")
    for e in range(4):
        single.weight_loader(single.w13_weight, gate_up[e, :20], e, "gate_proj")
        single.weight_loader(single.w13_weight, gate_up[e, 20:], e, "up_proj")
        single.weight_loader(single.w2_weight, down[e], e, "down_proj")
    assert torch.equal(stacked.w13_weight, single.w13_weight) and torch.equal(stacked.w2_weight, single.w2_weight)
    with pytest.raises(ValueError, match="expert 4 of a layer with 4 experts"):
        single.weight_loader(single.w2_weight, down[0], 4, "down_proj")
    with pytest.raises(ValueError, match="gate_proj of experts 1"):
        single.weight_loader(single.w13_weight, gate_up[1], 1, "gate_proj")


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_batch_matches_hf(moe_dir: str) -> None:
    prompts = random_prompts([3, 17, 40, 64, 100], seed=50)
    with LLM(moe_dir, **ENGINE, kv_cache_memory_bytes="8MiB") as llm:
        got = _greedy(llm, prompts)
    assert got == hf_greedy(moe_dir, prompts, MAX_TOKENS)


def test_chunked_prefill_prefix_hits_and_preemption_match_hf(moe_dir: str) -> None:
    """A 16-token budget splits the prompts, the second batch hits the first's cached prefixes; then a cache too
    small for the batch forces preemption."""
    prefix, *rest = random_prompts([40, 5, 13, 30, 9, 22], seed=51)
    first = [prefix + rest[0], rest[1], prefix + rest[2]]
    second = [prefix + rest[3], prefix + rest[2], rest[4]]
    engine = dict(ENGINE, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=True)
    with LLM(moe_dir, **engine, kv_cache_memory_bytes="8MiB") as llm:
        assert _greedy(llm, first) == hf_greedy(moe_dir, first, MAX_TOKENS)
        outs = _greedy(llm, second)
    assert outs == hf_greedy(moe_dir, second, MAX_TOKENS)
    prompts = first + second
    # 3 layers x 2 KV heads x 16 dims x 2 (k, v) x 4 bytes x 8 tokens = 6 KiB a block: 14 blocks for six requests
    small = dict(ENGINE, block_size=8, max_num_batched_tokens=32, max_model_len=96)
    with LLM(moe_dir, **small, kv_cache_memory_bytes=14 * 6144) as llm:
        with PreemptionCounter(llm) as counter:
            outs = _greedy(llm, prompts)
    assert counter.num_preemptions > 0
    assert outs == hf_greedy(moe_dir, prompts, MAX_TOKENS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe", "gpt-oss"])
def test_tensor_parallel_2_matches_hf(variant: str, tiny_model_dir: Path) -> None:
    """Each rank holds its share of every expert's intermediate dimension; the partial sums meet in one
    all-reduce a layer."""
    arch, kwargs = VARIANTS[variant]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    prompts = random_prompts([3, 17, 40], seed=52)
    llm = LLM(model=folder, tensor_parallel_size=2, **dict(ENGINE, engine_client="mp"))
    try:
        assert _greedy(llm, prompts) == hf_greedy(folder, prompts, MAX_TOKENS)
    finally:
        llm.engine_core.shutdown()


def test_olmoe_refuses_two_ranks(tiny_model_dir: Path) -> None:
    arch, kwargs = VARIANTS["olmoe"]
    folder = make_tiny_model(tiny_model_dir, arch, **kwargs)
    with pytest.raises(Exception, match="OLMoE runs on one rank only"):
        LLM(model=folder, tensor_parallel_size=2, **dict(ENGINE, engine_client="mp"))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_experts_in_a_dense_gguf_architecture_are_a_clear_error(arch: str) -> None:
    """A file of an architecture whose experts pagedllm does not build (only llama, olmoe and qwen3moe have them)
    is a ValueError naming it, not a dense model missing its tensors."""
    from pagedllm.model.config_loader import gguf_to_hf_config

    meta = {"general.architecture": arch, f"{arch}.expert_count": 8, f"{arch}.embedding_length": 64}
    with pytest.raises(ValueError, match=f"{arch!r} with 8 experts"):
        gguf_to_hf_config(meta)


def test_speculative_drafts_match_hf(moe_dir: str) -> None:
    """Drafts verified through the experts (several rows of a request in one step, each routed on its own), some
    accepted and some rejected: greedy tokens HF's."""
    prompts = random_prompts([20, 33, 47], seed=53)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    with LLM(moe_dir, **dict(ENGINE, block_size=8, speculative_config=spec)) as llm:
        core = llm.engine_core.engine_core
        core.executor.worker.model_runner.proposer = OracleProposer(prompts, hf_greedy(moe_dir, prompts, MAX_TOKENS))
        outs = _greedy(llm, prompts)
        stats = core.scheduler.total_spec_stats
    assert outs == hf_greedy(moe_dir, prompts, MAX_TOKENS)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_a_checkpoint_missing_an_expert_projection_is_a_clear_error() -> None:
    """The expert weights start uninitialised: an expert whose up projection never arrives is a ValueError naming it,
    not garbage."""
    layer = MoEMLP(24, 20, 4, 2, True)
    for e in range(4):
        for part, shape in (("gate_proj", (20, 24)), ("up_proj", (20, 24)), ("down_proj", (24, 20))):
            if (e, part) != (2, "up_proj"):
                param = layer.w2_weight if part == "down_proj" else layer.w13_weight
                layer.weight_loader(param, torch.zeros(shape), e, part)
    with pytest.raises(ValueError, match="expert 2's up_proj"):
        layer.settle_quant()
