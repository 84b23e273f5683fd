"""Test helpers: float32 weights -> GGML block-quantized bytes, written as llama.cpp's own quantizers write them.

Contract:

* `quantize(w, qtype)` takes float32 [rows, cols] and returns uint8 [rows, row_bytes] in GGML type `qtype`, one of
  `TYPES`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 (ids as in
  `gguf.GGMLQuantizationType`). cols must be a whole number of the type's blocks (`block_size(qtype)` gives
  (weights, bytes) of one block: 32 or 256 weights), else ValueError. A row is cols / weights blocks in
  ggml-common.h's layouts. Deterministic, and each block depends on its own weights only.
* `dequantize(q, qtype, shape)` is the `gguf` package's reference de-quantization, as float32 `shape`.
* The bytes are what llama-quantize writes without an importance matrix (ggml/src/ggml-quants.c: the
  `quantize_row_*_ref` functions, and for IQ4_NL and IQ4_XS `quantize_iq4_nl` / `quantize_iq4_xs`), so test data
  looks like real data: Q4_0, Q5_0 and IQ4_NL have a signed block scale (the weight of largest magnitude maps to the
  most negative level, so about half the scales are negative); Q3_K, Q6_K and IQ4_XS have signed sub-block scales
  (the one of largest magnitude is stored as the most negative, -32 or -128, so about half are negative); Q6_K's
  quants span [-32, 31], Q3_K's [-4, 3], with its 6-bit scales stored as sc + 32; Q4_1, Q5_1, Q2_K, Q4_K and Q5_K
  store an unsigned scale and a min.
* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 are the `gguf` package's quantizers (ports of llama.cpp's, bit for bit;
  MXFP4's shared exponent per block from the block's largest magnitude, its nibbles signed E2M1 values). The
  others are vectorised numpy ports of llama.cpp's code, in float32 with its order of operations and of summation:
  Q3_K, Q6_K, IQ4_NL and IQ4_XS come out as llama.cpp's bytes. Q2_K, Q4_K and Q5_K simplify one thing:
  make_qkx2_quants' search for the best scale and min tries a subset of llama.cpp's candidates (`_QKX2_TRIES`), so
  a scale or a quant differs now and then; the rest (signs, value ranges, clamps, rounding, packing) is llama.cpp's.
"""

from __future__ import annotations

import numpy as np

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
MXFP4 = 39
TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)

# (weights, bytes) of one block (ggml-common.h)
_BLOCK = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q5_1: (32, 24),
    Q8_0: (32, 34),
    Q2_K: (256, 84),
    Q3_K: (256, 110),
    Q4_K: (256, 144),
    Q5_K: (256, 176),
    Q6_K: (256, 210),
    IQ4_NL: (32, 18),
    IQ4_XS: (256, 136),
    MXFP4: (32, 17),
}

_GGUF_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

# The candidate scales the searches try (each costs a pass over the weights): make_qx_quants' `is` (Q6_K) and
# quantize_row_iq4_nl_impl's `itry` (IQ4_NL, IQ4_XS) are llama.cpp's; make_qkx2_quants' `is` (Q2_K, Q4_K, Q5_K) a
# subset of llama.cpp's 0..nstep (15, 20, 15), to keep 50M weights under about 4 s.
_QKX2_TRIES = {Q2_K: (0, 3, 6, 9, 12, 15), Q4_K: tuple(range(0, 21, 3)), Q5_K: tuple(range(0, 16, 2))}
_QX_TRIES = tuple(i for i in range(-9, 10) if i)
_IQ4_TRIES = tuple(range(-7, 8))

_CHUNK = 1 << 17  # weights quantized at a time, to stay in cache


def block_size(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of GGML type `qtype`."""
    if qtype not in _BLOCK:
        raise ValueError(f"no quantizer for GGML type {qtype}")
    return _BLOCK[qtype]


# ---- helpers ------------------------------------------------------------------------------------------------------
#
# The searches work on groups laid out as columns, xt [n, m]: element i of every group is row i, so a sum over a
# group, xt.sum(0) or _dot(a, b) = (a * b).sum(0), adds the elements one by one in C's order, and the float32
# results are C's.


def _cols(x: np.ndarray, n: int) -> np.ndarray:
    """Groups of n consecutive weights as the columns of [n, m]."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per column, the sum of a * b, in row order (as (a * b).sum(0), without the temporary)."""
    return np.einsum("ij,ij->j", a, b)


def _signed_absmax(xt: np.ndarray) -> np.ndarray:
    """Per column, the value of largest magnitude with its sign (the first one on ties, as ggml)."""
    return np.take_along_axis(xt, np.abs(xt).argmax(0)[None], 0)[0]


def _positive_max(a: np.ndarray) -> np.ndarray:
    """Per row, the largest value if positive, else +0 (C: float m = 0; if (a[j] > m) m = a[j])."""
    m = a.max(-1)
    return np.where(m > 0, m, np.float32(0))


def _safe(d: np.ndarray) -> np.ndarray:
    return np.where(d == 0, np.float32(1), d)


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its float16 (GGML_FP32_TO_FP16 then back)."""
    return x.astype(np.float16).astype(np.float32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _pack2(q: np.ndarray) -> np.ndarray:
    """2-bit quants [n, 256] -> [n, 64]: byte l of each half of 128 holds quants l, l+32, l+64, l+96."""
    v = q.reshape(len(q), 2, 4, 32)
    return (v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)).reshape(len(q), 64)


def _pack_nibbles(q: np.ndarray, span: int) -> np.ndarray:
    """4-bit quants [n, k] -> [n, k/2]: in each group of 2*span, byte l holds quants l (low) and l+span (high)."""
    v = q.reshape(len(q), -1, 2, span)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(len(q), -1)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> the 12 bytes of Q4_K / Q5_K (get_scale_min_k4)."""
    return np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )


def _pack_scales_q3(ls: np.ndarray) -> np.ndarray:
    """16 six-bit scales per super-block [n, 16] -> the 12 bytes of Q3_K."""
    low = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    hi = ls.reshape(len(ls), 4, 4) >> 4  # [n, j / 4, j % 4]
    high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([low, high], axis=1)


def _iq4_lut() -> tuple[np.ndarray, np.ndarray]:
    """best_index_int8 over kvalues_iq4nl as tables indexed by floor(2 x), negative indices from the end (the
    midpoints val[i-1] + val[i] are integers, so x2 >= mid is floor(x2) >= mid)."""
    mids = _KVALUES_IQ4NL[:-1] + _KVALUES_IQ4NL[1:]
    floors = np.arange(-256, 256, dtype=np.float32)
    idx = np.searchsorted(mids, floors, side="right").astype(np.uint8)
    idx = np.roll(idx, -256)  # entry k is floor k, for k in [-256, 256)
    return idx, _KVALUES_IQ4NL[idx]


_IQ4_IDX, _IQ4_VAL = _iq4_lut()


def _iq4_pos(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Indices into _IQ4_IDX / _IQ4_VAL of best_index_int8(kvalues_iq4nl, scale * x)."""
    t = x * (scale + scale)  # = 2 (scale x) exactly
    np.floor(t, out=t)
    np.clip(t, -256, 255, out=t)  # beyond the first and last midpoints (-231, 202) nothing changes
    return t.astype(np.intp)


# ---- the searches of ggml-quants.c, over columns ------------------------------------------------------------------


def _make_qx_quants(xt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) per column of xt [n, m]: (scale [m], L [n, m])."""
    mx = _signed_absmax(xt)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, np.float32(1), mx)
    w = xt * xt
    wx = w * xt

    def levels(iscale: np.ndarray) -> np.ndarray:
        lv = xt * iscale
        np.rint(lv, out=lv)
        return np.clip(lv, -nmax, nmax - 1, out=lv)

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = levels(iscale)
        return _dot(wx, lv), _dot(w * lv, lv)

    best_iscale = np.float32(-nmax) / mx
    sumlx, suml2 = fit(best_iscale)
    scale = np.where(suml2 != 0, sumlx / _safe(suml2), np.float32(0))
    best = scale * sumlx
    for step in _QX_TRIES:
        iscale = -(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx
        sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(better, sumlx / _safe(suml2), scale)
        best = np.where(better, scale * sumlx, best)
        best_iscale = np.where(better, iscale, best_iscale)
    lv = levels(best_iscale)
    lv += nmax
    lv[:, zero] = 0
    return np.where(zero, np.float32(0), scale), lv


def _make_q3_quants(xt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true) per column of xt [n, m]: (scale [m], L [n, m]).

    Its five passes of coordinate descent go element by element as in C, vectorised over the columns still changing
    (one that a whole pass left as it was stays so).
    """
    mx = _signed_absmax(xt)
    zero = np.abs(mx) < _EPS
    iscale = np.float32(-nmax) / np.where(zero, np.float32(1), mx)
    lt = np.rint(xt * iscale)
    np.clip(lt, -nmax, nmax - 1, out=lt)
    wt = xt * xt
    wxt = wt * xt
    sumlx = _dot(wxt, lt)
    suml2 = _dot(wt * lt, lt)
    # With max > 0 (iscale < 0) every l has the opposite sign of its x, so every w x l <= 0, slx <= 0 and L never
    # changes: only the columns with max < 0 descend.
    cols = np.flatnonzero(iscale > 0)
    for _ in range(5):
        xa, wa, wxa, la = xt[:, cols], wt[:, cols], wxt[:, cols], lt[:, cols]
        sx, s2 = sumlx[cols], suml2[cols]
        changed = np.zeros(len(cols), bool)
        for i in range(len(xt)):
            li = la[i]
            slx = sx - wxa[i] * li
            sl2 = s2 - wa[i] * li * li
            pos = slx > 0
            new = np.rint(xa[i] * sl2 / np.where(pos, slx, np.float32(1)))
            np.clip(new, -nmax, nmax - 1, out=new)
            slx += wxa[i] * new
            sl2 += wa[i] * new * new
            take = pos & (new != li) & (sl2 > 0) & (slx * slx * s2 > sx * sx * sl2)
            la[i] = np.where(take, new, li)
            sx = np.where(take, slx, sx)
            s2 = np.where(take, sl2, s2)
            changed |= take
        lt[:, cols], sumlx[cols], suml2[cols] = la, sx, s2
        cols = cols[changed]
        if not len(cols):
            break
    lt += nmax
    lt[:, zero] = 0
    scale = np.where(suml2 > 0, sumlx / _safe(suml2), np.float32(0))
    return np.where(zero, np.float32(0), scale), lt


def _make_qkx2_quants(
    xt: np.ndarray, wt: np.ndarray, nmax: int, rmin: float, rdelta: float, steps: tuple[int, ...], use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants per column of xt [n, m] with weights wt: (scale [m], the_min [m], L [n, m]), trying the
    candidate steps `steps` (llama.cpp: all of 0..nstep)."""
    mn = np.minimum(xt.min(0), np.float32(0))
    mx = xt.max(0)
    flat = mx == mn
    wx = wt * xt
    sum_w = wt.sum(0)
    sum_x = wx.sum(0)

    def levels(iscale: np.ndarray, mn: np.ndarray) -> np.ndarray:
        lv = xt - mn
        lv *= iscale
        np.rint(lv, out=lv)
        return np.clip(lv, 0, nmax, out=lv)

    def error(sc: np.ndarray, m: np.ndarray, lv: np.ndarray) -> np.ndarray:
        e = lv * sc
        e += m
        e -= xt
        if use_mad:
            np.abs(e, out=e)
        else:
            e *= e
        return _dot(wt, e)

    iscale = np.float32(nmax) / np.where(flat, np.float32(1), mx - mn)
    scale = np.float32(1) / iscale
    best_iscale, best_mn = iscale, mn
    best = error(scale, mn, levels(iscale, mn))
    for step in steps:
        iscale = (np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)) / (mx - mn)
        lv = levels(iscale, mn)
        wl = wt * lv
        s_l, s_l2, s_xl = wl.sum(0), _dot(wl, lv), _dot(wl, xt)
        det = sum_w * s_l2 - s_l * s_l
        this_scale = (sum_w * s_xl - sum_x * s_l) / det
        this_min = (s_l2 * sum_x - s_l * s_xl) / det
        pos = this_min > 0
        this_min = np.where(pos, np.float32(0), this_min)
        this_scale = np.where(pos, s_xl / s_l2, this_scale)
        cur = error(this_scale, this_min, lv)
        better = (det > 0) & (cur < best)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        best_iscale = np.where(better, iscale, best_iscale)
        best_mn = np.where(better, mn, best_mn)
        mn = np.where(better, this_min, mn)
    lv = levels(best_iscale, best_mn)
    lv[:, flat] = 0
    return np.where(flat, np.float32(0), scale), -mn, lv


# ---- the K types ------------------------------------------------------------------------------------------------


def _q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, w = d sc q - dmin m, q in [0, 3], sc and m 4-bit."""
    n = len(x)
    xt = _cols(x, 16)
    scales, mins, lv = _make_qkx2_quants(xt, np.abs(xt), 3, -0.5, 0.1, _QKX2_TRIES[Q2_K], True)
    scales, mins, lv = scales.reshape(n, 16), mins.reshape(n, 16), lv.T.reshape(n, 16, 16)
    max_scale = _positive_max(scales)
    max_min = _positive_max(mins)
    q4scale = np.float32(15)
    ls = np.rint(np.where(max_scale > 0, q4scale / _safe(max_scale), 0)[:, None] * scales).astype(np.int32)
    lm = np.rint(np.where(max_min > 0, q4scale / _safe(max_min), 0)[:, None] * mins).astype(np.int32)
    sc_bytes = ((ls & 0xFF) | (lm << 4)).astype(np.uint8)  # C: uint8 scales[j] = l; scales[j] |= l << 4
    d = _f16(max_scale / q4scale)
    dmin = _f16(max_min / q4scale)
    dl = d[:, None] * (sc_bytes & 0xF)
    ml = dmin[:, None] * (sc_bytes >> 4)
    q = np.rint((x.reshape(n, 16, 16) + ml[..., None]) / _safe(dl)[..., None])
    np.clip(q, 0, 3, out=q)
    q = np.where((dl != 0)[..., None], q, lv).astype(np.uint8).reshape(n, 256)
    return np.concatenate([sc_bytes, _pack2(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, w = d (sc - 32) q, q in [-4, 3], signed 6-bit sc."""
    n = len(x)
    scales, lv = _make_q3_quants(_cols(x, 16), 4)
    scales, lv = scales.reshape(n, 16), lv.T.reshape(n, 16, 16)
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)[:, 0]
    nonzero = max_scale != 0
    iscale = np.float32(-32) / _safe(max_scale)
    ls = np.rint(iscale[:, None] * scales)
    np.clip(ls, -32, 31, out=ls)
    ls = np.where(nonzero[:, None], ls + 32, 0).astype(np.uint8)
    d = np.where(nonzero, _f16(np.float32(1) / iscale), np.float32(0))
    dl = d[:, None] * (ls.astype(np.float32) - 32)
    q = np.rint(x.reshape(n, 16, 16) / _safe(dl)[..., None])
    np.clip(q, -4, 3, out=q)
    q = np.where((dl != 0)[..., None], q + 4, lv).astype(np.uint8).reshape(n, 256)
    hmask = ((q.reshape(n, 8, 32) >> 2) & 1) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = np.bitwise_or.reduce(hmask, axis=1)
    return np.concatenate([hmask, _pack2(q & 3), _pack_scales_q3(ls), _f16_bytes(d)], axis=1)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """quantize_row_q4_K_ref / q5_K_ref: 8 sub-blocks of 32, w = d sc q - dmin m, 6-bit sc and m."""
    n = len(x)
    nmax = (1 << bits) - 1
    xt = _cols(x, 32)
    av_x = np.sqrt(_dot(xt, xt) / np.float32(32))
    weights = np.abs(xt)
    weights += av_x
    rmin, steps = (-1.0, _QKX2_TRIES[Q4_K]) if bits == 4 else (-0.5, _QKX2_TRIES[Q5_K])
    scales, mins, lv = _make_qkx2_quants(xt, weights, nmax, rmin, 0.1, steps, False)
    scales, mins, lv = scales.reshape(n, 8), mins.reshape(n, 8), lv.T.reshape(n, 8, 32)
    max_scale = _positive_max(scales)
    max_min = _positive_max(mins)
    inv_scale = np.where(max_scale > 0, np.float32(63) / _safe(max_scale), np.float32(0))
    inv_min = np.where(max_min > 0, np.float32(63) / _safe(max_min), np.float32(0))
    # C: uint8_t ls = nearest_int(...); ls = MIN(63, ls)
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    d = _f16(max_scale / np.float32(63))
    dmin = _f16(max_min / np.float32(63))
    dl = d[:, None] * ls
    ml = dmin[:, None] * lm
    q = np.rint((x.reshape(n, 8, 32) + ml[..., None]) / _safe(dl)[..., None])
    np.clip(q, 0, nmax, out=q)
    q = np.where((dl != 0)[..., None], q, lv).astype(np.uint8).reshape(n, 256)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales_k4(ls, lm)]
    if bits == 5:
        high = (q.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(high, axis=1))
    parts.append(_pack_nibbles(q & 0xF, 32))
    return np.concatenate(parts, axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref: 16 sub-blocks of 16, w = d sc q, q in [-32, 31], int8 sc."""
    n = len(x)
    scales, lv = _make_qx_quants(_cols(x, 16), 32)
    scales, lv = scales.reshape(n, 16), lv.T.reshape(n, 16, 16)
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)[:, 0]
    zero = np.abs(max_scale) < _EPS
    iscale = np.float32(-128) / _safe(max_scale)
    d = np.where(zero, np.float32(0), _f16(np.float32(1) / iscale))
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    dl = d[:, None] * sc
    q = np.rint(x.reshape(n, 16, 16) / _safe(dl)[..., None])
    np.clip(q, -32, 31, out=q)
    q = np.where((dl != 0)[..., None], q + 32, lv)
    q = np.where(zero[:, None, None], 0, q).astype(np.uint8).reshape(n, 256)
    v = q.reshape(n, 2, 4, 32)  # two halves of 128, four quarters of 32
    ql = (v[:, :, :2] & 0xF) | ((v[:, :, 2:] & 0xF) << 4)
    qh = (v[:, :, 0] >> 4) | ((v[:, :, 1] >> 4) << 2) | ((v[:, :, 2] >> 4) << 4) | ((v[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


# ---- the IQ4 types ----------------------------------------------------------------------------------------------


def _iq4_scales(xt: np.ndarray) -> np.ndarray:
    """The per-block search of quantize_row_iq4_nl_impl (no importance matrix: weights x^2, ntry 7) per column of
    32 weights of xt [32, m]: the scale of each [m]."""
    mx = _signed_absmax(xt)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, np.float32(1), mx)
    w = xt * xt
    v0 = _KVALUES_IQ4NL[0]

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = _IQ4_VAL[_iq4_pos(xt, iscale)]
        wq = w * q
        return _dot(wq, xt), _dot(wq, q)

    sumqx, sumq2 = fit(np.float32(1) / (-mx / v0))
    d = np.where(sumq2 > 0, sumqx / _safe(sumq2), np.float32(0))
    best = d * sumqx
    for itry in _IQ4_TRIES:
        sumqx, sumq2 = fit((np.float32(itry) + v0) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / _safe(sumq2), d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, np.float32(0), d)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """quantize_iq4_nl (what llama-quantize writes): blocks of 32, w = d kvalues_iq4nl[q], signed d."""
    d = _iq4_scales(_cols(x, 32))
    q = _IQ4_IDX[_iq4_pos(x, np.where(d != 0, np.float32(1) / _safe(d), np.float32(0))[:, None])]
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q, 16)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_xs_ref: 8 sub-blocks of 32, w = d (sc - 32) kvalues_iq4nl[q], signed 6-bit sc."""
    n = len(x)
    scales = _iq4_scales(_cols(x, 32))
    scales = scales.reshape(n, 8)
    max_scale = np.take_along_axis(scales, np.abs(scales).argmax(-1)[:, None], -1)[:, 0]
    d = -max_scale / np.float32(32)
    idv = np.where(d != 0, np.float32(1) / _safe(d), np.float32(0))
    ls = np.rint(idv[:, None] * scales)
    np.clip(ls, -32, 31, out=ls)
    dl = d[:, None] * ls
    idl = np.where(dl != 0, np.float32(1) / _safe(dl), np.float32(0))
    q = _IQ4_IDX[_iq4_pos(x.reshape(n, 8, 32), idl[..., None])].reshape(n, 256)
    ls = (ls + 32).astype(np.uint16)
    scales_l = ((ls[:, 0::2] & 0xF) | ((ls[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype(np.uint16)
    return np.concatenate(
        [_f16_bytes(d), scales_h.view(np.uint8).reshape(n, 2), scales_l, _pack_nibbles(q, 16)], axis=1
    )


_QUANTIZERS = {
    Q2_K: _q2_k,
    Q3_K: _q3_k,
    Q4_K: lambda x: _q45_k(x, 4),
    Q5_K: lambda x: _q45_k(x, 5),
    Q6_K: _q6_k,
    IQ4_NL: _iq4_nl,
    IQ4_XS: _iq4_xs,
}


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, row_bytes] in GGML type `qtype` (cols a whole number of blocks)."""
    import gguf

    weights, nbytes = block_size(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {w.shape}")
    rows, cols = w.shape
    if cols % weights:
        raise ValueError(f"GGML type {qtype} needs rows of a multiple of {weights} weights, got {cols}")
    if qtype in _GGUF_TYPES:
        # + 0 turns -0.0 into +0.0: ggml starts its searches from +0, so a block of zeros gets Q4_0's d = 0 / -8 = -0
        return gguf.quants.quantize(w + np.float32(0), gguf.GGMLQuantizationType(qtype))
    blocks = w.reshape(-1, weights)
    out = np.empty((len(blocks), nbytes), np.uint8)
    step = max(_CHUNK // weights, 1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i in range(0, len(blocks), step):
            out[i : i + step] = _QUANTIZERS[qtype](blocks[i : i + step])
    return out.reshape(rows, cols // weights * nbytes)


def dequantize(q: np.ndarray, qtype: int, shape: tuple[int, int]) -> np.ndarray:
    """The `gguf` package's reference de-quantization, as float32 [rows, cols]."""
    import gguf

    return np.asarray(gguf.quants.dequantize(q, gguf.GGMLQuantizationType(qtype)), dtype=np.float32).reshape(shape)
