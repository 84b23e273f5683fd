"""LoRA adapters in llama.cpp's GGUF format (pagedllm/lora/gguf_adapter.py): the same adapter as a PEFT folder and
as a GGUF file gives the same weights and the same tokens.

A PEFT adapter is made on a tiny random Llama (4 heads, 2 kv heads) and written here as convert_lora_to_gguf.py writes
it: general.type "adapter", adapter.type "lora", adapter.lora.alpha, tensors `blk.N.<name>.weight.lora_a` [r, in] and
`.lora_b` [out, r] (numpy order), lora_b of attn_q / attn_k with its rows permuted by the converter's
LlamaModel.permute (attn_k by the kv heads), lora_a as it is. Checked: each module's A and scaled B match the PEFT
loader's (F32 to 1e-6; F16, BF16 and Q8_0 within their rounding), a rank pattern scales each pair by its own rank,
no un-permutation for an architecture llama.cpp does not permute; served, the GGUF adapter gives PEFT's greedy tokens;
the errors a user meets are ValueErrors naming the problem, and the engine serves on.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.gguf_adapter import load_gguf_adapter
from tests.lora_utils import make_peft_adapter, peft_greedy
from tests.model_utils import make_tiny_model, random_prompts

pytestmark = pytest.mark.timeout(300)
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
ENGINE = dict(kv_cache_memory_bytes="64MiB", max_model_len=512)
ALPHA = 16.0
# HF module (in a layer) -> llama.cpp tensor (in a block)
_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the rows of each head interleaved for llama.cpp's rotary."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(peft_folder: str, heads: int, kv_heads: int, permute: bool = True) -> dict[str, np.ndarray]:
    """The PEFT adapter's A and B (unscaled) under llama.cpp's names, q/k lora_b permuted as the converter does."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for key, t in load_file(os.path.join(peft_folder, "adapter_model.safetensors")).items():
        module, which = key.removeprefix("base_model.model.").removesuffix(".weight").rsplit(".lora_", 1)
        layer, rest = module.removeprefix("model.layers.").split(".", 1)
        t = t.astype(np.float32)
        if permute and which == "B" and rest == "self_attn.q_proj":
            t = llama_cpp_permute(t, heads, heads)
        elif permute and which == "B" and rest == "self_attn.k_proj":
            t = llama_cpp_permute(t, heads, kv_heads)
        out[f"blk.{layer}.{_GGUF[rest]}.weight.lora_{which.lower()}"] = t
    return out


def write_lora_gguf(
    path: str,
    tensors: dict[str, np.ndarray],
    kind: str = "F32",
    alpha: float | None = ALPHA,
    arch: str = "llama",
    general_type: str = "adapter",
    adapter_type: str = "lora",
) -> str:
    """A llama.cpp LoRA adapter GGUF of `tensors` stored as `kind` (F32, F16, BF16; Q8_0: lora_a in Q8_0, lora_b in
    F16, as the converter falls back for a row of rank elements, not a whole 32-weight block)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, arch)
    w.add_type(general_type)
    w.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if alpha is not None:
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, t in tensors.items():
        qtype = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}.get(kind, Q.F16)
        if kind == "Q8_0" and name.endswith(".lora_a"):
            qtype = Q.Q8_0
        if qtype == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t, dtype=np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def base(tiny_model_dir) -> str:
    return make_tiny_model(tiny_model_dir, "LlamaForCausalLM", num_hidden_layers=2)


@pytest.fixture(scope="module")
def hf_config(base):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    assert config.num_attention_heads != config.num_key_value_heads  # k's permutation by the kv heads is tested
    return config


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-gguf")


@pytest.fixture(scope="module")
def peft(base, root) -> str:
    return make_peft_adapter(base, root / "peft", seed=41, rank=8, alpha=ALPHA)


@pytest.fixture(scope="module")
def tensors(peft, hf_config) -> dict[str, np.ndarray]:
    return gguf_tensors(peft, hf_config.num_attention_heads, hf_config.num_key_value_heads)


@pytest.fixture(scope="module")
def gguf_f32(root, tensors) -> str:
    return write_lora_gguf(str(root / "adapter-f32.gguf"), tensors, "F32")


@pytest.fixture(scope="module")
def gguf_f16(root, tensors) -> str:
    return write_lora_gguf(str(root / "adapter-f16.gguf"), tensors, "F16")


def _compare(got, want, a_tol: tuple[float, float], b_tol: tuple[float, float]) -> None:
    assert sorted(got.modules) == sorted(want.modules)
    assert len(got.modules) == 2 * len(_GGUF)
    assert got.rank == want.rank
    for module, m in want.modules.items():
        g = got.modules[module]
        assert g.a.dtype == g.b.dtype == torch.float32
        rtol, atol = a_tol
        torch.testing.assert_close(g.a, m.a, rtol=rtol, atol=atol * float(m.a.abs().max()), msg=f"{module} A")
        rtol, atol = b_tol
        torch.testing.assert_close(g.b, m.b, rtol=rtol, atol=atol * float(m.b.abs().max()), msg=f"{module} B")


@pytest.mark.parametrize(
    "kind, a_tol, b_tol",
    [
        ("F32", (1e-6, 1e-7), (1e-6, 1e-7)),
        ("F16", (1e-3, 1e-5), (1e-3, 1e-5)),
        ("BF16", (8e-3, 1e-4), (8e-3, 1e-4)),
        ("Q8_0", (0.0, 1 / 127), (1e-3, 1e-5)),  # Q8_0: within half a step of the block's scale (amax / 127)
    ],
)
def test_the_gguf_adapter_has_the_peft_adapters_weights(peft, tensors, hf_config, root, kind, a_tol, b_tol) -> None:
    path = write_lora_gguf(str(root / f"weights-{kind}.gguf"), tensors, kind)
    want = load_adapter(peft, "p", 1, 16)
    got = load_gguf_adapter(path, "g", 2, 16, hf_config=hf_config)
    assert (got.name, got.lora_id, got.path, got.rank) == ("g", 2, path, 8)
    _compare(got, want, a_tol, b_tol)


def test_a_rank_pattern_scales_each_pair_by_its_own_rank(base, root, hf_config) -> None:
    """llama.cpp's scale is alpha / (the pair's rank), as PEFT's for a rank pattern without an alpha pattern; the
    adapter's rank is the largest."""
    peft = make_peft_adapter(base, root / "pattern", seed=42, rank=4, alpha=ALPHA, rank_pattern={"down_proj": 12})
    t = gguf_tensors(peft, hf_config.num_attention_heads, hf_config.num_key_value_heads)
    got = load_gguf_adapter(write_lora_gguf(str(root / "pattern.gguf"), t), "g", 1, 16, hf_config=hf_config)
    want = load_adapter(peft, "p", 2, 16)
    assert got.rank == want.rank == 12
    assert got.modules["model.layers.1.mlp.down_proj"].rank == 12
    _compare(got, want, (1e-6, 1e-7), (1e-6, 1e-7))


def test_without_alpha_the_scale_is_one(root, tensors, hf_config) -> None:
    """llama.cpp: `alpha ? alpha / rank : 1` (a missing alpha reads as 0)."""
    with_alpha = load_gguf_adapter(write_lora_gguf(str(root / "a.gguf"), tensors), "a", 1, 16, hf_config=hf_config)
    for alpha in (None, 0.0):
        path = write_lora_gguf(str(root / f"no-alpha-{alpha}.gguf"), tensors, alpha=alpha)
        got = load_gguf_adapter(path, "n", 2, 16, hf_config=hf_config)
        for module, m in with_alpha.modules.items():
            torch.testing.assert_close(got.modules[module].b * (ALPHA / 8), m.b, rtol=1e-6, atol=0)


def test_rows_are_unpermuted_only_for_the_architectures_llama_cpp_permutes(peft, root, hf_config) -> None:
    """An adapter of an architecture whose converter keeps HF's rows (qwen2) is read as stored (no head counts
    needed); a llama one needs them."""
    plain = gguf_tensors(peft, hf_config.num_attention_heads, hf_config.num_key_value_heads, permute=False)
    got = load_gguf_adapter(write_lora_gguf(str(root / "qwen2.gguf"), plain, arch="qwen2"), "q", 1, 16)
    _compare(got, load_adapter(peft, "p", 2, 16), (1e-6, 1e-7), (1e-6, 1e-7))
    llama = write_lora_gguf(str(root / "llama-plain.gguf"), plain)
    with pytest.raises(ValueError, match="needs the base model's head counts"):
        load_gguf_adapter(llama, "l", 3, 16)


def test_norm_weights_are_skipped_as_llama_cpp_skips_them(peft, tensors, hf_config, root) -> None:
    """mergekit-extract-lora adds norm weights to an adapter; llama.cpp ignores them (with a warning here)."""
    norms = {**tensors, "blk.0.attn_norm.weight": np.ones(64), "output_norm.weight": np.ones(64)}
    got = load_gguf_adapter(write_lora_gguf(str(root / "norms.gguf"), norms), "n", 1, 16, hf_config=hf_config)
    _compare(got, load_adapter(peft, "p", 2, 16), (1e-6, 1e-7), (1e-6, 1e-7))


# ---- served ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(base):
    engine = LLM(base, enable_lora=True, max_lora_rank=16, engine_client="inproc", **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts([5, 20], seed=43)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_served_gguf_adapter_gives_peft_tokens(llm, base, peft, gguf_f32, gguf_f16, prompts) -> None:
    reference = peft_greedy(base, peft, prompts, NEW)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) != reference, "the adapter must change tokens"
    from_peft = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("p", 2, peft)))
    from_gguf = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("g", 1, gguf_f32)))
    assert from_gguf == from_peft == reference
    half = LoRARequest("g16", 3, gguf_f16)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=half)) == reference


def test_errors_are_clear_and_leave_the_engine_serving(llm, base, peft, tensors, gguf_f32, prompts, root) -> None:
    def refused(lora_id: int, path: str, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{lora_id}", lora_id, path))

    def gguf(file: str, ts: dict[str, np.ndarray] = tensors, **kw) -> str:
        return write_lora_gguf(str(root / file), ts, **kw)

    refused(50, gguf("model.gguf", general_type="model"), "not an adapter GGUF .*general.type is 'model'")
    refused(51, gguf("cvec.gguf", adapter_type="control_vector"), "not a LoRA adapter .*'control_vector'")
    half = {k: v for k, v in tensors.items() if k != "blk.1.attn_v.weight.lora_b"}
    refused(52, gguf("half.gguf", half), "'blk.1.attn_v.weight' has lora_a only")
    rng = np.random.default_rng(0)
    big = {
        "blk.0.attn_q.weight.lora_a": rng.standard_normal((32, 64)),
        "blk.0.attn_q.weight.lora_b": np.zeros((64, 32)),
    }
    refused(53, gguf("r32.gguf", big), r"rank 32 of 'model.layers.0.self_attn.q_proj' is above --max-lora-rank 16")
    for i, target in enumerate(("token_embd", "output")):
        extra = {f"{target}.weight.lora_a": np.zeros((8, 64)), f"{target}.weight.lora_b": np.zeros((256, 8))}
        refused(54 + i, gguf(f"{target}.gguf", {**tensors, **extra}), "embedding/head adapters are not supported")
    stray = {**tensors, "blk.0.attn_q.weight": np.zeros((64, 64))}
    refused(57, gguf("stray.gguf", stray), "'blk.0.attn_q.weight' is not a LoRA lora_a/lora_b weight")
    not_gguf = root / "garbage.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    refused(56, str(not_gguf), "not a readable GGUF file")
    # The engine serves on.
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("g", 1, gguf_f32)))
    assert got == peft_greedy(base, peft, prompts, NEW)
    assert llm.check_invariants()["in_use"] == 0
