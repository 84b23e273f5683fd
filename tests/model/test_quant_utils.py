"""The test quantizers of tests/quant_utils.py write what llama.cpp's reference quantizers write.

* Round trip: for every type, `dequantize(quantize(w))` (the `gguf` package's reference de-quantization) is within
  what the type can hold of w, on realistic weights (normal with std 0.02, a row with outliers, heavy tails, a row of
  zeros, a zero sub-block; rows that are a whole number of 32-weight blocks but not of 256 for the 32-blocks types),
  and the bytes have the type's shape.
* Signed scales: Q4_0, Q5_0 and IQ4_NL block scales and Q3_K, Q6_K and IQ4_XS sub-block scales are negative in a
  sizeable share of blocks on symmetric data, as in real files (llama.cpp stores the scale of largest magnitude as the
  most negative one); and the extremes real files hold are written (Q6_K's sub-block scale -128 and quants -32 and
  31, Q3_K's -32 and -4 and 3, IQ4's first and last levels).
* One tiny block of each type, worked out by hand from llama.cpp's rules, byte for byte.
* The checks on bad input.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.quant_utils import (
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPES,
    block_size,
    dequantize,
    quantize,
)

NAMES = {t: gguf.GGMLQuantizationType(t).name for t in TYPES}

# Relative RMS error bounds, about 1.3 times the worst measured on _weights over seeds 0-4 (Q8_0 0.008, Q6_K 0.022,
# Q5_1 0.043, Q5_K 0.041, Q5_0 0.063, Q4_K 0.079, Q4_1 0.094, IQ4_XS 0.090, IQ4_NL 0.099, Q4_0 0.119 (the 32-weight
# symmetric types pay most for the outlier and heavy-tailed rows), Q3_K 0.157, Q2_K 0.301).
MAX_REL_RMS = {
    Q8_0: 0.011,
    Q6_K: 0.03,
    Q5_1: 0.06,
    Q5_K: 0.055,
    Q5_0: 0.085,
    Q4_K: 0.1,
    Q4_1: 0.12,
    IQ4_XS: 0.12,
    IQ4_NL: 0.13,
    MXFP4: 0.15,  # measured 0.127: 4-bit E2M1 values under a power-of-two scale
    Q4_0: 0.155,
    Q3_K: 0.2,
    Q2_K: 0.39,
}


def _weights(qtype: int, rows: int = 24, seed: int = 0) -> np.ndarray:
    """Realistic weights; cols a whole number of the type's blocks, and not of 256 for the 32-weight types."""
    rng = np.random.default_rng(seed)
    cols = 768 if block_size(qtype)[0] == 256 else 416
    w = rng.normal(0, 0.02, (rows, cols)).astype(np.float32)
    w[3] = 0  # a row of zeros
    w[5, rng.choice(cols, 6, replace=False)] *= 20  # outliers
    w[7] = (rng.standard_t(3, cols) * 0.01).astype(np.float32)  # heavy tails
    w[9, 32:48] = 0  # a zero sub-block
    return w


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _signed_scales(q: np.ndarray, qtype: int) -> np.ndarray:
    """The signed scales as stored: block d for Q4_0, Q5_0, IQ4_NL; sub-block scales for Q3_K, Q6_K, IQ4_XS."""
    blocks = q.reshape(-1, block_size(qtype)[1])
    if qtype in (Q4_0, Q5_0, IQ4_NL):
        return _f16(blocks[:, :2])
    if qtype == Q6_K:
        return blocks[:, 192:208].view(np.int8).astype(np.int32).ravel()
    if qtype == Q3_K:
        s = blocks[:, 96:108].astype(np.int32)
        low = np.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=1)
        high = np.concatenate([(s[:, 8:] >> (2 * g)) & 3 for g in range(4)], axis=1)
        return ((low | (high << 4)) - 32).ravel()
    assert qtype == IQ4_XS
    h = blocks[:, 2:4].copy().view(np.uint16).astype(np.int32)
    low = np.stack([blocks[:, 4:8] & 0xF, blocks[:, 4:8] >> 4], axis=-1).reshape(-1, 8).astype(np.int32)
    high = (h >> (2 * np.arange(8))) & 3
    return (low | (high << 4)) - 32


def test_block_sizes_are_ggmls() -> None:
    assert len(TYPES) == 13 and len(set(TYPES)) == 13
    for t in TYPES:
        assert block_size(t) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]


@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
def test_round_trip_within_what_the_type_holds(qtype: int) -> None:
    w = _weights(qtype)
    q = quantize(w, qtype)
    weights, nbytes = block_size(qtype)
    assert q.dtype == np.uint8 and q.shape == (w.shape[0], w.shape[1] // weights * nbytes)
    r = dequantize(q, qtype, w.shape)
    assert r.dtype == np.float32 and np.isfinite(r).all()
    assert not r[3].any(), "a row of zeros comes back as zeros"
    if qtype in (Q4_0, Q5_0, Q8_0, Q2_K, Q3_K, Q6_K):
        assert not r[9, 32:48].any(), "zeros (a zero sub-block of 16) come back as zeros"
    rel = np.sqrt(((r - w) ** 2).mean() / (w**2).mean())
    assert rel < MAX_REL_RMS[qtype], f"{NAMES[qtype]}: relative RMS error {rel:.4f}"
    # every row, outliers and heavy tails included, is held about as well
    per_row = np.sqrt(((r - w) ** 2).mean(1) / np.maximum((w**2).mean(1), 1e-30))
    assert per_row[np.arange(len(w)) != 3].max() < 2 * MAX_REL_RMS[qtype]


def test_quantize_is_deterministic_and_row_independent() -> None:
    w = _weights(Q6_K)
    for t in (Q2_K, Q3_K, Q4_K, Q6_K, IQ4_XS):
        full = quantize(w, t)
        np.testing.assert_array_equal(full, quantize(w, t))
        np.testing.assert_array_equal(full[5:9], quantize(w[5:9], t))


@pytest.mark.parametrize("qtype", (Q4_0, Q5_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS), ids=NAMES.get)
def test_signed_scales_are_negative_in_a_sizeable_share(qtype: int) -> None:
    w = np.random.default_rng(1).normal(0, 0.02, (32, 1024)).astype(np.float32)
    scales = _signed_scales(quantize(w, qtype), qtype)
    share = (scales < 0).mean()
    assert 0.2 < share < 0.8, f"{NAMES[qtype]}: {share:.2f} of the scales negative"
    # and the round trip through those negative scales is right
    assert np.sqrt(((dequantize(quantize(w, qtype), qtype, w.shape) - w) ** 2).mean()) < MAX_REL_RMS[qtype] * 0.02


def test_the_extremes_real_files_hold_are_written() -> None:
    w = np.random.default_rng(2).normal(0, 0.02, (16, 1024)).astype(np.float32)
    b6 = quantize(w, Q6_K).reshape(-1, 210)
    assert (_signed_scales(b6, Q6_K) == -128).any(), "Q6_K stores the largest sub-block scale as -128"
    ql, qh = b6[:, :128].reshape(-1, 2, 64), b6[:, 128:192].reshape(-1, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # quarters 0, 1, 2, 3 of each half
    high = np.concatenate([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
    q6 = (low | (high << 4)).astype(np.int32) - 32
    assert q6.min() == -32 and q6.max() == 31
    b3 = quantize(w, Q3_K).reshape(-1, 110)
    s3 = _signed_scales(b3, Q3_K)
    assert s3.min() == -32 and (s3 > 0).any()
    hm, qs = b3[:, :32], b3[:, 32:96].reshape(-1, 2, 32)
    low3 = np.concatenate([(qs >> (2 * k)) & 3 for k in range(4)], axis=2).reshape(-1, 256)
    high3 = np.concatenate([(hm >> k) & 1 for k in range(8)], axis=1)
    q3 = low3.astype(np.int32) - 4 * (1 - high3.astype(np.int32))
    assert q3.min() == -4 and q3.max() == 3
    for t, off in ((IQ4_NL, 2), (IQ4_XS, 8)):
        qs4 = quantize(w, t).reshape(-1, block_size(t)[1])[:, off:]
        idx = np.concatenate([qs4 & 0xF, qs4 >> 4])
        assert idx.min() == 0 and idx.max() == 15


def _one_block(qtype: int, values: dict[int, float]) -> np.ndarray:
    w = np.zeros((1, block_size(qtype)[0]), np.float32)
    for i, v in values.items():
        w[0, i] = v
    return quantize(w, qtype)[0]


def _h(x: float) -> list[int]:
    return list(np.float16(x).tobytes())


def test_one_block_of_the_32_weight_types_by_hand() -> None:
    # Q4_0: the weight of largest magnitude, 1, maps to -8: d = 1 / -8; q = trunc(x / d + 8.5) -> 0, 8 (zeros), 12
    want = _h(-0.125) + [0x80, 0xC8] + [0x88] * 14
    assert list(_one_block(Q4_0, {0: 1.0, 17: -0.5})) == want
    # Q4_1: d = (1 - -0.5) / 15, m = -0.5; q = trunc((x - m) / d + 0.5) -> 15, 5 (zeros), 0
    want = _h(0.1) + _h(-0.5) + [0x5F, 0x05] + [0x55] * 14
    assert list(_one_block(Q4_1, {0: 1.0, 17: -0.5})) == want
    # Q5_0: d = 1 / -16; q -> 0, 16 (zeros), 24; the fifth bits of all but q[0] are set
    want = _h(-0.0625) + [0xFE, 0xFF, 0xFF, 0xFF] + [0x00, 0x80] + [0x00] * 14
    assert list(_one_block(Q5_0, {0: 1.0, 17: -0.5})) == want
    # Q5_1: d = 1.5 / 31, m = -0.5; q -> 31, 10 (zeros), 0; only q[0] has a fifth bit
    want = _h(1.5 / 31) + _h(-0.5) + [1, 0, 0, 0] + [0xAF, 0x0A] + [0xAA] * 14
    assert list(_one_block(Q5_1, {0: 1.0, 17: -0.5})) == want
    # Q8_0: d = 1 / 127; q = round(x / d) -> 127, -32 (-31.75)
    want = _h(1 / 127) + [127] + [0] * 16 + [256 - 32] + [0] * 14
    assert list(_one_block(Q8_0, {0: 1.0, 17: -0.25})) == want
    # IQ4_NL: see IQ4_XS below; the scale, -135.125 / 17185.25, is d itself
    want = _h(np.float32(-135.125 / 17185.25)) + [0x80, 0x83] + [0x88] * 14
    assert list(_one_block(IQ4_NL, {0: 1.0, 1: 0.5})) == want


def test_one_block_of_q6_k_by_hand() -> None:
    # Sub-block 0 = [1, 0 x 15], the rest zero. make_qx_quants: 1 -> l = -32, scale = -1/32 (no other candidate
    # does better). Super-block: iscale = -128 / (-1/32) = 4096, d = 1/4096, sc[0] = -128, the other sc 0.
    # Quants: 1 / (d * -128) = -32 -> stored 0; the zeros of sub-block 0 -> 32; the zero sub-blocks keep
    # make_qx_quants' L = 0.
    b = _one_block(Q6_K, {0: 1.0})
    assert list(b[:128]) == [0] * 128  # low nibbles of 0 and 32
    assert list(b[128:192]) == [0] + [2] * 15 + [0] * 48  # high bits: 32 >> 4 = 2 for weights 1..15
    assert list(b[192:208]) == [0x80] + [0] * 15
    assert list(b[208:]) == _h(1 / 4096)
    assert dequantize(b[None], Q6_K, (1, 256))[0, 0] == 1.0


def test_one_block_of_q3_k_by_hand() -> None:
    # Sub-block 0 = [1, 0 x 15], the rest zero. make_q3_quants: 1 -> l = -4, scale = -4/16 = -0.25 (max > 0: no
    # descent). Super-block: iscale = -32 / -0.25 = 128, d = 1/128; sc[0] = -32 -> stored 0, the others 0 -> 32.
    # Quants: 1 / (d * -32) = -4 -> L 0; the zeros of sub-block 0 -> L 4 (high bit set); zero sub-blocks keep L 0.
    b = _one_block(Q3_K, {0: 1.0})
    assert list(b[:32]) == [0] + [1] * 15 + [0] * 16  # hmask: bit 0 of bytes 1..15
    assert list(b[32:96]) == [0] * 64
    assert list(b[96:108]) == [0] * 8 + [0xA8, 0xAA, 0xAA, 0xAA]  # low nibbles 0; high bits 2 but for scale 0
    assert list(b[108:]) == _h(1 / 128)
    assert dequantize(b[None], Q3_K, (1, 256))[0, 0] == 1.0


@pytest.mark.parametrize("qtype", (Q4_K, Q5_K), ids=NAMES.get)
def test_one_block_of_q4_k_q5_k_by_hand(qtype: int) -> None:
    # Sub-block 0 = 32 ones, the rest zero. make_qkx2_quants: min 0, L = nmax everywhere, scale = 1/nmax (every
    # other candidate has all its L equal, so D = 0). Super-block: ls[0] = 63, d = (1/nmax) / 63, no mins.
    nmax = 15 if qtype == Q4_K else 31
    b = _one_block(qtype, dict.fromkeys(range(32), 1.0))
    assert list(b[:2]) == _h(np.float32(1 / nmax) / 63) and list(b[2:4]) == [0, 0]
    assert list(b[4:16]) == [63] + [0] * 11
    qs = b[16:] if qtype == Q4_K else b[48:]
    assert list(qs) == [0x0F] * 32 + [0] * 96  # L & 15 of sub-block 0 in the low nibbles
    if qtype == Q5_K:
        assert list(b[16:48]) == [1] * 32  # the fifth bit of sub-block 0
    np.testing.assert_allclose(dequantize(b[None], qtype, (1, 256))[0, :32], 1.0, rtol=1e-3)


def test_one_block_of_q2_k_by_hand() -> None:
    # Sub-block 0 = 16 ones, the rest zero: L = 3, scale = 1/3, no min; ls[0] = 15, d = (1/3) / 15.
    b = _one_block(Q2_K, dict.fromkeys(range(16), 1.0))
    assert list(b[:16]) == [15] + [0] * 15
    assert list(b[16:80]) == [3] * 16 + [0] * 48
    assert list(b[80:82]) == _h(np.float32(1 / 3) / 15) and list(b[82:]) == [0, 0]


def test_one_block_of_iq4_xs_by_hand() -> None:
    # Sub-block 0 = [1, 0.5, 0 x 30], the rest zero. Weights x^2. The first fit maps 1 to 113 and 0.5 to 69 (score
    # 121.625^2 / 13959.25 = 1.0597); every try maps them to -127 and -65 (score 135.125^2 / 17185.25 = 1.0625,
    # better): scale -135.125 / 17185.25. Super-block: d = -scale / 32 > 0; sub-block 0 stores -32 (0), the zero
    # ones 0 (32). Quants: levels 0 (-127), 3 (-65), and 8 (value 1) for the zeros.
    b = _one_block(IQ4_XS, {0: 1.0, 1: 0.5})
    assert list(b[:2]) == _h(np.float32(135.125 / 17185.25) / 32)
    assert list(b[2:4]) == [0xA8, 0xAA] and list(b[4:8]) == [0, 0, 0, 0]
    assert list(b[8:]) == [0x80, 0x83] + [0x88] * 126


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 48), np.float32), Q4_0)  # not a whole number of blocks of 32
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 288), np.float32), Q4_K)  # a whole number of 32, not of 256
    with pytest.raises(ValueError):
        quantize(np.zeros((2, 256), np.float32), 1)  # F16 is not a block type here
    with pytest.raises(ValueError):
        block_size(99)
