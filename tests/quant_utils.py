"""Test helpers: float32 weights -> GGML block-quantized bytes for every type the native kernels run.

Q4_0, Q4_1 and Q8_0 use the `gguf` package's reference quantizers. The `gguf` package has no quantizer for the K
types, so Q4_K, Q5_K and Q6_K are packed here with a plain round-to-nearest rule (simpler than llama.cpp's search for
the best scales, and just as valid a file). The layouts are GGML's (ggml-common.h); what the packing produces is
checked against the `gguf` package's reference de-quantization in tests/model/test_quant_kernels.py.
"""

from __future__ import annotations

import numpy as np

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
TYPES = (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> GGML's 12 packed bytes [n, 12]."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (mn[:, j] & 63) | ((mn[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    return out


def _quantize_k_asym(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5): super-blocks of 256 in 8 sub-blocks of 32, w = d sc q - dmin m."""
    n = x.shape[0]
    top = (1 << bits) - 1
    sub = x.reshape(n, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / top
    d = np.maximum(scale.max(-1), 1e-12) / 63
    dmin = np.maximum((-lo).max(-1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.rint(scale / d16.astype(np.float64)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / dmin16.astype(np.float64)[:, None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float64)[:, None] * sc
    offset = dmin16.astype(np.float64)[:, None] * mn
    q = np.where(step[..., None] > 0, np.rint((sub + offset[..., None]) / np.where(step > 0, step, 1)[..., None]), 0)
    q = np.clip(q, 0, top).astype(np.uint8)  # [n, 8, 32]
    low = q & 0xF
    qs = np.zeros((n, 4, 32), dtype=np.uint8)
    for g in range(4):
        qs[:, g] = low[:, 2 * g] | (low[:, 2 * g + 1] << 4)
    parts = [_f16_bytes(d16).reshape(n, 2), _f16_bytes(dmin16).reshape(n, 2), _pack_scales_k4(sc, mn)]
    if bits == 5:
        qh = np.zeros((n, 32), dtype=np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        parts.append(qh)
    parts.append(qs.reshape(n, 128))
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: super-blocks of 256 in 16 sub-blocks of 16 with int8 scales, w = d sc (q - 32)."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float64)
    scale = np.abs(sub).max(-1) / 31
    d = np.maximum(np.abs(scale).max(-1), 1e-12) / 127
    d16 = d.astype(np.float16)
    sc = np.clip(np.rint(scale / d16.astype(np.float64)[:, None]), -128, 127).astype(np.int8)
    step = d16.astype(np.float64)[:, None] * sc
    q = np.where(step[..., None] != 0, np.rint(sub / np.where(step != 0, step, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for h in range(2):
        v = q[:, h]
        ql[:, h, :32] = (v[:, 0:32] & 0xF) | ((v[:, 64:96] & 0xF) << 4)
        ql[:, h, 32:] = (v[:, 32:64] & 0xF) | ((v[:, 96:128] & 0xF) << 4)
        high = [v[:, 32 * k : 32 * k + 32] >> 4 for k in range(4)]
        qh[:, h] = high[0] | (high[1] << 2) | (high[2] << 4) | (high[3] << 6)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d16).reshape(n, 2)], axis=1
    )


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes] in GGML type `qtype` (cols a whole number of blocks)."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype in (Q4_0, Q4_1, Q8_0):
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    rows, cols = w.shape
    if cols % 256:
        raise ValueError(f"K types need rows of a multiple of 256 weights, got {cols}")
    blocks = w.reshape(rows * cols // 256, 256)
    if qtype == Q6_K:
        out = _quantize_q6_k(blocks)
    elif qtype in (Q4_K, Q5_K):
        out = _quantize_k_asym(blocks, 4 if qtype == Q4_K else 5)
    else:
        raise ValueError(f"no quantizer for GGML type {qtype}")
    return out.reshape(rows, -1)


def dequantize(q: np.ndarray, qtype: int, shape: tuple[int, int]) -> np.ndarray:
    """The `gguf` package's reference de-quantization, as float32 [rows, cols]."""
    import gguf

    return np.asarray(gguf.quants.dequantize(q, gguf.GGMLQuantizationType(qtype)), dtype=np.float32).reshape(shape)
