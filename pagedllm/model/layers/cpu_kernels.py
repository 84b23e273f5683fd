"""Native CPU kernels, built once per machine with torch's C++ extension loader (a C++ compiler and ninja).

Contract. `load()` returns the extension module, or None where it cannot be built (no compiler, no ninja, or
PAGEDLLM_CPU_KERNELS=0); every caller then keeps its plain torch path, which is also what other devices and
dtypes run. All kernels take contiguous float32 CPU tensors and refuse anything else with a RuntimeError:

* `paged_decode_attention(out [n, Hq, D], q [n, Hq, D], k_cache [blocks, B, Hkv, D], v_cache,
  block_table [n, W] int64, seq_lens [n] int64, scale)`: each request's single-query attention over the first
  seq_lens[i] tokens of its paged context, keys and values read in place from their blocks;
* `paged_prefill_attention(out [T, Hq, D], q [T, Hq, D] (rows may be strided), k_cache, v_cache,
  block_tables [n, W] int64, segments [n, 3] int64, scale)`: causal attention of each segment's query rows
  (segments[i] = query start, query length, context length) over its context and itself, read in place from
  its blocks (its own keys and values already written there); rows outside every segment are left untouched;
* `silu_and_mul(out [T, I], x [T, 2I])`, `rms_norm(out, x, weight, eps)`,
  `fused_add_rms_norm(x, residual, weight, eps)` (in place: residual += x; x = norm(residual)),
  `rotary_inplace(x [T, H, D], positions [T], cos_sin_cache, heads)`: one pass each where torch takes several;
* `pack_panels(weight [O, I])` -> panels [ceil(O / w), I, w] (w = `panel_width()`, 32 with AVX-512): the weight
  transposed in strips of w output rows, zero past O; `panel_linear(x [M, I], panels, bias, O)`: x W^T (+ bias)
  for any M, streaming each panel once for up to a register block of rows (16 with AVX-512);
* `DecodeModel(layer_w, k_caches, v_caches, cos_sin, scale, eps, final_norm)(x [1, H], positions, slot_mapping,
  block_table, seq_lens)`: a whole Llama-family decoder stack for one decode token in one parallel region (ten
  tensors per layer in layer_w, the four linear weights as panels, an empty tensor for an absent bias; one cache
  pair and rotary table per layer):
  x enters as the token's embedding and leaves as the final normed hidden state, each layer's key and value
  written to its cache.

The model runner turns them on with the attention backend ("native", the default on the CPU in float32):
`set_active(load())`, after which the layers pick them up through `active_for(x)`.

Why kernels (figures from this 2-core machine, see bench/RESULTS.md): a decode step attends, per layer, over
every running request's whole context; in torch that is a copy of the context out of the cache and then SDPA,
whose CPU kernel is tuned for long query blocks: ~3.2 ms a layer at 64 requests x 192 tokens where the kernel
takes ~1.6 ms. It hands out requests longest first, one at a time, and prefetches each next block while it reads
one (blocks are scattered, which stops the hardware prefetcher): 32-64 requests of 256-384 tokens went from ~36-79
to ~28-60 ms a step over 30 layers' caches. With AVX-512 it takes 16 keys at a time, reduces their 16 dot
products together and prefetches into L2 two tiles ahead: 8-64 requests of 256-500 tokens went from ~13-15 to
~19-22 GB/s of KV read (~8.6 -> 5.8 ms a step at 8, ~77 -> 55 ms at 64, timed interleaved). The elementwise
kernels took a 2048-token prefill from ~3.1 to ~2.7 s.
oneDNN's GEMM reads the weights at 15-20 GB/s for 1-16 rows; the panel kernel streams them once for all rows, at
~30 GB/s for one row and close to that up to ~12 rows, where compute starts to bound it: decode steps of 4-12
requests at 300-token contexts went from ~39-60 ms to ~29-48 ms, one-row linears from ~23 to ~14 ms for SmolLM2's
30 layers.
The fused stack replaces ~12 dispatched ops (each a fork and join of the thread team) per layer and token by one
call with five barriers a layer, and its attention splits the context between the threads: a batch-1 forward
reads the weights within ~6 % of the LM head's bandwidth.
The prefill kernel tiles 16 query rows against 8 keys in the vector lanes, flash-attention style: ~2.2x SDPA's CPU
kernel at 256-512 tokens (SmolLM2's heads), and no gather or mask for chunks after context.
The first build takes ~30 s and is cached under ~/.cache/torch_extensions, one build per CPU model and flags
(it uses -march=native).
"""

from __future__ import annotations

import ctypes.util
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include <omp.h>
#include <utility>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(PAGEDLLM_LIBMVEC)
// glibc's vector math library: lets the compiler vectorise the softmax's exp (as <math.h> itself does under
// -ffast-math), at glibc's documented accuracy for libmvec (within 4 ulp).
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));
#endif

// Calls f(row, l) for every token l0 <= l < l1 of a paged context, in order: `row` points at the token's cached row
// (all KV heads: `row` floats); `table` maps block index -> cache block.
template <typename F>
static inline void for_each_token(const float* cache, const int64_t* table, int64_t l0, int64_t l1, int64_t bs,
                                  int64_t row, F&& f) {
  while (l0 < l1) {
    const int64_t b = l0 / bs;
    const float* block = cache + table[b] * bs * row;
    const int64_t t0 = l0 % bs, m = std::min(bs, t0 + l1 - l0);
    // The blocks are scattered, so the hardware prefetcher stops at each block's end: while on token t of this
    // block, fetch token t of the next one.
    const float* next = (b + 1) * bs < l1 ? cache + table[b + 1] * bs * row : nullptr;
    for (int64_t t = t0; t < m; ++t) {
      if (next != nullptr)
        for (int64_t c = 0; c < row; c += 16) __builtin_prefetch(next + t * row + c);
      f(block + t * row, l0 - t0 + t);
    }
    l0 += m - t0;
  }
}

// Threads for a parallel loop over `items` independent pieces of work: torch's thread count, at most one a piece.
static inline int team_size(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
}

// Scratch of one attention item (reused across items and calls of one thread).
struct AttendScratch {
  std::vector<float> scores, acc, mx, sum;
};

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

// s[l] = exp(s[l] - mx) for l < n; returns their sum (softmax numerators and denominator).
static inline float exp_in_place(float* s, int64_t n, float mx) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t l = 0; l < n; ++l) {
    const float e = expf(s[l] - mx);
    s[l] = e;
    sum += e;
  }
  return sum;
}

#if defined(__AVX512F__)
// Lane t of the result is the sum of the 16 lanes of v[t] (a transposed reduction: 45 shuffles and adds for 16
// dot products, where 16 separate horizontal sums take ~4x as many).
static inline __m512 sum16x16(const __m512* v) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] of tokens 2i, 2i+1
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit chunk: one partial sum of each of tokens 4i .. 4i+3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[i] += sum over the tile's tokens c < nt of p[i * stride + c] * value row c (at offset ko), for NR query heads
// of one KV head, the NR x D / 16 accumulators held in registers.
template <int D, int NR>
static inline void values_tile(float* acc, const float* p, int64_t stride, const float* const* rows, int64_t ko,
                               int64_t nt) {
  constexpr int DV = D / 16;
  __m512 av[NR][DV];
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < DV; ++v) av[i][v] = _mm512_loadu_ps(acc + i * D + 16 * v);
  for (int64_t c = 0; c < nt; ++c) {
    const float* vr = rows[c] + ko;
    __m512 vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = _mm512_loadu_ps(vr + 16 * v);
    for (int i = 0; i < NR; ++i) {
      const __m512 pi = _mm512_set1_ps(p[i * stride + c]);
      for (int v = 0; v < DV; ++v) av[i][v] = _mm512_fmadd_ps(pi, vv[v], av[i][v]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(acc + i * D + 16 * v, av[i][v]);
}

// attend_span for the specialised head sizes (64, 128; any multiple of 16 would do) with AVX-512: the same three
// passes (scores, softmax, values) over tiles of 16 tokens. A tile's 16 keys are read once for all query heads,
// their dot products reduced together (sum16x16); values accumulate in registers, up to 16 vectors of query heads
// of one KV head at a time. The rows of the tile two ahead are prefetched into L2, spread over the current tile's
// work: blocks are scattered, which stops the hardware prefetcher (into L1, or one tile ahead, read ~35 % slower).
template <int D>
static void attend_span_avx512(float* m, float* lsum, float* acc, const float* q, const float* kc, const float* vc,
                               const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row, int64_t hq,
                               int64_t g, float sc, std::vector<float>& scores) {
  constexpr int DV = D / 16, T = 16, kAhead = 2;
  constexpr int RB = DV >= 16 ? 1 : std::min(4, 16 / DV);  // query heads whose accumulators share the registers
  const int64_t span = l1 - l0, stride = (span + T - 1) / T * T;
  const int64_t used = ((hq - 1) / g + 1) * D;  // floats of each token row this span reads
  scores.resize(hq * stride);
  float* s = scores.data();
  const float* kr[T];
  const float* nxt[T];
  auto rows_of = [&](const float* base, int64_t t0, const float** out) {
    const int64_t nt = std::min<int64_t>(T, l1 - t0);
    int64_t b = t0 / bs, o = t0 % bs;
    for (int c = 0; c < nt; ++c) {
      out[c] = base + (table[b] * bs + o) * row;
      if (++o == bs) o = 0, ++b;
    }
    for (int c = nt; c < T; ++c) out[c] = out[nt - 1];  // past the span: repeat its last token (never used)
    return nt;
  };
  const float* pf[T];
  int64_t pf_lines = 0;
  const int64_t lpr = used / 16;
  // Prefetch lines [i0, i1) of the tile kAhead ahead (rows pf, pf_lines lines in all).
  auto prefetch = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < std::min(i1, pf_lines); ++i)
      _mm_prefetch(reinterpret_cast<const char*>(pf[i / lpr] + (i % lpr) * 16), _MM_HINT_T1);
  };
  const int64_t ntiles = stride / T;
  // The tiles are read in the order K 0 .. ntiles-1, then V 0 .. ntiles-1: aim kAhead tiles ahead in it.
  auto plan_prefetch = [&](int64_t tile) {
    int64_t ahead = tile + kAhead;
    const float* base = ahead < ntiles ? kc : vc;
    if (ahead >= ntiles) ahead -= ntiles;
    pf_lines = ahead < ntiles ? rows_of(base, l0 + ahead * T, pf) * lpr : 0;
  };
  for (int64_t tile = 0; tile < kAhead; ++tile) {  // the first tiles, before they are needed
    plan_prefetch(tile - kAhead);
    prefetch(0, pf_lines);
  }
  const __m512 scv = _mm512_set1_ps(sc);
  // Pass 1: scores, s[r * stride + l - l0].
  int64_t nt = rows_of(kc, l0, kr);
  for (int64_t t0 = l0; t0 < l1; t0 += T) {
    const int64_t nn = t0 + T < l1 ? rows_of(kc, t0 + T, nxt) : 0;
    plan_prefetch((t0 - l0) / T);
    for (int64_t r = 0; r < hq; ++r) {
      prefetch(r * pf_lines / hq, (r + 1) * pf_lines / hq);
      const float* qr = q + r * D;
      const int64_t ko = (r / g) * D;
      __m512 qv[DV], a[T];
      for (int v = 0; v < DV; ++v) qv[v] = _mm512_mul_ps(_mm512_loadu_ps(qr + 16 * v), scv);
#pragma GCC unroll 16
      for (int c = 0; c < T; ++c) {
        const float* k = kr[c] + ko;
        __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int v = 1; v < DV; ++v) x = _mm512_fmadd_ps(qv[v], _mm512_loadu_ps(k + 16 * v), x);
        a[c] = x;
      }
      _mm512_storeu_ps(s + r * stride + (t0 - l0), sum16x16(a));
    }
    std::copy(nxt, nxt + T, kr);
    nt = nn;
  }
  // Pass 2: softmax numerators and sums, per query head.
  for (int64_t r = 0; r < hq; ++r) {
    float* sr = s + r * stride;
    float mr = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mr)
    for (int64_t l = 0; l < span; ++l) mr = std::max(mr, sr[l]);
    m[r] = mr;
    lsum[r] = exp_in_place(sr, span, mr);
  }
  // Pass 3: values, a tile at a time; per tile, query heads in runs of up to RB sharing one KV head.
  std::fill(acc, acc + hq * D, 0.f);
  nt = rows_of(vc, l0, kr);
  for (int64_t t0 = l0; t0 < l1; t0 += T) {
    const int64_t nn = t0 + T < l1 ? rows_of(vc, t0 + T, nxt) : 0;
    plan_prefetch(ntiles + (t0 - l0) / T);
    for (int64_t r0 = 0; r0 < hq;) {
      const int64_t kvh = r0 / g, r1 = std::min<int64_t>({hq, (kvh + 1) * g, r0 + RB});
      prefetch(r0 * pf_lines / hq, r1 * pf_lines / hq);
      const float* sp = s + r0 * stride + (t0 - l0);
      float* ap = acc + r0 * D;
      switch (r1 - r0) {
        case 1: values_tile<D, 1>(ap, sp, stride, kr, kvh * D, nt); break;
        case 2: values_tile<D, std::min(2, RB)>(ap, sp, stride, kr, kvh * D, nt); break;
        case 3: values_tile<D, std::min(3, RB)>(ap, sp, stride, kr, kvh * D, nt); break;
        default: values_tile<D, std::min(4, RB)>(ap, sp, stride, kr, kvh * D, nt); break;
      }
      r0 = r1;
    }
    std::copy(nxt, nxt + T, kr);
    nt = nn;
  }
}
#endif

// Single-query attention of `hq` consecutive query heads q [hq, d] over the tokens [l0, l1) of one paged context:
// query head r reads KV head r / g counted from kc and vc (which may point past a token row's start, to skip KV
// heads); a cached token is `row` floats, read once for every head. The result is flash-decoding's unnormalised
// partial result, per head: its score max m[r], its sum of exp lsum[r] and
// acc[r] = sum of exp(score - m[r]) * value. An empty span gives m = -inf, lsum = 0, acc = 0.
template <int D>
static void attend_span(float* m, float* lsum, float* acc, const float* q, const float* kc, const float* vc,
                        const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row, int64_t hq,
                        int64_t g, int64_t d_rt, float sc, std::vector<float>& scores) {
  const int64_t d = D > 0 ? D : d_rt, span = l1 - l0;
  std::fill(m, m + hq, -std::numeric_limits<float>::infinity());
  std::fill(lsum, lsum + hq, 0.f);
  std::fill(acc, acc + hq * d, 0.f);
  if (span <= 0) return;
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 16 == 0) {
    attend_span_avx512<D>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, sc, scores);
    return;
  }
#endif
  scores.resize(hq * span);
  float* s = scores.data();
  for_each_token(kc, table, l0, l1, bs, row, [&](const float* kt, int64_t l) {
    for (int64_t r = 0; r < hq; ++r) {
      const float v = dot(q + r * d, kt + (r / g) * d, d) * sc;
      s[r * span + l - l0] = v;
      m[r] = std::max(m[r], v);
    }
  });
  for (int64_t r = 0; r < hq; ++r) {
    lsum[r] = exp_in_place(s + r * span, span, m[r]);
  }
  for_each_token(vc, table, l0, l1, bs, row, [&](const float* vt, int64_t l) {
    for (int64_t r = 0; r < hq; ++r) {
      const float p = s[r * span + l - l0];
      const float* vr = vt + (r / g) * d;
      float* ar = acc + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) ar[x] += p * vr[x];
    }
  });
}

// Single-query attention of `rows` consecutive query heads q [rows, d] over one request's whole paged context of
// `len` tokens, query row r reading KV head kv0 + r / g: attend_span over [0, len), normalised into out.
template <int D>
static void attend_item(float* out, const float* q, const float* kp, const float* vp, const int64_t* table,
                        int64_t len, int64_t bs, int64_t row, int64_t kv0, int64_t rows, int64_t g, int64_t d_rt,
                        float sc, AttendScratch& s) {
  const int64_t d = D > 0 ? D : d_rt;
  s.mx.resize(rows);
  s.sum.resize(rows);
  s.acc.resize(rows * d);
  attend_span<D>(s.mx.data(), s.sum.data(), s.acc.data(), q, kp + kv0 * d, vp + kv0 * d, table, 0, len, bs, row,
                 rows, g, d, sc, s.scores);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / s.sum[r];
    float* orow = out + r * d;
    const float* ar = s.acc.data() + r * d;
    for (int64_t x = 0; x < d; ++x) orow[x] = ar[x] * inv;
  }
}

// Every request of the batch, in parallel over items. An item is one request's KV heads [h0, h0 + hs) and their
// query heads: all KV heads when there are enough requests to keep every thread busy (each cached token row is
// then read whole and in order), one each otherwise.
template <int D>
static void decode_loop(float* op, const float* qp, const float* kp, const float* vp, const int64_t* tp,
                        const int64_t* lp, int64_t n, int64_t hq, int64_t hkv, int64_t bs, int64_t width,
                        int64_t d, float sc) {
  const int64_t g = hq / hkv;
  const int64_t row = hkv * d;  // floats between consecutive tokens of one block
  const int64_t hs = n >= 4 * at::get_num_threads() ? hkv : 1;
  const int64_t per_req = hkv / hs, items = n * per_req;
  // Longest contexts first, handed out one at a time: the threads finish together even when the lengths differ
  // or one thread loses its core for a while to another process (on a 2-core server, the API server's).
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[a] > lp[b]; });
  const int nt = team_size(items);
#pragma omp parallel num_threads(nt)
  {
    AttendScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = order[item / per_req], h0 = (item % per_req) * hs;
      const int64_t first = i * hq + h0 * g;  // the item's query heads are consecutive
      attend_item<D>(op + first * d, qp + first * d, kp, vp, tp + i * width, lp[i], bs, row, h0, hs * g, g, d, sc,
                     scratch);
    }
  }
}

static void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
              name, " must be a contiguous float32 CPU tensor");
}

static inline float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// out[t, k] = silu(x[t, k]) * x[t, I + k] for x [T, 2I] (gate | up), out [T, I].
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_float(out, "out");
  check_float(x, "x");
  const int64_t rows = x.size(0), inner = out.size(1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == rows && x.size(1) == 2 * inner, "x [T, 2I], out [T, I]");
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * inner, 8192, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t t = begin / inner, k0 = begin % inner, k1 = std::min(inner, k0 + (end - begin));
      const float* g = xp + t * 2 * inner;
      const float* u = g + inner;
      float* o = op + t * inner;
#pragma omp simd
      for (int64_t k = k0; k < k1; ++k) o[k] = silu_mul(g[k], u[k]);
      begin += k1 - k0;
    }
  });
}

static inline void rms_row(float* out, const float* x, const float* w, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < h; ++k) ss += x[k] * x[k];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t k = 0; k < h; ++k) out[k] = w[k] * (x[k] * r);
}

// residual += x; out = rms_norm(residual) * w (out may be x).
static inline void add_rms_row(float* out, float* residual, const float* x, const float* w, int64_t h, float eps) {
#pragma omp simd
  for (int64_t k = 0; k < h; ++k) residual[k] += x[k];
  rms_row(out, residual, w, h, eps);
}

// out = x * rsqrt(mean(x^2) + eps) * weight, row by row (x, out [T, H]).
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_float(out, "out");
  check_float(x, "x");
  check_float(weight, "weight");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && weight.numel() == h, "x, out [T, H], weight [H]");
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_row(op + t * h, xp + t * h, wp, h, static_cast<float>(eps));
  });
}

// In place: residual += x; x = rms_norm(residual) * weight (x, residual [T, H]).
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_float(x, "x");
  check_float(residual, "residual");
  check_float(weight, "weight");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && weight.numel() == h, "x, residual [T, H]");
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / h), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * h;
      add_rms_row(xr, rp + t * h, xr, wp, h, static_cast<float>(eps));
    }
  });
}

// One head v in place, HF's "rotate half" over its first 2 * half dims; c holds cos | sin (half each).
static inline void rotate_head(float* v, const float* c, int64_t half) {
  const float* sn = c + half;
#pragma omp simd
  for (int64_t k = 0; k < half; ++k) {
    const float x1 = v[k], x2 = v[k + half];
    v[k] = x1 * c[k] - x2 * sn[k];
    v[k + half] = x2 * c[k] + x1 * sn[k];
  }
}

// In place on x [T, H, D] (contiguous): rotate the first `heads` heads of every token by its position, HF's
// "rotate half" layout over the first `rot` dims; cache [max_position, rot] holds cos | sin.
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cache, int64_t heads) {
  check_float(x, "x");
  check_float(cache, "cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(x.dim() == 3 && positions.numel() == x.size(0) && heads <= x.size(1), "x [T, H, D], positions [T]");
  const int64_t rows = x.size(0), h = x.size(1), d = x.size(2), rot = cache.size(1), half = rot / 2;
  TORCH_CHECK(rot <= d && rot % 2 == 0, "rotary dims must be even and at most the head size");
  const int64_t max_pos = cache.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " out of range");
  float* xp = x.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  at::parallel_for(0, rows * heads, std::max<int64_t>(1, 4096 / d), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, hh = item % heads;
      rotate_head(xp + (t * h + hh) * d, cp + pp[t] * rot, half);
    }
  });
}

// ---- Few-row linear layers on weights packed in panels ----
// A panel holds kPanel consecutive output rows of a weight W [O, I] transposed: panels[p][i][n] = W[p kPanel + n][i]
// (zero past O), so one panel is a contiguous stream of I * kPanel floats. y [M, O] = x W^T for a few rows M is
// then a GEMM micro-kernel per panel: for each input column i, two vector loads of the panel row and M broadcasts of
// x[m][i] into 2 M register accumulators. Each weight is read from memory once for all the rows, with no horizontal
// sums; rows beyond what the registers hold go in blocks over the same panel, which is then in L2.
// On this 2-core Zen 4, SmolLM2's 30 layers of linears: 4 rows ~17 ms, 8 ~20, 12 ~22 against oneDNN's 21-29;
// one row ~14 ms, as fast as dot products over the dense rows.
#if defined(__AVX512F__)
typedef __m512 pvec;
constexpr int kLanes = 16, kPanelBlock = 16;
static inline pvec pv_zero() { return _mm512_setzero_ps(); }
static inline pvec pv_load(const float* p) { return _mm512_loadu_ps(p); }
static inline pvec pv_splat(float x) { return _mm512_set1_ps(x); }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline void pv_store(float* p, pvec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 pvec;
constexpr int kLanes = 8, kPanelBlock = 6;
static inline pvec pv_zero() { return _mm256_setzero_ps(); }
static inline pvec pv_load(const float* p) { return _mm256_loadu_ps(p); }
static inline pvec pv_splat(float x) { return _mm256_set1_ps(x); }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline void pv_store(float* p, pvec v) { _mm256_storeu_ps(p, v); }
#else
typedef float pvec __attribute__((vector_size(16)));
constexpr int kLanes = 4, kPanelBlock = 8;
static inline pvec pv_zero() { return pvec{0.f, 0.f, 0.f, 0.f}; }
static inline pvec pv_load(const float* p) { pvec v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline pvec pv_splat(float x) { return pvec{x, x, x, x}; }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return a * b + c; }
static inline void pv_store(float* p, pvec v) { __builtin_memcpy(p, &v, sizeof v); }
#endif
constexpr int kPanel = 2 * kLanes;

// Writes a panel's results for outputs [lo, hi) of it (bias added) to y, from the two accumulators.
static inline void panel_out(pvec a0, pvec a1, float* y, const float* bias, int64_t lo, int64_t hi) {
  float t[kPanel];
  pv_store(t, a0);
  pv_store(t + kLanes, a1);
  for (int64_t n = lo; n < hi; ++n) y[n] = bias ? t[n] + bias[n] : t[n];
}

// One row: y[lo..hi) = panel . x, with two interleaved accumulator pairs over i (hides the FMA latency).
static inline void panel_row(const float* __restrict wp, const float* __restrict x, int64_t in, float* y,
                             const float* bias, int64_t lo, int64_t hi) {
  pvec a0 = pv_zero(), a1 = pv_zero(), b0 = pv_zero(), b1 = pv_zero();
  int64_t i = 0;
  for (; i + 1 < in; i += 2) {
    const float* w = wp + i * kPanel;
    const pvec x0 = pv_splat(x[i]), x1 = pv_splat(x[i + 1]);
    a0 = pv_fma(pv_load(w), x0, a0);
    a1 = pv_fma(pv_load(w + kLanes), x0, a1);
    b0 = pv_fma(pv_load(w + kPanel), x1, b0);
    b1 = pv_fma(pv_load(w + kPanel + kLanes), x1, b1);
  }
  if (i < in) {
    const pvec xv = pv_splat(x[i]);
    a0 = pv_fma(pv_load(wp + i * kPanel), xv, a0);
    a1 = pv_fma(pv_load(wp + i * kPanel + kLanes), xv, a1);
  }
  panel_out(a0 + b0, a1 + b1, y, bias, lo, hi);
}

// MB rows at once: xt holds them transposed (xt[i * ld + m]); row m's outputs go to y + m * ys.
template <int MB>
static void panel_rows(const float* __restrict wp, const float* __restrict xt, int64_t ld, int64_t in, float* y,
                       int64_t ys, const float* bias, int64_t nout) {
  pvec acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = pv_zero();
  for (int64_t i = 0; i < in; ++i) {
    const pvec w0 = pv_load(wp + i * kPanel), w1 = pv_load(wp + i * kPanel + kLanes);
    const float* xi = xt + i * ld;
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const pvec xv = pv_splat(xi[m]);
      acc0[m] = pv_fma(w0, xv, acc0[m]);
      acc1[m] = pv_fma(w1, xv, acc1[m]);
    }
  }
  for (int m = 0; m < MB; ++m) panel_out(acc0[m], acc1[m], y + m * ys, bias, 0, nout);
}

using PanelRowsFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, const float*, int64_t);

// panel_rows<mb> for a block size known only at run time (1 <= mb <= kPanelBlock).
template <int... Ms>
static PanelRowsFn panel_rows_for(int mb, std::integer_sequence<int, Ms...>) {
  static const PanelRowsFn table[] = {panel_rows<Ms + 1>...};
  return table[mb - 1];
}

// y[m, :] for outputs [o0, o1) of one input row x (any alignment: a panel shared with a neighbouring range is read
// whole and written in part).
static void gemv_panels(const float* wp, const float* x, const float* bias, float* y, int64_t o0, int64_t o1,
                        int64_t in) {
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    const int64_t base = p * kPanel;
    panel_row(wp + p * in * kPanel, x, in, y + base, bias ? bias + base : nullptr, std::max<int64_t>(o0 - base, 0),
              std::min<int64_t>(o1 - base, kPanel));
  }
}

int64_t panel_width() { return kPanel; }

// A weight W [O, I] in panels: [ceil(O / kPanel), I, kPanel], zero past O.
torch::Tensor pack_panels(torch::Tensor weight) {
  check_float(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0, "weight must be a non-empty [O, I]");
  const int64_t out = weight.size(0), in = weight.size(1), np = (out + kPanel - 1) / kPanel;
  auto padded = torch::zeros({np * kPanel, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({np, kPanel, in}).transpose(1, 2).contiguous();
}

// y [M, O] = x [M, I] W^T (+ bias) from W's panels [ceil(O / kPanel), I, kPanel]; the threads split the panels and
// each runs its rows in blocks of at most kPanelBlock.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                           int64_t out_features) {
  check_float(x, "x");
  check_float(panels, "panels");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M, I]");
  const int64_t rows = x.size(0), in = x.size(1), np = (out_features + kPanel - 1) / kPanel;
  TORCH_CHECK(out_features >= 1 && panels.dim() == 3 && panels.size(0) == np && panels.size(1) == in &&
                  panels.size(2) == kPanel,
              "panels must be [ceil(O / ", kPanel, "), I, ", kPanel, "] for x [M, I] and ", out_features,
              " outputs");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_float(*bias, "bias");
    TORCH_CHECK(bias->numel() == out_features, "bias must be [O]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({rows, out_features}, x.options());
  float* yp = y.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *wp = panels.data_ptr<float>();
  // Panels are handed out in shrinking chunks (guided; each panel is a contiguous stream of I * kPanel floats): the
  // threads finish together even when one loses its core for a while to another process.
  const int nt = team_size(np);
  if (rows == 1) {
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t p = 0; p < np; ++p)
      gemv_panels(wp, xp, bp, yp, p * kPanel, std::min((p + 1) * kPanel, out_features), in);
    return y;
  }
  std::vector<float> xt(in * rows);  // x transposed: one input column's rows side by side
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < in; ++i) xt[i * rows + m] = xp[m * in + i];
  // Rows in near-equal blocks of at most kPanelBlock, each with its kernel, chosen once for all panels.
  const int64_t blocks = (rows + kPanelBlock - 1) / kPanelBlock;
  std::vector<int64_t> first(blocks);
  std::vector<PanelRowsFn> kernel(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    first[b] = rows * b / blocks;
    kernel[b] = panel_rows_for(static_cast<int>(rows * (b + 1) / blocks - first[b]),
                               std::make_integer_sequence<int, kPanelBlock>{});
  }
#pragma omp parallel for schedule(guided) num_threads(nt)
  for (int64_t p = 0; p < np; ++p) {
    const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, out_features - base);
    for (int64_t b = 0; b < blocks; ++b)
      kernel[b](wp + p * in * kPanel, xt.data() + first[b], rows, in, yp + first[b] * out_features + base,
                out_features, bp ? bp + base : nullptr, nout);
  }
  return y;
}

// The checks both paged attention kernels share: out and q [T, Hq, D] of one shape, float32, out contiguous and
// q's heads contiguous within a token (its rows may be strided); caches [blocks, B, Hkv, D] of one shape, float32,
// contiguous, of q's head size, Hkv dividing Hq; the two index tensors int64 and contiguous.
static void check_paged(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& index0, const torch::Tensor& index1) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D] of one shape");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "q's heads must be contiguous within a token (rows may be strided)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, B, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(index0.scalar_type() == at::kLong && index1.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && index0.is_contiguous() &&
              index1.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, "head sizes do not match");
}

// The first `blocks` ids of a block table row name cache blocks.
static void check_block_ids(const int64_t* row, int64_t blocks, int64_t num_blocks) {
  for (int64_t b = 0; b < blocks; ++b) TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "block id out of range");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  check_paged(out, q, k_cache, v_cache, block_table, seq_lens);
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == n && seq_lens.numel() == n, "one row per query");
  const int64_t g = hq / hkv, width = block_table.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * bs, "seq_len ", lp[i], " outside 1..", width * bs);
    check_block_ids(tp + i * width, (lp[i] + bs - 1) / bs, num_blocks);
  }
  const float sc = static_cast<float>(scale);
  switch (d) {
    case 64: decode_loop<64>(op, qp, kp, vp, tp, lp, n, hq, hkv, bs, width, 64, sc); break;
    case 128: decode_loop<128>(op, qp, kp, vp, tp, lp, n, hq, hkv, bs, width, 128, sc); break;
    default: decode_loop<0>(op, qp, kp, vp, tp, lp, n, hq, hkv, bs, width, d, sc);
  }
}

// Causal attention of up to R query rows of one query head over a paged context, flash-attention style: key tiles
// of C tokens; the R rows sit in the vector lanes (qt holds them transposed and pre-scaled, qt[x * R + i]), so each
// key element is broadcast against R queries and the running softmax needs no horizontal reductions. Row i sits at
// position p0 + i and attends the tokens [0, p0 + i]; rows past nrows are padding (qt zero) and not written.
// kc, vc point at the query head's KV head within token rows of `row` floats; ot is [d, R] scratch.
constexpr int kPrefillRows = 16, kPrefillKeys = 8;

template <int D>
static void prefill_tile(float* out, int64_t ostride, const float* qt, int64_t nrows, int64_t p0, const float* kc,
                         const float* vc, const int64_t* table, int64_t bs, int64_t row, float* ot, int64_t d_rt) {
  constexpr int R = kPrefillRows, C = kPrefillKeys;
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  const int64_t d = D > 0 ? D : d_rt, klen = p0 + nrows;
  float m[R], l[R];
  std::fill(m, m + R, ninf);
  std::fill(l, l + R, 0.f);
  std::fill(ot, ot + d * R, 0.f);
  for (int64_t j0 = 0; j0 < klen; j0 += C) {
    const int64_t nc = std::min<int64_t>(C, klen - j0);
    const float* kr[C];
    const float* vr[C];
    for (int c = 0; c < C; ++c) {  // past the context, repeat its last token (masked below)
      const int64_t j = j0 + std::min<int64_t>(c, nc - 1);
      const int64_t off = (table[j / bs] * bs + j % bs) * row;
      kr[c] = kc + off;
      vr[c] = vc + off;
    }
    float s[C][R] = {};
    for (int64_t x = 0; x < d; ++x) {
      const float* qx = qt + x * R;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const float kv = kr[c][x];
#pragma omp simd
        for (int i = 0; i < R; ++i) s[c][i] += kv * qx[i];
      }
    }
    if (j0 + C - 1 > p0 || nc < C) {  // the tile reaches past some row's position: mask
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < R; ++i)
          if (c >= nc || j0 + c > p0 + i) s[c][i] = ninf;
    }
    // Token 0 is in the first tile and visible to every row: m is finite from the first tile on.
    float mn[R], alpha[R];
    std::copy(m, m + R, mn);
    for (int c = 0; c < C; ++c)
#pragma omp simd
      for (int i = 0; i < R; ++i) mn[i] = std::max(mn[i], s[c][i]);
#pragma omp simd
    for (int i = 0; i < R; ++i) {
      alpha[i] = expf(m[i] - mn[i]);
      m[i] = mn[i];
      l[i] *= alpha[i];
    }
    for (int c = 0; c < C; ++c)
#pragma omp simd
      for (int i = 0; i < R; ++i) {
        const float e = expf(s[c][i] - mn[i]);
        s[c][i] = e;
        l[i] += e;
      }
    for (int64_t x = 0; x < d; ++x) {
      float* o = ot + x * R;
      float acc[R];
#pragma omp simd
      for (int i = 0; i < R; ++i) acc[i] = o[i] * alpha[i];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const float vv = vr[c][x];
#pragma omp simd
        for (int i = 0; i < R; ++i) acc[i] += s[c][i] * vv;
      }
      std::copy(acc, acc + R, o);
    }
  }
  for (int64_t i = 0; i < nrows; ++i) {
    const float inv = 1.f / l[i];
    float* orow = out + i * ostride;
    for (int64_t x = 0; x < d; ++x) orow[x] = ot[x * R + i] * inv;
  }
}

// One tile of work: rows [i0, i0 + R) of query head h of segment s.
struct PrefillTask {
  int64_t seg, i0, h, cost;
};

void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor segments, double scale) {
  check_paged(out, q, k_cache, v_cache, block_tables, segments);
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3, "segments must be [n, 3]: query start, length, context");
  const int64_t nseg = segments.size(0), tokens = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == nseg, "one block table row per segment");
  const int64_t g = hq / hkv, row = hkv * d, width = block_tables.size(1), qstride = q.stride(0);
  const int64_t* sp = segments.data_ptr<int64_t>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  constexpr int R = kPrefillRows;
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t start = sp[3 * s], len = sp[3 * s + 1], ctx = sp[3 * s + 2];
    TORCH_CHECK(start >= 0 && len >= 1 && start + len <= tokens, "segment ", s, " rows [", start, ", ",
                start + len, ") outside the ", tokens, " queries");
    TORCH_CHECK(ctx >= 0 && ctx + len <= width * bs, "segment ", s, ": context ", ctx, " + ", len,
                " tokens past its block table");
    check_block_ids(tp + s * width, (ctx + len + bs - 1) / bs, num_blocks);
    for (int64_t i0 = 0; i0 < len; i0 += R)
      for (int64_t h = 0; h < hq; ++h) tasks.push_back({s, i0, h, ctx + i0});
  }
  // Longest first, handed out one at a time: causal tiles differ in cost, and the threads finish together.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& a, const PrefillTask& b) { return a.cost > b.cost; });
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(team_size(n))
  {
    std::vector<float> qt(d * R), ot(d * R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; ++t) {
      const PrefillTask& task = tasks[t];
      const int64_t start = sp[3 * task.seg], len = sp[3 * task.seg + 1], ctx = sp[3 * task.seg + 2];
      const int64_t nrows = std::min<int64_t>(R, len - task.i0), h = task.h;
      const float* qrow = qp + (start + task.i0) * qstride + h * d;
      for (int64_t i = 0; i < R; ++i)
        for (int64_t x = 0; x < d; ++x) qt[x * R + i] = i < nrows ? qrow[i * qstride + x] * sc : 0.f;
      float* orow = op + ((start + task.i0) * hq + h) * d;
      const int64_t kv = (h / g) * d;
      const int64_t* table = tp + task.seg * width;
      switch (d) {
        case 64:
          prefill_tile<64>(orow, hq * d, qt.data(), nrows, ctx + task.i0, kp + kv, vp + kv, table, bs, row,
                           ot.data(), d);
          break;
        case 128:
          prefill_tile<128>(orow, hq * d, qt.data(), nrows, ctx + task.i0, kp + kv, vp + kv, table, bs, row,
                            ot.data(), d);
          break;
        default:
          prefill_tile<0>(orow, hq * d, qt.data(), nrows, ctx + task.i0, kp + kv, vp + kv, table, bs, row,
                          ot.data(), d);
      }
    }
  }
}

// Thread t's share [first, last) of n items, in whole chunks of `align`.
static inline void share(int64_t n, int t, int nt, int64_t align, int64_t& first, int64_t& last) {
  const int64_t chunks = (n + align - 1) / align;
  first = std::min(n, chunks * t / nt * align);
  last = std::min(n, chunks * (t + 1) / nt * align);
}

static void attend_span_any(float* m, float* lsum, float* acc, const float* q, const float* kc, const float* vc,
                            const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row, int64_t hq,
                            int64_t g, int64_t d, float sc, std::vector<float>& scores) {
  if (d == 64) attend_span<64>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
  else if (d == 128) attend_span<128>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
  else attend_span<0>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
}

// The weights of one decoder layer.
struct LayerWeights {
  const float *n1, *qkv, *qkv_b, *o, *o_b, *n2, *gu, *gu_b, *down, *down_b, *cos_sin;
  float *kc, *vc;
};

// Panels of a weight [out, in] (see pack_panels).
static void check_panels(const torch::Tensor& t, int64_t out, int64_t in, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == (out + kPanel - 1) / kPanel && t.size(1) == in && t.size(2) == kPanel,
              what);
}

// A bias: an empty tensor means none.
static const float* bias_ptr(const torch::Tensor& t, int64_t numel, const char* name) {
  if (t.numel() == 0) return nullptr;
  check_float(t, name);
  TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements");
  return t.data_ptr<float>();
}

// A whole Llama-family model's decoder stack for one decode token, in one parallel region. Per layer l (weights
// layer_w[10 l .. 10 l + 9] = norm1, qkv_w, qkv_b, o_w, o_b, norm2, gate_up_w, gate_up_b, down_w, down_b, the four
// weights as panels (pack_panels); an empty bias means none):
//   residual += x (residual = x at the first layer); h = rms_norm(residual) * norm1
//   q, k, v = h Wqkv^T (+ b); rotary on q and k at positions[0] (cos_sin[l]); k, v written to cache l at
//   slot_mapping[0]
//   a = attention(q, the cached keys and values of block_table[0] over seq_lens[0] tokens) * scale
//   residual += a Wo^T (+ b); h = rms_norm(residual) * norm2
//   x = (silu(gate) * up)(h Wgu^T (+ b)) Wd^T (+ b)
// and then x = rms_norm(residual + x) * final_norm: x [1, H] enters as the token's embedding and leaves as the
// final hidden state, exactly what the unfused layers compute.
//
// Built once per set of weights and caches, which it holds and checks then: a step passes only the token's few
// index tensors (converting and checking some 400 tensors on every step cost ~0.2 ms, cache-cold after the
// weights have streamed through).
//
// Work split between the threads, five barriers a layer: each thread keeps its own copy of the residual stream and
// normalises it itself (a few hundred floats, cheaper than a barrier); the qkv rows split on head boundaries, so
// each thread rotates and caches the heads it computed; attention splits the context between the threads
// (flash-decoding: every thread reads each of its cached tokens once for all heads, and the partial results merge
// per head); gate and up split on the same rows, so SiLU-and-mul needs no barrier of its own.
class DecodeModel {
 public:
  DecodeModel(std::vector<torch::Tensor> layer_w, std::vector<torch::Tensor> k_caches,
              std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> cos_sin, double scale, double eps,
              torch::Tensor final_norm)
      : scale_(static_cast<float>(scale)), eps_(static_cast<float>(eps)) {
    const size_t layers = k_caches.size();
    TORCH_CHECK(layers >= 1 && layer_w.size() == 10 * layers && v_caches.size() == layers &&
                cos_sin.size() == layers, "10 weights, two caches and a rotary table per layer");
    check_float(final_norm, "final_norm");
    const torch::Tensor& k0 = k_caches[0];
    TORCH_CHECK(k0.dim() == 4, "caches must be [blocks, B, Hkv, D]");
    blocks_ = k0.size(0), bs_ = k0.size(1), hkv_ = k0.size(2), d_ = k0.size(3);
    check_float(layer_w[1], "qkv panels");
    check_float(layer_w[3], "o panels");
    check_float(layer_w[8], "down panels");
    TORCH_CHECK(layer_w[1].dim() == 3 && layer_w[3].dim() == 3 && layer_w[8].dim() == 3,
                "the linear weights must be panels [P, I, ", kPanel, "]");
    hidden_ = layer_w[1].size(1), inter_ = layer_w[8].size(1), hq_ = layer_w[3].size(1) / d_;
    qkv_out_ = (hq_ + 2 * hkv_) * d_;
    TORCH_CHECK(hq_ > 0 && hq_ % hkv_ == 0 && layer_w[3].size(1) == hq_ * d_,
                "o panels must be [P, Hq D, ", kPanel, "] with Hq a multiple of the caches' Hkv");
    TORCH_CHECK(final_norm.numel() == hidden_, "final_norm must be [H]");
    rot_ = cos_sin[0].dim() == 2 ? cos_sin[0].size(1) : 0;
    TORCH_CHECK(rot_ > 0 && rot_ <= d_ && rot_ % 2 == 0, "rotary dims must be even and at most the head size");
    max_pos_ = cos_sin[0].size(0);
    for (size_t l = 0; l < layers; ++l) {
      const torch::Tensor* w = layer_w.data() + 10 * l;
      for (int i : {0, 1, 3, 5, 6, 8}) check_float(w[i], "layer weights");
      check_float(k_caches[l], "k_cache");
      check_float(v_caches[l], "v_cache");
      check_float(cos_sin[l], "cos_sin");
      TORCH_CHECK(k_caches[l].sizes() == k0.sizes() && v_caches[l].sizes() == k0.sizes(), "caches of one shape");
      TORCH_CHECK(w[0].numel() == hidden_ && w[5].numel() == hidden_, "norm weights must be [H]");
      check_panels(w[1], qkv_out_, hidden_, "qkv panels must hold [(Hq + 2 Hkv) D, H]");
      check_panels(w[3], hidden_, hq_ * d_, "o panels must hold [H, Hq D]");
      check_panels(w[6], 2 * inter_, hidden_, "gate_up panels must hold [2 I, H]");
      check_panels(w[8], hidden_, inter_, "down panels must hold [H, I]");
      TORCH_CHECK(cos_sin[l].dim() == 2 && cos_sin[l].size(1) == rot_ && cos_sin[l].size(0) == max_pos_,
                  "rotary tables of one shape");
      layers_.push_back({w[0].data_ptr<float>(), w[1].data_ptr<float>(), bias_ptr(w[2], qkv_out_, "qkv bias"),
                         w[3].data_ptr<float>(), bias_ptr(w[4], hidden_, "o bias"), w[5].data_ptr<float>(),
                         w[6].data_ptr<float>(), bias_ptr(w[7], 2 * inter_, "gate_up bias"),
                         w[8].data_ptr<float>(), bias_ptr(w[9], hidden_, "down bias"),
                         cos_sin[l].data_ptr<float>(), k_caches[l].data_ptr<float>(),
                         v_caches[l].data_ptr<float>()});
    }
    fn_ = final_norm.data_ptr<float>();
    // Keep every tensor alive as long as the pointers above are in use.
    keep_ = std::move(layer_w);
    for (auto* list : {&k_caches, &v_caches, &cos_sin}) keep_.insert(keep_.end(), list->begin(), list->end());
    keep_.push_back(final_norm);
  }

  // x [1, H] in place; the token's position, cache slot, block table row and context length (int64, first
  // element of each).
  void operator()(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping, torch::Tensor block_table,
                  torch::Tensor seq_lens) const {
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == hidden_, "x must be [1, H]");
    for (auto* t : {&positions, &slot_mapping, &block_table, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() >= 1, "int64 index tensors");
    const int64_t pos = positions.data_ptr<int64_t>()[0], slot = slot_mapping.data_ptr<int64_t>()[0];
    const int64_t len = seq_lens.data_ptr<int64_t>()[0], width = block_table.size(-1);
    const int64_t* table = block_table.data_ptr<int64_t>();
    TORCH_CHECK(pos >= 0 && pos < max_pos_, "position ", pos, " out of the rotary table's range");
    TORCH_CHECK(slot >= 0 && slot < blocks_ * bs_, "slot ", slot, " out of range");
    TORCH_CHECK(len >= 1 && len <= width * bs_, "seq_len ", len, " outside 1..", width * bs_);
    for (int64_t b = 0; b < (len + bs_ - 1) / bs_; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < blocks_, "block id out of range");
    run(x.data_ptr<float>(), pos, slot, table, len);
  }

 private:
  void run(float* xp, int64_t pos, int64_t slot, const int64_t* table, int64_t len) const;

  std::vector<LayerWeights> layers_;
  std::vector<torch::Tensor> keep_;
  const float* fn_;
  float scale_, eps_;
  int64_t blocks_, bs_, hkv_, d_, hidden_, qkv_out_, inter_, hq_, rot_, max_pos_;
};

void DecodeModel::run(float* xp, int64_t pos, int64_t slot, const int64_t* table, int64_t len) const {
  const int64_t hidden = hidden_, bs = bs_, hkv = hkv_, d = d_, qkv_out = qkv_out_, inter = inter_, hq = hq_;
  const int64_t layers = static_cast<int64_t>(layers_.size()), half = rot_ / 2, cs_off = pos * rot_;
  const float* fn = fn_;
  const int64_t row = hkv * d, g = hq / hkv;
  const float sc = scale_, ep = eps_;
  const int nt = std::max(1, at::get_num_threads());
  // Shared between the threads: q|k|v, the attention output, SiLU-and-mul's output, and every thread's partial
  // attention (max, sum, accumulator per head).
  std::vector<float> shared(qkv_out + hq * d + inter + nt * hq * (d + 2));
  float* qkv = shared.data();
  float* att = qkv + qkv_out;
  float* act = att + hq * d;
  float* part = act + inter;
  std::vector<float> gate_up(2 * inter);
  float* gu = gate_up.data();

#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> mine(2 * hidden);
    float* res = mine.data();  // this thread's copy of the residual stream
    float* h = res + hidden;
    std::vector<float> scores;
    int64_t a, b, ha, hb, ia, ib, ra, rb;
    share(qkv_out / d, t, n, 1, ha, hb);  // heads of q|k|v
    share(inter, t, n, kPanel, ia, ib);
    share(hidden, t, n, kPanel, ra, rb);
    share(len, t, n, 1, a, b);  // this thread's span of the context
    float* pm = part + t * hq * (d + 2);
    for (int64_t l = 0; l < layers; ++l) {
      const LayerWeights& w = layers_[l];
      if (l == 0) {
        std::copy(xp, xp + hidden, res);
        rms_row(h, res, w.n1, hidden, ep);
      } else {
        add_rms_row(h, res, xp, w.n1, hidden, ep);
      }
      gemv_panels(w.qkv, h, w.qkv_b, qkv, ha * d, hb * d, hidden);
      for (int64_t hh = ha; hh < hb; ++hh) {
        float* v = qkv + hh * d;
        if (hh < hq + hkv) rotate_head(v, w.cos_sin + cs_off, half);
        if (hh >= hq + hkv) std::copy(v, v + d, w.vc + slot * row + (hh - hq - hkv) * d);
        else if (hh >= hq) std::copy(v, v + d, w.kc + slot * row + (hh - hq) * d);
      }
#pragma omp barrier
      attend_span_any(pm, pm + hq, pm + 2 * hq, qkv, w.kc, w.vc, table, a, b, bs, row, hq, g, d, sc, scores);
#pragma omp barrier
      int64_t qa, qb;
      share(hq, t, n, 1, qa, qb);
      for (int64_t r = qa; r < qb; ++r) {  // merge the threads' partial results of query head r
        float mx = -std::numeric_limits<float>::infinity();
        for (int u = 0; u < n; ++u) mx = std::max(mx, part[u * hq * (d + 2) + r]);
        float total = 0.f;
        float* o = att + r * d;
        std::fill(o, o + d, 0.f);
        for (int u = 0; u < n; ++u) {
          const float* pu = part + u * hq * (d + 2);
          const float f = pu[hq + r] > 0.f ? expf(pu[r] - mx) : 0.f;
          total += f * pu[hq + r];
          const float* au = pu + 2 * hq + r * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) o[k] += f * au[k];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) o[k] *= inv;
      }
#pragma omp barrier
      gemv_panels(w.o, att, w.o_b, xp, ra, rb, hq * d);
#pragma omp barrier
      add_rms_row(h, res, xp, w.n2, hidden, ep);
      gemv_panels(w.gu, h, w.gu_b, gu, ia, ib, hidden);
      gemv_panels(w.gu, h, w.gu_b, gu, inter + ia, inter + ib, hidden);
#pragma omp simd
      for (int64_t k = ia; k < ib; ++k) act[k] = silu_mul(gu[k], gu[inter + k]);
#pragma omp barrier
      gemv_panels(w.down, act, w.down_b, xp, ra, rb, inter);
#pragma omp barrier
    }
    if (t == 0) add_rms_row(xp, res, xp, fn, hidden, ep);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", torch::wrap_pybind_function(paged_decode_attention));
  m.def("paged_prefill_attention", torch::wrap_pybind_function(paged_prefill_attention));
  m.def("silu_and_mul", torch::wrap_pybind_function(silu_and_mul));
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm));
  m.def("fused_add_rms_norm", torch::wrap_pybind_function(fused_add_rms_norm));
  m.def("rotary_inplace", torch::wrap_pybind_function(rotary_inplace));
  m.def("panel_width", &panel_width);
  m.def("pack_panels", torch::wrap_pybind_function(pack_panels));
  m.def("panel_linear", torch::wrap_pybind_function(panel_linear));
  py::class_<DecodeModel>(m, "DecodeModel")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<torch::Tensor>, double, double, torch::Tensor>(),
           py::arg("layer_w"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos_sin"), py::arg("scale"),
           py::arg("eps"), py::arg("final_norm"))
      .def("__call__", &DecodeModel::operator(), py::arg("x"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_table"), py::arg("seq_lens"));
}
"""

_UNSET = object()
_module: Any = _UNSET
# The kernels the model layers use: set by the model runner (`set_active`) when its backend is native.
_active: Any = None


def _cpu_tag() -> str:
    """A short hash of this CPU's model and flags: the build uses -march=native, so each CPU gets its own."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return hashlib.sha1("".join(lines).encode()).hexdigest()[:10]


def load() -> Any:
    """The extension module (built on the first call), or None where it cannot be built."""
    global _module
    if _module is _UNSET:
        _module = _build()
    return _module


def paged_decode_op() -> Callable[..., None] | None:
    """The native paged decode attention (built on first call), or None where it cannot be built."""
    module = load()
    return None if module is None else module.paged_decode_attention


def set_active(module: Any) -> None:
    """Route the model layers' RMSNorm, SiLU-and-mul and rotary through `module` (None: plain torch)."""
    global _active
    _active = module


def active_for(x: torch.Tensor) -> Any:
    """The active kernels if they apply to `x` (a float32 CPU tensor), else None."""
    if _active is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return _active


def _build() -> Any:
    if os.environ.get("PAGEDLLM_CPU_KERNELS", "1").strip() == "0":
        return None
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        logger.warning("no C++ compiler (%s) found: decode attention uses the slower torch path", compiler)
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        cflags, ldflags = ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]
        if platform.machine() == "x86_64" and ctypes.util.find_library("mvec"):
            cflags.append("-DPAGEDLLM_LIBMVEC")
            ldflags.append("-lmvec")
        module = load_inline(
            name=f"pagedllm_cpu_kernels_{_cpu_tag()}",
            cpp_sources=[_SOURCE],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            verbose=False,
        )
    except Exception as exc:  # a missing ninja or a failing compiler: fall back, say why
        logger.warning("could not build the CPU decode attention kernel (%s): using the torch path", exc)
        return None
    return module
