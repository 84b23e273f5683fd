"""Gemma 3, Gemma 2 and Gemma from GGUF files: llama.cpp's `gemma3`, `gemma2` and `gemma` tensor names, their norms
stored as 1 + w, for Gemma 3 five local layers to one global (the window read from the file), each kind with its
rope base, for Gemma 2 one and one and the soft-caps read from the file. A tiny
random model of each (Gemma 3: six layers, a 12-token window) written by the tests' GGUF writer in llama.cpp's Q4_K_M
layout (tests/gguf_utils.py), then run:
  - de-quantized (`quantization="none"`): greedy tokens identical to HF transformers running the same de-quantized
    weights (the file read back by the gguf package, norms less 1, loaded into the HF model of the folder's config),
    on prompts several windows long;
The head (tied embedding) is scaled up as in test_gguf_matrix, for a trained model's confidence.
  - as stored: teacher-forced top-1 agreement with the de-quantized path >= 0.97, and the first greedy token of
    each prompt the de-quantized path's.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_gguf_matrix import _sharpen
from tests.gguf_utils import hf_on_dequantized, write_gguf
from tests.model_utils import make_tiny_model, random_prompts

GEMMA3 = dict(
    seed=31,
    tie_word_embeddings=True,
    num_hidden_layers=6,
    rope_theta=1e6,
    sliding_window=12,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    query_pre_attn_scalar=16,  # llama.cpp's scale for Gemma 3 below 27B: 1 / sqrt(head size)
)
# Gemma 2: local and global layers alternating (as llama.cpp lays out a gemma2 file), soft-caps that matter
GEMMA2 = dict(
    seed=33,
    tie_word_embeddings=True,
    num_hidden_layers=4,
    sliding_window=12,
    layer_types=["sliding_attention", "full_attention"] * 2,
    query_pre_attn_scalar=16,  # llama.cpp's scale below 27B: 1 / sqrt(head size)
    attn_logit_softcapping=10.0,
    final_logit_softcapping=30.0,  # the released models' (a smaller one ties the sharpened head's top logits)
)
# architecture -> (make_tiny_model kwargs, GGUF architecture)
CASES = {
    "Gemma3ForCausalLM": (GEMMA3, "gemma3"),
    "Gemma2ForCausalLM": (GEMMA2, "gemma2"),
    "GemmaForCausalLM": (dict(seed=32, tie_word_embeddings=True), "gemma"),
}
ENGINE = dict(engine_client="inproc", num_threads=1, max_model_len=256, kv_cache_memory_bytes="16MiB")
N = 24


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tiny_model_dir, tmp_path_factory) -> tuple[str, str, str]:
    kwargs, arch = CASES[request.param]
    # the head (the tied embedding) scaled as test_gguf_matrix does: a trained model's confident logits, where a
    # random head leaves near ties that any rounding swaps
    folder = _sharpen(make_tiny_model(tiny_model_dir, request.param, **kwargs))
    path = str(tmp_path_factory.mktemp(arch) / f"tiny-{arch}-q4_k_m.gguf")
    types = write_gguf(folder, path, "Q4_K_M")
    assert len(set(types.values())) >= 2, types  # a mix of types, as a real Q4_K_M holds
    return folder, path, arch


def _hf_on_dequantized(folder: str, path: str, arch: str):
    """The HF model of the folder's config holding the file's de-quantized weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return hf_on_dequantized(hf, path, arch)


def test_dequantized_gguf_matches_hf(model) -> None:
    folder, path, arch = model
    hf = _hf_on_dequantized(folder, path, arch)
    prompts = random_prompts([5, 40, 90], seed=3)
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, min_new_tokens=N)
        expected.append(out[0, len(p) :].tolist())
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    with LLM(path, tokenizer=folder, quantization="none", **ENGINE) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        cfg = llm.engine_core.engine_core.executor.worker.model_runner.model.config
    if arch in ("gemma2", "gemma3"):
        kwargs = GEMMA3 if arch == "gemma3" else GEMMA2
        assert cfg.layer_types == kwargs["layer_types"] and cfg.sliding_window == 12
    if arch == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (10.0, 30.0)
    for p, o, ref in zip(prompts, outs, expected, strict=True):
        assert list(o.outputs[0].token_ids) == ref, f"prompt of {len(p)} tokens"


def test_as_stored_agrees_with_dequantized(model) -> None:
    folder, path, arch = model
    ids = random_prompts([200], seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tops = []
    for kw in ({}, {"quantization": "none"}):
        with LLM(path, tokenizer=folder, **kw, **ENGINE) as llm:
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            firsts = [
                o.outputs[0].token_ids[0]
                for o in llm.generate(
                    [{"prompt_token_ids": p} for p in random_prompts([7, 30, 64], seed=9)], params, use_tqdm=False
                )
            ]
        # each position's entries: the actual token and the top-1 (rank 1; the same entry where they agree)
        tops.append(([next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[1:]], firsts))
    (stored, s_first), (ref, r_first) = tops
    agreement = sum(a == b for a, b in zip(stored, ref, strict=True)) / len(ref)
    print(f"\ntiny {arch} Q4_K_M as stored: teacher-forced top-1 {agreement:.3f}")
    assert agreement >= 0.97
    assert s_first == r_first
