"""`dtype="bfloat16"` on the native CPU kernels: the default model's weights (de-quantized from its GGUF, as an HF
folder's float weights would be) held in bf16 panels, products in bf16 (in hardware where the CPU has AVX512-BF16,
widened to float32 elsewhere), float32 sums and activations, the KV cache in bf16 (kv_cache_dtype auto follows
--dtype); against the same weights in float32.

* Teacher forcing over a fixed text: the top-1 token agrees at >= 98% of the positions, perplexity within 2%.
* Greedy decoding, one request and several: the tokens are float32's top-1 at >= 95% of the positions.
* One bf16 copy of each weight: every linear layer and the LM head on bf16 panels, the tied embedding reading its
  rows from the LM head's; weight bytes <= 55% of the float32 model's 4 bytes a parameter.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import default_model_path
from pagedllm.model.gguf_file import open_gguf
from pagedllm.model.loader import weight_bytes
from tests.engine.test_quantized import PROMPTS, _model, _teacher_forced, teacher_forced_against

ENGINE = {"engine_client": "inproc", "kv_cache_memory_bytes": "128MiB", "max_model_len": 1024, "quantization": "none"}


@pytest.fixture(scope="module")
def bf16():
    llm = LLM(dtype="bfloat16", **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def float32():
    llm = LLM(dtype="float32", **ENGINE)
    yield llm
    llm.shutdown()


def test_weights_are_held_once_in_bf16(bf16) -> None:
    from pagedllm.model.layers.linear import LinearBase

    model = _model(bf16)
    runner = bf16.engine_core.engine_core.executor.worker.model_runner
    assert runner.bf16_weights
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.bf16_panels is not None and not m.weight.numel() for m in linears)
    assert runner.decode_runner is not None  # one request decodes on the fused decoder, on the bf16 panels
    assert model.lm_head.bf16_panels is not None
    assert model.model.embed_tokens.bf16_table is model.lm_head.bf16_panels
    assert not model.model.embed_tokens.weight.numel()
    # the KV cache follows --dtype (kv_cache_dtype auto): bf16
    assert model.model.layers[0].self_attn.attn.kv_cache[0].dtype == torch.bfloat16
    ids = torch.tensor([5, 49151, 0])
    params = sum(int(t.n_elements) for t in open_gguf(default_model_path()).tensors)
    assert weight_bytes(model) <= 0.55 * 4 * params, (weight_bytes(model), 4 * params)
    emb = model.model.embed_tokens(ids)
    assert emb.dtype == torch.float32 and emb.shape == (3, model.config.hidden_size)


def test_embedding_rows_are_the_bf16_weights(bf16, float32) -> None:
    ids = torch.tensor([[0, 7], [49151, 31]])
    got = _model(bf16).model.embed_tokens(ids)
    ref = _model(float32).model.embed_tokens(ids)
    assert torch.equal(got, ref.bfloat16().float())


def test_teacher_forced_agreement_and_perplexity(bf16, float32) -> None:
    agreement, ppl_ratio = teacher_forced_against(bf16, float32)
    assert agreement >= 0.98, agreement
    assert abs(ppl_ratio - 1) <= 0.02, ppl_ratio


@pytest.mark.parametrize("batch", [1, 4])
def test_decoding_agrees_with_float32(bf16, float32, batch: int) -> None:
    tok = bf16.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    if batch == 1:
        outs = [bf16.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    else:
        outs = bf16.generate(PROMPTS, params, use_tqdm=False)
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ids = tok.encode(prompt) + tokens
        f_top, _, _ = _teacher_forced(float32, ids)
        start = len(ids) - len(tokens) - 1  # entry i predicts ids[i + 1]
        agree += sum(f_top[start + k] == token for k, token in enumerate(tokens))
        total += len(tokens)
    assert agree / total >= 0.95, agree / total
