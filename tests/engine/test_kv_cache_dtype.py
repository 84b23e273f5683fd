"""`kv_cache_dtype="bfloat16"` (--kv-cache-dtype): the KV cache in bf16, against float32, on the default model run
as the user runs it (its GGUF as stored, where bf16 is also what "auto" gives).

* The cache holds bf16 elements: half the bytes a block, so the same budget buys twice the blocks.
* Teacher forcing over a fixed text (the prompt's keys and values are read back from the cache): the top-1 token
  agrees with the float32 cache at >= 98% of the positions, perplexity within 1%.
* Greedy decoding, one request (the fused one-token decoder) and several (the layer-by-layer path): the tokens are
  the float32 cache's top-1 at >= 95% of the positions.
* The torch attention backend (the reference path) reads a bf16 cache too, and agrees with the native one.
* "auto" follows --dtype, but is bf16 for a GGUF run as stored; a dtype without a cache is refused naming the
  argument.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from tests.engine.test_quantized import PROMPTS, _model, _teacher_forced, teacher_forced_against

ENGINE = {"engine_client": "inproc", "kv_cache_memory_bytes": "64MiB", "max_model_len": 1024}


@pytest.fixture(scope="module")
def bf16_kv():
    llm = LLM(kv_cache_dtype="bfloat16", **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def f32_kv():
    llm = LLM(kv_cache_dtype="float32", **ENGINE)
    yield llm
    llm.shutdown()


def _runner(llm: LLM):
    return llm.engine_core.engine_core.executor.worker.model_runner


def test_cache_is_bf16_with_twice_the_blocks(bf16_kv, f32_kv) -> None:
    for llm, dtype in ((bf16_kv, torch.bfloat16), (f32_kv, torch.float32)):
        layers = _model(llm).model.layers
        assert all(layer.self_attn.attn.kv_cache[0].dtype == dtype for layer in layers)
        assert all(layer.self_attn.attn.kv_cache[1].dtype == dtype for layer in layers)
    assert 2 * _runner(bf16_kv).kv_cache_bytes_per_block() == _runner(f32_kv).kv_cache_bytes_per_block()
    b_blocks = _model(bf16_kv).model.layers[0].self_attn.attn.kv_cache[0].shape[0]
    f_blocks = _model(f32_kv).model.layers[0].self_attn.attn.kv_cache[0].shape[0]
    assert b_blocks == 2 * f_blocks


def test_teacher_forced_agreement_and_perplexity(bf16_kv, f32_kv) -> None:
    agreement, ppl_ratio = teacher_forced_against(bf16_kv, f32_kv)
    assert agreement >= 0.98, agreement
    assert abs(ppl_ratio - 1) <= 0.01, ppl_ratio


def _greedy_agreement(llm: LLM, ref: LLM, outs) -> float:
    tok = llm.get_tokenizer()
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ids = tok.encode(prompt) + tokens
        top, _, _ = _teacher_forced(ref, ids)
        start = len(ids) - len(tokens) - 1  # entry i predicts ids[i + 1]
        agree += sum(top[start + k] == token for k, token in enumerate(tokens))
        total += len(tokens)
    return agree / total


@pytest.mark.parametrize("batch", [1, 4])
def test_decoding_agrees_with_float32_cache(bf16_kv, f32_kv, batch: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if batch == 1:  # one request at a time: the fused decoder writes and reads the bf16 cache
        assert _runner(bf16_kv).decode_runner is not None
        outs = [bf16_kv.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    else:
        outs = bf16_kv.generate(PROMPTS, params, use_tqdm=False)
    assert _greedy_agreement(bf16_kv, f32_kv, outs) >= 0.95


def test_torch_backend_reads_a_bf16_cache(bf16_kv) -> None:
    llm = LLM(kv_cache_dtype="bfloat16", attention_backend="torch", quantization="none", **ENGINE)
    try:
        assert _runner(llm).attn_backend.name == "torch"
        assert _model(llm).model.layers[0].self_attn.attn.kv_cache[0].dtype == torch.bfloat16
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _greedy_agreement(llm, bf16_kv, outs) >= 0.9  # float32 weights against the GGUF's: close, not equal
    finally:
        llm.shutdown()


def test_auto_follows_dtype_and_bad_dtype_is_refused() -> None:
    config = EngineArgs(dtype="bfloat16").create_engine_config().cache_config
    assert config.cache_dtype == "auto" and config.kv_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineArgs(kv_cache_dtype="bfloat16").create_engine_config().cache_config.kv_dtype(torch.float32) == (
        torch.bfloat16
    )
    # A GGUF as stored: bf16 by default; float32 when asked, and when its weights are de-quantized to float32.
    assert config.kv_dtype(torch.float32, gguf_as_stored=True) == torch.bfloat16
    f32 = EngineArgs(kv_cache_dtype="float32").create_engine_config().cache_config
    assert f32.kv_dtype(torch.float32, gguf_as_stored=True) == torch.float32
    gguf = EngineArgs().create_engine_config()
    assert gguf.model_config.quantization == "gguf"
    assert gguf.cache_config.kv_dtype(torch.float32, gguf_as_stored=True) == torch.bfloat16
    assert EngineArgs(quantization="none").create_engine_config().model_config.quantization is None
    with pytest.raises(ValueError, match="kv_cache_dtype.*fp8"):
        EngineArgs(kv_cache_dtype="fp8").create_engine_config()
