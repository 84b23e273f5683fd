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
// Where the CPU has AMX tiles (Intel Sapphire Rapids on) and the OS grants them, a panel is multiplied on the tiles
// instead (amx_panel_block: ~5x the AVX512-BF16 rate at 256 rows on two cores), its input rows as plain pairs; each
// row's sums still run over the pairs in one order whatever the other rows. PAGEDLLM_AMX=0 turns it off.
//
// Users: `--dtype bfloat16` weights (packed once, at load) and the GGUF path for many rows (quant.cpp de-quantizes a
// panel at a time into bf16 panels, where the CPU has AVX512-BF16).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "internal.h"
#include "simd.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

// One row's panel sums (a0: outputs 0..kLanes-1, a1: the rest) to out[0, nout), bias added when given; with `add`,
// added to what out holds.
static inline void store_sums(float* out, pvec a0, pvec a1, const float* bias, int64_t nout, bool add) {
  if (nout == kPanel) {  // a whole panel: vector adds, the same sums as the scalar tail below
    if (bias) a0 = pv_add(a0, pv_load(bias)), a1 = pv_add(a1, pv_load(bias + kLanes));
    if (add) a0 = pv_add(pv_load(out), a0), a1 = pv_add(pv_load(out + kLanes), a1);
    pv_store(out, a0);
    pv_store(out + kLanes, a1);
    return;
  }
  float t[kPanel];
  pv_store(t, a0);
  pv_store(t + kLanes, a1);
  if (add)
    for (int64_t n = 0; n < nout; ++n) out[n] += bias ? t[n] + bias[n] : t[n];
  else
    for (int64_t n = 0; n < nout; ++n) out[n] = bias ? t[n] + bias[n] : t[n];
}

// MB input rows (their pairs interleaved: xt[i2 * ld + m]) against one panel of in2 pairs; row m's outputs [0, nout)
// go to y + m * ys, bias added when given; with `add`, the sums are added to what y holds (a later slice of the
// pairs: the caller splits long panels so that a slice stays in L1 for every row block).
template <int MB>
static void bf16_rows(const uint32_t* __restrict wp, const uint32_t* __restrict xt, int64_t ld, int64_t in2, float* y,
                      int64_t ys, const float* bias, int64_t nout, bool add) {
#if defined(PAGEDLLM_NATIVE_BF16)
  __m512 acc0[MB], acc1[MB];
#pragma GCC unroll 16
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
#pragma GCC unroll 16
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
  // Unrolled, as the set-up above: a loop here kept the accumulators in a stack array (zeroed by memset each call),
  // ~8% of a 128-pair slice's time.
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) store_sums(y + m * ys, acc0[m], acc1[m], bias, nout, add);
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

#if defined(PAGEDLLM_NATIVE_BF16) && defined(__x86_64__) && defined(__linux__)
#define PAGEDLLM_AMX 1

// AMX (Intel's tile matrix unit, Sapphire Rapids on): a tile is up to 16 rows of 64 bytes; TDPBF16PS adds to a
// 16 x 16 float32 tile C the products of A (16 rows of 16 bf16 pairs) and B (16 pairs of 16 columns, VNNI order:
// B's row k holds column n's pair k at its 32-bit lane n). A bf16 panel's pairs [k0, k0 + 16) of outputs
// [n0, n0 + 16) are such a B, rows kPanel * 4 bytes apart; input rows as plain pairs are A. Linux hands the tile
// state to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM); without that, the first tile instruction
// traps.
unsigned cpuid7_edx() {  // CPUID leaf 7's EDX: bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  return d;
}

bool amx_usable() {
  const unsigned d = cpuid7_edx();
  if (!(d >> 22 & 1u) || !(d >> 24 & 1u)) return false;  // AMX-BF16, AMX-TILE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo >> 17 & 3u) != 3u) return false;  // the OS saves the tile config and data
  const char* env = std::getenv("PAGEDLLM_AMX");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

std::atomic<int> g_amx{-1};  // -1: not decided yet; 0 off; 1 on

bool amx_on() {
  int v = g_amx.load(std::memory_order_relaxed);
  if (v < 0) {
    v = amx_usable() ? 1 : 0;
    g_amx.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

// Loads a config of 8 tiles: C 0-3 and A 4-5 of `rows` rows, B 6-7 of 16.
__attribute__((target("amx-tile"))) inline void amx_config(int rows) {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
  }
  _tile_loadconfig(&cfg);
}

// `tiles` (1 or 2) tiles of input rows (plain pairs from a, rows in2 pairs apart) against the panel's two column
// tiles, over all in2 pairs in order: their sums to c [16 tiles][kPanel] (C tiles 0-1 the first row tile's, 2-3 the
// second's).
template <int Tiles>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_rows_panel(const uint32_t* panel, const uint32_t* a,
                                                                        int64_t in2, float* c) {
  const int64_t xs = in2 * 4, ps = kPanel * 4;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Tiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < in2; k += 16) {
    _tile_loadd(4, a + k, xs);
    _tile_loadd(6, panel + k * kPanel, ps);
    _tile_loadd(7, panel + k * kPanel + 16, ps);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Tiles == 2) {
      _tile_loadd(5, a + 16 * in2 + k, xs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ps);
  _tile_stored(1, c + 16, ps);
  if constexpr (Tiles == 2) {
    _tile_stored(2, c + 16 * kPanel, ps);
    _tile_stored(3, c + 16 * kPanel + 16, ps);
  }
}

// One panel against mb input rows given as plain pairs (row m at x + m * in2; in2 a multiple of 16): 32 rows at a
// time in four C tiles (two row tiles by the panel's two column tiles), a last 16, and the rest in tiles configured
// for fewer rows. Every row's sums run over the pairs in the same order whatever its block, so its result does not
// depend on the other rows.
__attribute__((target("amx-tile,amx-bf16"))) void amx_panel_block(const uint32_t* panel, const uint32_t* x,
                                                                   int64_t mb, int64_t in2, float* y, int64_t ys,
                                                                   const float* bias, int64_t nout) {
  alignas(64) float c[32 * kPanel];
  auto write = [&](int64_t m0, int64_t rows) {
    for (int64_t m = 0; m < rows; ++m)
      store_sums(y + (m0 + m) * ys, pv_load(c + m * kPanel), pv_load(c + m * kPanel + kLanes), bias, nout, false);
  };
  const int64_t full = mb / 16 * 16;
  int64_t m0 = 0;
  if (full > 0) amx_config(16);
  for (; m0 + 32 <= full; m0 += 32) {
    amx_rows_panel<2>(panel, x + m0 * in2, in2, c);
    write(m0, 32);
  }
  if (m0 < full) {
    amx_rows_panel<1>(panel, x + m0 * in2, in2, c);
    write(m0, 16);
    m0 += 16;
  }
  if (m0 < mb) {
    amx_config(static_cast<int>(mb - m0));
    amx_rows_panel<1>(panel, x + m0 * in2, in2, c);
    write(m0, mb - m0);
  }
  _tile_release();
}
#endif

// Whether rows of in2 pairs run on AMX (then bf16_pairs_blocked lays them out as plain pairs).
inline bool amx_rows(int64_t in2) {
#if defined(PAGEDLLM_AMX)
  return in2 % 16 == 0 && amx_on();
#else
  (void)in2;
  return false;
#endif
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

// Row m as plain pairs at xt + m * in2 (AMX's input rows).
static void plain_pairs(uint32_t* xt, const float* x, int64_t m, int64_t in) {
  auto* half = reinterpret_cast<uint16_t*>(xt + m * ((in + 1) / 2));
  bf16_round_row(half, x + m * in, in);
  if (in & 1) half[in] = 0;
}

void bf16_pairs_blocked(uint32_t* xt, const float* x, int64_t rows, int64_t in, int threads) {
  if (amx_rows((in + 1) / 2)) {
#pragma omp parallel for schedule(static) num_threads(team_for_grain(threads, rows * in, int64_t{1} << 15))
    for (int64_t m = 0; m < rows; ++m) plain_pairs(xt, x, m, in);
    return;
  }
  const int64_t blocks = (rows + kBf16Block - 1) / kBf16Block;
#pragma omp parallel num_threads(team_for_grain(threads, rows * in, int64_t{1} << 15))
  {
    std::vector<uint16_t> r(in + 1);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) pairs_block(xt, x, rows, in, b, blocks, r.data());
  }
}

void bf16_pairs_blocked_serial(uint32_t* xt, const float* x, int64_t rows, int64_t in, uint16_t* scratch) {
  if (rows == 1 || amx_rows((in + 1) / 2)) {  // plain pairs, rounded in place
    for (int64_t m = 0; m < rows; ++m) plain_pairs(xt, x, m, in);
    return;
  }
  const int64_t blocks = (rows + kBf16Block - 1) / kBf16Block;
  for (int64_t b = 0; b < blocks; ++b) pairs_block(xt, x, rows, in, b, blocks, scratch);
}

void bf16_panel_block(const uint32_t* panel, const uint32_t* xt, int64_t mb, int64_t in2, float* y, int64_t ys,
                      const float* bias, int64_t nout) {
#if defined(PAGEDLLM_AMX)
  if (amx_rows(in2)) {
    amx_panel_block(panel, xt, mb, in2, y, ys, bias, nout);
    return;
  }
#endif
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
  // The rows in tiles whose pairs (blocked) stay in L2 while every panel passes over them; on AMX (plain pairs, 32
  // rows at a time) a tile is a whole block. Many rows go block by block, each passed by every panel (internal.h
  // row_block): the same kernel calls for every row, in another order.
  const int64_t unit = amx_rows(in2) ? 32
                                     : std::max<int64_t>(kBf16Block, (int64_t{256} << 10) / (in2 * 4) / kBf16Block *
                                                                         kBf16Block);
  const int64_t block = row_block(rows, in2 * 4, unit);
  const int64_t tile = amx_rows(in2) ? block : unit;
  uint32_t* xt = scratch<uint32_t, 0>(rows * in2);
  for (int64_t t0 = 0; t0 < rows; t0 += tile)
    bf16_pairs_blocked(xt + t0 * in2, x + t0 * in, std::min(tile, rows - t0), in, threads);
#pragma omp parallel num_threads(team_size(threads, np))
  for (int64_t m0 = 0; m0 < rows; m0 += block) {
    const int64_t m1 = std::min(rows, m0 + block);
#pragma omp for schedule(guided) nowait
    for (int64_t p = 0; p < np; ++p) {
      const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, out - base);
      for (int64_t t0 = m0; t0 < m1; t0 += tile) {
        const int64_t n = std::min(tile, m1 - t0);
        bf16_panel_block(wp + p * in2 * kPanel, xt + t0 * in2, n, in2, y + t0 * out + base, out,
                         bias ? bias + base : nullptr, nout);
      }
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

bool amx_int8_on() {
#if defined(PAGEDLLM_AMX)
  static const bool cpu = cpuid7_edx() >> 25 & 1u;  // AMX-INT8
  return cpu && amx_on();
#else
  return false;
#endif
}

bool bf16_amx_rows(int64_t in2) { return amx_rows(in2); }

int32_t bf16_amx(int32_t mode) {
#if defined(PAGEDLLM_AMX)
  if (mode == 0) g_amx.store(0);
  if (mode == 1) g_amx.store(amx_usable() ? 1 : 0);
  return amx_on() ? 1 : 0;
#else
  (void)mode;
  return 0;
#endif
}

}  // namespace pagedllm
