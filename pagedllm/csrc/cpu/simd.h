// What every kernel source of one ISA build shares: the panel vector type, the vectorised exp, and the small row
// helpers (dot product, softmax numerators, RMSNorm, rotary, SiLU) that the layer kernels and the fused decoder both
// use. The ISA comes from the compiler flags of the build (setup.py): __AVX512F__, __AVX2__ + __FMA__, or neither.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "kernels.h"

#if defined(PAGEDLLM_LIBMVEC)
// glibc's vector math library: lets the compiler vectorise the softmax's exp (as <math.h> itself does under
// -ffast-math), at glibc's documented accuracy for libmvec (within 4 ulp).
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));
#endif

namespace pagedllm {

#if defined(__AVX512F__)
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PAGEDLLM_ISA_NAME "avx512bf16"
#else
#define PAGEDLLM_ISA_NAME "avx512"
#endif
typedef __m512 pvec;
constexpr int kLanes = 16, kPanelBlock = 16;
static inline pvec pv_zero() { return _mm512_setzero_ps(); }
static inline pvec pv_load(const float* p) { return _mm512_loadu_ps(p); }
static inline pvec pv_splat(float x) { return _mm512_set1_ps(x); }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline pvec pv_add(pvec a, pvec b) { return _mm512_add_ps(a, b); }
static inline void pv_store(float* p, pvec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_ISA_NAME "avx2"
typedef __m256 pvec;
constexpr int kLanes = 8, kPanelBlock = 6;
static inline pvec pv_zero() { return _mm256_setzero_ps(); }
static inline pvec pv_load(const float* p) { return _mm256_loadu_ps(p); }
static inline pvec pv_splat(float x) { return _mm256_set1_ps(x); }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline pvec pv_add(pvec a, pvec b) { return _mm256_add_ps(a, b); }
static inline void pv_store(float* p, pvec v) { _mm256_storeu_ps(p, v); }
#else
#define PAGEDLLM_ISA_NAME "generic"
typedef float pvec __attribute__((vector_size(16)));
constexpr int kLanes = 4, kPanelBlock = 8;
static inline pvec pv_zero() { return pvec{0.f, 0.f, 0.f, 0.f}; }
static inline pvec pv_load(const float* p) {
  pvec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
static inline pvec pv_splat(float x) { return pvec{x, x, x, x}; }
static inline pvec pv_fma(pvec a, pvec b, pvec c) { return a * b + c; }
static inline pvec pv_add(pvec a, pvec b) { return a + b; }
static inline void pv_store(float* p, pvec v) { __builtin_memcpy(p, &v, sizeof v); }
#endif
// Outputs per panel: two vectors, so the micro-kernels keep two accumulators a row.
constexpr int kPanel = 2 * kLanes;

// Threads for a parallel loop over `items` independent pieces of work: at most `threads`, at most one a piece.
static inline int team_size(int threads, int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
}

// Threads for `work` elements when each thread should get at least `grain` of them.
static inline int team_for_grain(int threads, int64_t work, int64_t grain) {
  return team_size(threads, (work + grain - 1) / std::max<int64_t>(1, grain));
}

// Thread t's share [first, last) of n items, in whole chunks of `align`.
static inline void share(int64_t n, int t, int nt, int64_t align, int64_t& first, int64_t& last) {
  const int64_t chunks = (n + align - 1) / align;
  first = std::min(n, chunks * t / nt * align);
  last = std::min(n, chunks * (t + 1) / nt * align);
}

// KV cache elements (PagedCache's kv_dtype): float32 as is, bfloat16 (uint16_t) widened to float32 by a shift.
static inline float kv_f(float x) { return x; }
static inline float kv_f(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
// kLanes bfloat16 values widened to a vector of float32 (exact).
#if defined(__AVX512F__)
static inline pvec pv_load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline pvec pv_load(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
static inline pvec pv_load(const uint16_t* p) { return pvec{kv_f(p[0]), kv_f(p[1]), kv_f(p[2]), kv_f(p[3])}; }
#endif
// kLanes int8 values as float32 (LoRA slots stored in int8 with a scale per row).
static inline float kv_f(int8_t x) { return static_cast<float>(x); }
#if defined(__AVX512F__)
static inline pvec pv_load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline pvec pv_load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
static inline pvec pv_load(const int8_t* p) { return pvec{kv_f(p[0]), kv_f(p[1]), kv_f(p[2]), kv_f(p[3])}; }
#endif
#if defined(__AVX512F__)
static inline __m512 kv_load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 kv_load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
template <typename KV>
static inline float dot_kv(const float* __restrict a, const KV* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += a[k] * kv_f(b[k]);
  return acc;
}

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < n; ++k) acc += a[k] * b[k];
  return acc;
}

// exp(x) for vectors, within ~2 ulp of expf: x = n ln2 + r (ln2 in two parts), exp(r) for |r| <= ln2 / 2 by Cephes'
// degree-7 polynomial, times 2^n. Inputs below kExpMin give ~1e-38 instead of a denormal or 0 (softmax arguments are
// <= 0, where that is far below a float's resolution of the sum). Written out because the compiler left `#pragma omp
// simd` loops over expf scalar (one libm call per score, the sum carried through memory).
constexpr float kExpMin = -87.33654f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // highest degree first

#if defined(__AVX512F__)
// 16 lanes; 2^n by scalef.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 8 lanes; 2^n built in the exponent bits (n within [-126, 127] after the clamps).
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(88.02f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The first n (< 8) lanes set.
static inline __m256i lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// The largest of s[0 .. n) (-inf when n = 0).
static inline float max_of(const float* s, int64_t n) {
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf;
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + l));
  if (l < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, static_cast<__mmask16>((1u << (n - l)) - 1), s + l));
  return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = ninf;
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + l));
  if (l < n) m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + l, lanes8(n - l)),
                                                   _mm256_castsi256_ps(lanes8(n - l))));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) mx = std::max(mx, s[l]);
  return mx;
#endif
}

// out[l] = exp(x[l] - mx) for l < n (out may be x); returns their sum (softmax numerators and denominator). With
// kZeroNinf, out[l] is exactly 0 where x[l] is -inf: the vector exp gives ~1e-38 there, and a masked token must have
// no mass (the sampler's rows). The sum is float, over vector lanes, then across them.
template <bool kZeroNinf = false>
static inline float exp_into(const float* x, float* out, int64_t n, float mx) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto exp_of = [&](__m512 v) {
    const __m512 e = exp16(_mm512_sub_ps(v, m));
    if constexpr (kZeroNinf) return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ), e);
    return e;
  };
  __m512 acc = _mm512_setzero_ps();
  int64_t l = 0;
  for (; l + 16 <= n; l += 16) {
    const __m512 e = exp_of(_mm512_loadu_ps(x + l));
    _mm512_storeu_ps(out + l, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (l < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - l)) - 1);
    const __m512 e = exp_of(_mm512_maskz_loadu_ps(k, x + l));
    _mm512_mask_storeu_ps(out + l, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  auto exp_of = [&](__m256 v) {
    const __m256 e = exp8(_mm256_sub_ps(v, m));
    if constexpr (kZeroNinf) return _mm256_and_ps(_mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ), e);
    return e;
  };
  __m256 acc = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    const __m256 e = exp_of(_mm256_loadu_ps(x + l));
    _mm256_storeu_ps(out + l, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (l < n) {
    const __m256i k = lanes8(n - l);
    const __m256 e = _mm256_and_ps(exp_of(_mm256_maskload_ps(x + l, k)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(out + l, k, e);
    acc = _mm256_add_ps(acc, e);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t l = 0; l < n; ++l) {
    const float e = expf(x[l] - mx);  // exp(-inf) = 0
    out[l] = e;
    sum += e;
  }
  return sum;
#endif
}

// s[l] = exp(s[l] - mx) for l < n; returns their sum.
static inline float exp_in_place(float* s, int64_t n, float mx) { return exp_into(s, s, n, mx); }

static inline float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }
// gelu(g, tanh approximation) * u: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) u, tanh(z) as 1 - 2 / (e^2z + 1)
// (vectorised through expf; saturates to +-1 for large |z|).
static inline float gelu_tanh_mul(float g, float u) {
  const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float t = 1.f - 2.f / (expf(2.f * z) + 1.f);
  return 0.5f * g * (1.f + t) * u;
}

// gelu(g, tanh approximation) alone (a plain MLP's activation): gelu_tanh_mul(g, 1).
static inline float gelu_tanh(float g) { return gelu_tanh_mul(g, 1.f); }

// LayerNorm of one row of h: (x - mean) * rsqrt(var + eps) * w + b (out may be x; b may be null).
static inline void layer_norm_row(float* out, const float* x, const float* w, const float* b, int64_t h, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < h; ++k) sum += x[k];
  const float mean = sum / static_cast<float>(h);
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t k = 0; k < h; ++k) ss += (x[k] - mean) * (x[k] - mean);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  if (b == nullptr) {
#pragma omp simd
    for (int64_t k = 0; k < h; ++k) out[k] = (x[k] - mean) * r * w[k];
  } else {
#pragma omp simd
    for (int64_t k = 0; k < h; ++k) out[k] = (x[k] - mean) * r * w[k] + b[k];
  }
}

// out = x * rsqrt(mean(x^2) + eps) * w over one row of h (out may be x).
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

}  // namespace pagedllm
