// Linear layers on GGUF block-quantized weights, run as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, IQ4_NL, IQ4_XS and MXFP4 (IQ4_NL's layout with FP4 values, twice over, and a power-of-two scale: exact int8).
//
// A weight is a QMatrix (kernels.h): up to four row segments, each the GGUF file's own bytes of consecutive output
// rows of one type (a merged q|k|v or gate|up may mix types, as a Q4_K_M file does). Every type is read in chunks of
// 32 weights, each of the form w[i] = a * sc[i / 16] * q[i] + b with small integers q and sc (sc is 1 but for Q6_K,
// whose 16-weight sub-blocks have their own scales): `decode_chunk` below says how each type's bytes give them.
//
// On a packed weight with `int8` set (generated tokens' rows, any number: model/layers/linear.py says which), or on
// a weight as stored up to kQuantDotMaxRows input rows (internal.h), y = x W^T runs as ggml does: each input row
// is quantized to int8 in blocks of 32 (dx, qx; sx = dx * sum qx), and a chunk's product is
// a * dx * sum(sc * q * qx) + b * sx, the integer sum by int8 dot products. Two layouts:
// * Packed (AVX2 and AVX-512 builds; every type but Q2_K and MXFP4, in whole groups of 16 rows, rewritten in place at
//   load by quant_pack): one vpdpbusd (AVX-512 VNNI; without it, vpmaddubsw on 8 rows at a
//   time) multiplies 4 weights of 16 output rows by 4 inputs broadcast, so a group's chunk is decoded once for every
//   input row, no horizontal sum is needed, and the float step serves 8 or 16 outputs at once. Compute bound from a
//   few rows on, at ~480 GFLOP/s on two Zen 4 cores (bench/RESULTS.md).
// * As stored (every other type, build or row): AVX2 vpmaddubsw then vpmaddwd by the 16-bit scales, or vpdpbusd where
//   the scales are all 1 and the build has VNNI; each output row's chunks are decoded once for a group of up to kGroup
//   input rows, the rows in tiles whose int8 copy stays in L2. Without AVX2 the same integer arithmetic in plain C++.
// Either way a row's result does not depend on the other rows of the call. Otherwise (prompt tokens' rows on a packed
// weight, more rows on one as stored) the rows run on de-quantized panels, whose inputs keep more precision than int8
// blocks do (a row's result again independent of the others beyond kQuantDotMaxRows): kPanel output rows at a time
// are de-quantized into a panel, which a panel GEMM kernel runs over the input rows (up to an L2-sized block of rows,
// block by block beyond: quant_linear_panels): bf16 panels and inputs where the CPU has AVX512-BF16 (bf16.cpp), else
// float32 panels, exact products of the de-quantized weights (linear.cpp).
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

#if defined(__AVX2__)
#define PAGEDLLM_QUANT_AVX2 1
#endif

constexpr int kGroup = 4;            // input rows sharing one decode of a weight row's chunks

constexpr int64_t kTileBytes = 96 << 10;  // int8 input rows per tile: ~96 KiB, well inside L2

float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Weights and bytes per block of each type.
constexpr bool super_block(int32_t type) {
  return type == PQ_Q2_K || type == PQ_Q3_K || type == PQ_Q4_K || type == PQ_Q5_K || type == PQ_Q6_K ||
         type == PQ_IQ4_XS;
}

constexpr int64_t block_weights(int32_t type) { return super_block(type) ? 256 : 32; }

constexpr int64_t block_bytes(int32_t type) {
  switch (type) {
    case PQ_Q4_0: return 18;
    case PQ_Q4_1: return 20;
    case PQ_Q5_0: return 22;
    case PQ_Q5_1: return 24;
    case PQ_Q8_0: return 34;
    case PQ_Q2_K: return 84;
    case PQ_Q3_K: return 110;
    case PQ_Q4_K: return 144;
    case PQ_Q5_K: return 176;
    case PQ_Q6_K: return 210;
    case PQ_IQ4_NL: return 18;
    case PQ_IQ4_XS: return 136;
    case PQ_MXFP4: return 17;
    default: return 0;
  }
}

// The 16 values of IQ4_NL and IQ4_XS nibbles (llama.cpp's kvalues_iq4nl).
alignas(16) constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
// The same plus 128, as unsigned bytes (the packed kernels' u, for vpdpbusd).
alignas(16) constexpr uint8_t kIq4Unsigned[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

// The 16 values of MXFP4 nibbles (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), doubled to integers
// (llama.cpp's kvalues_mxfp4); the block scale is then 2^(e - 128) (ggml_e8m0_to_fp32_half).
alignas(16) constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {  // the float's bits built directly (ldexpf is a library call per block)
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K and Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q3_K: its 16 signed 6-bit scales (stored as s + 32 in 12 bytes) unpacked.
inline void scales_q3_k(const uint8_t* packed, int8_t* out) {
  for (int j = 0; j < 16; ++j) {
    const int low = j < 8 ? (packed[j] & 0xF) : (packed[j - 8] >> 4);
    const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    out[j] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
}

// IQ4_XS: the signed 6-bit scale of sub-block j (0..7).
inline int scale_iq4_xs(const uint8_t* blk, int j) {
  const int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0xF;
  const int high = (static_cast<int>(blk[2] | (blk[3] << 8)) >> (2 * j)) & 3;
  return (low | (high << 4)) - 32;
}

// Chunk c (weights 32 c .. 32 c + 31) of a row: w[i] = a * sc[i / 16] * q[i] + b + bm * mn[i / 16] (mn and bm: the
// per-16 mins of Q2_K; 0 for the other types).
struct Chunk {
  int8_t q[32] = {};
  int16_t sc[2] = {1, 1};
  int16_t mn[2] = {0, 0};
  float a = 0.f, b = 0.f, bm = 0.f;
};

void decode_chunk(int32_t type, const uint8_t* row, int64_t c, Chunk& k) {
  k.sc[0] = k.sc[1] = 1;
  k.mn[0] = k.mn[1] = 0;
  k.a = k.b = k.bm = 0.f;
  switch (type) {
    case PQ_Q4_0:
    case PQ_Q4_1:
    case PQ_IQ4_NL: {
      const uint8_t* blk = row + c * block_bytes(type);
      const float d = f16_at(blk);
      k.a = d;
      k.b = type == PQ_Q4_0 ? -8.f * d : type == PQ_Q4_1 ? f16_at(blk + 2) : 0.f;
      const uint8_t* qs = blk + (type == PQ_Q4_1 ? 4 : 2);
      for (int l = 0; l < 16; ++l) {
        const int lo = qs[l] & 0xF, hi = qs[l] >> 4;
        k.q[l] = static_cast<int8_t>(type == PQ_IQ4_NL ? kIq4Values[lo] : lo);
        k.q[l + 16] = static_cast<int8_t>(type == PQ_IQ4_NL ? kIq4Values[hi] : hi);
      }
      return;
    }
    case PQ_MXFP4: {
      const uint8_t* blk = row + c * 17;
      k.a = e8m0_half(blk[0]);
      for (int l = 0; l < 16; ++l) {
        k.q[l] = kMxfp4Values[blk[1 + l] & 0xF];
        k.q[l + 16] = kMxfp4Values[blk[1 + l] >> 4];
      }
      return;
    }
    case PQ_Q5_0:
    case PQ_Q5_1: {
      const uint8_t* blk = row + c * block_bytes(type);
      const float d = f16_at(blk);
      k.a = d;
      k.b = type == PQ_Q5_0 ? -16.f * d : f16_at(blk + 2);
      const uint8_t* qhp = blk + (type == PQ_Q5_0 ? 2 : 4);
      const uint32_t qh = qhp[0] | (qhp[1] << 8) | (qhp[2] << 16) | (static_cast<uint32_t>(qhp[3]) << 24);
      const uint8_t* qs = qhp + 4;
      for (int l = 0; l < 16; ++l) {
        k.q[l] = static_cast<int8_t>((qs[l] & 0xF) | (((qh >> l) & 1) << 4));
        k.q[l + 16] = static_cast<int8_t>((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
      }
      return;
    }
    case PQ_Q8_0: {
      const uint8_t* blk = row + c * 34;
      k.a = f16_at(blk);
      std::memcpy(k.q, blk + 2, 32);
      return;
    }
    case PQ_Q2_K: {  // scales [16] (scale | min << 4), qs [64], d, dmin
      const int j = static_cast<int>(c % 8), h = j / 4, shift = 2 * (j % 4);
      const uint8_t* blk = row + (c / 8) * 84;
      const uint8_t* qs = blk + 16 + 32 * h;
      k.a = f16_at(blk + 80);
      k.bm = -f16_at(blk + 82);
      for (int u = 0; u < 2; ++u) {
        k.sc[u] = blk[2 * j + u] & 0xF;
        k.mn[u] = blk[2 * j + u] >> 4;
      }
      for (int l = 0; l < 32; ++l) k.q[l] = static_cast<int8_t>((qs[l] >> shift) & 3);
      return;
    }
    case PQ_Q3_K: {  // hmask [32], qs [64], scales [12], d
      const int j = static_cast<int>(c % 8), h = j / 4, shift = 2 * (j % 4);
      const uint8_t* blk = row + (c / 8) * 110;
      const uint8_t* qs = blk + 32 + 32 * h;
      int8_t scales[16];
      scales_q3_k(blk + 96, scales);
      k.a = f16_at(blk + 108);
      k.sc[0] = scales[2 * j];
      k.sc[1] = scales[2 * j + 1];
      for (int l = 0; l < 32; ++l)
        k.q[l] = static_cast<int8_t>(((qs[l] >> shift) & 3) - (((blk[l] >> j) & 1) ? 0 : 4));
      return;
    }
    case PQ_Q4_K:
    case PQ_Q5_K: {
      const int j = static_cast<int>(c % 8);
      const uint8_t* blk = row + (c / 8) * block_bytes(type);
      int sc, m;
      scale_min_k4(j, blk + 4, sc, m);
      k.a = f16_at(blk) * static_cast<float>(sc);
      k.b = -f16_at(blk + 2) * static_cast<float>(m);
      const bool q5 = type == PQ_Q5_K;
      const uint8_t* src = blk + (q5 ? 48 : 16) + 32 * (j / 2);
      for (int l = 0; l < 32; ++l) {
        int v = (j % 2) ? src[l] >> 4 : src[l] & 0xF;
        if (q5) v += ((blk[16 + l] >> j) & 1) << 4;
        k.q[l] = static_cast<int8_t>(v);
      }
      return;
    }
    case PQ_Q6_K: {
      const int j = static_cast<int>(c % 8), h = j / 4, part = j % 4;
      const uint8_t* blk = row + (c / 8) * 210;
      const uint8_t* ql = blk + 64 * h + (part % 2 ? 32 : 0);
      const uint8_t* qh = blk + 128 + 32 * h;
      const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
      k.a = f16_at(blk + 208);
      k.sc[0] = scales[8 * h + 2 * part];
      k.sc[1] = scales[8 * h + 2 * part + 1];
      for (int l = 0; l < 32; ++l) {
        const int lo = part < 2 ? ql[l] & 0xF : ql[l] >> 4;
        k.q[l] = static_cast<int8_t>((lo | (((qh[l] >> (2 * part)) & 3) << 4)) - 32);
      }
      return;
    }
    case PQ_IQ4_XS: {  // d, scales_h (16 bits), scales_l [4], qs [128]
      const int j = static_cast<int>(c % 8);
      const uint8_t* blk = row + (c / 8) * 136;
      const uint8_t* qs = blk + 8 + 16 * j;
      k.a = f16_at(blk) * static_cast<float>(scale_iq4_xs(blk, j));
      for (int l = 0; l < 16; ++l) {
        k.q[l] = kIq4Values[qs[l] & 0xF];
        k.q[l + 16] = kIq4Values[qs[l] >> 4];
      }
      return;
    }
    default:
      return;
  }
}


void dequant_row_scalar(int32_t type, const uint8_t* row, int64_t in, float* out) {
  Chunk k;
  for (int64_t c = 0; c < in / 32; ++c) {
    decode_chunk(type, row, c, k);
    float* o = out + 32 * c;
    const float a0 = k.a * k.sc[0], a1 = k.a * k.sc[1];
    const float b0 = k.b + k.bm * k.mn[0], b1 = k.b + k.bm * k.mn[1];
    for (int l = 0; l < 16; ++l) o[l] = a0 * k.q[l] + b0;
    for (int l = 16; l < 32; ++l) o[l] = a1 * k.q[l] + b1;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Input rows quantized to int8 in blocks of 32.
struct Q8Rows {
  int8_t* q;       // [rows, in]
  float* d;        // [rows, in / 32]: the block's scale
  float* s;        // [rows, in / 32]: d * sum of the block's q
  int64_t in;      // row length
  int32_t* s16;    // [rows, in / 16]: the sums of q over 16 (Q6_K's packed kernel)
};

void quantize_row(const float* x, int64_t in, int8_t* q, float* d, float* s, int32_t* s16) {
  for (int64_t c = 0; c < in / 32; ++c) {
    const float* v = x + 32 * c;
    int8_t* o = q + 32 * c;
#if defined(PAGEDLLM_QUANT_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
           v3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, mul)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, mul));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, mul)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, mul));
    const __m256i lo16 = _mm256_add_epi32(i0, i1);
    const __m256i sum32 = _mm256_add_epi32(lo16, _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), i0);
    d[c] = dd;
    s[c] = dd * static_cast<float>(_mm_cvtsi128_si32(s4));
    if (s16 != nullptr) {  // weights 0-15 are lo16's (i0, i1 before packing), 16-31 the rest
      __m128i h0 = _mm_add_epi32(_mm256_castsi256_si128(lo16), _mm256_extracti128_si256(lo16, 1));
      h0 = _mm_add_epi32(h0, _mm_shuffle_epi32(h0, 0x4E));
      h0 = _mm_add_epi32(h0, _mm_shuffle_epi32(h0, 0xB1));
      s16[2 * c] = _mm_cvtsi128_si32(h0);
      s16[2 * c + 1] = _mm_cvtsi128_si32(s4) - s16[2 * c];
    }
#else
    float amax = 0.f;
    for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(v[l]));
    const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0, low = 0;
    for (int l = 0; l < 32; ++l) {
      const int qi = static_cast<int>(std::nearbyint(v[l] * id));
      o[l] = static_cast<int8_t>(qi);
      sum += qi;
      if (l == 15) low = sum;
    }
    d[c] = dd;
    s[c] = dd * static_cast<float>(sum);
    if (s16 != nullptr) {
      s16[2 * c] = low;
      s16[2 * c + 1] = sum - low;
    }
#endif
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The products of one weight row with a group of MB quantized input rows (the group's first row at xq, xd, xs; rows
// ldq / ldb apart): out[m * ldo] = row . x_m.
#if defined(PAGEDLLM_QUANT_AVX2)

inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> their 16 low nibbles, then their 16 high nibbles
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 bytes, byte i 0xFF where bit i of `bits` is set (the fifth bits of Q5_0 and Q5_1).
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // every bit but bit i % 8 of byte i
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

inline __m256i iq4_table() {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
}

inline __m256i mxfp4_table() {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
}

// Calls f(c, q, sc16, a, b, m16, bm) for every chunk of a row: q the chunk's 32 integers as bytes (unsigned for the
// types with kSigned false), sc16 the 16-bit multipliers of the 16 pair sums (vpmaddubsw's output lanes 0-7 cover
// weights 0-15), a and b its float scale and offset; Q2_K's per-16 mins in m16 (like sc16) with their float scale bm
// (w = a sc q + bm mn), zero for the other types.
template <int32_t T, class F>
inline void visit_row(const uint8_t* row, int64_t in, F&& f) {
  const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F), none = _mm256_setzero_si256();
  if constexpr (T == PQ_Q4_0 || T == PQ_Q4_1 || T == PQ_Q8_0 || T == PQ_IQ4_NL) {
    constexpr int64_t bytes = block_bytes(T);
    [[maybe_unused]] const __m256i table = T == PQ_IQ4_NL ? iq4_table() : none;
    for (int64_t c = 0; c < in / 32; ++c) {
      const uint8_t* blk = row + c * bytes;
      const float d = T == PQ_Q4_1 ? 0.f : f16_at(blk);
      if constexpr (T == PQ_Q4_0) f(c, nibbles16(blk + 2), ones, d, -8.f * d, none, 0.f);
      if constexpr (T == PQ_Q4_1) {  // d and m side by side: both converted in one instruction
        int32_t dm;
        std::memcpy(&dm, blk, 4);
        const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        f(c, nibbles16(blk + 4), ones, _mm_cvtss_f32(both), _mm_cvtss_f32(_mm_movehdup_ps(both)), none, 0.f);
      }
      if constexpr (T == PQ_Q8_0)
        f(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)), ones, d, 0.f, none, 0.f);
      if constexpr (T == PQ_IQ4_NL) f(c, _mm256_shuffle_epi8(table, nibbles16(blk + 2)), ones, d, 0.f, none, 0.f);
    }
  } else if constexpr (T == PQ_MXFP4) {
    const __m256i table = mxfp4_table();
    for (int64_t c = 0; c < in / 32; ++c) {
      const uint8_t* blk = row + c * 17;
      f(c, _mm256_shuffle_epi8(table, nibbles16(blk + 1)), ones, e8m0_half(blk[0]), 0.f, none, 0.f);
    }
  } else if constexpr (T == PQ_Q5_0 || T == PQ_Q5_1) {
    constexpr int64_t bytes = block_bytes(T), qh_at = T == PQ_Q5_0 ? 2 : 4;
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t c = 0; c < in / 32; ++c) {
      const uint8_t* blk = row + c * bytes;
      const float d = f16_at(blk), b = T == PQ_Q5_0 ? -16.f * d : f16_at(blk + 2);
      uint32_t qh;
      std::memcpy(&qh, blk + qh_at, 4);
      const __m256i q = _mm256_or_si256(nibbles16(blk + qh_at + 4), _mm256_and_si256(bytes_from_bits(qh), sixteen));
      f(c, q, ones, d, b, none, 0.f);
    }
  } else if constexpr (T == PQ_IQ4_XS) {
    const __m256i table = iq4_table();
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * 136;
      const float d = f16_at(blk);
      for (int j = 0; j < 8; ++j) {
        const __m256i q = _mm256_shuffle_epi8(table, nibbles16(blk + 8 + 16 * j));
        f(sb * 8 + j, q, ones, d * static_cast<float>(scale_iq4_xs(blk, j)), 0.f, none, 0.f);
      }
    }
  } else if constexpr (T == PQ_Q2_K) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * 84;
      const float d = f16_at(blk + 80), dmin = f16_at(blk + 82);
      for (int h = 0; h < 2; ++h) {
        const __m256i q32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * h));
        for (int part = 0; part < 4; ++part) {
          const int j = 4 * h + part;
          const __m256i q = _mm256_and_si256(_mm256_srli_epi16(q32, 2 * part), three);
          const uint8_t s0 = blk[2 * j], s1 = blk[2 * j + 1];
          const __m256i sc16 = _mm256_set_m128i(_mm_set1_epi16(s1 & 0xF), _mm_set1_epi16(s0 & 0xF));
          const __m256i m16 = _mm256_set_m128i(_mm_set1_epi16(s1 >> 4), _mm_set1_epi16(s0 >> 4));
          f(sb * 8 + j, q, sc16, d, 0.f, m16, -dmin);
        }
      }
    }
  } else if constexpr (T == PQ_Q3_K) {
    const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * 110;
      const float d = f16_at(blk + 108);
      int8_t scales[16];
      scales_q3_k(blk + 96, scales);
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      for (int h = 0; h < 2; ++h) {
        const __m256i q32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * h));
        for (int part = 0; part < 4; ++part) {
          const int j = 4 * h + part;
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
          const __m256i unset = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), none);  // high bit clear: q - 4
          const __m256i q = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(q32, 2 * part), three),
                                            _mm256_and_si256(unset, four));
          const __m256i sc16 = _mm256_set_m128i(_mm_set1_epi16(scales[2 * j + 1]), _mm_set1_epi16(scales[2 * j]));
          f(sb * 8 + j, q, sc16, d, 0.f, none, 0.f);
        }
      }
    }
  } else if constexpr (T == PQ_Q4_K || T == PQ_Q5_K) {
    constexpr bool q5 = T == PQ_Q5_K;
    constexpr int64_t bytes = q5 ? 176 : 144;
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * bytes;
      const float d = f16_at(blk), dmin = f16_at(blk + 2);
      const uint8_t* qs = blk + (q5 ? 48 : 16);
      const __m256i qh = q5 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const __m256i bytes32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * g));
        __m256i lo = _mm256_and_si256(bytes32, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes32, 4), m4);
        if constexpr (q5) {
          const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * g)));
          const __m256i b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * g + 1)));
          const __m256i sixteen = _mm256_set1_epi8(16);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        int sc, m;
        scale_min_k4(2 * g, blk + 4, sc, m);
        f(sb * 8 + 2 * g, lo, ones, d * static_cast<float>(sc), -dmin * static_cast<float>(m), none, 0.f);
        scale_min_k4(2 * g + 1, blk + 4, sc, m);
        f(sb * 8 + 2 * g + 1, hi, ones, d * static_cast<float>(sc), -dmin * static_cast<float>(m), none, 0.f);
      }
    }
  } else {  // Q6_K
    static_assert(T == PQ_Q6_K);
    const __m256i three = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < in / 256; ++sb) {
      const uint8_t* blk = row + sb * 210;
      const auto* scales = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = f16_at(blk + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i lows[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int part = 0; part < 4; ++part) {
          const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), three);
          const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[part], _mm256_slli_epi16(hb, 4)), off);
          const int s0 = scales[8 * h + 2 * part], s1 = scales[8 * h + 2 * part + 1];
          const __m256i sc16 = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(s1)),
                                                _mm_set1_epi16(static_cast<int16_t>(s0)));
          f(sb * 8 + 4 * h + part, q, sc16, d, 0.f, none, 0.f);
        }
      }
    }
  }
}

template <int32_t T>
constexpr bool kSigned =
    T == PQ_Q8_0 || T == PQ_Q6_K || T == PQ_Q3_K || T == PQ_IQ4_NL || T == PQ_IQ4_XS || T == PQ_MXFP4;
template <int32_t T>  // b != 0
constexpr bool kOffset = T == PQ_Q4_0 || T == PQ_Q4_1 || T == PQ_Q5_0 || T == PQ_Q5_1 || T == PQ_Q4_K || T == PQ_Q5_K;
template <int32_t T>
constexpr bool kUnitScales = !(T == PQ_Q6_K || T == PQ_Q3_K || T == PQ_Q2_K);
template <int32_t T>
constexpr bool kMins = T == PQ_Q2_K;  // per-16 mins (m16, bm)

// A row de-quantized to float32, vectorized: each chunk's 32 integers widened to float and scaled (a * sc, b).
template <int32_t T>
void dequant_row_avx2(const uint8_t* row, int64_t in, float* out) {
  visit_row<T>(row, in, [&](int64_t c, __m256i q, __m256i sc16, float a, float b, __m256i m16, float bm) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    // The 16-bit lanes are signed (Q3_K's and Q6_K's scales): _mm256_extract_epi16 zero-extends them.
    const float a0 = a * static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(sc16, 0)));
    const float a1 = a * static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(sc16, 8)));
    float b0 = b, b1 = b;
    if constexpr (kMins<T>) {
      b0 = bm * static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(m16, 0)));
      b1 = bm * static_cast<float>(static_cast<int16_t>(_mm256_extract_epi16(m16, 8)));
    }
    const __m256 bv0 = _mm256_set1_ps(b0), bv1 = _mm256_set1_ps(b1), av0 = _mm256_set1_ps(a0), av1 = _mm256_set1_ps(a1);
    auto widen = [&](__m128i v) { return kSigned<T> ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v); };
    float* o = out + 32 * c;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(lo)), av0, bv0));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(_mm_srli_si128(lo, 8))), av0, bv0));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(hi)), av1, bv1));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(_mm_srli_si128(hi, 8))), av1, bv1));
  });
}

template <int32_t T, int MB>
void dot_group(const uint8_t* row, int64_t in, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
               int64_t ldb, float* out, int64_t ldo) {
  // Even and odd chunks in separate accumulators where registers allow: one chain of dependent FMAs would bound a
  // single row's product by the FMA latency.
  constexpr int NA = 2;
  __m256 acc[MB][NA];
  __m256 off[NA];  // lane m: row m's sum of b * sx (m < MB <= 4)
  for (int m = 0; m < MB; ++m)
    for (int u = 0; u < NA; ++u) acc[m][u] = _mm256_setzero_ps();
  for (int u = 0; u < NA; ++u) off[u] = _mm256_setzero_ps();
  float off1 = 0.f, off2 = 0.f;  // one row: its two offset sums as scalars (same arithmetic, fewer instructions)
  visit_row<T>(row, in, [&](int64_t c, __m256i q, __m256i sc16, float a, float b, __m256i m16, float bm) {
    const __m256i aq = kSigned<T> ? _mm256_sign_epi8(q, q) : q;  // |q| (vpsignb: q * sign(q))
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * ldq + 32 * c));
      if constexpr (kSigned<T>) x = _mm256_sign_epi8(x, q);  // the sign of q moved onto x
      __m256i p;
#if defined(__AVX512VNNI__)
      if constexpr (kUnitScales<T>)
        p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, x);
      else
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), sc16);
#else
      p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), sc16);
#endif
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a * xd[m * ldb + c]), acc[m][0]);
      if constexpr (kMins<T>) {  // the mins times the input's sums over 16
        const __m256i pm = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x), m16);
        acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(bm * xd[m * ldb + c]), acc[m][0]);
      }
    }
    if constexpr (kOffset<T> && MB == 1) {
      off1 = std::fma(b, xs[c], off1);  // the same rounding as a vector lane's fma below
    } else if constexpr (kOffset<T>) {
      __m256 sx;
      if constexpr (MB == 2) sx = _mm256_setr_ps(xs[c], xs[ldb + c], 0, 0, 0, 0, 0, 0);
      else if constexpr (MB == 3) sx = _mm256_setr_ps(xs[c], xs[ldb + c], xs[2 * ldb + c], 0, 0, 0, 0, 0);
      else sx = _mm256_setr_ps(xs[c], xs[ldb + c], xs[2 * ldb + c], xs[3 * ldb + c], 0, 0, 0, 0);
      off[0] = _mm256_fmadd_ps(sx, _mm256_set1_ps(b), off[0]);
    }
    if constexpr (NA == 2) {  // the next chunk adds to the other accumulators (a register rename, not a move)
      for (int m = 0; m < MB; ++m) std::swap(acc[m][0], acc[m][1]);
      std::swap(off[0], off[1]);
      std::swap(off1, off2);
    }
  });
  float offs[8];
  __m256 o = off[0];
  for (int u = 1; u < NA; ++u) o = _mm256_add_ps(o, off[u]);
  _mm256_storeu_ps(offs, o);
  if constexpr (MB == 1) offs[0] = off1 + off2;
  for (int m = 0; m < MB; ++m) {
    __m256 a = acc[m][0];
    for (int u = 1; u < NA; ++u) a = _mm256_add_ps(a, acc[m][u]);
    out[m * ldo] = hsum(a) + (kOffset<T> ? offs[m] : 0.f);
  }
}

#else  // no AVX2: the same integer arithmetic in plain C++

template <int32_t T, int MB>
void dot_group(const uint8_t* row, int64_t in, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
               int64_t ldb, float* out, int64_t ldo) {
  float acc[MB] = {}, off[MB] = {};
  Chunk k;
  for (int64_t c = 0; c < in / 32; ++c) {
    decode_chunk(T, row, c, k);
    for (int m = 0; m < MB; ++m) {
      const int8_t* x = xq + m * ldq + 32 * c;
      int32_t s0 = 0, s1 = 0;
      for (int l = 0; l < 16; ++l) s0 += k.q[l] * x[l];
      for (int l = 16; l < 32; ++l) s1 += k.q[l] * x[l];
      acc[m] += k.a * xd[m * ldb + c] * static_cast<float>(s0 * k.sc[0] + s1 * k.sc[1]);
      off[m] += k.b * xs[m * ldb + c];
      if (k.bm != 0.f) {  // Q2_K's per-16 mins times the input's sums over 16
        int32_t t0 = 0, t1 = 0;
        for (int l = 0; l < 16; ++l) t0 += x[l];
        for (int l = 16; l < 32; ++l) t1 += x[l];
        off[m] += k.bm * xd[m * ldb + c] * static_cast<float>(t0 * k.mn[0] + t1 * k.mn[1]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m * ldo] = acc[m] + off[m];
}

#endif


// ---------------------------------------------------------------------------------------------------------------
// The interleaved layout of AVX2 and AVX-512 builds (quant_pack): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL rows in
// groups of 16 output rows (the super-block types' below).
// A group holds its rows' chunks in order, chunk c in as many bytes as the 16 rows' blocks c: first the 16 scales a
// (f16), for Q4_1 then the 16 offsets b (f16), then the weights as vectors of 16 lanes of 4 bytes, lane r of vector j
// holding row r's weights 4j .. 4j + 3 of the chunk as unsigned bytes u, so that w = a u + b:
// * Q4_0 and Q4_1: the file's 16 nibble bytes of a row, in 4 vectors; byte k of lane r of vector t has weight 4t + k
//   in its low nibble and 16 + 4t + k in its high one (vector t & 15 and (vector t >> 4) & 15 give u for vectors t
//   and t + 4); b = -8 a for Q4_0, the block's min for Q4_1.
// * Q8_0: 8 vectors of u = q + 128, and b = -128 a.
// * IQ4_NL: the file's nibble bytes as Q4_0's, each nibble the index of its value (kIq4Values).
// One vpdpbusd then multiplies 4 weights of 16 output rows by 4 int8 inputs broadcast, and a chunk's float step
// (convert, scale, offset) serves 16 outputs: no horizontal sums, and the weights of a group are decoded once for
// every input row. A group is as many bytes as its 16 rows were, so packing happens in place.
constexpr int64_t kPackRows = 16;

// The super-block types Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS have a packed layout of their own (pack_group_k).
constexpr bool packed_k(int32_t type) {
  return type == PQ_Q3_K || type == PQ_Q4_K || type == PQ_Q5_K || type == PQ_Q6_K || type == PQ_IQ4_XS;
}
// The types whose packed groups go straight into panels (packed_panel_groups): all the packable ones.
constexpr bool panel_direct(int32_t type) {
  return type == PQ_Q4_0 || type == PQ_Q4_1 || type == PQ_Q5_0 || type == PQ_Q5_1 || type == PQ_Q8_0 ||
         type == PQ_IQ4_NL || packed_k(type);
}

inline bool packable(int32_t type) {
  return type == PQ_Q4_0 || type == PQ_Q4_1 || type == PQ_Q5_0 || type == PQ_Q5_1 || type == PQ_Q8_0 ||
         type == PQ_IQ4_NL || packed_k(type);
}
constexpr bool has_min(int32_t type) { return type == PQ_Q4_1 || type == PQ_Q5_1; }  // b from the block, not a
constexpr bool five_bit(int32_t type) { return type == PQ_Q5_0 || type == PQ_Q5_1; }
// Where a packed chunk's fifth bits start (Q5_0, Q5_1: 16 lanes of 4 bytes, after the scales and mins) and its weight
// vectors.
constexpr int64_t packed_qh_at(int32_t type) { return has_min(type) ? 64 : 32; }
constexpr int64_t packed_weights_at(int32_t type) { return packed_qh_at(type) + (five_bit(type) ? 64 : 0); }
// b of a type without a min, as a multiple of a: w = a u + b with u the unsigned integer the packed layout holds.
// IQ4_NL's (and IQ4_XS's) nibbles index kIq4Values: u is the value + 128 for vpdpbusd.
constexpr float packed_offset(int32_t type) {
  return type == PQ_Q8_0 || type == PQ_IQ4_NL || type == PQ_IQ4_XS ? -128.f : type == PQ_Q5_0 ? -16.f : -8.f;
}

// Q5_0 and Q5_1: the fifth bit of weight w (0..31) of a chunk goes to bit 8 (w % 4) + j of its row's packed word,
// j = (w % 16) / 4 + 4 (w / 16) the index of the weight vector that holds the weight's nibble (vectors 0-3 the low
// nibbles, 4-7 the high ones): shifted by 4 - j, the word then holds vector j's fifth bits at bit 4 of each byte.
constexpr int fifth_bit_at(int w) { return 8 * (w % 4) + (w % 16) / 4 + 4 * (w / 16); }

[[maybe_unused]] void pack_group(uint8_t* grp, int32_t type, int64_t nb, std::vector<uint8_t>& tmp) {
  const int64_t bb = block_bytes(type), rb = nb * bb, wo = packed_weights_at(type), qh_at = packed_qh_at(type);
  const int vecs = type == PQ_Q8_0 ? 8 : 4;
  const int qoff = (has_min(type) ? 4 : 2) + (five_bit(type) ? 4 : 0);  // of the block's weights
  const uint32_t flip = type == PQ_Q8_0 ? 0x80808080u : 0u;  // q + 128 as unsigned bytes
  tmp.assign(grp, grp + kPackRows * rb);
  for (int64_t c = 0; c < nb; ++c) {
    uint8_t* o = grp + c * kPackRows * bb;
    for (int r = 0; r < kPackRows; ++r) {
      const uint8_t* blk = tmp.data() + r * rb + c * bb;
      std::memcpy(o + 2 * r, blk, 2);
      if (has_min(type)) std::memcpy(o + 32 + 2 * r, blk + 2, 2);
      if (five_bit(type)) {
        uint32_t qh, word = 0;
        std::memcpy(&qh, blk + (has_min(type) ? 4 : 2), 4);
        for (int w = 0; w < 32; ++w) word |= ((qh >> w) & 1u) << fifth_bit_at(w);
        std::memcpy(o + qh_at + 4 * r, &word, 4);
      }
      for (int j = 0; j < vecs; ++j) {
        uint32_t w4;
        std::memcpy(&w4, blk + qoff + 4 * j, 4);
        w4 ^= flip;
        std::memcpy(o + wo + 64 * j + 4 * r, &w4, 4);
      }
    }
  }
}

// The packed layout of Q4_K and Q5_K: each super-block of a group's 16 rows in as many bytes as the rows' blocks,
// the 16 rows' fields side by side: d (16 f16), dmin (16 f16), the 12 scale bytes as 3 vectors of 16 lanes of 4 bytes
// (vector w lane r: bytes 4w .. 4w + 3 of row r's), for Q5_K the 32 fifth-bit bytes as 8 such vectors, then the 128
// nibble bytes as 32 vectors: vector 8g + t lane r holds bytes 32g + 4t .. 32g + 4t + 3 of row r's nibbles, whose
// low nibbles are weights 4t .. 4t + 3 of chunk 2g and high nibbles those of chunk 2g + 1 (ggml's order). A chunk's
// 8 vectors then feed vpdpbusd as Q4_0's do, and its scale and min come from the scale vectors for 16 rows at once.
constexpr int64_t kQh = 256;  // where Q5_K's fifth bits start in a packed super-block
constexpr int64_t k_nibbles_at(int32_t type) { return type == PQ_Q5_K ? kQh + 512 : kQh; }

// Q6_K's: d (16 f16), the 16 int8 scales as 4 vectors (vector w lane r: scales 4w .. 4w + 3 of row r), the 128
// low-bit bytes as 32 vectors (vector v lane r: bytes 4v .. 4v + 3 of row r's ql), the 64 high-bit bytes as 16
// (likewise of qh).
constexpr int64_t kQ6Scales = 32, kQ6Low = 32 + 256, kQ6High = 32 + 256 + 2048;

// IQ4_XS's: d (16 f16), scales_h (16 u16), scales_l as one vector (lane r: row r's 4 bytes), then the 128 nibble
// bytes as 32 vectors (vector 4j + t lane r: bytes 16j + 4t .. + 3 of row r's, chunk j's weights 4t .. 4t + 3 in the
// low nibbles and 16 + 4t .. in the high ones, as Q4_0's).
constexpr int64_t kXsHigh = 32, kXsLow = 64, kXsNibbles = 128;

// Q3_K's: d (16 f16), the 12 scale bytes as 3 vectors (vector w lane r: bytes 4w .. 4w + 3 of row r's), the 32
// high-bit mask bytes as 8 vectors, the 64 low-bit bytes as 16 (lane r of vector v: bytes 4v .. 4v + 3 of row r's).
constexpr int64_t kQ3Scales = 32, kQ3Mask = 32 + 192, kQ3Low = 32 + 192 + 512;

// Moves row r's block between its GGUF layout (blk) and its lanes of a packed super-block (sb): `pack` true writes
// sb, false writes blk.
void move_block_k(int32_t type, uint8_t* sb, int r, uint8_t* blk, bool pack) {
  auto mv = [&](int64_t at_sb, int64_t at_blk, int64_t n) {
    if (pack) std::memcpy(sb + at_sb, blk + at_blk, n);
    else std::memcpy(blk + at_blk, sb + at_sb, n);
  };
  if (type == PQ_IQ4_XS) {  // d, scales_h [2], scales_l [4], qs [128]
    mv(2 * r, 0, 2);
    mv(kXsHigh + 2 * r, 2, 2);
    mv(kXsLow + 4 * r, 4, 4);
    for (int v = 0; v < 32; ++v) mv(kXsNibbles + 64 * v + 4 * r, 8 + 4 * v, 4);
    return;
  }
  if (type == PQ_Q3_K) {  // hmask [32], qs [64], scales [12], d
    mv(2 * r, 108, 2);
    for (int w = 0; w < 3; ++w) mv(kQ3Scales + 64 * w + 4 * r, 96 + 4 * w, 4);
    for (int t = 0; t < 8; ++t) mv(kQ3Mask + 64 * t + 4 * r, 4 * t, 4);
    for (int v = 0; v < 16; ++v) mv(kQ3Low + 64 * v + 4 * r, 32 + 4 * v, 4);
    return;
  }
  if (type == PQ_Q6_K) {  // ql [128], qh [64], scales [16], d
    mv(2 * r, 208, 2);
    for (int w = 0; w < 4; ++w) mv(kQ6Scales + 64 * w + 4 * r, 192 + 4 * w, 4);
    for (int v = 0; v < 32; ++v) mv(kQ6Low + 64 * v + 4 * r, 4 * v, 4);
    for (int v = 0; v < 16; ++v) mv(kQ6High + 64 * v + 4 * r, 128 + 4 * v, 4);
    return;
  }
  mv(2 * r, 0, 2);
  mv(32 + 2 * r, 2, 2);
  for (int w = 0; w < 3; ++w) mv(64 + 64 * w + 4 * r, 4 + 4 * w, 4);
  const int64_t qs = type == PQ_Q5_K ? 48 : 16;
  if (type == PQ_Q5_K)
    for (int t = 0; t < 8; ++t) mv(kQh + 64 * t + 4 * r, 16 + 4 * t, 4);
  for (int v = 0; v < 32; ++v) mv(k_nibbles_at(type) + 64 * v + 4 * r, qs + 4 * v, 4);
}

[[maybe_unused]] void pack_group_k(uint8_t* grp, int32_t type, int64_t nsb, std::vector<uint8_t>& tmp) {
  const int64_t bb = block_bytes(type), rb = nsb * bb;
  tmp.assign(grp, grp + kPackRows * rb);
  for (int64_t sbi = 0; sbi < nsb; ++sbi)
    for (int r = 0; r < kPackRows; ++r)
      move_block_k(type, grp + sbi * kPackRows * bb, r, tmp.data() + r * rb + sbi * bb, true);
}

void dequant_row(int32_t type, const uint8_t* row, int64_t in, float* out);

// Row `lane` of a packed group, de-quantized (the same arithmetic as dequant_row).
void dequant_packed_row(int32_t type, const uint8_t* grp, int lane, int64_t nb, float* out) {
  if (packed_k(type)) {  // the row's blocks put back together, then de-quantized as stored
    uint8_t blk[210];
    for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
      move_block_k(type, const_cast<uint8_t*>(grp) + sbi * kPackRows * block_bytes(type), lane, blk, false);
      dequant_row(type, blk, 256, out + 256 * sbi);
    }
    return;
  }
  const int64_t cb = kPackRows * block_bytes(type), wo = packed_weights_at(type);
  for (int64_t c = 0; c < nb; ++c) {
    const uint8_t* ch = grp + c * cb;
    const uint8_t* u = ch + wo + 4 * lane;
    const float a = f16_at(ch + 2 * lane);
    float* o = out + 32 * c;
    if (type == PQ_Q8_0) {
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 4; ++k) o[4 * j + k] = a * static_cast<float>(static_cast<int>(u[64 * j + k]) - 128);
      continue;
    }
    if (type == PQ_IQ4_NL) {  // nibbles as Q4_0's, each the index of its value
      for (int t = 0; t < 4; ++t)
        for (int k = 0; k < 4; ++k) {
          o[4 * t + k] = a * static_cast<float>(kIq4Values[u[64 * t + k] & 0xF]);
          o[16 + 4 * t + k] = a * static_cast<float>(kIq4Values[u[64 * t + k] >> 4]);
        }
      continue;
    }
    uint32_t word = 0;
    if (five_bit(type)) std::memcpy(&word, ch + packed_qh_at(type) + 4 * lane, 4);
    auto fifth = [&](int w) { return static_cast<int>((word >> fifth_bit_at(w)) & 1u) << 4; };
    const float b = has_min(type) ? f16_at(ch + 32 + 2 * lane) : packed_offset(type) * a;
    for (int t = 0; t < 4; ++t)
      for (int k = 0; k < 4; ++k) {
        const uint8_t v = u[64 * t + k];
        o[4 * t + k] = std::fma(a, static_cast<float>((v & 0xF) | fifth(4 * t + k)), b);
        o[16 + 4 * t + k] = std::fma(a, static_cast<float>((v >> 4) | fifth(16 + 4 * t + k)), b);
      }
  }
}

#if defined(PAGEDLLM_QUANT_AVX2)
// Asks for `bytes` of weights `ahead` bytes past p: a packed segment's groups lie back to back, so past a group's
// end come the next group's. Past a segment's end it is a hint, never a fault (uintptr_t arithmetic).
inline void prefetch_weights(const uint8_t* p, int64_t ahead, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + ahead + l), _MM_HINT_T0);
}

// Inputs 4t .. 4t + 3 of a chunk's int8 copy x, broadcast to every 32-bit lane (vpmaddubsw's second operand).
inline __m256i inputs4(const int8_t* x, int t) {
  int32_t w;
  std::memcpy(&w, x + 4 * t, 4);
  return _mm256_set1_epi32(w);
}

// sum over the 8 weight vectors v (signed, |v| in av) of v times their inputs, as int32 lanes: the sign of v moved
// onto x and |v| multiplied (ggml's way: at most 2 * 128 * 127 per pair), each vector's pairs widened by vpmaddwd.
inline __m256i signed_sum8(const __m256i* v, const __m256i* av, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(av[0], _mm256_sign_epi8(inputs4(x, 0), v[0])), ones);
#pragma GCC unroll 8
  for (int t = 1; t < 8; ++t)
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(av[t], _mm256_sign_epi8(inputs4(x, t), v[t])), ones));
  return s;
}

// sum over the 8 weight vectors v (unsigned) of v times their inputs, as int32 lanes: the pair sums added in 16 bits,
// all eight where u <= 15 (8 * 2 * 15 * 127), four at a time where u <= 31 (`five`: 4 * 2 * 31 * 127).
template <bool five>
inline __m256i unsigned_sum8(const __m256i* v, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (five) {
    __m256i p = _mm256_maddubs_epi16(v[0], inputs4(x, 0)), q = _mm256_maddubs_epi16(v[4], inputs4(x, 4));
#pragma GCC unroll 4
    for (int t = 1; t < 4; ++t) {
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[t], inputs4(x, t)));
      q = _mm256_add_epi16(q, _mm256_maddubs_epi16(v[t + 4], inputs4(x, t + 4)));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_madd_epi16(q, ones));
  }
  __m256i p = _mm256_maddubs_epi16(v[0], inputs4(x, 0));
#pragma GCC unroll 8
  for (int t = 1; t < 8; ++t) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[t], inputs4(x, t)));
  return _mm256_madd_epi16(p, ones);
}

// offset + the sum over the 4 weight vectors v[t0 .. t0 + 3] (unsigned, u <= U) of v times their inputs, as int32
// lanes: one 16-weight half of a chunk whose halves have scales of their own (Q3_K, Q6_K). The pair sums add up in 16
// bits all four at a time where u <= 7 (Q3_K: 4 * 2 * 7 * 127), two at a time where u <= 63 (Q6_K: 2 * 2 * 63 * 127).
template <int U>
inline __m256i unsigned_sum4(const __m256i* v, const int8_t* x, int t0, int32_t offset) {
  static_assert(U == 7 || U == 63);
  const __m256i ones = _mm256_set1_epi16(1);
  auto pair = [&](int t) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(v[t], inputs4(x, t)), _mm256_maddubs_epi16(v[t + 1], inputs4(x, t + 1)));
  };
  const __m256i s = U == 7 ? _mm256_madd_epi16(_mm256_add_epi16(pair(t0), pair(t0 + 2)), ones)
                           : _mm256_add_epi32(_mm256_madd_epi16(pair(t0), ones), _mm256_madd_epi16(pair(t0 + 2), ones));
  return _mm256_add_epi32(_mm256_set1_epi32(offset), s);
}

// Chunk j's scale a = d sc and offset b = -dmin m for rows 8 half .. 8 half + 7 of a packed Q4_K or Q5_K super-block
// (scale_min_k4's bit fields, lane-wise from the halves of its three scale vectors).
inline void k4_scales_avx2(const uint8_t* sb, int half, int j, __m256 d, __m256 dmin, __m256& a, __m256& b) {
  const __m256i m6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3);
  auto vec = [&](int w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 + 64 * w + 32 * half)); };
  const __m256i w0 = vec(0), w1 = vec(1);
  __m256i sc, mn;
  if (j < 4) {
    sc = _mm256_and_si256(_mm256_srli_epi32(w0, 8 * j), m6);
    mn = _mm256_and_si256(_mm256_srli_epi32(w1, 8 * j), m6);
  } else {
    const int k = 8 * (j - 4);
    const __m256i w2 = vec(2);
    sc = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, k), low4),
                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, k + 6), three), 4));
    mn = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, k + 4), low4),
                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, k + 6), three), 4));
  }
  a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
  b = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dmin), _mm256_cvtepi32_ps(mn));
}

// IQ4_XS chunk j's scale a = d (scale - 32) for 8 rows of a packed super-block (scale_iq4_xs's bit fields, lane-wise
// from the rows' scales_l words lo and their scales_h widened to lanes, hi).
inline __m256 xs_scale_avx2(__m256 d, __m256i lo, __m256i hi, int j) {
  const __m256i low = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * j), _mm256_set1_epi32(0xF));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi32(hi, 2 * j), _mm256_set1_epi32(3));
  const __m256i sc = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32))));
}

// IQ4_XS chunk j of rows 8 half .. 8 half + 7 of a packed super-block as 8 vectors of signed bytes (vector t: weights
// 4 t .. 4 t + 3 of the chunk, the nibbles' values).
inline void xs_chunk_avx2(const uint8_t* sb, int half, int j, __m256i* v) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), table = iq4_table();
  for (int t = 0; t < 4; ++t) {
    const uint8_t* at = sb + kXsNibbles + 64 * (4 * j + t) + 32 * half;
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    v[t] = _mm256_shuffle_epi8(table, _mm256_and_si256(p, m4));
    v[t + 4] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(p, 4), m4));
  }
}

// Q3_K's signed 6-bit scale s (0..15) for 8 rows, from the halves of a packed super-block's three scale vectors w
// (scales_q3_k's bit fields, lane-wise), as floats.
inline __m256 q3_scale_avx2(const __m256i* w, int s) {
  const int b1 = s % 8;
  const __m256i low =
      _mm256_and_si256(_mm256_srli_epi32(w[b1 / 4], 8 * (b1 % 4) + (s >= 8 ? 4 : 0)), _mm256_set1_epi32(0xF));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi32(w[2], 8 * (s % 4) + 2 * (s / 4)), _mm256_set1_epi32(3));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32)));
}

// Q3_K chunk j of rows 8 half .. of a packed super-block as 8 byte vectors u = the 2 low bits | the mask bit << 2
// (0..7; vector t: weights 4 t .. 4 t + 3).
inline void q3_chunk_avx2(const uint8_t* sb, int half, int j, __m256i* v) {
  const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const int hh = j / 4, shift = 2 * (j % 4);
  for (int t = 0; t < 8; ++t) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ3Low + 64 * (8 * hh + t) + 32 * half));
    const __m256i m = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ3Mask + 64 * t + 32 * half));
    v[t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(q, shift), m3),
                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(m, j), one), 2));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define PAGEDLLM_QUANT_PACKED 1

// How far ahead packed_group asks for its weights (kPrefetchAhead: see the AVX2 kernel below for why). On Zen 5, 5
// KiB ahead made the model's 30 layers of linears 1.1-1.2x faster at 1 row and 1.3x at 5-8 rows
// (bench/quant_kernels_ab.py; 8 KiB was level with 5, 2.5 KiB between 5 and none; bench/RESULTS.md).
constexpr int64_t kPrefetchAhead = 5120;

// The 16 outputs of one packed group for RB input rows (row r's int8 copy at xq + r * ldq, its block scales and
// scaled sums at xd, xs + r * ldb), the lanes in `keep` stored to y + r * ldy. Each row's sums run in the same order
// whatever RB: a row's result does not depend on the others.
// Chunk c of RB input rows against a packed group's 16 rows, whose 32 weights are the 8 vectors v (lane r: 4
// unsigned weights of row r), w = a u + b: acc[r] += a dx sum(u x) + b sx, each row's in the same order.
// acc += a dx s + b sx: one chunk's integer sums s of one input row (dx, sx its block scale and scaled sum) for 16
// outputs whose weights are w = a u + b, in this order (the VNNI and the AMX kernels alike).
inline __m512 add_chunk(__m512 acc, __m512i s, __m512 a, __m512 b, float dx, float sx) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(a, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(b, _mm512_set1_ps(sx), acc);
}

inline __m512i iq4u_table512() {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Unsigned)));
}

template <int RB>
inline void chunk_rows(const __m512i* v, const int8_t* xq, const float* xd, const float* xs, int64_t ldq, int64_t ldb,
                       int64_t c, __m512 a, __m512 b, __m512* acc) {
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const int8_t* x = xq + r * ldq + 32 * c;
    __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      int32_t x4;
      std::memcpy(&x4, x + 4 * j, 4);
      s = _mm512_dpbusd_epi32(s, v[j], _mm512_set1_epi32(x4));
    }
    acc[r] = add_chunk(acc[r], s, a, b, xd[r * ldb + c], xs[r * ldb + c]);
  }
}

// A packed chunk of 16 rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): its scale a and offset b per row, and its 32
// unsigned weights as 8 vectors (lane r: 4 weights of row r), as vpdpbusd reads them.
template <int32_t T>
inline void unpack_chunk(const uint8_t* ch, __m512& a, __m512& b, __m512i* v) {
  constexpr int64_t wo = packed_weights_at(T);
  a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch)));
  b = has_min(T) ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32)))
                 : _mm512_mul_ps(a, _mm512_set1_ps(packed_offset(T)));
  if constexpr (T == PQ_Q8_0) {
    for (int j = 0; j < 8; ++j) v[j] = _mm512_loadu_si512(ch + wo + 64 * j);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i p = _mm512_loadu_si512(ch + wo + 64 * t);
      v[t] = _mm512_and_si512(p, m4);
      v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    }
    if constexpr (T == PQ_IQ4_NL)  // each nibble's value + 128
      for (int j = 0; j < 8; ++j) v[j] = _mm512_shuffle_epi8(iq4u_table512(), v[j]);
    if constexpr (five_bit(T)) {  // vector j's fifth bits at bit 4 of each byte: (word << 4 - j) & 0x10
      const __m512i word = _mm512_loadu_si512(ch + packed_qh_at(T)), b4 = _mm512_set1_epi8(0x10);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i at = j <= 4 ? _mm512_slli_epi32(word, 4 - j) : _mm512_srli_epi32(word, j - 4);
        v[j] = _mm512_ternarylogic_epi32(v[j], at, b4, 0xF8);  // v | (at & b4)
      }
    }
  }
}

template <int32_t T, int RB>
void packed_group(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                  int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  constexpr int64_t cb = kPackRows * block_bytes(T);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nb; ++c) {
    const uint8_t* ch = grp + c * cb;
    prefetch_weights(ch, kPrefetchAhead, cb);
    __m512 a, b;
    __m512i v[8];
    unpack_chunk<T>(ch, a, b, v);
    chunk_rows<RB>(v, xq, xd, xs, ldq, ldb, c, a, b, acc);
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

// Chunk j's scale a = d sc and offset b = -dmin m for the 16 rows of a packed Q4_K or Q5_K super-block (scale_min_k4's
// bit fields, lane-wise from its three scale vectors).
inline void k4_scales(const uint8_t* sb, int j, __m512 d, __m512 dmin, __m512& a, __m512& b) {
  const __m512i m6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(0xF), three = _mm512_set1_epi32(3);
  const __m512i w0 = _mm512_loadu_si512(sb + 64), w1 = _mm512_loadu_si512(sb + 128), w2 = _mm512_loadu_si512(sb + 192);
  __m512i sc, mn;
  if (j < 4) {
    sc = _mm512_and_si512(_mm512_srli_epi32(w0, 8 * j), m6);
    mn = _mm512_and_si512(_mm512_srli_epi32(w1, 8 * j), m6);
  } else {
    const int k = 8 * (j - 4);
    sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, k), low4),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, k + 6), three), 4));
    mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, k + 4), low4),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, k + 6), three), 4));
  }
  a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  b = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin), _mm512_cvtepi32_ps(mn));
}

// The same for a packed group of Q4_K or Q5_K rows (pack_group_k): each chunk's scale a = d sc and offset
// b = -dmin m for the 16 rows from the super-block's scale vectors (scale_min_k4's bit fields, lane-wise).
template <int32_t T, int RB>
void packed_group_k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                    int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  constexpr int64_t sbb = kPackRows * block_bytes(T);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
    for (int g = 0; g < 4; ++g) {
      const uint8_t* vs = sb + k_nibbles_at(T) + 64 * 8 * g;
      prefetch_weights(vs, kPrefetchAhead, 512);
      __m512i raw[8];
      for (int t = 0; t < 8; ++t) raw[t] = _mm512_loadu_si512(vs + 64 * t);
#pragma GCC unroll 2
      for (int hi = 0; hi < 2; ++hi) {
        const int j = 2 * g + hi;
        __m512 a, b;
        k4_scales(sb, j, d, dmin, a, b);
        __m512i v[8];
        for (int t = 0; t < 8; ++t) {
          v[t] = hi ? _mm512_and_si512(_mm512_srli_epi16(raw[t], 4), m4) : _mm512_and_si512(raw[t], m4);
          if constexpr (T == PQ_Q5_K) {  // bit j of the fifth-bit bytes: weight 4t + k's bit 4
            const __m512i qh = _mm512_loadu_si512(sb + kQh + 64 * t);
            const __m512i bit = _mm512_and_si512(_mm512_srli_epi32(qh, j), _mm512_set1_epi8(1));
            v[t] = _mm512_or_si512(v[t], _mm512_slli_epi32(bit, 4));
          }
        }
        chunk_rows<RB>(v, xq, xd, xs, ldq, ldb, sbi * 8 + j, a, b, acc);
      }
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

// Chunk j's two scales d sc (its first and second 16 weights) for the 16 rows of a packed Q6_K super-block: scales
// 8h + 2 part and + 1 (h = j / 4, part = j % 4) are bytes (2 part) % 4 and + 1 of scale vector 2h + part / 2,
// sign-extended.
inline void q6_scales(const uint8_t* sb, int j, __m512 d, __m512& a0, __m512& a1) {
  const int h = j / 4, part = j % 4;
  const __m512i sw = _mm512_loadu_si512(sb + kQ6Scales + 64 * (2 * h + part / 2));
  const int sh = 8 * ((2 * part) % 4);
  const __m512i s0 = _mm512_srai_epi32(_mm512_slli_epi32(sw, 24 - sh), 24);
  const __m512i s1 = _mm512_srai_epi32(_mm512_slli_epi32(sw, 16 - sh), 24);
  a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s0));
  a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(s1));
}

// Chunk 4 h + P of a packed Q6_K super-block as vpdpbusd's 8 unsigned weight vectors: the chunk's nibbles (low or
// high ones of its 8 low-bit vectors) with the 2 bits of the high-bit vectors at bits 4-5, every shift an immediate.
template <int P>
inline void q6_chunk_weights(const uint8_t* sb, int h, __m512i* v) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const __m512i lo = _mm512_loadu_si512(sb + kQ6Low + 64 * (16 * h + 8 * (P % 2) + t));
    const __m512i hi = _mm512_loadu_si512(sb + kQ6High + 64 * (8 * h + t));
    const __m512i nib = P < 2 ? _mm512_and_si512(lo, m4) : _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4);
    // bits 2P, 2P + 1 of each high-bit byte to bits 4, 5 (what a 16-bit shift carries across bytes is masked off)
    const __m512i at = P < 2 ? _mm512_slli_epi16(hi, 4 - 2 * P) : P == 2 ? hi : _mm512_srli_epi16(hi, 2);
    v[t] = _mm512_ternarylogic_epi32(nib, at, m30, 0xF8);  // nib | (at & m30)
  }
}

// The same for a packed group of Q6_K rows: w = d sc (u - 32) with u = 6 bits (unsigned, for vpdpbusd) and a scale per
// 16 weights, so a chunk's two halves sum apart, each less 32 times the sum of its 16 inputs. The chunks of a
// super-block are unrolled so that every shift is an immediate (1.15x at 1 row, 1.13x at 8, one thread).
template <int32_t T, int RB>
void packed_group_q6k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                      int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_Q6_K);
  (void)xs;
  constexpr int64_t sbb = kPackRows * 210;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  auto chunk = [&](const uint8_t* sb, __m512 d, int64_t sbi, int h, auto part) {
    constexpr int P = decltype(part)::value;
    const int j = 4 * h + P;
    __m512 a0, a1;
    q6_scales(sb, j, d, a0, a1);
    __m512i v[8];
    q6_chunk_weights<P>(sb, h, v);
    const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const int8_t* x = xq + r * ldq + 32 * c;
      // less 32 times each half's input sum (quantize_row's sums over 16: x16, rows 2 ldb apart)
      const int32_t* sums = x16 + r * 2 * ldb + 2 * c;
      __m512i p0 = _mm512_set1_epi32(-32 * sums[0]), p1 = _mm512_set1_epi32(-32 * sums[1]);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        int32_t x4a, x4b;
        std::memcpy(&x4a, x + 4 * t, 4);
        std::memcpy(&x4b, x + 16 + 4 * t, 4);
        p0 = _mm512_dpbusd_epi32(p0, v[t], _mm512_set1_epi32(x4a));
        p1 = _mm512_dpbusd_epi32(p1, v[t + 4], _mm512_set1_epi32(x4b));
      }
      const __m512 dx = _mm512_set1_ps(xd[r * ldb + c]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(a0, dx), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(a1, dx), acc[r]);
    }
  };
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    prefetch_weights(sb, kPrefetchAhead, sbb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    for (int h = 0; h < 2; ++h) {
      chunk(sb, d, sbi, h, std::integral_constant<int, 0>{});
      chunk(sb, d, sbi, h, std::integral_constant<int, 1>{});
      chunk(sb, d, sbi, h, std::integral_constant<int, 2>{});
      chunk(sb, d, sbi, h, std::integral_constant<int, 3>{});
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

// IQ4_XS chunk j's scale a = d (scale - 32) for the 16 rows of a packed super-block (scale_iq4_xs's bit fields,
// lane-wise from the rows' scales_l words lo and their scales_h widened to lanes, hi).
inline __m512 xs_scale(__m512 d, __m512i lo, __m512i hi, int j) {
  const __m512i low = _mm512_and_si512(_mm512_srli_epi32(lo, 4 * j), _mm512_set1_epi32(0xF));
  const __m512i high = _mm512_and_si512(_mm512_srli_epi32(hi, 2 * j), _mm512_set1_epi32(3));
  const __m512i sc = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
}

// IQ4_XS chunk j of a packed super-block as vpdpbusd's 8 unsigned vectors (vector t: weights 4 t .. 4 t + 3 of the
// chunk), each nibble's value + 128 (kIq4Unsigned).
inline void xs_chunk(const uint8_t* sb, int j, __m512i* v) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), tab = iq4u_table512();
  for (int t = 0; t < 4; ++t) {
    const __m512i p = _mm512_loadu_si512(sb + kXsNibbles + 64 * (4 * j + t));
    v[t] = _mm512_shuffle_epi8(tab, _mm512_and_si512(p, m4));
    v[t + 4] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(p, 4), m4));
  }
}

// The same for a packed group of IQ4_XS rows (kXsNibbles' layout): chunk j's scale a = d (scale - 32) for the 16 rows
// from the super-block's scale fields (scale_iq4_xs's, lane-wise), its nibbles' values + 128 as u, w = a (u - 128).
template <int32_t T, int RB>
void packed_group_xs(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                     int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_IQ4_XS);
  (void)x16;
  constexpr int64_t sbb = kPackRows * 136;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    prefetch_weights(sb, kPrefetchAhead, sbb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kXsHigh)));
    const __m512i lo = _mm512_loadu_si512(sb + kXsLow);
    for (int j = 0; j < 8; ++j) {
      const __m512 a = xs_scale(d, lo, hi, j);
      const __m512 b = _mm512_mul_ps(a, _mm512_set1_ps(-128.f));
      __m512i v[8];
      xs_chunk(sb, j, v);
      chunk_rows<RB>(v, xq, xd, xs, ldq, ldb, sbi * 8 + j, a, b, acc);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

// Q3_K's signed 6-bit scale s (0..15) for the 16 rows of a packed super-block, from its three scale vectors
// (scales_q3_k's bit fields, lane-wise).
inline __m512 q3_scale(const __m512i* w, int s) {
  const int b1 = s % 8;
  const __m512i low = _mm512_and_si512(_mm512_srli_epi32(w[b1 / 4], 8 * (b1 % 4) + (s >= 8 ? 4 : 0)),
                                       _mm512_set1_epi32(0xF));
  const __m512i high = _mm512_and_si512(_mm512_srli_epi32(w[2], 8 * (s % 4) + 2 * (s / 4)), _mm512_set1_epi32(3));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32)));
}

// The three scale vectors of a packed Q3_K super-block (q3_scale's w).
inline void q3_scale_words(const uint8_t* sb, __m512i* w) {
  for (int k = 0; k < 3; ++k) w[k] = _mm512_loadu_si512(sb + kQ3Scales + 64 * k);
}

// Q3_K chunk j of a packed super-block as 8 byte vectors u = the 2 low bits | the mask bit << 2 (0..7, unsigned for
// vpdpbusd; vector t: weights 4 t .. 4 t + 3 of the chunk).
inline void q3_chunk(const uint8_t* sb, int j, __m512i* v) {
  const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
  const int hh = j / 4, shift = 2 * (j % 4);
  for (int t = 0; t < 8; ++t) {
    const __m512i q = _mm512_loadu_si512(sb + kQ3Low + 64 * (8 * hh + t));
    const __m512i m = _mm512_loadu_si512(sb + kQ3Mask + 64 * t);
    v[t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q, shift), m3),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(m, j), one), 2));
  }
}

// The same for a packed group of Q3_K rows (kQ3Low's layout): w = d sc (u - 4) with u = the 2 low bits | the mask bit
// << 2 (0..7, unsigned for vpdpbusd) and a scale per 16 weights, so each half of a chunk sums apart, less 4 times the
// sum of its 16 inputs (as Q6_K's less 32).
template <int32_t T, int RB>
void packed_group_q3k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                      int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_Q3_K);
  (void)xs;
  constexpr int64_t sbb = kPackRows * 110;
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    prefetch_weights(sb, kPrefetchAhead, sbb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    __m512i w[3];
    q3_scale_words(sb, w);
    for (int j = 0; j < 8; ++j) {
      const __m512 a0 = _mm512_mul_ps(d, q3_scale(w, 2 * j)), a1 = _mm512_mul_ps(d, q3_scale(w, 2 * j + 1));
      __m512i v[8];
      q3_chunk(sb, j, v);
      const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = xq + r * ldq + 32 * c;
        const int32_t* sums = x16 + r * 2 * ldb + 2 * c;  // the input's sums over 16 (quantize_row)
        __m512i p0 = _mm512_set1_epi32(-4 * sums[0]), p1 = _mm512_set1_epi32(-4 * sums[1]);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          int32_t x4a, x4b;
          std::memcpy(&x4a, x + 4 * t, 4);
          std::memcpy(&x4b, x + 16 + 4 * t, 4);
          p0 = _mm512_dpbusd_epi32(p0, v[t], _mm512_set1_epi32(x4a));
          p1 = _mm512_dpbusd_epi32(p1, v[t + 4], _mm512_set1_epi32(x4b));
        }
        const __m512 dx = _mm512_set1_ps(xd[r * ldb + c]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(a0, dx), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(a1, dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

constexpr int kPackedTile = 8;  // input rows per packed_group call

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)
#define PAGEDLLM_AMX_INT8 1
// 16 input rows against a packed group of Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 rows on AMX tiles: a chunk's integer sums
// sum(u x) for 16 rows x 16 outputs in one TDPBSUD (x signed in A, 16 rows of 32 bytes; u unsigned in B, the
// chunk's 8 weight vectors as its 8 rows, as vpdpbusd reads them), then add_chunk on them, as chunk_rows does. Integer sums are exact, so every row's outputs are bit for bit packed_group's, whatever the rows
// around it (the two mix freely within a call).
template <int32_t T>
__attribute__((target("amx-tile,amx-int8"))) void amx_packed_group(const uint8_t* grp, int64_t nb, const int8_t* xq,
                                                                   const float* xd, const float* xs, int64_t ldq,
                                                                   int64_t ldb, float* y, int64_t ldy, uint32_t keep) {
  constexpr int64_t cb = kPackRows * block_bytes(T), wo = packed_weights_at(T);
  AmxTileConfig cfg;
  for (int t = 0; t < 2; ++t) {  // C 0-1: 16 x 16 int32; A 2-3: 16 rows x 32 bytes; B 4-5: 8 rows x 64 bytes
    cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[2 + t] = 16, cfg.colsb[2 + t] = 32;
    cfg.rows[4 + t] = 8, cfg.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint8_t bt[2][512];
  alignas(64) int32_t sums[2][16 * 16];
  __m512 acc[16], sa[2], sb[2];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  auto weights = [&](int64_t c, int k) -> const uint8_t* {  // chunk c's 8 vectors as B's rows; its a, b to sa, sb
    const uint8_t* ch = grp + c * cb;
    __m512i v[8];
    unpack_chunk<T>(ch, sa[k], sb[k], v);
    if constexpr (T == PQ_Q8_0) return ch + wo;
    for (int j = 0; j < 8; ++j) _mm512_store_si512(bt[k] + 64 * j, v[j]);
    return bt[k];
  };
  auto scale = [&](int64_t c, int k) {  // add_chunk on the tile's sums, row by row
    const int32_t* s = sums[k];
    const __m512 a = sa[k], b = sb[k];
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r)
      acc[r] = add_chunk(acc[r], _mm512_load_si512(s + 16 * r), a, b, xd[r * ldb + c], xs[r * ldb + c]);
  };
  int64_t c = 0;
  for (; c + 2 <= nb; c += 2) {
    prefetch_weights(grp + c * cb, kPrefetchAhead, 2 * cb);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, xq + 32 * c, ldq);
    _tile_loadd(3, xq + 32 * (c + 1), ldq);
    _tile_loadd(4, weights(c, 0), 64);
    _tile_loadd(5, weights(c + 1, 1), 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    scale(c, 0);
    scale(c + 1, 1);
  }
  if (c < nb) {
    _tile_zero(0);
    _tile_loadd(2, xq + 32 * c, ldq);
    _tile_loadd(4, weights(c, 0), 64);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, sums[0], 64);
    scale(c, 0);
  }
  _tile_release();
  for (int r = 0; r < 16; ++r) _mm512_mask_storeu_ps(y + r * ldy, static_cast<__mmask16>(keep), acc[r]);
}

using AmxGroupFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t,
                            float*, int64_t, uint32_t);

// The AMX kernel of a packed type, where AMX is on and the type has one (else null: packed_group's VNNI rows).
AmxGroupFn amx_group_fn(int32_t type) {
  if (!amx_int8_on()) return nullptr;
  switch (type) {
    case PQ_Q4_0: return amx_packed_group<PQ_Q4_0>;
    case PQ_Q4_1: return amx_packed_group<PQ_Q4_1>;
    case PQ_Q5_0: return amx_packed_group<PQ_Q5_0>;
    case PQ_Q5_1: return amx_packed_group<PQ_Q5_1>;
    case PQ_Q8_0: return amx_packed_group<PQ_Q8_0>;
    default: return nullptr;
  }
}
#endif

#elif defined(PAGEDLLM_QUANT_AVX2)
#define PAGEDLLM_QUANT_PACKED 1

// The same as above with AVX2 and no VNNI, each group in two halves of 8 rows (the low, then the high 32 bytes of
// every 64-byte vector). vpmaddubsw multiplies pairs of unsigned weights by int8 inputs into 16-bit sums:
// * Q4_0 and Q4_1 (u <= 15, |x| <= 127): the 8 vectors' pair sums add up in 16 bits without overflow (at most
//   8 * 2 * 15 * 127 = 30480), and one vpmaddwd turns them into the int32 sums vpdpbusd gives.
// * Q8_0: u = q + 128 would overflow a 16-bit pair (2 * 255 * 127): u is flipped back to the signed q, its sign
//   moved onto x and |q| multiplied (ggml's way, at most 2 * 128 * 127 per pair), each vector's pairs widened by
//   vpmaddwd. The sum is then sum q x itself, with no offset term.
// At one or a few rows the weights stream from memory, and the hardware prefetcher alone brings them too late:
// asking for them ~2.5 KiB ahead made the model's 30 layers of linears 1.04x faster at 1 row, 1.10-1.15x at 2-5
// and the Q8_0 head 1.2-1.3x at 2-5 on Zen 3 (bench/quant_kernels_ab.py, bench/RESULTS.md). 5 KiB ahead was better
// at 1 row and worse at 5 in a harness; 5 KiB up to 2 rows was no better in the real kernels.
constexpr int64_t kPrefetchAhead = 2560;

// The half's 8 output lanes of each input row: stored where `keep` says.
template <int RB>
inline void store_half(const __m256* acc, float* y, int64_t ldy, int h, uint32_t keep) {
  const uint32_t k8 = (keep >> (8 * h)) & 0xFFu;
  for (int r = 0; r < RB; ++r) {
    float* o = y + r * ldy + 8 * h;
    if (k8 == 0xFFu) {
      _mm256_storeu_ps(o, acc[r]);
    } else if (k8 != 0) {
      alignas(32) float t[8];
      _mm256_store_ps(t, acc[r]);
      for (int l = 0; l < 8; ++l)
        if (k8 >> l & 1u) o[l] = t[l];
    }
  }
}

template <int32_t T, int RB>
void packed_group(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                  int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  constexpr int64_t cb = kPackRows * block_bytes(T), wo = packed_weights_at(T);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nb; ++c) {
      const uint8_t* ch = grp + c * cb;
      // The first half asks for the weights kPrefetchAhead bytes on; the second half finds this group in L1.
      if (h == 0) prefetch_weights(ch, kPrefetchAhead, cb);
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 16 * h)));
      const __m256 b = has_min(T)
                           ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 32 + 16 * h)))
                           : _mm256_mul_ps(a, _mm256_set1_ps(packed_offset(T)));
      __m256i v[8], av[8];
      if constexpr (T == PQ_Q8_0) {
        for (int j = 0; j < 8; ++j) {
          v[j] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + wo + 64 * j + 32 * h)),
                                  flip);
          av[j] = _mm256_abs_epi8(v[j]);
        }
      } else if constexpr (T == PQ_IQ4_NL) {  // the nibbles' signed values, summed as Q8_0's
        for (int t = 0; t < 4; ++t) {
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + wo + 64 * t + 32 * h));
          v[t] = _mm256_shuffle_epi8(iq4_table(), _mm256_and_si256(p, m4));
          v[t + 4] = _mm256_shuffle_epi8(iq4_table(), _mm256_and_si256(_mm256_srli_epi16(p, 4), m4));
        }
        for (int j = 0; j < 8; ++j) av[j] = _mm256_abs_epi8(v[j]);
      } else {
        for (int t = 0; t < 4; ++t) {
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + wo + 64 * t + 32 * h));
          v[t] = _mm256_and_si256(p, m4);
          v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
        }
        if constexpr (five_bit(T)) {  // as in the AVX-512 kernel: vector j's fifth bits are (word << 4 - j) & 0x10
          const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + packed_qh_at(T) + 32 * h));
          const __m256i b4 = _mm256_set1_epi8(0x10);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            const __m256i at = j <= 4 ? _mm256_slli_epi32(word, 4 - j) : _mm256_srli_epi32(word, j - 4);
            v[j] = _mm256_or_si256(v[j], _mm256_and_si256(at, b4));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = xq + r * ldq + 32 * c;
        __m256i s;
        if constexpr (T == PQ_Q8_0 || T == PQ_IQ4_NL)
          s = signed_sum8(v, av, x);
        else
          s = unsigned_sum8<five_bit(T)>(v, x);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(a, _mm256_set1_ps(xd[r * ldb + c])), acc[r]);
        if constexpr (T != PQ_Q8_0 && T != PQ_IQ4_NL) acc[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(xs[r * ldb + c]), acc[r]);
      }
    }
    store_half<RB>(acc, y, ldy, h, keep);
  }
}

// Q4_K and Q5_K in their packed layout (pack_group_k), each group in two halves of 8 rows as above: a chunk's scale
// and offset for the half's 8 rows from the super-block's scale vectors (k4_scales_avx2), its nibbles (u <= 15, or
// <= 31 with Q5_K's fifth bits) summed in 16 bits as Q4_0's (Q5_0's), then w = a u + b.
template <int32_t T, int RB>
void packed_group_k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                    int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  (void)x16;
  constexpr int64_t sbb = kPackRows * block_bytes(T);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
      const uint8_t* sb = grp + sbi * sbb;
      if (h == 0) prefetch_weights(sb, kPrefetchAhead, sbb);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * h)));
      for (int g = 0; g < 4; ++g) {
        const uint8_t* vs = sb + k_nibbles_at(T) + 64 * 8 * g + 32 * h;
        __m256i raw[8];
        for (int t = 0; t < 8; ++t) raw[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vs + 64 * t));
#pragma GCC unroll 2
        for (int hi = 0; hi < 2; ++hi) {
          const int j = 2 * g + hi;
          __m256 a, b;
          k4_scales_avx2(sb, h, j, d, dmin, a, b);
          __m256i v[8];
          for (int t = 0; t < 8; ++t) {
            v[t] = hi ? _mm256_and_si256(_mm256_srli_epi16(raw[t], 4), m4) : _mm256_and_si256(raw[t], m4);
            if constexpr (T == PQ_Q5_K) {  // bit j of the fifth-bit bytes: weight 4t + k's bit 4
              const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQh + 64 * t + 32 * h));
              const __m256i bit = _mm256_and_si256(_mm256_srli_epi32(qh, j), _mm256_set1_epi8(1));
              v[t] = _mm256_or_si256(v[t], _mm256_slli_epi32(bit, 4));
            }
          }
          const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
          for (int r = 0; r < RB; ++r) {
            const int8_t* x = xq + r * ldq + 32 * c;
            const __m256i s = unsigned_sum8<T == PQ_Q5_K>(v, x);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(a, _mm256_set1_ps(xd[r * ldb + c])), acc[r]);
            acc[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(xs[r * ldb + c]), acc[r]);
          }
        }
      }
    }
    store_half<RB>(acc, y, ldy, h, keep);
  }
}

// Q6_K in its packed layout, in halves of 8 rows: w = d sc (u - 32), u of 6 bits (unsigned for vpmaddubsw) and a
// scale per 16 weights, so each half of a chunk sums apart (two vectors' pair sums fit 16 bits: 2 * 2 * 63 * 127),
// less 32 times its 16 inputs' sum.
template <int32_t T, int RB>
void packed_group_q6k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                      int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_Q6_K);
  (void)xs;
  constexpr int64_t sbb = kPackRows * 210;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    auto chunk = [&](const uint8_t* sb, __m256 d, int64_t sbi, int hh, auto part) {
      constexpr int P = decltype(part)::value;
      const int j = 4 * hh + P;
      // scales 8 hh + 2 P and + 1: bytes (2 P) % 4 and + 1 of scale vector 2 hh + P / 2, sign-extended
      const __m256i sw =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ6Scales + 64 * (2 * hh + P / 2) + 32 * h));
      constexpr int sh = 8 * ((2 * P) % 4);
      const __m256 a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sw, 24 - sh), 24)));
      const __m256 a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sw, 16 - sh), 24)));
      __m256i v[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m256i lo = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(sb + kQ6Low + 64 * (16 * hh + 8 * (P % 2) + t) + 32 * h));
        const __m256i hb =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ6High + 64 * (8 * hh + t) + 32 * h));
        const __m256i nib = P < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
        // bits 2P, 2P + 1 of each high-bit byte to bits 4, 5 (what a 16-bit shift carries across bytes is masked off)
        const __m256i at = P < 2 ? _mm256_slli_epi16(hb, 4 - 2 * P) : P == 2 ? hb : _mm256_srli_epi16(hb, 2);
        v[t] = _mm256_or_si256(nib, _mm256_and_si256(at, m30));
      }
      const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = xq + r * ldq + 32 * c;
        const int32_t* sums = x16 + r * 2 * ldb + 2 * c;  // the input's sums over 16 (quantize_row)
        const __m256i p0 = unsigned_sum4<63>(v, x, 0, -32 * sums[0]), p1 = unsigned_sum4<63>(v, x, 4, -32 * sums[1]);
        const __m256 dx = _mm256_set1_ps(xd[r * ldb + c]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(a0, dx), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(a1, dx), acc[r]);
      }
    };
    for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
      const uint8_t* sb = grp + sbi * sbb;
      if (h == 0) prefetch_weights(sb, kPrefetchAhead, sbb);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      for (int hh = 0; hh < 2; ++hh) {
        chunk(sb, d, sbi, hh, std::integral_constant<int, 0>{});
        chunk(sb, d, sbi, hh, std::integral_constant<int, 1>{});
        chunk(sb, d, sbi, hh, std::integral_constant<int, 2>{});
        chunk(sb, d, sbi, hh, std::integral_constant<int, 3>{});
      }
    }
    store_half<RB>(acc, y, ldy, h, keep);
  }
}

// IQ4_XS in its packed layout, in halves of 8 rows: the nibbles' signed values (iq4_table) summed as Q8_0's (|q|
// times x with q's sign, each vector's pairs widened), w = d (scale - 32) q.
template <int32_t T, int RB>
void packed_group_xs(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                     int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_IQ4_XS);
  (void)xs, (void)x16;
  constexpr int64_t sbb = kPackRows * 136;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
      const uint8_t* sb = grp + sbi * sbb;
      if (h == 0) prefetch_weights(sb, kPrefetchAhead, sbb);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kXsHigh + 16 * h)));
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kXsLow + 32 * h));
      for (int j = 0; j < 8; ++j) {
        const __m256 a = xs_scale_avx2(d, lo, hi, j);
        __m256i v[8], av[8];
        xs_chunk_avx2(sb, h, j, v);
        for (int t = 0; t < 8; ++t) av[t] = _mm256_abs_epi8(v[t]);
        const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const int8_t* x = xq + r * ldq + 32 * c;
          const __m256i s = signed_sum8(v, av, x);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(a, _mm256_set1_ps(xd[r * ldb + c])), acc[r]);
        }
      }
    }
    store_half<RB>(acc, y, ldy, h, keep);
  }
}

// Q3_K in its packed layout, in halves of 8 rows: u = the 2 low bits | the mask bit << 2 (0..7), w = d sc (u - 4),
// a scale per 16 weights (each half of a chunk sums apart: four vectors' pair sums fit 16 bits, 4 * 2 * 7 * 127), less
// 4 times the half's input sum.
template <int32_t T, int RB>
void packed_group_q3k(const uint8_t* grp, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t ldq,
                      int64_t ldb, float* y, int64_t ldy, uint32_t keep, const int32_t* x16) {
  static_assert(T == PQ_Q3_K);
  (void)xs;
  constexpr int64_t sbb = kPackRows * 110;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
      const uint8_t* sb = grp + sbi * sbb;
      if (h == 0) prefetch_weights(sb, kPrefetchAhead, sbb);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      __m256i w[3];
      for (int k = 0; k < 3; ++k)
        w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kQ3Scales + 64 * k + 32 * h));
      for (int j = 0; j < 8; ++j) {
        const __m256 a0 = _mm256_mul_ps(d, q3_scale_avx2(w, 2 * j)), a1 = _mm256_mul_ps(d, q3_scale_avx2(w, 2 * j + 1));
        __m256i v[8];
        q3_chunk_avx2(sb, h, j, v);
        const int64_t c = sbi * 8 + j;
#pragma GCC unroll 8
        for (int r = 0; r < RB; ++r) {
          const int8_t* x = xq + r * ldq + 32 * c;
          const int32_t* sums = x16 + r * 2 * ldb + 2 * c;  // the input's sums over 16 (quantize_row)
          const __m256i p0 = unsigned_sum4<7>(v, x, 0, -4 * sums[0]), p1 = unsigned_sum4<7>(v, x, 4, -4 * sums[1]);
          const __m256 dx = _mm256_set1_ps(xd[r * ldb + c]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(a0, dx), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(a1, dx), acc[r]);
        }
      }
    }
    store_half<RB>(acc, y, ldy, h, keep);
  }
}

constexpr int kPackedTile = 6;  // input rows per packed_group call (6 is ~8% faster than 4 at 5-6 rows on Zen 3)
#endif

#if defined(PAGEDLLM_QUANT_PACKED)
using PackedFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t,
                          float*, int64_t, uint32_t, const int32_t*);

template <int32_t T, int... RB>
PackedFn packed_pick(int rb, std::integer_sequence<int, RB...>) {
  PackedFn fn = nullptr;
  ((fn = (rb == RB + 1 ? packed_group<T, RB + 1> : fn)), ...);
  return fn;
}

template <int32_t T, int... RB>
PackedFn packed_pick_k(int rb, std::integer_sequence<int, RB...>) {
  PackedFn fn = nullptr;
  if constexpr (T == PQ_Q6_K)
    ((fn = (rb == RB + 1 ? packed_group_q6k<T, RB + 1> : fn)), ...);
  else if constexpr (T == PQ_Q3_K)
    ((fn = (rb == RB + 1 ? packed_group_q3k<T, RB + 1> : fn)), ...);
  else if constexpr (T == PQ_IQ4_XS)
    ((fn = (rb == RB + 1 ? packed_group_xs<T, RB + 1> : fn)), ...);
  else
    ((fn = (rb == RB + 1 ? packed_group_k<T, RB + 1> : fn)), ...);
  return fn;
}

PackedFn packed_fn(int32_t type, int rb) {
  const auto all = std::make_integer_sequence<int, kPackedTile>{};
  switch (type) {
    case PQ_Q4_0: return packed_pick<PQ_Q4_0>(rb, all);
    case PQ_Q4_1: return packed_pick<PQ_Q4_1>(rb, all);
    case PQ_Q5_0: return packed_pick<PQ_Q5_0>(rb, all);
    case PQ_Q5_1: return packed_pick<PQ_Q5_1>(rb, all);
    case PQ_Q8_0: return packed_pick<PQ_Q8_0>(rb, all);
    case PQ_IQ4_NL: return packed_pick<PQ_IQ4_NL>(rb, all);
    case PQ_Q3_K: return packed_pick_k<PQ_Q3_K>(rb, all);
    case PQ_Q4_K: return packed_pick_k<PQ_Q4_K>(rb, all);
    case PQ_Q5_K: return packed_pick_k<PQ_Q5_K>(rb, all);
    case PQ_Q6_K: return packed_pick_k<PQ_Q6_K>(rb, all);
    case PQ_IQ4_XS: return packed_pick_k<PQ_IQ4_XS>(rb, all);
    default: return nullptr;
  }
}

// Outputs [l0, l1) of a packed segment (its rows counted from its first; the segment's output 0 at y) for `rows`
// input rows: group by group, each group's weights read once for all the rows.
void packed_range(const QSegment& g, int64_t in, const Q8Rows& x, int64_t rows, float* y, int64_t ldy, int64_t l0,
                  int64_t l1) {
  const int64_t nb = in / 32, group_bytes = kPackRows * quant_row_bytes(g.type, in);
#if defined(PAGEDLLM_AMX_INT8)
  const AmxGroupFn amx = rows >= 16 ? amx_group_fn(g.type) : nullptr;
  const int64_t rest = amx != nullptr ? rows % 16 : rows;
#else
  const int64_t rest = rows;
#endif
  const PackedFn full = packed_fn(g.type, kPackedTile), tail = packed_fn(g.type, static_cast<int>(rest % kPackedTile));
  for (int64_t gi = l0 / kPackRows; gi * kPackRows < l1; ++gi) {
    const int64_t s0 = gi * kPackRows;
    const int first = static_cast<int>(std::max<int64_t>(0, l0 - s0)), last = static_cast<int>(std::min<int64_t>(16, l1 - s0));
    const uint32_t keep = ((1u << last) - 1) & ~((1u << first) - 1);
    const uint8_t* grp = g.data + gi * group_bytes;
    int64_t m = 0;
#if defined(PAGEDLLM_AMX_INT8)
    if (amx != nullptr)  // 16 rows at a time on the tiles, the rest below: the same sums either way
      for (; m + 16 <= rows; m += 16)
        amx(grp, nb, x.q + m * in, x.d + m * nb, x.s + m * nb, in, nb, y + m * ldy + s0, ldy, keep);
#endif
    for (; m + kPackedTile <= rows; m += kPackedTile)
      full(grp, nb, x.q + m * in, x.d + m * nb, x.s + m * nb, in, nb, y + m * ldy + s0, ldy, keep, x.s16 + m * 2 * nb);
    if (m < rows)
      tail(grp, nb, x.q + m * in, x.d + m * nb, x.s + m * nb, in, nb, y + m * ldy + s0, ldy, keep, x.s16 + m * 2 * nb);
  }
}

// Calls fn(type, group, nb, n0) for each packed group of the panel of outputs [base, base + kPanel) (its rows from
// column n0; type a std::integral_constant of the segment's type), where they all are in one packed segment's whole
// groups, of a K type (Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) if K and of an interleaved one otherwise; false otherwise
// (the caller de-quantizes rows).
template <bool K = false, class Fn>
bool packed_panel_groups(const QMatrix& w, int64_t base, Fn&& fn) {
  if (kPanel % kPackRows != 0) return false;
  int64_t first = 0;
  for (int s = 0; s < w.nseg; ++s) {
    const QSegment& g = w.seg[s];
    if (base < first + g.rows) {
      const int64_t local = base - first;
      if (local % kPackRows != 0 || local + kPanel > g.packed || packed_k(g.type) != K || !panel_direct(g.type))
        return false;
      const int64_t nb = w.in / 32, group_bytes = kPackRows * quant_row_bytes(g.type, w.in);
      for (int64_t h = 0; h < kPanel / kPackRows; ++h) {
        const uint8_t* grp = g.data + (local / kPackRows + h) * group_bytes;
        if constexpr (K) {
          switch (g.type) {
            case PQ_Q4_K: fn(std::integral_constant<int32_t, PQ_Q4_K>{}, grp, nb, h * kPackRows); break;
            case PQ_Q5_K: fn(std::integral_constant<int32_t, PQ_Q5_K>{}, grp, nb, h * kPackRows); break;
            case PQ_Q6_K: fn(std::integral_constant<int32_t, PQ_Q6_K>{}, grp, nb, h * kPackRows); break;
            case PQ_IQ4_XS: fn(std::integral_constant<int32_t, PQ_IQ4_XS>{}, grp, nb, h * kPackRows); break;
            default: fn(std::integral_constant<int32_t, PQ_Q3_K>{}, grp, nb, h * kPackRows); break;
          }
          continue;
        }
        switch (g.type) {
          case PQ_Q4_0: fn(std::integral_constant<int32_t, PQ_Q4_0>{}, grp, nb, h * kPackRows); break;
          case PQ_Q4_1: fn(std::integral_constant<int32_t, PQ_Q4_1>{}, grp, nb, h * kPackRows); break;
          case PQ_Q5_0: fn(std::integral_constant<int32_t, PQ_Q5_0>{}, grp, nb, h * kPackRows); break;
          case PQ_Q5_1: fn(std::integral_constant<int32_t, PQ_Q5_1>{}, grp, nb, h * kPackRows); break;
          case PQ_IQ4_NL: fn(std::integral_constant<int32_t, PQ_IQ4_NL>{}, grp, nb, h * kPackRows); break;
          default: fn(std::integral_constant<int32_t, PQ_Q8_0>{}, grp, nb, h * kPackRows); break;
        }
      }
      return true;
    }
    first += g.rows;
  }
  return false;
}

#if defined(PAGEDLLM_QUANT_AVX2)
// The IQ4 value (kIq4Values) of each lane's index 0..15, as int32: two 8-entry halves (vpermd reads an index's low 3
// bits), the upper half where the index is past 7.
inline __m256i iq4_value8(__m256i u) {
  auto half = [](int at) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kIq4Values + at)));
  };
  const __m256i lo = _mm256_permutevar8x32_epi32(half(0), u), hi = _mm256_permutevar8x32_epi32(half(8), u);
  return _mm256_blendv_epi8(lo, hi, _mm256_cmpgt_epi32(u, _mm256_set1_epi32(7)));
}

// A packed group's 16 rows straight into 16 columns of a float32 panel (panel [in, kPanel], the group's outputs from
// column n0): dequant_packed_row's arithmetic, bit for bit, the 8 rows of a half's weight k being one vector's lanes.
template <int32_t T>
void packed_group_to_f32_panel(const uint8_t* grp, int64_t nb, float* panel, int64_t n0) {
  constexpr int64_t cb = kPackRows * block_bytes(T), wo = packed_weights_at(T);
  for (int64_t c = 0; c < nb; ++c) {
    const uint8_t* ch = grp + c * cb;
    prefetch_weights(ch, kPrefetchAhead, cb);  // the AVX2 build on Zen 5: 30 layers at 1 row 9.0 -> 6.1 ms
    for (int h = 0; h < 2; ++h) {
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 16 * h)));
      const __m256 b = has_min(T)
                           ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch + 32 + 16 * h)))
                           : _mm256_mul_ps(a, _mm256_set1_ps(packed_offset(T)));
      [[maybe_unused]] const __m256i word =
          five_bit(T) ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + packed_qh_at(T) + 32 * h))
                      : _mm256_setzero_si256();
      auto fifth = [&](int w) {  // weight w's fifth bit as 16 or 0, for the 8 rows
        return _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(word, fifth_bit_at(w)), _mm256_set1_epi32(1)), 4);
      };
      float* o = panel + 32 * c * kPanel + n0 + 8 * h;
      [[maybe_unused]] auto iq4 = [&](__m256i u) { return _mm256_mul_ps(a, _mm256_cvtepi32_ps(iq4_value8(u))); };
      for (int j = 0; j < (T == PQ_Q8_0 ? 8 : 4); ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + wo + 64 * j + 32 * h));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m256i sh = _mm256_srli_epi32(v, 8 * k);
          if constexpr (T == PQ_Q8_0) {
            const __m256i u = _mm256_sub_epi32(_mm256_and_si256(sh, _mm256_set1_epi32(0xFF)), _mm256_set1_epi32(128));
            _mm256_storeu_ps(o + (4 * j + k) * kPanel, _mm256_mul_ps(a, _mm256_cvtepi32_ps(u)));
          } else if constexpr (T == PQ_IQ4_NL) {  // dequant_packed_row's a * value
            _mm256_storeu_ps(o + (4 * j + k) * kPanel, iq4(_mm256_and_si256(sh, _mm256_set1_epi32(0xF))));
            _mm256_storeu_ps(o + (16 + 4 * j + k) * kPanel,
                             iq4(_mm256_and_si256(_mm256_srli_epi32(sh, 4), _mm256_set1_epi32(0xF))));
          } else {
            __m256i lo = _mm256_and_si256(sh, _mm256_set1_epi32(0xF));
            __m256i hi = _mm256_and_si256(_mm256_srli_epi32(sh, 4), _mm256_set1_epi32(0xF));
            if constexpr (five_bit(T)) {
              lo = _mm256_or_si256(lo, fifth(4 * j + k));
              hi = _mm256_or_si256(hi, fifth(16 + 4 * j + k));
            }
            _mm256_storeu_ps(o + (4 * j + k) * kPanel, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(lo), b));
            _mm256_storeu_ps(o + (16 + 4 * j + k) * kPanel, _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(hi), b));
          }
        }
      }
    }
  }
}

// The same for a packed group of Q4_K, Q5_K or Q6_K rows (move_block_k's layout): dequant_row's arithmetic
// (w = fma(u, d sc, -dmin m); Q6_K: (u - 32) d sc), each chunk's scales for a half's 8 rows from the super-block's
// scale vectors as the int8 kernels read them. IQ4_XS and Q3_K as packed_group_k_to_panel reads them.
template <int32_t T>
void packed_group_k_to_f32_panel(const uint8_t* grp, int64_t nb, float* panel, int64_t n0) {
  constexpr int64_t sbb = kPackRows * block_bytes(T);
  const __m256i low4 = _mm256_set1_epi32(0xF), three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1);
  const __m256 zero = _mm256_setzero_ps();
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    prefetch_weights(sb, kPrefetchAhead, sbb);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 16 * h)));
      for (int j = 0; j < 8; ++j) {
        float* o = panel + 32 * (sbi * 8 + j) * kPanel + n0 + 8 * h;
        if constexpr (T == PQ_IQ4_XS || T == PQ_Q3_K) {  // the int8 kernels' byte vectors, lane by lane
          __m256i v[8];
          __m256 a0, a1;
          if constexpr (T == PQ_IQ4_XS) {
            const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kXsHigh + 16 * h));
            a0 = a1 = xs_scale_avx2(d, load(sb + kXsLow + 32 * h), _mm256_cvtepu16_epi32(high), j);
            xs_chunk_avx2(sb, h, j, v);  // signed values
          } else {
            const __m256i w[3] = {load(sb + kQ3Scales + 32 * h), load(sb + kQ3Scales + 64 + 32 * h),
                                  load(sb + kQ3Scales + 128 + 32 * h)};
            a0 = _mm256_mul_ps(d, q3_scale_avx2(w, 2 * j));
            a1 = _mm256_mul_ps(d, q3_scale_avx2(w, 2 * j + 1));
            q3_chunk_avx2(sb, h, j, v);  // u = q + 4
          }
          for (int k = 0; k < 32; ++k) {
            __m256i q = _mm256_srai_epi32(_mm256_slli_epi32(v[k / 4], 24 - 8 * (k % 4)), 24);  // byte k % 4
            if constexpr (T == PQ_Q3_K) q = _mm256_sub_epi32(q, _mm256_set1_epi32(4));
            _mm256_storeu_ps(o + k * kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), k < 16 ? a0 : a1, zero));
          }
        } else if constexpr (T == PQ_Q6_K) {
          const int hh = j / 4, part = j % 4, sh = 8 * ((2 * part) % 4);
          const __m256i sw = load(sb + kQ6Scales + 64 * (2 * hh + part / 2) + 32 * h);
          const __m256 a0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sw, 24 - sh), 24)));
          const __m256 a1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(sw, 16 - sh), 24)));
          for (int k = 0; k < 32; ++k) {
            const int t = k / 4, at = 8 * (k % 4);
            const __m256i lo = load(sb + kQ6Low + 64 * (16 * hh + 8 * (part % 2) + t) + 32 * h);
            const __m256i hi = load(sb + kQ6High + 64 * (8 * hh + t) + 32 * h);
            const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(lo, at + (part < 2 ? 0 : 4)), low4);
            const __m256i top = _mm256_and_si256(_mm256_srli_epi32(hi, at + 2 * part), three);
            const __m256i u = _mm256_sub_epi32(_mm256_or_si256(nib, _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
            _mm256_storeu_ps(o + k * kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), k < 16 ? a0 : a1, _mm256_setzero_ps()));
          }
        } else {
          const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 32 + 16 * h)));
          __m256 a, b;
          k4_scales_avx2(sb, h, j, d, dmin, a, b);
          const uint8_t* vs = sb + k_nibbles_at(T) + 64 * 8 * (j / 2) + 32 * h;
          for (int k = 0; k < 32; ++k) {
            const int t = k / 4, at = 8 * (k % 4);
            __m256i u = _mm256_and_si256(_mm256_srli_epi32(load(vs + 64 * t), at + 4 * (j % 2)), low4);
            if constexpr (T == PQ_Q5_K) {
              const __m256i qh = load(sb + kQh + 64 * t + 32 * h);
              u = _mm256_or_si256(u, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, at + j), one), 4));
            }
            _mm256_storeu_ps(o + k * kPanel, _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), a, b));
          }
        }
      }
    }
  }
}

bool packed_f32_panel(const QMatrix& w, int64_t base, float* panel) {
  if (packed_panel_groups<true>(w, base, [&](auto type, const uint8_t* grp, int64_t nb, int64_t n0) {
        packed_group_k_to_f32_panel<decltype(type)::value>(grp, nb, panel, n0);
      }))
    return true;
  return packed_panel_groups(w, base, [&](auto type, const uint8_t* grp, int64_t nb, int64_t n0) {
    packed_group_to_f32_panel<decltype(type)::value>(grp, nb, panel, n0);
  });
}
#endif

#if defined(__AVX512BF16__)
#define PAGEDLLM_QUANT_PACKED_BF16 1
// kIq4Values as 16 int32 lanes (vpermd's table: an index's low 4 bits pick its value).
inline __m512i iq4_values16() {
  return _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Values)));
}

// 32 weights of a packed group's 16 rows (weight(k): a vector of row lanes) -> pairs 16 c .. 16 c + 15 of the
// panel's columns [n0, n0 + 16): both weights of pair p rounded in one instruction (row n's even weight in bf16 lane
// n, its odd one in lane 16 + n), then interleaved into row n's pair by one permutation of the 32 bf16 lanes;
// unrolled, so that each weight's shift is a constant.
template <class W>
inline void chunk_to_panel(W&& weight, uint32_t* panel, int64_t c, int64_t n0) {
  const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(weight(2 * p + 1), weight(2 * p));
    _mm512_storeu_si512(panel + (16 * c + p) * kPanel + n0, _mm512_permutexvar_epi16(inter, both));
  }
}

// A packed group's 16 rows straight into 16 columns of a bf16 pair panel (panel [in / 2, kPanel], the group's
// outputs from column n0): the pairs bf16_panel_from_rows makes of the rows de-quantized (dequant_packed_row's
// arithmetic, rounded to nearest even), the 16 rows' weight k of a chunk being one vector of the packed layout.
template <int32_t T>
void packed_group_to_panel(const uint8_t* grp, int64_t nb, uint32_t* panel, int64_t n0) {
  constexpr int64_t cb = kPackRows * block_bytes(T), wo = packed_weights_at(T);
  for (int64_t c = 0; c < nb; ++c) {
    const uint8_t* ch = grp + c * cb;
    // Without asking ahead, a third of this loop's time went to waiting for the weights (Zen 5, one row).
    prefetch_weights(ch, kPrefetchAhead, cb);
    const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch)));
    const __m512 b = has_min(T) ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch + 32)))
                                : _mm512_mul_ps(a, _mm512_set1_ps(packed_offset(T)));
    [[maybe_unused]] const __m512i word =
        five_bit(T) ? _mm512_loadu_si512(ch + packed_qh_at(T)) : _mm512_setzero_si512();
    [[maybe_unused]] const __m512i iq4_values = iq4_values16();
    auto weight = [&](int k) {  // weight k (0..31) of the chunk, for the 16 rows
      if constexpr (T == PQ_Q8_0) {
        const __m512i v = _mm512_loadu_si512(ch + wo + 64 * (k / 4));
        const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (k % 4)), _mm512_set1_epi32(0xFF));
        return _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(128))));
      } else {
        const __m512i v = _mm512_loadu_si512(ch + wo + 64 * ((k % 16) / 4));
        const int shift = 8 * (k % 4) + (k >= 16 ? 4 : 0);
        __m512i u = _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0xF));
        if constexpr (T == PQ_IQ4_NL)  // the nibble's value (vpermd reads an index's low 4 bits), times a
          return _mm512_mul_ps(a, _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(u, iq4_values)));
        if constexpr (five_bit(T))
          u = _mm512_or_si512(
              u, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(word, fifth_bit_at(k)), _mm512_set1_epi32(1)), 4));
        return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(u), b);
      }
    };
    chunk_to_panel(weight, panel, c, n0);
  }
}

// The bf16 pair panel of outputs [base, base + kPanel) straight from packed groups (packed_panel_groups).
bool packed_panel(const QMatrix& w, int64_t base, uint32_t* panel) {
  return packed_panel_groups(w, base, [&](auto type, const uint8_t* grp, int64_t nb, int64_t n0) {
    packed_group_to_panel<decltype(type)::value>(grp, nb, panel, n0);
  });
}

#if defined(__AVX512VNNI__)
// A packed group of Q4_K, Q5_K or Q6_K rows (move_block_k's layout) straight into 16 columns of a bf16 pair panel:
// dequant_row's arithmetic (w = fma(u, d sc, -dmin m); Q6_K: (u - 32) d sc), the chunk's scales for the 16 rows
// from the super-block's scale vectors as packed_group_k and packed_group_q6k read them.
//
// IQ4_XS (w = value d (ls - 32), ls its sub-block's 6-bit scale) and Q3_K (w = q d sc, q = low 2 bits - 4 unless the
// high bit is set, sc its 16 weights' signed 6-bit scale) likewise: dequant_row's arithmetic on the fields of their
// packed layouts (move_block_k), the products as fma(x, y, 0) as there.
template <int32_t T>
void packed_group_k_to_panel(const uint8_t* grp, int64_t nb, uint32_t* panel, int64_t n0) {
  constexpr int64_t sbb = kPackRows * block_bytes(T);
  const __m512i low4 = _mm512_set1_epi32(0xF), three = _mm512_set1_epi32(3), one = _mm512_set1_epi32(1);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t sbi = 0; sbi < nb / 8; ++sbi) {
    const uint8_t* sb = grp + sbi * sbb;
    prefetch_weights(sb, kPrefetchAhead, sbb);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    for (int j = 0; j < 8; ++j) {
      const int64_t c = sbi * 8 + j;
      if constexpr (T == PQ_IQ4_XS || T == PQ_Q3_K) {  // the int8 kernels' unsigned byte vectors, lane by lane
        __m512i v[8];
        __m512 a0, a1;
        if constexpr (T == PQ_IQ4_XS) {
          const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kXsHigh));
          a0 = a1 = xs_scale(d, _mm512_loadu_si512(sb + kXsLow), _mm512_cvtepu16_epi32(high), j);
          xs_chunk(sb, j, v);  // value + 128
        } else {
          __m512i w[3];
          q3_scale_words(sb, w);
          a0 = _mm512_mul_ps(d, q3_scale(w, 2 * j));
          a1 = _mm512_mul_ps(d, q3_scale(w, 2 * j + 1));
          q3_chunk(sb, j, v);  // q + 4
        }
        const __m512i offset = _mm512_set1_epi32(T == PQ_IQ4_XS ? 128 : 4);
        auto weight = [&](int k) {
          const __m512i u = _mm512_and_si512(_mm512_srli_epi32(v[k / 4], 8 * (k % 4)), _mm512_set1_epi32(0xFF));
          return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, offset)), k < 16 ? a0 : a1, zero);
        };
        chunk_to_panel(weight, panel, c, n0);
      } else if constexpr (T == PQ_Q6_K) {
        const int h = j / 4, part = j % 4;
        __m512 a0, a1;
        q6_scales(sb, j, d, a0, a1);
        auto weight = [&](int k) {
          const int t = k / 4, at = 8 * (k % 4);
          const __m512i lo = _mm512_loadu_si512(sb + kQ6Low + 64 * (16 * h + 8 * (part % 2) + t));
          const __m512i hi = _mm512_loadu_si512(sb + kQ6High + 64 * (8 * h + t));
          const __m512i nib = _mm512_and_si512(_mm512_srli_epi32(lo, at + (part < 2 ? 0 : 4)), low4);
          const __m512i top = _mm512_and_si512(_mm512_srli_epi32(hi, at + 2 * part), three);
          const __m512i u = _mm512_sub_epi32(_mm512_or_si512(nib, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32));
          return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), k < 16 ? a0 : a1, _mm512_setzero_ps());
        };
        chunk_to_panel(weight, panel, c, n0);
      } else {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 32)));
        __m512 a, b;
        k4_scales(sb, j, d, dmin, a, b);
        const uint8_t* vs = sb + k_nibbles_at(T) + 64 * 8 * (j / 2);
        auto weight = [&](int k) {
          const int t = k / 4, at = 8 * (k % 4);
          __m512i u = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(vs + 64 * t), at + 4 * (j % 2)), low4);
          if constexpr (T == PQ_Q5_K) {
            const __m512i qh = _mm512_loadu_si512(sb + kQh + 64 * t);
            u = _mm512_or_si512(u, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, at + j), one), 4));
          }
          return _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), a, b);
        };
        chunk_to_panel(weight, panel, c, n0);
      }
    }
  }
}

// The same for a panel of outputs [base, base + kPanel) that lies in whole packed groups of one K-type segment.
bool packed_panel_k(const QMatrix& w, int64_t base, uint32_t* panel) {
  return packed_panel_groups<true>(w, base, [&](auto type, const uint8_t* grp, int64_t nb, int64_t n0) {
    packed_group_k_to_panel<decltype(type)::value>(grp, nb, panel, n0);
  });
}
#endif
#endif
#endif

void dequant_row(int32_t type, const uint8_t* row, int64_t in, float* out) {
#if defined(PAGEDLLM_QUANT_AVX2)
  switch (type) {
    case PQ_Q4_0: return dequant_row_avx2<PQ_Q4_0>(row, in, out);
    case PQ_Q4_1: return dequant_row_avx2<PQ_Q4_1>(row, in, out);
    case PQ_Q5_0: return dequant_row_avx2<PQ_Q5_0>(row, in, out);
    case PQ_Q5_1: return dequant_row_avx2<PQ_Q5_1>(row, in, out);
    case PQ_Q8_0: return dequant_row_avx2<PQ_Q8_0>(row, in, out);
    case PQ_Q2_K: return dequant_row_avx2<PQ_Q2_K>(row, in, out);
    case PQ_Q3_K: return dequant_row_avx2<PQ_Q3_K>(row, in, out);
    case PQ_Q4_K: return dequant_row_avx2<PQ_Q4_K>(row, in, out);
    case PQ_Q5_K: return dequant_row_avx2<PQ_Q5_K>(row, in, out);
    case PQ_Q6_K: return dequant_row_avx2<PQ_Q6_K>(row, in, out);
    case PQ_IQ4_NL: return dequant_row_avx2<PQ_IQ4_NL>(row, in, out);
    case PQ_IQ4_XS: return dequant_row_avx2<PQ_IQ4_XS>(row, in, out);
    case PQ_MXFP4: return dequant_row_avx2<PQ_MXFP4>(row, in, out);
    default: return;
  }
#else
  dequant_row_scalar(type, row, in, out);
#endif
}

// Row r of the matrix de-quantized into out [w.in], whichever layout its segment keeps it in.
void dequant_matrix_row(const QMatrix& w, int64_t r, float* out) {
  for (int s = 0; s < w.nseg; ++s) {
    const QSegment& g = w.seg[s];
    if (r < g.rows) {
      const int64_t row_bytes = (w.in / block_weights(g.type)) * block_bytes(g.type);
      if (r < g.packed)
        dequant_packed_row(g.type, g.data + (r / kPackRows) * kPackRows * row_bytes, static_cast<int>(r % kPackRows),
                           w.in / 32, out);
      else
        dequant_row(g.type, g.data + r * row_bytes, w.in, out);
      return;
    }
    r -= g.rows;
  }
}

using DotFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t, float*,
                       int64_t);

template <int32_t T>
DotFn dot_for(int mb) {
  switch (mb) {
    case 1: return dot_group<T, 1>;
    case 2: return dot_group<T, 2>;
    case 3: return dot_group<T, 3>;
    default: return dot_group<T, 4>;
  }
}

DotFn dot_fn(int32_t type, int mb) {
  switch (type) {
    case PQ_Q4_0: return dot_for<PQ_Q4_0>(mb);
    case PQ_Q4_1: return dot_for<PQ_Q4_1>(mb);
    case PQ_Q5_0: return dot_for<PQ_Q5_0>(mb);
    case PQ_Q5_1: return dot_for<PQ_Q5_1>(mb);
    case PQ_Q8_0: return dot_for<PQ_Q8_0>(mb);
    case PQ_Q2_K: return dot_for<PQ_Q2_K>(mb);
    case PQ_Q3_K: return dot_for<PQ_Q3_K>(mb);
    case PQ_Q4_K: return dot_for<PQ_Q4_K>(mb);
    case PQ_Q5_K: return dot_for<PQ_Q5_K>(mb);
    case PQ_Q6_K: return dot_for<PQ_Q6_K>(mb);
    case PQ_IQ4_NL: return dot_for<PQ_IQ4_NL>(mb);
    case PQ_IQ4_XS: return dot_for<PQ_IQ4_XS>(mb);
    case PQ_MXFP4: return dot_for<PQ_MXFP4>(mb);
    default: return nullptr;
  }
}

// Outputs [o0, o1) of `rows` quantized input rows (row m at x.q + m * x.in ...) into y (row m at y + m * ldy).
void quant_rows_range(const QMatrix& w, const Q8Rows& x, int64_t rows, const float* bias, float* y, int64_t ldy,
                      int64_t o0, int64_t o1) {
  const int64_t in = x.in, nb = in / 32;
  int64_t first = 0;  // of the current segment
  for (int s = 0; s < w.nseg && first < o1; ++s) {
    const QSegment& g = w.seg[s];
    int64_t lo = std::max(o0, first);
    const int64_t hi = std::min(o1, first + g.rows);
#if defined(PAGEDLLM_QUANT_PACKED)
    if (lo < std::min(hi, first + g.packed)) {
      packed_range(g, in, x, rows, y + first, ldy, lo - first, std::min(hi, first + g.packed) - first);
      lo = std::min(hi, first + g.packed);
    }
#endif
    if (lo < hi) {
      const int64_t stride = (in / block_weights(g.type)) * block_bytes(g.type);
      DotFn full = dot_fn(g.type, kGroup), tail = dot_fn(g.type, static_cast<int>(rows % kGroup));
      for (int64_t o = lo; o < hi; ++o) {
        const uint8_t* wr = g.data + (o - first) * stride;
        int64_t m = 0;
        for (; m + kGroup <= rows; m += kGroup)
          full(wr, in, x.q + m * in, x.d + m * nb, x.s + m * nb, in, nb, y + m * ldy + o, ldy);
        if (m < rows) tail(wr, in, x.q + m * in, x.d + m * nb, x.s + m * nb, in, nb, y + m * ldy + o, ldy);
      }
    }
    first += g.rows;
  }
  if (bias != nullptr)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t o = o0; o < o1; ++o) y[m * ldy + o] += bias[o];
}

}  // namespace

int64_t quant_dot_max_rows() { return kQuantDotMaxRows; }

int64_t quant_row_bytes(int32_t type, int64_t in) {
  const int64_t bw = block_weights(type), bb = block_bytes(type);
  if (bb == 0 || in <= 0 || in % bw) return 0;
  return in / bw * bb;
}

int64_t quant_pack(uint8_t* data, int32_t type, int64_t rows, int64_t in) {
#if defined(PAGEDLLM_QUANT_PACKED)
  const int64_t row_bytes = quant_row_bytes(type, in), groups = rows / kPackRows;
  if (!packable(type) || row_bytes == 0) return 0;
#pragma omp parallel
  {
    std::vector<uint8_t> tmp;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      if (packed_k(type)) pack_group_k(data + g * kPackRows * row_bytes, type, in / 256, tmp);
      else pack_group(data + g * kPackRows * row_bytes, type, in / 32, tmp);
    }
  }
  return groups * kPackRows;
#else
  (void)data, (void)type, (void)rows, (void)in;
  return 0;
#endif
}

namespace {

// The bf16 pair panel of W's outputs [base, base + nout) (nout <= kPanel): straight from whole packed groups where
// it can be, else from its rows de-quantized into `rows` (scratch of kPanel * in floats).
// Outputs [base, base + nout) of W de-quantized into a float32 panel [in, kPanel] (zero past nout): from the packed
// groups directly where the build can, else row by row through `row` (scratch of in floats).
void f32_panel_of(const QMatrix& w, int64_t base, int64_t nout, float* panel, float* row) {
  const int64_t in = w.in;
#if defined(PAGEDLLM_QUANT_PACKED) && defined(PAGEDLLM_QUANT_AVX2)
  if (packed_f32_panel(w, base, panel)) return;
#endif
  for (int64_t k = 0; k < kPanel; ++k) {
    if (k < nout) {
      dequant_matrix_row(w, base + k, row);
      for (int64_t i = 0; i < in; ++i) panel[i * kPanel + k] = row[i];
    } else {
      for (int64_t i = 0; i < in; ++i) panel[i * kPanel + k] = 0.f;
    }
  }
}

void bf16_panel_of(const QMatrix& w, int64_t base, int64_t nout, uint32_t* bpanel, float* rows) {
#if defined(PAGEDLLM_QUANT_PACKED_BF16)
  if (packed_panel(w, base, bpanel)) return;  // whole packed groups: no float rows in between
#if defined(__AVX512VNNI__)
  if (packed_panel_k(w, base, bpanel)) return;
#endif
#endif
  for (int64_t k = 0; k < nout; ++k) dequant_matrix_row(w, base + k, rows + k * w.in);
  bf16_panel_from_rows(bpanel, rows, w.in, nout, w.in);
}

// Many rows: each thread de-quantizes a panel of kPanel output rows at a time and runs a panel kernel over the input
// rows, in tiles whose transposed copy stays in L2 (on AMX, a tile is a whole block of rows, below). The weight is
// de-quantized once per call, which many rows amortize. Where the CPU multiplies bf16 in hardware (AVX512-BF16) the
// panel is rounded to bf16 and the inputs too (bf16.cpp: twice the float32 multiply rate, float32 sums); elsewhere
// the panel and the products are float32.
//
// Rows past two blocks' worth of inputs (internal.h row_block: a prompt chunk of several hundred tokens on) would
// have every panel stream all of them from L3 again: 1.1 GB for a 2,048-row chunk of Qwen2.5-0.5B's gate|up (9,728
// x 896). There the panels of a group of outputs (up to kPanelGroupBytes) are de-quantized first, and then the rows
// go block by block, each block passed by every panel of the group while it stays in L2: that product went from
// 39-41 ms to 26-32 ms on the Sapphire Rapids of bench/RESULTS.md (AMX). Each row meets the same panels in the same
// kernel calls, only in another order: its results are the same bits.
constexpr int64_t kPanelGroupBytes = int64_t{16} << 20;

void quant_linear_panels(float* y, const float* x, const QMatrix& w, const float* bias, int64_t rows, int threads) {
  const int64_t in = w.in, out = w.out, np = (out + kPanel - 1) / kPanel, in2 = (in + 1) / 2;
  const bool bf16 = bf16_native();
  const int64_t elem = bf16 ? 2 : 4;  // bytes of one input of a transposed row
  // AMX (bf16.cpp) reads its input rows as plain pairs, 32 rows at a time: any tile will do, the taller the better,
  // so there a tile is a whole block of rows.
  const bool amx = bf16 && bf16_amx_rows(in2);
  const int64_t unit =
      amx ? 32 : std::max<int64_t>(kPanelBlock, (int64_t{256} << 10) / (in * elem) / kPanelBlock * kPanelBlock);
  const int64_t block = row_block(rows, in * elem, unit);  // rows of a block: whole tiles
  const int64_t tile = amx ? block : unit;
  // x in tiles of `tile` rows, in pack_row_blocks' blocks, or in bf16 pairs as bf16_panel_block reads them.
  float* xt = bf16 ? nullptr : scratch<float, 0>(rows * in);
  uint32_t* xp = bf16 ? scratch<uint32_t, 1>(rows * in2) : nullptr;
  for (int64_t t0 = 0; t0 < rows; t0 += tile) {
    const int64_t n = std::min(tile, rows - t0);
    if (bf16) {
      bf16_pairs_blocked(xp + t0 * in2, x + t0 * in, n, in, threads);
      continue;
    }
    pack_row_blocks(x + t0 * in, n, in, xt + t0 * in);
  }
  const int64_t panel_size = bf16 ? in2 * kPanel : in * kPanel;  // elements of one panel (uint32 pairs or floats)
  const bool blocked = rows > block;
  // Panels of a group: at most kPanelGroupBytes, the groups evened out (292 + 12 panels would leave the last group
  // passing every row for 12 panels, on at most 12 threads).
  const int64_t most = std::max<int64_t>(1, kPanelGroupBytes / (panel_size * 4));
  const int64_t groups = (np + most - 1) / most, group = blocked ? (np + groups - 1) / groups : np;
  // Blocked: the group's panels, shared by the threads (the calling thread's scratch).
  uint32_t* bgroup = blocked && bf16 ? scratch<uint32_t, 5>(std::min(group, np) * panel_size) : nullptr;
  float* fgroup = blocked && !bf16 ? scratch<float, 5>(std::min(group, np) * panel_size) : nullptr;
  for (int64_t g0 = 0; g0 < np; g0 += group) {
    const int64_t g1 = std::min(np, g0 + group);
    const int nt = team_size(threads, g1 - g0);
#pragma omp parallel num_threads(nt)
    {
      // This thread's panel (float32, or bf16 pairs) and de-quantized rows.
      float* row = scratch<float, 2>(bf16 ? in * kPanel : in);
      float* acc = bf16 ? nullptr : scratch<float, 3>(std::min(tile, rows) * kPanel);
      auto panel_of = [&](int64_t p, uint32_t* bpanel, float* panel) {
        const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, out - base);
        if (bf16)
          bf16_panel_of(w, base, nout, bpanel, row);
        else
          f32_panel_of(w, base, nout, panel, row);
      };
      // Panel p against rows [m0, m1) (whole tiles), tile by tile.
      auto run_panel = [&](int64_t p, const uint32_t* bpanel, const float* panel, int64_t m0, int64_t m1) {
        const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, out - base);
        const float* bt = bias ? bias + base : nullptr;
        for (int64_t t0 = m0; t0 < m1; t0 += tile) {
          const int64_t n = std::min(tile, m1 - t0);
          float* yt = y + t0 * out + base;
          if (bf16)
            bf16_panel_block(bpanel, xp + t0 * in2, n, in2, yt, out, bt, nout);
          else
            panel_block(panel, xt + t0 * in, n, in, yt, out, bt, nout, acc);
        }
      };
      if (!blocked) {
        uint32_t* bpanel = bf16 ? scratch<uint32_t, 2>(panel_size) : nullptr;
        float* panel = bf16 ? nullptr : scratch<float, 1>(panel_size);
#pragma omp for schedule(guided)
        for (int64_t p = 0; p < np; ++p) {
          panel_of(p, bpanel, panel);
          run_panel(p, bpanel, panel, 0, rows);
        }
      } else {
#pragma omp for schedule(static)
        for (int64_t p = g0; p < g1; ++p)
          panel_of(p, bf16 ? bgroup + (p - g0) * panel_size : nullptr, bf16 ? nullptr : fgroup + (p - g0) * panel_size);
        for (int64_t m0 = 0; m0 < rows; m0 += block) {
          const int64_t m1 = std::min(rows, m0 + block);
#pragma omp for schedule(guided) nowait
          for (int64_t p = g0; p < g1; ++p)
            run_panel(p, bf16 ? bgroup + (p - g0) * panel_size : nullptr,
                      bf16 ? nullptr : fgroup + (p - g0) * panel_size, m0, m1);
        }
      }
    }
  }
}

}  // namespace

void quant_panel_rows_range(const QMatrix& w, const uint32_t* xt, int64_t rows, const float* bias, float* y,
                            int64_t ldy, int64_t o0, int64_t o1, float* t) {
  // quant_linear_panels' bf16 branch over [o0, o1): the same panels (bf16_panel_of), the same bf16_panel_block calls.
  const int64_t in = w.in, in2 = (in + 1) / 2;
  uint32_t* bpanel = scratch<uint32_t, 2>(in2 * kPanel);
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, w.out - base);
    const int64_t lo = std::max<int64_t>(o0 - base, 0), hi = std::min<int64_t>(o1 - base, nout);
    bf16_panel_of(w, base, nout, bpanel, scratch<float, 2>(in * kPanel));
    bf16_panel_block(bpanel, xt, rows, in2, t, kPanel, bias ? bias + base : nullptr, nout);
    for (int64_t m = 0; m < rows; ++m) std::copy(t + m * kPanel + lo, t + m * kPanel + hi, y + m * ldy + base + lo);
  }
}

void quant_f32_panel_rows_range(const QMatrix& w, const float* xb, int64_t rows, const float* bias, float* y,
                                int64_t ldy, int64_t o0, int64_t o1, float* t) {
  // quant_linear_panels' float32 branch over [o0, o1): the same panels, the same panel_block calls.
  const int64_t in = w.in;
  float* panel = scratch<float, 1>(in * kPanel);
  float* row = scratch<float, 2>(in);
  float* acc = scratch<float, 3>(std::max<int64_t>(rows, kPanelBlock) * kPanel);
  for (int64_t p = o0 / kPanel; p * kPanel < o1; ++p) {
    const int64_t base = p * kPanel, nout = std::min<int64_t>(kPanel, w.out - base);
    const int64_t lo = std::max<int64_t>(o0 - base, 0), hi = std::min<int64_t>(o1 - base, nout);
    f32_panel_of(w, base, nout, panel, row);
    panel_block(panel, xb, rows, in, t, kPanel, bias ? bias + base : nullptr, nout, acc);
    for (int64_t m = 0; m < rows; ++m) std::copy(t + m * kPanel + lo, t + m * kPanel + hi, y + m * ldy + base + lo);
  }
}

void quant_linear(float* y, const float* x, const QMatrix* wp, const float* bias, int64_t rows, int32_t int8,
                  int threads) {
  const QMatrix& w = *wp;
  bool packed = true;
  for (int s = 0; s < w.nseg; ++s) packed = packed && w.seg[s].packed == w.seg[s].rows;
  if (packed ? !int8 : rows > kQuantDotMaxRows) {  // packed: the caller says; as stored: the number of rows
    quant_linear_panels(y, x, w, bias, rows, threads);
    return;
  }
  const int64_t in = w.in, out = w.out, nb = in / 32;
  // The rows in tiles whose int8 copy fits kTileBytes (a whole number of groups), each quantized then multiplied.
  const int64_t tile = std::max<int64_t>(kGroup, std::min<int64_t>(rows, kTileBytes / in / kGroup * kGroup));
  int8_t* q = scratch<int8_t, 0>(tile * in);
  int32_t* s16 = scratch<int32_t, 0>(tile * 2 * nb);
  float* d = scratch<float, 3>(tile * nb);
  float* s = scratch<float, 4>(tile * nb);
  // Outputs in chunks of 16 rows, handed out in shrinking runs (guided): a thread that loses its core for a while
  // does not hold the others up.
  const int64_t chunks = (out + 15) / 16;
  const int nt = team_size(threads, chunks);
  for (int64_t t0 = 0; t0 < rows; t0 += tile) {
    const int64_t n = std::min(tile, rows - t0);
    const Q8Rows xr{q, d, s, in, s16};
#pragma omp parallel num_threads(team_for_grain(nt, n * in, 1 << 14))
    {
#pragma omp for schedule(static)
      for (int64_t m = 0; m < n; ++m)
        quantize_row(x + (t0 + m) * in, in, q + m * in, d + m * nb, s + m * nb, s16 + m * 2 * nb);
    }
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t ch = 0; ch < chunks; ++ch)
      quant_rows_range(w, xr, n, bias, y + t0 * out, out, ch * 16, std::min(out, ch * 16 + 16));
  }
}

void quant_dequantize_rows(float* out, const QMatrix* wp, const int64_t* ids, int64_t n, int threads) {
  const QMatrix& w = *wp;
#pragma omp parallel for schedule(static) num_threads(team_for_grain(threads, n * w.in, 1 << 16))
  for (int64_t i = 0; i < n; ++i) dequant_matrix_row(w, ids[i], out + i * w.in);
}

void quantize_input(const float* x, int64_t in, int8_t* q, float* d, float* s, int32_t* s16) {
  quantize_row(x, in, q, d, s, s16);
}

void quant_gemv_rows(const QMatrix& w, const int8_t* q, const float* d, const float* s, const int32_t* s16,
                     int64_t rows, const float* bias, float* y, int64_t ldy, int64_t o0, int64_t o1) {
  const Q8Rows x{const_cast<int8_t*>(q), const_cast<float*>(d), const_cast<float*>(s), w.in, const_cast<int32_t*>(s16)};
  quant_rows_range(w, x, rows, bias, y, ldy, o0, o1);
}

}  // namespace pagedllm
