"""Test helpers: float32 weights -> GGML block-quantized bytes, written as llama.cpp's own quantizers write them.

Contract:

* `quantize(w, qtype)` takes float32 [rows, cols] and returns uint8 [rows, row_bytes] in GGML type `qtype`, one of
  `TYPES`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (ids as in
  `gguf.GGMLQuantizationType`). cols must be a whole number of the type's blocks (`block_size(qtype)[0]`: 32 or
  256 weights), else ValueError. Each row is `cols / weights` blocks of `bytes` bytes, in ggml-common.h's layouts.
* `dequantize(q, qtype, shape)` is the `gguf` package's reference de-quantization, as float32 `shape`.
* The bytes are those of llama.cpp's reference quantizers (ggml/src/ggml-quants.c, `quantize_row_*_ref`, the ones
  llama-quantize uses without an importance matrix), so test data looks like real data: Q4_0, Q5_0 and IQ4_NL have
  a signed block scale (the weight of largest magnitude maps to the most negative level, so about half the scales are
  negative); Q3_K, Q6_K and IQ4_XS have signed sub-block scales (the sub-block scale of largest magnitude is stored
  as the most negative one, -32 or -128, so again about half are negative); Q6_K's quants span [-32, 31], Q3_K's
  [-4, 3] with its 6-bit scales stored as sc + 32; the asymmetric types (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) store an
  unsigned scale and a min.
* Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are the `gguf` package's quantizers (bit-exact ports of llama.cpp's). The others
  are vectorised numpy ports of llama.cpp's, with one simplification where llama.cpp searches for the best scale:
  the search tries fewer candidate scales (`_QKX2_TRIES`, `_QX_TRIES`, `_IQ4_TRIES` below list which). Every rule
  that fixes signs, value ranges, clamps, rounding (round half to even, as ggml's nearest_int) and packing is
  llama.cpp's, computed in float32 as in C.
"""

from __future__ import annotations

import numpy as np

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23
TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)

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
}

_GGUF_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)

# The candidate scales the searches try, a subset of llama.cpp's (each candidate costs a pass over the weights):
# make_qkx2_quants' steps `is` (llama.cpp: 0..nstep), make_qx_quants' `is` (llama.cpp: -9..9 but 0) and
# quantize_row_iq4_nl_impl's `itry` (llama.cpp: -7..7).
_QKX2_TRIES = {Q2_K: (0, 5, 10, 15), Q4_K: (0, 5, 10, 15, 20), Q5_K: (0, 5, 10, 15)}
_QX_TRIES = (-9, -5, -2, 2, 5, 9)
_IQ4_TRIES = (-7, -3, 0, 3, 7)

_CHUNK = 1 << 20  # weights quantized at a time, to stay in cache


def block_size(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of GGML type `qtype`."""
    if qtype not in _BLOCK:
        raise ValueError(f"no quantizer for GGML type {qtype}")
    return _BLOCK[qtype]


# ---- helpers ------------------------------------------------------------------------------------------------------


def _dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sum over the last axis of a * b."""
    return np.einsum("...i,...i->...", a, b)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign (the first one on ties, as ggml)."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


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
    hi = ls.reshape(len(ls), 4, 4) >> 4  # [n, group j/4, j%4]
    high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([low, high], axis=1)


def _iq4_lut() -> tuple[np.ndarray, np.ndarray]:
    """best_index_int8 over kvalues_iq4nl as a table of floor(2 x) (the midpoints val[i-1] + val[i] are integers)."""
    mids = _KVALUES_IQ4NL[:-1] + _KVALUES_IQ4NL[1:]
    lo, hi = int(mids[0]) - 1, int(mids[-1])
    idx = np.searchsorted(mids, np.arange(lo, hi + 1, dtype=np.float32), side="right").astype(np.uint8)
    return idx, _KVALUES_IQ4NL[idx]


_IQ4_IDX, _IQ4_VAL = _iq4_lut()
_IQ4_LO = np.float32(_KVALUES_IQ4NL[0] + _KVALUES_IQ4NL[1] - 1)


def _iq4_pos(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Positions in _IQ4_IDX / _IQ4_VAL of best_index_int8(kvalues_iq4nl, scale * x)."""
    t = scale * x
    t += t
    t -= _IQ4_LO
    np.clip(t, 0, len(_IQ4_IDX) - 1, out=t)
    return t.astype(np.intp)  # truncation = floor on t >= 0


# ---- the searches of ggml-quants.c ------------------------------------------------------------------------------


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) over the rows of x [m, n]: (scale [m], L [m, n])."""
    mx = _signed_absmax(x)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, np.float32(1), mx)
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lv = np.rint(iscale[:, None] * x)
        np.clip(lv, -nmax, nmax - 1, out=lv)
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
    lv = np.rint(best_iscale[:, None] * x)
    np.clip(lv, -nmax, nmax - 1, out=lv)
    lv += nmax
    lv[zero] = 0
    return np.where(zero, np.float32(0), scale), lv


def _make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_q3_quants(n, nmax, x, L, do_rmse=true) over the rows of x [m, n]: (scale [m], L [m, n]).

    The five passes of coordinate descent go element by element as in C, vectorised over the rows.
    """
    mx = _signed_absmax(x)
    zero = np.abs(mx) < _EPS
    iscale = np.float32(-nmax) / np.where(zero, np.float32(1), mx)
    xt = np.ascontiguousarray(x.T)  # [n, m]
    lt = np.rint(iscale * xt)
    np.clip(lt, -nmax, nmax - 1, out=lt)
    wt = xt * xt
    wxt = wt * xt
    sumlx = np.zeros(len(x), np.float32)
    suml2 = np.zeros(len(x), np.float32)
    for i in range(len(xt)):  # the sums in C's order
        sumlx += wxt[i] * lt[i]
        suml2 += wt[i] * lt[i] * lt[i]
    for _ in range(5):
        changed = False
        for i in range(len(xt)):
            li = lt[i]
            slx = sumlx - wxt[i] * li
            sl2 = suml2 - wt[i] * li * li
            pos = slx > 0
            new = np.rint(xt[i] * sl2 / np.where(pos, slx, np.float32(1)))
            np.clip(new, -nmax, nmax - 1, out=new)
            slx = slx + wxt[i] * new
            sl2 = sl2 + wt[i] * new * new
            take = pos & (new != li) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            if take.any():
                changed = True
                lt[i] = np.where(take, new, li)
                sumlx = np.where(take, slx, sumlx)
                suml2 = np.where(take, sl2, suml2)
        if not changed:
            break
    lv = lt.T + nmax
    lv[zero] = 0
    scale = np.where(suml2 > 0, sumlx / _safe(suml2), np.float32(0))
    return np.where(zero, np.float32(0), scale), lv


def _make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, steps: tuple[int, ...], use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants over the rows of x [m, n] with weights w: (scale [m], the_min [m], L [m, n]).

    With use_mad false the weighted squared error of a candidate comes from its sums, not from another pass.
    """
    mn = np.minimum(x.min(-1), np.float32(0))
    mx = x.max(-1)
    flat = mx == mn
    sum_w = w.sum(-1, dtype=np.float32)
    sum_x = _dot(w, x)
    sum_x2 = _dot(w * x, x).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.float32(nmax) / np.where(flat, np.float32(1), mx - mn)
        scale = np.float32(1) / iscale
        lv = np.rint(iscale[:, None] * (x - mn[:, None]))
        np.clip(lv, 0, nmax, out=lv)

        def error(sc: np.ndarray, m: np.ndarray, lv: np.ndarray, s_l, s_l2, s_xl) -> np.ndarray:
            if use_mad:
                return _dot(w, np.abs(sc[:, None] * lv + m[:, None] - x))
            sc, m = sc.astype(np.float64), m.astype(np.float64)
            return (
                sc * sc * s_l2 + 2 * sc * m * s_l - 2 * sc * s_xl + m * m * sum_w - 2 * m * sum_x
            ) + sum_x2  # sum of w (sc l + m - x)^2

        wl = w * lv
        best = error(scale, mn, lv, wl.sum(-1), _dot(wl, lv), _dot(wl, x))
        for step in steps:
            iscale = (np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)) / (mx - mn)
            la = np.rint(iscale[:, None] * (x - mn[:, None]))
            np.clip(la, 0, nmax, out=la)
            wl = w * la
            s_l, s_l2, s_xl = wl.sum(-1), _dot(wl, la), _dot(wl, x)
            det = sum_w * s_l2 - s_l * s_l
            this_scale = (sum_w * s_xl - sum_x * s_l) / det
            this_min = (s_l2 * sum_x - s_l * s_xl) / det
            pos = this_min > 0
            this_min = np.where(pos, np.float32(0), this_min)
            this_scale = np.where(pos, s_xl / s_l2, this_scale)
            cur = error(this_scale, this_min, la, s_l, s_l2, s_xl)
            better = (det > 0) & (cur < best)
            lv = np.where(better[:, None], la, lv)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    lv[flat] = 0
    return np.where(flat, np.float32(0), scale), -mn, lv


# ---- the K types ------------------------------------------------------------------------------------------------


def _q2_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref: 16 sub-blocks of 16, w = d sc q - dmin m, q in [0, 3], sc and m 4-bit."""
    n = len(x)
    sub = x.reshape(n * 16, 16)
    scales, mins, lv = _make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, _QKX2_TRIES[Q2_K], True)
    scales, mins, lv = scales.reshape(n, 16), mins.reshape(n, 16), lv.reshape(n, 16, 16)
    max_scale = np.maximum(scales.max(-1), 0)
    max_min = np.maximum(mins.max(-1), 0)
    q4scale = np.float32(15)
    ls = np.rint(np.where(max_scale > 0, q4scale / _safe(max_scale), 0)[:, None] * scales).astype(np.int32)
    lm = np.rint(np.where(max_min > 0, q4scale / _safe(max_min), 0)[:, None] * mins).astype(np.int32)
    sc_bytes = ((ls & 0xFF) | (lm << 4)).astype(np.uint8)  # C: uint8 scales[j] = l; scales[j] |= l << 4
    d = _f16(max_scale / q4scale)
    dmin = _f16(max_min / q4scale)
    dl = d[:, None] * (sc_bytes & 0xF)
    ml = dmin[:, None] * (sc_bytes >> 4)
    q = np.rint((sub.reshape(n, 16, 16) + ml[..., None]) / _safe(dl)[..., None])
    np.clip(q, 0, 3, out=q)
    q = np.where((dl != 0)[..., None], q, lv).astype(np.uint8).reshape(n, 256)
    return np.concatenate([sc_bytes, _pack2(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref: 16 sub-blocks of 16, w = d (sc - 32) q, q in [-4, 3], signed 6-bit sc."""
    n = len(x)
    sub = x.reshape(n * 16, 16)
    scales, lv = _make_q3_quants(sub, 4)
    scales, lv = scales.reshape(n, 16), lv.reshape(n, 16, 16)
    max_scale = _signed_absmax(scales)
    nonzero = max_scale != 0
    iscale = np.float32(-32) / _safe(max_scale)
    ls = np.rint(iscale[:, None] * scales)
    np.clip(ls, -32, 31, out=ls)
    ls = np.where(nonzero[:, None], ls + 32, 0).astype(np.uint8)
    d = np.where(nonzero, _f16(np.float32(1) / iscale), np.float32(0))
    dl = d[:, None] * (ls.astype(np.float32) - 32)
    q = np.rint(sub.reshape(n, 16, 16) / _safe(dl)[..., None])
    np.clip(q, -4, 3, out=q)
    q = np.where((dl != 0)[..., None], q + 4, lv).astype(np.uint8).reshape(n, 256)
    hmask = (q.reshape(n, 8, 32) >> 2) & 1
    hmask = np.bitwise_or.reduce(hmask << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    return np.concatenate([hmask, _pack2(q & 3), _pack_scales_q3(ls), _f16_bytes(d)], axis=1)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """quantize_row_q4_K_ref / q5_K_ref: 8 sub-blocks of 32, w = d sc q - dmin m, 6-bit sc and m."""
    n = len(x)
    nmax = (1 << bits) - 1
    sub = x.reshape(n * 8, 32)
    av_x = np.sqrt(_dot(sub, sub) / np.float32(32))
    weights = av_x[:, None] + np.abs(sub)
    if bits == 4:
        scales, mins, lv = _make_qkx2_quants(sub, weights, nmax, -1.0, 0.1, _QKX2_TRIES[Q4_K], False)
    else:
        scales, mins, lv = _make_qkx2_quants(sub, weights, nmax, -0.5, 0.1, _QKX2_TRIES[Q5_K], False)
    scales, mins, lv = scales.reshape(n, 8), mins.reshape(n, 8), lv.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(-1), 0)
    max_min = np.maximum(mins.max(-1), 0)
    inv_scale = np.where(max_scale > 0, np.float32(63) / _safe(max_scale), np.float32(0))
    inv_min = np.where(max_min > 0, np.float32(63) / _safe(max_min), np.float32(0))
    # C: uint8_t ls = nearest_int(...); ls = MIN(63, ls)
    ls = np.minimum(np.rint(inv_scale[:, None] * scales).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(np.rint(inv_min[:, None] * mins).astype(np.int32) & 0xFF, 63).astype(np.uint8)
    d = _f16(max_scale / np.float32(63))
    dmin = _f16(max_min / np.float32(63))
    dl = d[:, None] * ls
    ml = dmin[:, None] * lm
    q = np.rint((sub.reshape(n, 8, 32) + ml[..., None]) / _safe(dl)[..., None])
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
    sub = x.reshape(n * 16, 16)
    scales, lv = _make_qx_quants(sub, 32)
    scales, lv = scales.reshape(n, 16), lv.reshape(n, 16, 16)
    max_scale = _signed_absmax(scales)
    zero = np.abs(max_scale) < _EPS
    iscale = np.float32(-128) / _safe(max_scale)
    d = np.where(zero, np.float32(0), _f16(np.float32(1) / iscale))
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    dl = d[:, None] * sc
    q = np.rint(sub.reshape(n, 16, 16) / _safe(dl)[..., None])
    np.clip(q, -32, 31, out=q)
    q = np.where((dl != 0)[..., None], q + 32, lv)
    q = np.where(zero[:, None, None], 0, q).astype(np.uint8).reshape(n, 256)
    v = q.reshape(n, 2, 4, 32)  # two halves of 128, four quarters of 32
    ql = (v[:, :, :2] & 0xF) | ((v[:, :, 2:] & 0xF) << 4)
    qh = (v[:, :, 0] >> 4) | ((v[:, :, 1] >> 4) << 2) | ((v[:, :, 2] >> 4) << 4) | ((v[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


# ---- the IQ4 types ----------------------------------------------------------------------------------------------


def _iq4_scales(sub: np.ndarray, tries: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    """The per-block part of quantize_row_iq4_nl_impl (weights x^2) over rows of 32: (scale [m], positions [m, 32]).

    tries None is ntry = -1 (quantize_row_iq4_nl_ref: one fit); otherwise ntry = 7 (quantize_iq4_xs) with those itry.
    """
    mx = _signed_absmax(sub)
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, np.float32(1), mx)
    w = sub * sub
    wx = w * sub
    v0 = _KVALUES_IQ4NL[0]
    d = -mx / v0 if tries is not None else mx / v0
    pos = _iq4_pos(sub, (np.float32(1) / d)[:, None])
    q = _IQ4_VAL[pos]
    sumqx, sumq2 = _dot(wx, q), _dot(w * q, q)
    d = np.where(sumq2 > 0, sumqx / _safe(sumq2), np.float32(0))
    best = d * sumqx
    for itry in tries or ():
        q = _IQ4_VAL[_iq4_pos(sub, ((np.float32(itry) + v0) / mx)[:, None])]
        sumqx, sumq2 = _dot(wx, q), _dot(w * q, q)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / _safe(sumq2), d)
        best = np.where(better, d * sumqx, best)
    pos[zero] = np.searchsorted(_IQ4_IDX, 0)  # L = 0
    return np.where(zero, np.float32(0), d), pos


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_ref: blocks of 32, w = d kvalues_iq4nl[q], signed d."""
    d, pos = _iq4_scales(x, None)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(_IQ4_IDX[pos], 16)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_xs_ref: 8 sub-blocks of 32, w = d (sc - 32) kvalues_iq4nl[q], signed 6-bit sc."""
    n = len(x)
    sub = x.reshape(n * 8, 32)
    scales, pos = _iq4_scales(sub, _IQ4_TRIES)
    scales = scales.reshape(n, 8)
    max_scale = _signed_absmax(scales)
    d = -max_scale / np.float32(32)
    idv = np.where(d != 0, np.float32(1) / _safe(d), np.float32(0))
    ls = np.rint(idv[:, None] * scales)
    np.clip(ls, -32, 31, out=ls)
    dl = d[:, None] * ls
    idl = np.where(dl != 0, np.float32(1) / _safe(dl), np.float32(0))
    q = _IQ4_IDX[_iq4_pos(sub, idl.reshape(n * 8, 1))].reshape(n, 256)
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
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
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
