"""GGUF files of the architectures beyond Llama's layout: llama.cpp's `granite` (four multipliers), `olmo2` (post
norms, q/k norms over the whole projection), `smollm3` (every fourth layer without rope, fixed by llama.cpp rather
than stored), `stablelm` (LayerNorm with biases, q/k/v biases, partial rotary), `starcoder2` (biases, GELU MLP
without a gate, tied head), `phi2` (parallel attention and MLP, partial rotary, a head with a bias) and `phi3` (fused
attn_qkv and ffn_up, LongRoPE factors as tensors, partial rotary). A tiny random HF model of each is written by the
tests' GGUF writer (tests/gguf_utils.py: gguf-py's tensor names, the metadata keys convert_hf_to_gguf.py writes, q/k
rows permuted where the converter permutes them), then:
  - in F32 (with a float32 KV cache: a GGUF's default is bfloat16): pagedllm's greedy tokens identical to HF
    transformers running the original folder, so every metadata key and tensor name is read as the converter meant;
  - in llama.cpp's Q4_K_M layout, run as stored (bfloat16 KV cache): against HF transformers running the file's
    de-quantized weights (loaded into the folder's HF model), teacher-forced over a prompt of 150 tokens, the
    log-probabilities of the prompt's tokens within MEAN_NOISE on average (a wrong tensor or key is off by nats),
    top-1 agreement >= 0.9 and every disagreement a near-tie of HF's own top two (within NEAR_TIE): these untrained
    models' logits have such near-ties at a few percent of the positions, which the activations' rounding swaps.
Phi-3's original context is 32 of 512: the engine's 256 tokens take the long factors, as transformers does for the
prompts here (all longer than 32).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagedllm import LLM, SamplingParams
from tests.gguf_utils import check_against_dequantized, write_gguf
from tests.model_utils import PHI3_LONGROPE_32, hf_greedy, load_hf_model, make_tiny_model, random_prompts

# GGUF architecture -> (HF architecture, make_tiny_model kwargs)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "granite": (
        "GraniteForCausalLM",
        dict(
            seed=41,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=0.5,
        ),
    ),
    "olmo2": ("Olmo2ForCausalLM", dict(seed=42)),
    "smollm3": ("SmolLM3ForCausalLM", dict(seed=43, num_hidden_layers=4)),  # layer 3 without rope
    "stablelm": ("StableLmForCausalLM", dict(seed=44, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "starcoder2": ("Starcoder2ForCausalLM", dict(seed=45, tie_word_embeddings=True, sliding_window=None)),
    "phi2": ("PhiForCausalLM", dict(seed=46, partial_rotary_factor=0.5, intermediate_size=256)),  # 4 * hidden
    "phi3": ("Phi3ForCausalLM", dict(seed=47, **PHI3_LONGROPE_32)),
}
# GGUF architecture -> config fields its file must give (beyond what the greedy tokens check)
EXPECTED: dict[str, dict[str, Any]] = {
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=0.5),
    "smollm3": dict(no_rope_layers=[1, 1, 1, 0]),
    "stablelm": dict(partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=False),
    "starcoder2": dict(use_bias=True, tie_word_embeddings=True),
    "phi2": dict(partial_rotary_factor=0.5),
    "phi3": dict(partial_rotary_factor=0.5),
}
ENGINE: dict[str, Any] = dict(
    engine_client="inproc", num_threads=1, max_model_len=256, kv_cache_memory_bytes="16MiB", dtype="float32"
)
N = 16
MEAN_NOISE = 0.1  # nat; measured 0.006-0.04
NEAR_TIE = 0.25  # nat; the swapped tops measured within 0.15


@pytest.fixture(scope="module", params=list(CASES))
def folder(request: pytest.FixtureRequest, tiny_model_dir: Any) -> tuple[str, str]:
    hf_arch, kwargs = CASES[request.param]
    return request.param, make_tiny_model(tiny_model_dir, hf_arch, **kwargs)


def test_f32_gguf_matches_hf(folder: tuple[str, str], tmp_path: Any) -> None:
    arch, path_hf = folder
    path = str(tmp_path / f"tiny-{arch}-f32.gguf")
    types = write_gguf(path_hf, path, "F32")
    assert set(types.values()) == {0}
    prompts = random_prompts([40, 90], seed=7)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    with LLM(path, tokenizer=path_hf, kv_cache_dtype="float32", **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        config = llm.engine_core.engine_core.executor.worker.model_runner.model.config
    assert config.architectures == [CASES[arch][0]] and config.model_type == arch
    assert {k: getattr(config, k) for k in EXPECTED.get(arch, {})} == EXPECTED.get(arch, {})
    if arch == "granite":
        assert config.attention_multiplier == pytest.approx(0.1)
    if arch == "phi3":  # the factor tensors and the original context, as LongRoPE
        rope = config.rope_parameters
        assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 32
        assert rope["long_factor"] == pytest.approx(CASES["phi3"][1]["rope_scaling"]["long_factor"])
    for p, o, ref in zip(prompts, outs, hf_greedy(path_hf, prompts, N), strict=True):
        assert list(o.outputs[0].token_ids) == ref, f"prompt of {len(p)} tokens"


def test_q4_k_m_as_stored_agrees_with_hf_on_dequantized(folder: tuple[str, str], tmp_path: Any) -> None:
    arch, path_hf = folder
    path = str(tmp_path / f"tiny-{arch}-q4_k_m.gguf")
    types = write_gguf(path_hf, path, "Q4_K_M")
    assert len(set(types.values())) >= 2, types  # a mix of types, as a real Q4_K_M holds
    ids = random_prompts([150], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with LLM(path, tokenizer=path_hf, **ENGINE) as llm:  # a GGUF runs as stored by default
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        model = llm.engine_core.engine_core.executor.worker.model_runner.model
        stored = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
    assert len(stored) >= 4 * CASES[arch][1].get("num_hidden_layers", 3), "the matrices do not run as stored"
    hf = copy.deepcopy(load_hf_model(path_hf))
    check_against_dequantized(out, ids, hf, path, arch, f"tiny {arch} Q4_K_M", MEAN_NOISE, NEAR_TIE)
