// Linear layers in bfloat16 with float32 accumulation: weights packed in bf16 pair panels, inputs rounded to bf16.
//
// A bf16 panel holds kPanel consecutive output rows of W [O, I] as 32-bit pairs: pp[i2 * kPanel + n] = bf16(W[n][2
// i2]) | bf16(W[n][2 i2 + 1]) << 16 (zero past O, and past I when I is odd), so a panel is a stream of ceil(I / 2)
// * kPanel pairs, half the bytes of a float32 panel. An input row x is rounded to bf16 the same way, and read as
// pairs x2[i2]. y[n] = sum over i2 of the pair's dot product: where the CPU has AVX512-BF16, one vdpbf16ps does 16
// outputs' pair products and adds them to float32 accumulators (twice the multiply rate of float32 FMAs); elsewhere
// the pairs are widened to float32 (exact: a bf16 is a float32's upper half) and multiplied with FMAs, the same
// products summed in another order. The micro-kernel is linear.cpp's: per panel, MB input rows in registers, each
// weight pair read once for all of them. Rounding: each product of two bf16 is exact in float32; the sum is float32.
//
// Users: `--dtype bfloat16` weights (packed once, at load) and the GGUF path for many rows (quant.cpp de-quantizes a
// panel at a time into bf16 panels, where the CPU has AVX512-BF16).
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

constexpr int64_t kBf16Slice = 128;  // pairs of a panel slice: 16 KiB

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGEDLLM_NATIVE_BF16 1
constexpr int kBf16Block = 14;  // 28 accumulators, two weight vectors and a broadcast: 31 of the 32 registers
#elif defined(__AVX512F__)
constexpr int kBf16Block = 12;
#else
constexpr int kBf16Block = kPanelBlock;
#endif

// The float32 value of the even (low) and odd (high) bf16 of each pair in kLanes consecutive pairs.
#if defined(__AVX512F__)
static inline pvec pair_lo(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
static inline pvec pair_hi(const uint32_t* p) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline pvec pair_lo(const uint32_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
static inline pvec pair_hi(const uint32_t* p) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#else
static inline pvec pair_lo(const uint32_t* p) {
  float f[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    const uint32_t u = p[k] << 16;
    std::memcpy(&f[k], &u, 4);
  }
  return pv_load(f);
}
static inline pvec pair_hi(const uint32_t* p) {
  float f[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    const uint32_t u = p[k] & 0xFFFF0000u;
    std::memcpy(&f[k], &u, 4);
  }
  return pv_load(f);
}
#endif

static inline float lo_float(uint32_t pair) {
  const uint32_t u = pair << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline float hi_float(uint32_t pair) {
  const uint32_t u = pair & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// MB input rows (their pairs interleaved: xt[i2 * ld + m]) against one panel of in2 pairs; row m's outputs [0, nout)
// go to y + m * ys, bias added when given; with `add`, the sums are added to what y holds (a later slice of the
// pairs: the caller splits long panels so that a slice stays in L1 for every row block).
template <int MB>
static void bf16_rows(const uint32_t* __restrict wp, const uint32_t* __restrict xt, int64_t ld, int64_t in2, float* y,
                      int64_t ys, const float* bias, int64_t nout, bool add) {
#if defined(PAGEDLLM_NATIVE_BF16)
  __m512 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
  for (int64_t i2 = 0; i2 < in2; ++i2) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + i2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + i2 * kPanel + kLanes);
    const uint32_t* xi = xt + i2 * ld;
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xi[m]));
      acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, xv);
      acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, xv);
    }
  }
#else
  pvec acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = pv_zero();
  for (int64_t i2 = 0; i2 < in2; ++i2) {
    const uint32_t* w = wp + i2 * kPanel;
    const pvec e0 = pair_lo(w), o0 = pair_hi(w), e1 = pair_lo(w + kLanes), o1 = pair_hi(w + kLanes);
    const uint32_t* xi = xt + i2 * ld;
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const pvec xe = pv_splat(lo_float(xi[m])), xo = pv_splat(hi_float(xi[m]));
      acc0[m] = pv_fma(o0, xo, pv_fma(e0, xe, acc0[m]));
      acc1[m] = pv_fma(o1, xo, pv_fma(e1, xe, acc1[m]));
    }
  }
#endif
  for (int m = 0; m < MB; ++m) {
    float* out = y + m * ys;
    if (nout == kPanel) {  // a whole panel: vector adds, the same sums as the scalar tail below
      pvec a0 = acc0[m], a1 = acc1[m];
      if (bias) a0 = pv_add(a0, pv_load(bias)), a1 = pv_add(a1, pv_load(bias + kLanes));
      if (add) a0 = pv_add(pv_load(out), a0), a1 = pv_add(pv_load(out + kLanes), a1);
      pv_store(out, a0);
      pv_store(out + kLanes, a1);
      continue;
    }
    float t[kPanel];
    pv_store(t, acc0[m]);
    pv_store(t + kLanes, acc1[m]);
    if (add)
      for (int64_t n = 0; n < nout; ++n) out[n] += bias ? t[n] + bias[n] : t[n];
    else
      for (int64_t n = 0; n < nout; ++n) out[n] = bias ? t[n] + bias[n] : t[n];
  }
}

using Bf16RowsFn = void (*)(const uint32_t*, const uint32_t*, int64_t, int64_t, float*, int64_t, const float*, int64_t,
                            bool);

template <int... Ms>
static Bf16RowsFn bf16_rows_for(int mb, std::integer_sequence<int, Ms...>) {
  static const Bf16RowsFn table[] = {bf16_rows<Ms + 1>...};
  return table[mb - 1];
}

static inline Bf16RowsFn bf16_kernel(int64_t mb) {
  return bf16_rows_for(static_cast<int>(mb), std::make_integer_sequence<int, kBf16Block>{});
}

}  // namespace

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);                  // round to nearest even
}

void bf16_round_row(uint16_t* dst, const float* x, int64_t n) {
  int64_t i = 0;
#if defined(PAGEDLLM_NATIVE_BF16)
  for (; i + 32 <= n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(dst + i, (__m512i)v);
  }
#endif
  for (; i < n; ++i) dst[i] = to_bf16(x[i]);
}

#if defined(PAGEDLLM_NATIVE_BF16)
namespace {

// r[j] = column j of the 16 x 16 matrix of 32-bit lanes whose rows r[i] hold (unpack within 128-bit lanes by 32
// and 64 bits, then exchange the 128-bit lanes twice).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

}  // namespace
#endif

void bf16_panel_from_rows(uint32_t* panel, const float* rows, int64_t ld, int64_t nout, int64_t in) {
  const int64_t in2 = (in + 1) / 2;
  int64_t done = 0;  // pairs written so far for every output of the panel
#if defined(PAGEDLLM_NATIVE_BF16)
  // Whole panels, 16 outputs by 16 pairs at a time: 16 rows of 32 floats rounded to 16 pairs each, transposed.
  if (nout == kPanel) {
    for (; done + 16 <= in / 2; done += 16)
      for (int64_t n0 = 0; n0 < kPanel; n0 += 16) {
        __m512i r[16];
        for (int k = 0; k < 16; ++k) {
          const float* src = rows + (n0 + k) * ld + 2 * done;
          r[k] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(panel + (done + j) * kPanel + n0, r[j]);
      }
  }
#endif
  for (int64_t n = 0; n < kPanel; ++n) {
    const float* src = rows + n * ld;
    for (int64_t i2 = done; i2 < in2; ++i2) {
      uint32_t pair = 0;
      if (n < nout) {
        const uint32_t lo = to_bf16(src[2 * i2]), hi = 2 * i2 + 1 < in ? to_bf16(src[2 * i2 + 1]) : 0u;
        pair = lo | hi << 16;
      }
      panel[i2 * kPanel + n] = pair;
    }
  }
}

namespace {

// Block b of `blocks` of the rows: rows [m0, m1) interleaved pair by pair (its few KiB stay in L1 while its rows
// are written); r holds one rounded row.
void pairs_block(uint32_t* xt, const float* x, int64_t rows, int64_t in, int64_t b, int64_t blocks, uint16_t* r) {
  const int64_t in2 = (in + 1) / 2, m0 = rows * b / blocks, m1 = rows * (b + 1) / blocks, mb = m1 - m0;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(r);
  uint32_t* dst = xt + m0 * in2;
  for (int64_t m = m0; m < m1; ++m) {
    bf16_round_row(r, x + m * in, in);
    if (in & 1) r[in] = 0;
    for (int64_t i2 = 0; i2 < in2; ++i2) dst[i2 * mb + (m - m0)] = pairs[i2];
  }
}

}  // namespace

void bf16_pairs_blocked(uint32_t* xt, const float* x, int64_t rows, int64_t in, int threads) {
  const int64_t blocks = (rows + kBf16Block - 1) / kBf16Block;
#pragma omp parallel num_threads(team_for_grain(threads, rows * in, int64_t{1} << 15))
  {
    std::vector<uint16_t> r(in + 1);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) pairs_block(xt, x, rows, in, b, blocks, r.data());
  }
}

void bf16_pairs_blocked_serial(uint32_t* xt, const float* x, int64_t rows, int64_t in, uint16_t* scratch) {
  if (rows == 1) {  // one row: its plain pairs, rounded in place
    auto* half = reinterpret_cast<uint16_t*>(xt);
    bf16_round_row(half, x, in);
    if (in & 1) half[in] = 0;
    return;
  }
  const int64_t blocks = (rows + kBf16Block - 1) / kBf16Block;
  for (int64_t b = 0; b < blocks; ++b) pairs_block(xt, x, rows, in, b, blocks, scratch);
}

void bf16_panel_block(const uint32_t* panel, const uint32_t* xt, int64_t mb, int64_t in2, float* y, int64_t ys,
                      const float* bias, int64_t nout) {
  // Near-equal blocks of at most kBf16Block rows (a lone remainder row would waste the panel's pass), each block's
  // pairs contiguous (bf16_pairs_blocked), so the kernel reads its inputs as one stream. The panel goes in slices
  // of kBf16Slice pairs (16 KiB), each read from L1 by every block (from L2, a long panel was read ~20% more
  // slowly); every row's sums are split the same way whatever the batch, so its result stays the same.
  const int64_t blocks = (mb + kBf16Block - 1) / kBf16Block;
  for (int64_t k0 = 0; k0 < in2; k0 += kBf16Slice) {
    const int64_t kn = std::min(kBf16Slice, in2 - k0);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m0 = mb * b / blocks, m1 = mb * (b + 1) / blocks, n = m1 - m0;
      bf16_kernel(n)(panel + k0 * kPanel, xt + m0 * in2 + k0 * n, n, kn, y + m0 * ys, ys,
                     k0 + kn == in2 ? bias : nullptr, nout, k0 > 0);
    }
  }
}

void bf16_gemm_range(const uint32_t* wp, const uint32_t* xt, int64_t rows, const float* bias, float* y, int64_t ldy,
                     int64_t o0, int64_t o1, int64_t in2, float* t) {
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    const int64_t base = p * kPanel, lo = std::max<int64_t>(o0 - base, 0), hi = std::min<int64_t>(o1 - base, kPanel);
    bf16_panel_block(wp + p * in2 * kPanel, xt, rows, in2, t, kPanel, bias ? bias + base : nullptr, hi);
    for (int64_t m = 0; m < rows; ++m) std::copy(t + m * kPanel + lo, t + m * kPanel + hi, y + m * ldy + base + lo);
  }
}

void bf16_pack_panels(uint32_t* dst, const float* w, int64_t out, int64_t in, int threads) {
  const int64_t np = (out + kPanel - 1) / kPanel, in2 = (in + 1) / 2;
  const int nt = team_for_grain(threads, np * in * kPanel, int64_t{1} << 16);
#pragma omp parallel for schedule(guided) num_threads(nt)
  for (int64_t p = 0; p < np; ++p)
    bf16_panel_from_rows(dst + p * in2 * kPanel, w + p * kPanel * in, in, std::min<int64_t>(kPanel, out - p * kPanel),
                         in);
}

void bf16_panel_linear(float* y, const float* x, const uint32_t* wp, const float* bias, int64_t rows, int64_t in,
                       int64_t out, int threads) {
  const int64_t np = (out + kPanel - 1) / kPanel, in2 = (in + 1) / 2;
  // The rows in tiles whose pairs (blocked) stay in L2 while every panel passes over them.
  const int64_t tile = std::max<int64_t>(kBf16Block, (int64_t{256} << 10) / (in2 * 4) / kBf16Block * kBf16Block);
  uint32_t* xt = scratch<uint32_t, 0>(rows * in2);
  for (int64_t t0 = 0; t0 < rows; t0 += tile)
    bf16_pairs_blocked(xt + t0 * in2, x + t0 * in, std::min(tile, rows - t0), in, threads);
#pragma omp parallel for schedule(guided) num_threads(team_size(threads, np))
  for (int64_t p = 0; p < np; ++p) {
    const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, out - base);
    for (int64_t t0 = 0; t0 < rows; t0 += tile) {
      const int64_t n = std::min(tile, rows - t0);
      bf16_panel_block(wp + p * in2 * kPanel, xt + t0 * in2, n, in2, y + t0 * out + base, out,
                       bias ? bias + base : nullptr, nout);
    }
  }
}

bool bf16_native() {
#if defined(PAGEDLLM_NATIVE_BF16)
  return true;
#else
  return false;
#endif
}

int32_t bf16_has_native() { return bf16_native() ? 1 : 0; }

}  // namespace pagedllm
