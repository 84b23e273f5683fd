// Row-wise kernels of the decoder layers, one pass each where torch takes several: SiLU-and-mul over a merged
// gate|up projection, GELU(tanh) gated or alone, RMSNorm and LayerNorm alone and fused with the residual add (in
// place, as vLLM's), and rotary embedding in place over the first heads of each row (queries and keys side by side in
// the fused projection). Each row's arithmetic is the fused decoder's (simd.h), so the layer path and the fused
// decoder agree bit for bit.
#include "internal.h"
#include "simd.h"

namespace pagedllm {

// out[t, k] = f(x + t * stride, k) for k < inner, the rows' elements split evenly between the threads.
template <class F>
static void act_rows(float* out, const float* x, int64_t rows, int64_t inner, int64_t stride, int threads, F f) {
  const int64_t total = rows * inner;
  const int nt = team_for_grain(threads, total, 8192);
#pragma omp parallel num_threads(nt)
  {
    int64_t begin, end;
    share(total, omp_get_thread_num(), omp_get_num_threads(), 1, begin, end);
    while (begin < end) {
      const int64_t t = begin / inner, k0 = begin % inner, k1 = std::min(inner, k0 + (end - begin));
      const float* row = x + t * stride;
      float* o = out + t * inner;
#pragma omp simd
      for (int64_t k = k0; k < k1; ++k) o[k] = f(row, k);
      begin += k1 - k0;
    }
  }
}

void silu_and_mul(float* out, const float* x, int64_t rows, int64_t inner, int threads) {
  act_rows(out, x, rows, inner, 2 * inner, threads,
           [inner](const float* g, int64_t k) { return silu_mul(g[k], g[inner + k]); });
}

void gelu_tanh(float* out, const float* x, int64_t rows, int64_t inner, int gated, int threads) {
  if (gated)
    act_rows(out, x, rows, inner, 2 * inner, threads,
             [inner](const float* g, int64_t k) { return gelu_tanh_mul(g[k], g[inner + k]); });
  else
    act_rows(out, x, rows, inner, inner, threads, [](const float* g, int64_t k) { return pagedllm::gelu_tanh(g[k]); });
}

void layer_norm(float* out, const float* x, const float* w, const float* b, int64_t rows, int64_t h, float eps,
                int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, std::max<int64_t>(1, 16384 / h)))
  for (int64_t t = 0; t < rows; ++t) layer_norm_row(out + t * h, x + t * h, w, b, h, eps);
}

void fused_add_layer_norm(float* x, float* residual, const float* w, const float* b, int64_t rows, int64_t h,
                          float eps, int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, std::max<int64_t>(1, 16384 / h)))
  for (int64_t t = 0; t < rows; ++t) {
    float* r = residual + t * h;
    const float* xr = x + t * h;
#pragma omp simd
    for (int64_t k = 0; k < h; ++k) r[k] += xr[k];
    layer_norm_row(x + t * h, r, w, b, h, eps);
  }
}

void rms_norm(float* out, const float* x, const float* w, int64_t rows, int64_t h, float eps, int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, std::max<int64_t>(1, 16384 / h)))
  for (int64_t t = 0; t < rows; ++t) rms_row(out + t * h, x + t * h, w, h, eps);
}

void fused_add_rms_norm(float* x, float* residual, const float* w, int64_t rows, int64_t h, float eps, int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, std::max<int64_t>(1, 16384 / h)))
  for (int64_t t = 0; t < rows; ++t) add_rms_row(x + t * h, residual + t * h, x + t * h, w, h, eps);
}

void rotary(float* x, const int64_t* positions, const float* cache, int64_t rows, int64_t h, int64_t d, int64_t heads,
            int64_t rot, int threads) {
  const int64_t items = rows * heads, half = rot / 2;
#pragma omp parallel for num_threads(team_for_grain(threads, items, std::max<int64_t>(1, 4096 / d)))
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / heads, hh = item % heads;
    rotate_head(x + (t * h + hh) * d, cache + positions[t] * rot, half);
  }
}

}  // namespace pagedllm
