"""A synthetic model of a real model's shapes, quantized by llama.cpp's own quantizer: for batch-1 speed at the sizes
users run on a CPU, where no such checkpoint can be had here (no model hub).

    python bench/peers/synthetic_gguf.py [--shape llama-3.2-3b] [--ftype Q4_K_M] [--out FILE]

1. writes an F16 GGUF (llama architecture) of the shape with random weights (N(0, 0.02), norms 1), and the
   tokenizer of the packaged Qwen2.5-Coder-0.5B GGUF (a real BPE vocabulary of 151,936 tokens, so both engines load
   it; Llama-3.2-3B's own has 128,256);
2. quantizes it with llama.cpp's `llama_model_quantize` (llama-cpp-python in the peer virtualenv,
   setup_llamacpp.sh) to the type mix llama-quantize gives that ftype, then deletes the F16 file.
Prints the output path. Decode speed does not depend on the weights' values, only on their types and shapes. Never
part of `make test`: the F16 file of a 3B model is 6.6 GB and the quantization takes minutes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SHAPES = {
    # Llama-3.2-3B: 28 layers, hidden 3072, 24 query heads over 8 KV heads of 128, intermediate 8192, tied head.
    "llama-3.2-3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, inter=8192, tied=True),
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 over 8 heads of 64, intermediate 8192, tied head.
    "llama-3.2-1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, tied=True),
    # OLMoE-1B-7B (olmoe): 16 layers, hidden 2048, 16 heads of 128 (no GQA), q/k norms over the whole projection,
    # 64 experts of 1024, 8 per token, untied head. (Its own vocabulary has 50,304 tokens; this one has 151,936.)
    "olmoe-1b-7b": dict(
        arch="olmoe",
        layers=16,
        hidden=2048,
        heads=16,
        kv_heads=16,
        head_dim=128,
        inter=1024,
        tied=False,
        experts=64,
        used=8,
        qk_norm="full",
    ),
    # Qwen3-30B-A3B (qwen3moe): 48 layers, hidden 2048, 32 query heads over 4 KV heads of 128, per-head q/k norms,
    # 128 experts of 768, 8 per token, untied head.
    "qwen3-30b-a3b": dict(
        arch="qwen3moe",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        inter=768,
        tied=False,
        experts=128,
        used=8,
        qk_norm="head",
    ),
}
# gpt-oss-20b (gpt-oss): 24 layers, hidden 2880, 64 query heads over 8 KV heads of 64, q/k/v/o biases, sinks,
# alternating 128-token windows, YaRN (32 over 4096), 32 experts of 2880, 4 a token, untied head. Written directly
# in its release's types (experts MXFP4, every other matrix Q8_0; --ftype MXFP4_MOE): its F16 source (~40 GB) does
# not fit this machine's disk, and decode speed does not depend on the values, only on the types and shapes.
SHAPES["gpt-oss-20b"] = dict(
    arch="gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, inter=2880, tied=False,
    experts=32, used=4, window=128,
)  # fmt: skip
FTYPES = {"MXFP4_MOE": 38, "Q4_K_M": 15, "Q5_K_M": 17, "Q8_0": 7, "Q4_0": 2, "Q3_K_M": 12, "IQ4_XS": 30}


def _tokenizer_source() -> Any:
    """The packaged Qwen2.5-Coder GGUF, whose tokenizer (a real BPE vocabulary both engines load) the models take:
    every item parsed (open_gguf skips over the vocabulary's arrays)."""
    from pagedllm.model.gguf_file import reader_classes
    from pagedllm.model.packaged import packaged_model

    return reader_classes()[1](packaged_model("qwen2.5-coder-0.5b-q4_k_m"))


def _copy_tokenizer(w: Any, source: Any) -> None:
    """The source file's tokenizer metadata into writer `w`."""
    w.add_tokenizer_model(source.fields["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(source.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(source.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    for key in ("bos", "eos", "padding"):
        field = source.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(field.contents()))


def write_f16(path: str, shape: dict, seed: int = 0) -> None:
    import gguf

    source = _tokenizer_source()
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    arch = shape.get("arch", "llama")
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"synthetic {os.path.basename(path)}")
    w.add_block_count(shape["layers"])
    w.add_context_length(8192)
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["inter"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_rope_dimension_count(shape["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0 if arch == "llama" else 10000.0)
    if shape.get("experts"):
        w.add_expert_count(shape["experts"])
        w.add_expert_used_count(shape["used"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(shape["inter"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(w, source)
    rng = np.random.default_rng(seed)

    def matrix(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    h, d, inter, experts = shape["hidden"], shape["head_dim"], shape["inter"], shape.get("experts", 0)
    # (name, numpy shape, maker): declared first, then written one at a time (a MoE model's F16 experts are ~13 GB)
    ones = lambda n: lambda: np.ones(n, dtype=np.float32)  # noqa: E731
    tensors: list[tuple[str, tuple[int, ...], Any]] = [("token_embd.weight", (vocab, h), lambda: matrix(vocab, h))]
    tensors.append(("output_norm.weight", (h,), ones(h)))
    if not shape["tied"]:
        tensors.append(("output.weight", (vocab, h), lambda: matrix(vocab, h)))
    q_out, kv_out = shape["heads"] * d, shape["kv_heads"] * d
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (h,), ones(h)), (b + "ffn_norm.weight", (h,), ones(h))]
        if shape.get("qk_norm"):
            full = shape["qk_norm"] == "full"
            tensors.append((b + "attn_q_norm.weight", (q_out if full else d,), ones(q_out if full else d)))
            tensors.append((b + "attn_k_norm.weight", (kv_out if full else d,), ones(kv_out if full else d)))
        for name, dims in (("attn_q", (q_out, h)), ("attn_k", (kv_out, h)), ("attn_v", (kv_out, h))):
            tensors.append((b + name + ".weight", dims, lambda dims=dims: matrix(*dims)))
        tensors.append((b + "attn_output.weight", (h, q_out), lambda: matrix(h, q_out)))
        if experts:
            router = lambda: rng.standard_normal((experts, h), dtype=np.float32) * 0.02  # noqa: E731
            tensors.append((b + "ffn_gate_inp.weight", (experts, h), router))
            for name, dims in (
                ("gate", (experts, inter, h)),
                ("up", (experts, inter, h)),
                ("down", (experts, h, inter)),
            ):
                tensors.append((b + f"ffn_{name}_exps.weight", dims, lambda dims=dims: matrix(*dims)))
            continue
        for name, dims in (("ffn_gate", (inter, h)), ("ffn_up", (inter, h)), ("ffn_down", (h, inter))):
            tensors.append((b + name + ".weight", dims, lambda dims=dims: matrix(*dims)))
    for name, dims, _ in tensors:
        dtype = np.float32 if len(dims) == 1 or name.endswith("ffn_gate_inp.weight") else np.float16
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()


def write_gpt_oss_direct(path: str, shape: dict, seed: int = 0) -> None:
    """A gpt-oss GGUF of the shape in its release's types, random blocks written as stored: MXFP4 experts (E8M0
    scales 2^-8 .. 2^-5, random nibbles), Q8_0 for the other matrices (float16 scales ~1e-3, random int8), float32
    norms, biases, sinks and router, with the metadata llama.cpp's gpt-oss graph reads."""
    import gguf

    source = _tokenizer_source()
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    h, d, inter, experts = shape["hidden"], shape["head_dim"], shape["inter"], shape["experts"]
    q_out, kv_out = shape["heads"] * d, shape["kv_heads"] * d
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name(f"synthetic {os.path.basename(path)}")
    w.add_block_count(shape["layers"])
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_expert_feed_forward_length(inter)
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(shape["window"])
    w.add_expert_count(experts)
    w.add_expert_used_count(shape["used"])
    w.add_vocab_size(vocab)
    w.add_file_type(38)  # MOSTLY_MXFP4_MOE
    _copy_tokenizer(w, source)
    rng = np.random.default_rng(seed)
    Q8, MX = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4

    def q8(*dims: int) -> np.ndarray:  # [..., cols / 32 * 34]: a float16 scale, then 32 int8
        blocks = rng.integers(-127, 128, size=(*dims[:-1], dims[-1] // 32, 34), dtype=np.int8).view(np.uint8)
        blocks[..., :2] = np.full(blocks.shape[:-1], 1e-3, np.float16).view(np.uint8).reshape(*blocks.shape[:-1], 2)
        return blocks.reshape(*dims[:-1], -1)

    def mx(*dims: int) -> np.ndarray:  # [..., cols / 32 * 17]: an E8M0 scale, then 16 bytes of nibbles
        blocks = rng.integers(0, 256, size=(*dims[:-1], dims[-1] // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(119, 123, size=blocks.shape[:-1], dtype=np.uint8)
        return blocks.reshape(*dims[:-1], -1)

    def f32(*dims: int, scale: float = 0.02) -> Any:
        return lambda: (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32)

    ones = lambda n: lambda: np.ones(n, dtype=np.float32)  # noqa: E731
    # (name, byte or element shape, dtype, GGML type or None, maker)
    tensors: list[tuple[str, tuple[int, ...], Any, Any, Any]] = []

    def add(name: str, dims: tuple[int, ...], qtype: Any, make: Any) -> None:
        if qtype is None:
            tensors.append((name, dims, np.float32, None, make))
        else:
            per = 34 if qtype == Q8 else 17
            tensors.append((name, (*dims[:-1], dims[-1] // 32 * per), np.uint8, qtype, make))

    add("token_embd.weight", (vocab, h), Q8, lambda: q8(vocab, h))
    add("output_norm.weight", (h,), None, ones(h))
    add("output.weight", (vocab, h), Q8, lambda: q8(vocab, h))
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (h,), None, ones(h))
        add(b + "post_attention_norm.weight", (h,), None, ones(h))
        for name, rows, cols in (
            ("attn_q", q_out, h),
            ("attn_k", kv_out, h),
            ("attn_v", kv_out, h),
            ("attn_output", h, q_out),
        ):
            add(b + name + ".weight", (rows, cols), Q8, lambda rows=rows, cols=cols: q8(rows, cols))
            add(b + name + ".bias", (rows,), None, f32(rows))
        add(b + "attn_sinks.weight", (shape["heads"],), None, f32(shape["heads"], scale=1.0))
        add(b + "ffn_gate_inp.weight", (experts, h), None, f32(experts, h))
        add(b + "ffn_gate_inp.bias", (experts,), None, f32(experts))
        for name, rows, cols in (("gate", inter, h), ("up", inter, h), ("down", h, inter)):
            add(b + f"ffn_{name}_exps.weight", (experts, rows, cols), MX, lambda r=rows, c=cols: mx(experts, r, c))
            add(b + f"ffn_{name}_exps.bias", (experts, rows), None, f32(experts, rows))
    for name, dims, dtype, qtype, _ in tensors:
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, dims, np.dtype(dtype), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, _, _, make in tensors:
        w.write_tensor_data(make())
    w.close()


_QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-3b", choices=sorted(SHAPES))
    parser.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    parser.add_argument("--out", default=None, help="default: $PAGEDLLM_CACHE_DIR/models/synthetic-SHAPE-FTYPE.gguf")
    args = parser.parse_args(argv)
    from pagedllm.config import cache_dir

    out = args.out or os.path.join(cache_dir(), "models", f"synthetic-{args.shape}-{args.ftype.lower()}.gguf")
    if os.path.isfile(out):
        print(out)
        return 0
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if SHAPES[args.shape].get("arch") == "gpt-oss":
        if args.ftype != "MXFP4_MOE":
            parser.error("gpt-oss shapes are written directly as its release stores them: --ftype MXFP4_MOE")
        print(f"writing {args.shape} in MXFP4 / Q8_0 ...", file=sys.stderr, flush=True)
        write_gpt_oss_direct(out + ".tmp", SHAPES[args.shape])
        os.replace(out + ".tmp", out)
        print(out)
        return 0
    f16 = out + ".f16.tmp"
    print(f"writing the F16 model of {args.shape} ...", file=sys.stderr, flush=True)
    write_f16(f16, SHAPES[args.shape])
    subprocess.run([str(HERE / "setup_llamacpp.sh")], check=True)
    venv = Path(os.environ.get("LLAMACPP_VENV", HERE.parents[1] / ".venv-llamacpp"))
    print(f"quantizing to {args.ftype} with llama.cpp ...", file=sys.stderr, flush=True)
    tmp = out + ".tmp"
    subprocess.run([str(venv / "bin" / "python"), "-c", _QUANTIZE, f16, tmp, str(FTYPES[args.ftype])], check=True)
    os.replace(tmp, out)
    os.unlink(f16)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
