"""Mixture-of-experts GGUF files: Mixtral as llama.cpp stores it (`llama` with expert_count), `qwen3moe` and `olmoe`.
A tiny random HF model of each (widths that are not all multiples of 256: the experts' 96-wide down projection falls
back to the legacy types, as llama.cpp's quantizer does) is written by the tests' GGUF writer (tests/gguf_utils.py:
the router in F32, each projection's experts stacked in one tensor [experts, rows, cols], the metadata keys
convert_hf_to_gguf.py writes), then:
  - in F32: pagedllm's greedy tokens identical to HF transformers running the original folder;
  - in llama.cpp's Q4_K_M layout (gpt-oss: its release's, MXFP4 experts), the experts run as stored on the fused
    experts kernel (a float32 KV cache): against HF transformers
    running the file's de-quantized weights, teacher-forced over a prompt of 150 tokens, the prompt's log-probabilities
    within MEAN_NOISE on average, top-1 agreement >= 0.9 and every disagreement a near-tie of HF's own top two.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.moe import MoEMLP
from tests.gguf_utils import check_against_dequantized, write_gguf
from tests.model_utils import hf_greedy, load_hf_model, make_tiny_model, random_prompts
from tests.quant_utils import MXFP4

# initializer_range 0.05: at 256 wide, 0.2 (the tiny models' default) gives logits so large that rounding moves the
# log-probabilities of dense models as much as 0.14 nat; at 0.08 the bf16 rounding of the prompt rows' inputs alone
# swapped a top 0.66 nat from a tie (gpt-oss), at 0.06 0.55 nat (Mixtral); at 0.05 at most 0.12
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05)
# GGUF architecture -> (HF architecture, make_tiny_model kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("MixtralForCausalLM", dict(seed=61, num_local_experts=8, num_experts_per_tok=2, intermediate_size=96)),
    "qwen3moe": (
        "Qwen3MoeForCausalLM",
        dict(seed=62, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=96, norm_topk_prob=True),
    ),
    "olmoe": (
        "OlmoeForCausalLM",
        dict(seed=63, num_experts=8, num_experts_per_tok=2, intermediate_size=96, norm_topk_prob=False),
    ),
    # sinks, biases, alternating windows of 16, YaRN (truncated correction dims: llama.cpp's, which a GGUF gets)
    "gpt-oss": (
        "GptOssForCausalLM",
        dict(
            seed=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=96,
            sliding_window=16,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=True,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}
# The quantized layout each file is written in: llama.cpp's Q4_K_M, or gpt-oss's release (MXFP4 experts, Q8_0 else)
LAYOUT = {"gpt-oss": "MXFP4_MOE"}
ENGINE: dict[str, Any] = dict(
    engine_client="inproc", num_threads=2, max_model_len=256, kv_cache_memory_bytes="16MiB", dtype="float32"
)
N = 16
MEAN_NOISE = 0.1  # nat
NEAR_TIE = 0.25  # nat


@pytest.fixture(scope="module", params=list(CASES))
def folder(request: pytest.FixtureRequest, tiny_model_dir: Any) -> tuple[str, str]:
    hf_arch, kwargs = CASES[request.param]
    return request.param, make_tiny_model(tiny_model_dir, hf_arch, **SHAPE, **kwargs)


def _experts(llm: LLM) -> list[MoEMLP]:
    model = llm.engine_core.engine_core.executor.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def test_f32_gguf_matches_hf(folder: tuple[str, str], tmp_path: Any) -> None:
    arch, path_hf = folder
    path = str(tmp_path / f"tiny-{arch}-moe-f32.gguf")
    assert set(write_gguf(path_hf, path, "F32").values()) == {0}
    prompts = random_prompts([40, 90], seed=7)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    with LLM(path, tokenizer=path_hf, kv_cache_dtype="float32", **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        config = llm.engine_core.engine_core.executor.worker.model_runner.model.config
        experts = _experts(llm)
    assert config.architectures == [CASES[arch][0]]
    assert len(experts) == 3 and all(e.native is not None and not e.quantized for e in experts)
    for p, o, ref in zip(prompts, outs, hf_greedy(path_hf, prompts, N), strict=True):
        assert list(o.outputs[0].token_ids) == ref, f"prompt of {len(p)} tokens"


def test_quantized_experts_as_stored_agree_with_hf_on_dequantized(folder: tuple[str, str], tmp_path: Any) -> None:
    arch, path_hf = folder
    layout = LAYOUT.get(arch, "Q4_K_M")
    path = str(tmp_path / f"tiny-{arch}-moe-{layout}.gguf")
    types = write_gguf(path_hf, path, layout)
    exps = {t for name, t in types.items() if "_exps" in name}
    if layout == "Q4_K_M":  # K types for gate/up (256 wide rows), legacy ones for the 96-wide down
        assert len(exps) >= 2, types
    else:
        assert exps == {MXFP4}, types
    ids = random_prompts([150], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    # A float32 KV cache: the weights as stored are what is checked. With the GGUF default (bf16), the cache's
    # rounding alone moved this tiny model's log-probabilities by 0.06 nat on average on builds with float32 panels
    # (AVX2, AVX-512 without BF16), one swapped top 0.48 nat from a tie; with a float32 cache they give HF's exactly.
    with LLM(path, tokenizer=path_hf, kv_cache_dtype="float32", **ENGINE) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        experts = _experts(llm)
    assert len(experts) == 3 and all(e.quantized for e in experts), "the experts do not run as stored"
    hf = copy.deepcopy(load_hf_model(path_hf))
    check_against_dequantized(out, ids, hf, path, arch, f"tiny {arch} MoE {layout}", MEAN_NOISE, NEAR_TIE)
