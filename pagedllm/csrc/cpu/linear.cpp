// Few-row linear layers on weights packed in panels.
//
// A panel holds kPanel consecutive output rows of a weight W [O, I] transposed: panels[p][i][n] = W[p kPanel + n][i]
// (zero past O), so one panel is a contiguous stream of I * kPanel floats. y [M, O] = x W^T for a few rows M is then
// a GEMM micro-kernel per panel: for each input column i, two vector loads of the panel row and M broadcasts of
// x[m][i] into 2 M register accumulators. Each weight is read from memory once for all the rows, with no horizontal
// sums; rows beyond what the registers hold go in blocks over the same panel, which is then in L2. oneDNN's GEMM
// reads a weight well below the memory bandwidth for 1-16 rows on two cores: this is why (bench/RESULTS.md).
// panel_block serves many rows on one panel made on the fly (quantized weights' prompt rows, quant.cpp): the panel in
// slices that stay in L1 while every block of rows, packed contiguous, goes over them (a BLIS-style GEMM).
#include <algorithm>
#include <utility>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

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

// The sums of MB rows over inputs [i0, i1) into their accumulators, in order: xt holds the rows transposed
// (xt[i * ld + m]). Inlined, so the accumulators stay in registers.
template <int MB>
static inline __attribute__((always_inline)) void panel_fma(const float* __restrict wp, const float* __restrict xt,
                                                            int64_t ld, int64_t i0, int64_t i1, pvec (&acc0)[MB],
                                                            pvec (&acc1)[MB]) {
  for (int64_t i = i0; i < i1; ++i) {
    const pvec w0 = pv_load(wp + i * kPanel), w1 = pv_load(wp + i * kPanel + kLanes);
    const float* xi = xt + i * ld;
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const pvec xv = pv_splat(xi[m]);
      acc0[m] = pv_fma(w0, xv, acc0[m]);
      acc1[m] = pv_fma(w1, xv, acc1[m]);
    }
  }
}

// MB rows at once: xt holds them transposed (xt[i * ld + m]); row m's outputs [lo, hi) of the panel go to y + m * ys.
template <int MB>
static void panel_rows(const float* __restrict wp, const float* __restrict xt, int64_t ld, int64_t in, float* y,
                       int64_t ys, const float* bias, int64_t lo, int64_t hi) {
  pvec acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) acc0[m] = acc1[m] = pv_zero();
  panel_fma<MB>(wp, xt, ld, 0, in, acc0, acc1);
  for (int m = 0; m < MB; ++m) panel_out(acc0[m], acc1[m], y + m * ys, bias, lo, hi);
}

using PanelRowsFn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, const float*, int64_t,
                             int64_t);

// panel_rows<mb> for a block size known only at run time (1 <= mb <= kPanelBlock).
template <int... Ms>
static PanelRowsFn panel_rows_for(int mb, std::integer_sequence<int, Ms...>) {
  static const PanelRowsFn table[] = {panel_rows<Ms + 1>...};
  return table[mb - 1];
}

// MB rows over inputs [i0, i1) only, their block transposed (xb[i * MB + m]): the accumulators start from acc
// ([MB][kPanel]; zero when `fresh`) and end there, so a row's sums run over the inputs in order across calls,
// exactly as panel_rows runs them in one.
template <int MB>
static void panel_rows_part(const float* __restrict wp, const float* __restrict xb, int64_t i0, int64_t i1,
                            float* __restrict acc, bool fresh) {
  pvec acc0[MB], acc1[MB];
  for (int m = 0; m < MB; ++m) {
    acc0[m] = fresh ? pv_zero() : pv_load(acc + m * kPanel);
    acc1[m] = fresh ? pv_zero() : pv_load(acc + m * kPanel + kLanes);
  }
  panel_fma<MB>(wp, xb, MB, i0, i1, acc0, acc1);
  for (int m = 0; m < MB; ++m) {
    pv_store(acc + m * kPanel, acc0[m]);
    pv_store(acc + m * kPanel + kLanes, acc1[m]);
  }
}

using PanelPartFn = void (*)(const float*, const float*, int64_t, int64_t, float*, bool);

template <int... Ms>
static PanelPartFn panel_part_for(int mb, std::integer_sequence<int, Ms...>) {
  static const PanelPartFn table[] = {panel_rows_part<Ms + 1>...};
  return table[mb - 1];
}

// Inputs of a panel slice that fill 16 KB: a slice stays in L1 while every block of rows goes over it.
constexpr int64_t kPanelDepth = (int64_t{16} << 10) / (kPanel * static_cast<int64_t>(sizeof(float)));

}  // namespace

void pack_row_blocks(const float* x, int64_t mb, int64_t in, float* xb) {
  for (int64_t m0 = 0; m0 < mb; m0 += kPanelBlock) {
    const int64_t n = std::min<int64_t>(kPanelBlock, mb - m0);
    float* dst = xb + m0 * in;
    for (int64_t m = 0; m < n; ++m)
      for (int64_t i = 0; i < in; ++i) dst[i * n + m] = x[(m0 + m) * in + i];
  }
}

void panel_block(const float* panel, const float* xb, int64_t mb, int64_t in, float* y, int64_t ys, const float* bias,
                 int64_t nout, float* acc) {
  for (int64_t i0 = 0; i0 < in; i0 += kPanelDepth) {
    const int64_t i1 = std::min(in, i0 + kPanelDepth);
    for (int64_t m0 = 0; m0 < mb; m0 += kPanelBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kPanelBlock, mb - m0));
      panel_part_for(n, std::make_integer_sequence<int, kPanelBlock>{})(panel, xb + m0 * in, i0, i1,
                                                                        acc + m0 * kPanel, i0 == 0);
    }
  }
  for (int64_t m = 0; m < mb; ++m)
    panel_out(pv_load(acc + m * kPanel), pv_load(acc + m * kPanel + kLanes), y + m * ys, bias, 0, nout);
}

void gemv_panels(const float* wp, const float* x, const float* bias, float* y, int64_t o0, int64_t o1, int64_t in) {
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    const int64_t base = p * kPanel;
    panel_row(wp + p * in * kPanel, x, in, y + base, bias ? bias + base : nullptr, std::max<int64_t>(o0 - base, 0),
              std::min<int64_t>(o1 - base, kPanel));
  }
}

// The threads split the panels in contiguous runs, so each first-touches its own part of a fresh destination (the OS
// then zeroes those pages on every core, not one). Within a panel the loop runs along the input and writes the panel
// in order: the kPanel source rows are kPanel sequential streams whose current cache lines stay in L1 until all
// their columns are used, and each destination line is written whole once (row by row, each would be revisited
// kPanel times, after it may have left the cache).
void pack_panels(float* dst, const float* w, int64_t out, int64_t in, int threads) {
  const int64_t np = (out + kPanel - 1) / kPanel;
  const int nt = team_for_grain(threads, np * in * kPanel, int64_t{1} << 16);  // a small weight: one thread
#pragma omp parallel for schedule(guided) num_threads(nt)
  for (int64_t p = 0; p < np; ++p) {
    float* __restrict panel = dst + p * in * kPanel;
    const float* __restrict src = w + p * kPanel * in;
    const int64_t rows = std::min<int64_t>(kPanel, out - p * kPanel);
    if (rows == kPanel) {
      for (int64_t i = 0; i < in; ++i)
#pragma GCC unroll 32
        for (int64_t n = 0; n < kPanel; ++n) panel[i * kPanel + n] = src[n * in + i];
    } else {  // the last panel of a weight whose outputs are not a multiple of kPanel: zeros past them
      for (int64_t i = 0; i < in; ++i)
        for (int64_t n = 0; n < kPanel; ++n) panel[i * kPanel + n] = n < rows ? src[n * in + i] : 0.f;
    }
  }
}

// The threads split the panels and each runs its rows in blocks of at most kPanelBlock.
void panel_linear(float* yp, const float* xp, const float* wp, const float* bp, int64_t rows, int64_t in,
                  int64_t out_features, int threads) {
  const int64_t np = (out_features + kPanel - 1) / kPanel;
  // Panels are handed out in shrinking chunks (guided; each panel is a contiguous stream of I * kPanel floats): the
  // threads finish together even when one loses its core for a while to another process.
  const int nt = team_size(threads, np);
  if (rows == 1) {
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t p = 0; p < np; ++p)
      gemv_panels(wp, xp, bp, yp, p * kPanel, std::min((p + 1) * kPanel, out_features), in);
    return;
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
                out_features, bp ? bp + base : nullptr, 0, nout);
  }
}

// One row against two consecutive panels at once, each panel's sums exactly as panel_rows<1> runs them: four
// independent accumulator chains instead of two hide more of the FMA latency.
static void panel_row_pair(const float* __restrict wp, const float* __restrict x, int64_t in, float* y,
                           const float* bias) {
  const float* __restrict wq = wp + in * kPanel;
  pvec a0 = pv_zero(), a1 = pv_zero(), b0 = pv_zero(), b1 = pv_zero();
  for (int64_t i = 0; i < in; ++i) {
    const pvec xv = pv_splat(x[i]);
    a0 = pv_fma(pv_load(wp + i * kPanel), xv, a0);
    a1 = pv_fma(pv_load(wp + i * kPanel + kLanes), xv, a1);
    b0 = pv_fma(pv_load(wq + i * kPanel), xv, b0);
    b1 = pv_fma(pv_load(wq + i * kPanel + kLanes), xv, b1);
  }
  panel_out(a0, a1, y, bias, 0, kPanel);
  panel_out(b0, b1, y + kPanel, bias ? bias + kPanel : nullptr, 0, kPanel);
}

void panel_rows_range(const float* wp, const float* xt, int64_t rows, int64_t in, const float* bias, float* y,
                      int64_t ys, int64_t o0, int64_t o1) {
  const int64_t blocks = (rows + kPanelBlock - 1) / kPanelBlock;
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    if (rows == 1 && p * kPanel >= o0 && (p + 2) * kPanel <= o1) {  // two whole panels
      panel_row_pair(wp + p * in * kPanel, xt, in, y + p * kPanel, bias ? bias + p * kPanel : nullptr);
      ++p;
      continue;
    }
    const int64_t base = p * kPanel;
    const int64_t lo = std::max<int64_t>(o0 - base, 0), hi = std::min<int64_t>(o1 - base, kPanel);
    for (int64_t b = 0; b < blocks; ++b) {  // near-equal blocks; the panel is in cache after the first
      const int64_t m0 = rows * b / blocks, m1 = rows * (b + 1) / blocks;
      panel_rows_for(static_cast<int>(m1 - m0), std::make_integer_sequence<int, kPanelBlock>{})(
          wp + p * in * kPanel, xt + m0, rows, in, y + m0 * ys + base, ys, bias ? bias + base : nullptr, lo, hi);
    }
  }
}


}  // namespace pagedllm
