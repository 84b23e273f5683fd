// Paged attention over a block KV cache, reading keys and values in place from their blocks (no gather, no mask):
// single-query decode (flash-decoding partial results per span, merged per head) and causal prefill of multi-token
// segments (16 query rows x 8 keys a tile in the vector lanes, flash-attention style). With AVX-512 (AVX2) the
// decode span takes 16 (8) keys at a time and reduces their dot products together. The cache holds float32 or
// bfloat16 (KV below: float or uint16_t), widened to float32 as it is read; scores and sums are float32. Figures:
// bench/RESULTS.md.
#include <type_traits>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

// Elements of a KV cache in one 64-byte cache line.
template <typename KV>
constexpr int64_t kLine = 64 / sizeof(KV);

// Calls f(row, l) for every token l0 <= l < l1 of a paged context, in order: `row` points at the token's cached row
// (all KV heads: `row` elements); `table` maps block index -> cache block.
template <typename KV, typename F>
static inline void for_each_token(const KV* cache, const int64_t* table, int64_t l0, int64_t l1, int64_t bs,
                                  int64_t row, F&& f) {
  while (l0 < l1) {
    const int64_t b = l0 / bs;
    const KV* block = cache + table[b] * bs * row;
    const int64_t t0 = l0 % bs, m = std::min(bs, t0 + l1 - l0);
    // The blocks are scattered, so the hardware prefetcher stops at each block's end: while on token t of this
    // block, fetch token t of the next one.
    const KV* next = (b + 1) * bs < l1 ? cache + table[b + 1] * bs * row : nullptr;
    for (int64_t t = t0; t < m; ++t) {
      if (next != nullptr)
        for (int64_t c = 0; c < row; c += kLine<KV>) __builtin_prefetch(next + t * row + c);
      f(block + t * row, l0 - t0 + t);
    }
    l0 += m - t0;
  }
}


// Scratch of one attention item (reused across items and calls of one thread).
struct AttendScratch {
  std::vector<float> scores, acc, mx, sum;
};


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGEDLLM_SPAN_TILES 1
#if defined(__AVX512F__)
// The tiled span attention's vector: 16 float lanes (a tile is 16 tokens), 32 registers.
struct SpanVec {
  using V = __m512;
  // W lanes; kChunk vectors of a head's columns and kAcc accumulators at most in registers.
  static constexpr int W = 16, kChunk = 8, kAcc = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) { return kv_load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // Lane t of the result is the sum of the 16 lanes of v[t] (a transposed reduction: 45 shuffles and adds for 16
  // dot products, where 16 separate horizontal sums take ~4x as many).
  static V sum_lanes(const V* v) {
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
};
#else
// The same with AVX2: 8 float lanes (a tile is 8 tokens), 16 registers.
struct SpanVec {
  using V = __m256;
  static constexpr int W = 8, kChunk = 4, kAcc = 12;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // Lane t of the result is the sum of the 8 lanes of v[t].
  static V sum_lanes(const V* v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // tokens 0-3, 2 halves
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));  // tokens 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#endif

// Whether decode spans over a cache of KV run in tiles. With AVX2 a float32 cache keeps the token loop: from memory it
// read ~12 GB/s there, the tiles ~10 (bench/decode_attention.py on Zen 3; a bfloat16 cache 1.6x faster in tiles).
template <typename KV>
#if defined(__AVX512F__)
constexpr bool kSpanTiles = true;
#else
constexpr bool kSpanTiles = std::is_same_v<KV, uint16_t>;
#endif

// Vectors of a head's D columns that one pass of values_tile or scores_tile holds in registers per query head.
template <int D>
constexpr int kSpanChunk = std::min(D / SpanVec::W, SpanVec::kChunk);

// acc[i] += sum over the tile's tokens c < nt of p[i * stride + c] * value row c (at offset ko), for NR query heads
// of one KV head, the NR x kSpanChunk accumulators held in registers (the columns in chunks of that many vectors,
// each chunk a pass over the tile's tokens: every accumulator still adds its tokens in order).
template <int D, int NR, typename KV, typename Tick>
static inline void values_tile(float* acc, const float* p, int64_t stride, const KV* const* rows, int64_t ko,
                               int64_t nt, Tick&& tick) {
  using V = SpanVec::V;
  constexpr int W = SpanVec::W, CV = kSpanChunk<D>;
  for (int v0 = 0; v0 < D / W; v0 += CV) {
    V av[NR][CV];
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < CV; ++v) av[i][v] = SpanVec::load(acc + i * D + W * (v0 + v));
    for (int64_t c = 0; c < nt; ++c) {
      if (v0 == 0) tick();
      const KV* vr = rows[c] + ko + W * v0;
      V pi[NR];
      for (int i = 0; i < NR; ++i) pi[i] = SpanVec::set1(p[i * stride + c]);
      for (int v = 0; v < CV; ++v) {
        const V vv = SpanVec::load(vr + W * v);
        for (int i = 0; i < NR; ++i) av[i][v] = SpanVec::fma(pi[i], vv, av[i][v]);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < CV; ++v) SpanVec::store(acc + i * D + W * (v0 + v), av[i][v]);
  }
}

// Scores of G query heads sharing one KV head (queries q, G x D, pre-scaled by sc) against a tile of W keys (rows
// kr, at offset ko): out[i * W + c] = q_i . k_c. Each key vector is loaded (and widened, from bf16) once for the G
// heads; each head's dot product is summed in the order a lone head's would be (the same bits whatever G), the
// columns in chunks of kSpanChunk vectors whose partial sums carry over.
template <int D, int G, typename KV, typename Tick>
static inline void scores_tile(const float* q, SpanVec::V scv, const KV* const* kr, int64_t ko, float* out,
                               Tick&& tick) {
  using V = SpanVec::V;
  constexpr int T = SpanVec::W, CV = kSpanChunk<D>;
  alignas(64) V a[G][T];
  for (int v0 = 0; v0 < D / T; v0 += CV) {
    V qv[G][CV];
    for (int i = 0; i < G; ++i)
      for (int v = 0; v < CV; ++v) qv[i][v] = SpanVec::mul(SpanVec::load(q + i * D + T * (v0 + v)), scv);
#pragma GCC unroll 16
    for (int c = 0; c < T; ++c) {
      if (v0 == 0 && c % 4 == 0) tick();
      const KV* k = kr[c] + ko + T * v0;
      V x[G];
      const V k0 = SpanVec::load(k);
      for (int i = 0; i < G; ++i) x[i] = v0 == 0 ? SpanVec::mul(qv[i][0], k0) : SpanVec::fma(qv[i][0], k0, a[i][c]);
      for (int v = 1; v < CV; ++v) {
        const V kv = SpanVec::load(k + T * v);
        for (int i = 0; i < G; ++i) x[i] = SpanVec::fma(qv[i][v], kv, x[i]);
      }
      for (int i = 0; i < G; ++i) a[i][c] = x[i];
    }
  }
  for (int i = 0; i < G; ++i) SpanVec::store(out + i * T, SpanVec::sum_lanes(a[i]));
}

// attend_span for the specialised head sizes (64, 128; any multiple of 16 would do) with AVX-512 or AVX2, for R
// query tokens of one context at once (jobs: each token's queries, span and outputs): the same three passes (scores,
// softmax, values) over tiles of W tokens (SpanVec: 16 with AVX-512, 8 with AVX2) of the spans' union. A tile's keys
// are read once for all query heads of all the tokens whose span covers it (from memory once, from L1 for the other
// tokens), their dot products reduced together (SpanVec::sum_lanes); values accumulate in registers, up to half the
// registers' worth of query heads of one KV head at a time. Each token's
// arithmetic is what it would be alone: a score depends on its token only, each token's softmax runs over its own
// span's scores laid out as alone, and its values accumulate token by token in order. The rows of the tile two ahead
// are prefetched into L2, spread over the current tile's work: blocks are scattered, which stops the hardware
// prefetcher (into L1, or only one tile ahead, it read more slowly: bench/RESULTS.md).
template <int D, typename KV>
static void attend_spans_tiled(const SpanJob* jobs, int64_t R, const KV* kc, const KV* vc, const int64_t* table,
                                int64_t bs, int64_t row, int64_t hq, int64_t g, ScoreScale sc, std::vector<float>& scores) {
  constexpr int T = SpanVec::W, kAhead = 2;
  // Query heads whose accumulators share the registers (pass 3), and that share one pass over a tile's keys (1).
  constexpr int RB = std::max(1, std::min(4, SpanVec::kAcc / kSpanChunk<D>)), GB = RB;
  int64_t u0 = std::numeric_limits<int64_t>::max(), u1 = 0, total = 0;
  thread_local std::vector<int64_t> layout;  // each token's score stride and offset (no allocation per call)
  layout.resize(2 * R);
  int64_t* stride = layout.data();
  int64_t* off = stride + R;
  for (int64_t j = 0; j < R; ++j) {
    const SpanJob& jb = jobs[j];
    stride[j] = (std::max<int64_t>(0, jb.l1 - jb.l0) + T - 1) / T * T;
    off[j] = total;
    total += hq * stride[j];
    if (jb.l1 > jb.l0) u0 = std::min(u0, jb.l0), u1 = std::max(u1, jb.l1);
  }
  if (u1 <= u0) return;
  const int64_t used = ((hq - 1) / g + 1) * D;  // elements of each token row the spans read
  scores.resize(total);
  const KV* kr[T];
  const KV* nxt[T];
  auto rows_of = [&](const KV* base, int64_t t0, const KV** out) {
    const int64_t nt = std::min<int64_t>(T, u1 - t0);
    int64_t b = t0 / bs, o = t0 % bs;
    for (int c = 0; c < nt; ++c) {
      out[c] = base + (table[b] * bs + o) * row;
      if (++o == bs) o = 0, ++b;
    }
    for (int c = nt; c < T; ++c) out[c] = out[nt - 1];  // past the union: repeat its last token (never used)
    return nt;
  };
  const KV* pf[T];
  int64_t pf_rows = 0;
  const int64_t lpr = std::max<int64_t>(1, used / kLine<KV>);
  // The token rows of the tile kAhead ahead (pf, pf_rows of them) go out paced: `tick` is called `pf_slots` times
  // over the current tile's work and issues pf_rows / pf_slots rows each time (a running credit, no division), a
  // row's lpr lines together. Issued as one burst a tile, the misses queued up behind each other and stalled the
  // loads of the current tile (attention from memory ~1.5x slower); paced line by line, the bookkeeping cost as
  // much as the arithmetic where the data was near. `flush` issues what is left at the tile's end.
  int64_t pf_next = 0, pf_credit = 0, pf_slots = 1;
  auto issue = [&]() {
    const char* p = reinterpret_cast<const char*>(pf[pf_next++]);
    for (int64_t l = 0; l < lpr; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T1);
  };
  auto tick = [&]() {
    for (pf_credit += pf_rows; pf_credit >= pf_slots && pf_next < pf_rows; pf_credit -= pf_slots) issue();
  };
  auto flush = [&]() {
    while (pf_next < pf_rows) issue();
  };
  const int64_t ntiles = (u1 - u0 + T - 1) / T;
  // The tiles are read in the order K 0 .. ntiles-1, then V 0 .. ntiles-1: aim kAhead tiles ahead in it.
  auto plan_prefetch = [&](int64_t tile) {
    int64_t ahead = tile + kAhead;
    const KV* base = ahead < ntiles ? kc : vc;
    if (ahead >= ntiles) ahead -= ntiles;
    pf_rows = ahead < ntiles ? rows_of(base, u0 + ahead * T, pf) : 0;
    pf_next = pf_credit = 0;
  };
  for (int64_t tile = 0; tile < kAhead; ++tile) {  // the first tiles, before they are needed
    plan_prefetch(tile - kAhead);
    flush();
  }
  // Query-head runs of pass 3 (up to RB heads of one KV head each): its ticks are runs x T; pass 1's runs of up to
  // GB heads tick T / 4 times each.
  int64_t runs = 0, runs1 = 0;
  for (int64_t r0 = 0; r0 < hq; ++runs) r0 = std::min<int64_t>({hq, (r0 / g + 1) * g, r0 + RB});
  for (int64_t r0 = 0; r0 < hq; ++runs1) r0 = std::min<int64_t>({hq, (r0 / g + 1) * g, r0 + GB});
  // Token j's part [lo, hi) of the tile at t0 (empty: lo >= hi).
  auto part = [&](const SpanJob& jb, int64_t t0, int64_t& lo, int64_t& hi) {
    lo = std::max(t0, jb.l0);
    hi = std::min(t0 + T, jb.l1);
  };
  const SpanVec::V scv = SpanVec::set1(sc);
  // Pass 1: scores, token j's head r at scores[off[j] + r * stride[j] + l - l0].
  rows_of(kc, u0, kr);
  alignas(64) float tmp[GB * T];
  for (int64_t t0 = u0; t0 < u1; t0 += T) {
    if (t0 + T < u1) rows_of(kc, t0 + T, nxt);
    plan_prefetch((t0 - u0) / T);
    pf_slots = runs1 * (T / 4);
    bool spread = false;  // the prefetch goes along the first token's heads that use this tile
    for (int64_t j = 0; j < R; ++j) {
      const SpanJob& jb = jobs[j];
      int64_t lo, hi;
      part(jb, t0, lo, hi);
      if (lo >= hi) continue;
      float* s = scores.data() + off[j];
      for (int64_t r0 = 0; r0 < hq;) {
        const int64_t r1 = std::min<int64_t>({hq, (r0 / g + 1) * g, r0 + GB}), ko = (r0 / g) * D;
        const float* qr = jb.q + r0 * D;
        auto run = [&](auto&& tk) {
          switch (r1 - r0) {
            case 1: scores_tile<D, 1>(qr, scv, kr, ko, tmp, tk); break;
            case 2: scores_tile<D, std::min(2, GB)>(qr, scv, kr, ko, tmp, tk); break;
            case 3: scores_tile<D, std::min(3, GB)>(qr, scv, kr, ko, tmp, tk); break;
            default: scores_tile<D, std::min(4, GB)>(qr, scv, kr, ko, tmp, tk); break;
          }
        };
        if (spread) run([] {});
        else run(tick);
        for (int64_t r = r0; r < r1; ++r)
          std::copy(tmp + (r - r0) * T + (lo - t0), tmp + (r - r0) * T + (hi - t0), s + r * stride[j] + (lo - jb.l0));
        r0 = r1;
      }
      spread = true;
    }
    flush();
    std::copy(nxt, nxt + T, kr);
  }
  // Pass 2: softmax numerators and sums, per token and query head.
  for (int64_t j = 0; j < R; ++j) {
    const SpanJob& jb = jobs[j];
    const int64_t span = jb.l1 - jb.l0;
    if (span <= 0) continue;
    for (int64_t r = 0; r < hq; ++r) {
      float* sr = scores.data() + off[j] + r * stride[j];
      sc.cap_scores(sr, span);
      const float mr = max_of(sr, span);
      jb.m[r] = mr;
      jb.lsum[r] = exp_in_place(sr, span, mr);
    }
  }
  // Pass 3: values, a tile at a time; per tile and token, query heads in runs of up to RB sharing one KV head.
  rows_of(vc, u0, kr);
  for (int64_t t0 = u0; t0 < u1; t0 += T) {
    if (t0 + T < u1) rows_of(vc, t0 + T, nxt);
    plan_prefetch(ntiles + (t0 - u0) / T);
    pf_slots = runs * T;
    bool spread = false;
    for (int64_t j = 0; j < R; ++j) {
      const SpanJob& jb = jobs[j];
      int64_t lo, hi;
      part(jb, t0, lo, hi);
      if (lo >= hi) continue;
      for (int64_t r0 = 0; r0 < hq;) {
        const int64_t kvh = r0 / g, r1 = std::min<int64_t>({hq, (kvh + 1) * g, r0 + RB});
        const float* sp = scores.data() + off[j] + r0 * stride[j] + (lo - jb.l0);
        float* ap = jb.acc + r0 * D;
        const KV* const* rows = kr + (lo - t0);
        auto run = [&](auto&& tk) {
          switch (r1 - r0) {
            case 1: values_tile<D, 1>(ap, sp, stride[j], rows, kvh * D, hi - lo, tk); break;
            case 2: values_tile<D, std::min(2, RB)>(ap, sp, stride[j], rows, kvh * D, hi - lo, tk); break;
            case 3: values_tile<D, std::min(3, RB)>(ap, sp, stride[j], rows, kvh * D, hi - lo, tk); break;
            default: values_tile<D, std::min(4, RB)>(ap, sp, stride[j], rows, kvh * D, hi - lo, tk); break;
          }
        };
        if (spread) run([] {});
        else run(tick);
        r0 = r1;
      }
      spread = true;
    }
    flush();
    std::copy(nxt, nxt + T, kr);
  }
}
#endif

// Single-query attention of `hq` consecutive query heads q [hq, d] over the tokens [l0, l1) of one paged context:
// query head r reads KV head r / g counted from kc and vc (which may point past a token row's start, to skip KV
// heads); a cached token is `row` floats, read once for every head. The result is flash-decoding's unnormalised
// partial result, per head: its score max m[r], its sum of exp lsum[r] and
// acc[r] = sum of exp(score - m[r]) * value. An empty span gives m = -inf, lsum = 0, acc = 0.
template <int D, typename KV>
static void attend_span(float* m, float* lsum, float* acc, const float* q, const KV* kc, const KV* vc,
                        const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row, int64_t hq,
                        int64_t g, int64_t d_rt, ScoreScale sc, std::vector<float>& scores) {
  const int64_t d = D > 0 ? D : d_rt, span = l1 - l0;
  std::fill(m, m + hq, -std::numeric_limits<float>::infinity());
  std::fill(lsum, lsum + hq, 0.f);
  std::fill(acc, acc + hq * d, 0.f);
  if (span <= 0) return;
#if defined(PAGEDLLM_SPAN_TILES)
  if constexpr (D > 0 && D % 16 == 0 && kSpanTiles<KV>) {
    const SpanJob job{q, l0, l1, m, lsum, acc};
    attend_spans_tiled<D, KV>(&job, 1, kc, vc, table, bs, row, hq, g, sc, scores);
    return;
  }
#endif
  scores.resize(hq * span);
  float* s = scores.data();
  for_each_token(kc, table, l0, l1, bs, row, [&](const KV* kt, int64_t l) {
    for (int64_t r = 0; r < hq; ++r) {
      const float v = sc.capped(dot_kv(q + r * d, kt + (r / g) * d, d) * sc);
      s[r * span + l - l0] = v;
      m[r] = std::max(m[r], v);
    }
  });
  for (int64_t r = 0; r < hq; ++r) {
    lsum[r] = exp_in_place(s + r * span, span, m[r]);
  }
  for_each_token(vc, table, l0, l1, bs, row, [&](const KV* vt, int64_t l) {
    for (int64_t r = 0; r < hq; ++r) {
      const float p = s[r * span + l - l0];
      const KV* vr = vt + (r / g) * d;
      float* ar = acc + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) ar[x] += p * kv_f(vr[x]);
    }
  });
}

// Single-query attention of `rows` consecutive query heads q [rows, d] over one request's paged context of `len`
// tokens, query row r reading KV head kv0 + r / g: attend_span over [0, len), or over its last `window` tokens
// (window > 0), normalised into out.
template <int D, typename KV>
static void attend_item(float* out, const float* q, const KV* kp, const KV* vp, const int64_t* table,
                        int64_t len, int64_t window, int64_t bs, int64_t row, int64_t kv0, int64_t rows, int64_t g,
                        int64_t d_rt, ScoreScale sc, AttendScratch& s) {
  const int64_t d = D > 0 ? D : d_rt;
  s.mx.resize(rows);
  s.sum.resize(rows);
  s.acc.resize(rows * d);
  const int64_t l0 = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  attend_span<D, KV>(s.mx.data(), s.sum.data(), s.acc.data(), q, kp + kv0 * d, vp + kv0 * d, table, l0, len, bs,
                     row, rows, g, d, sc, s.scores);
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = sc.inv_sum(s.mx[r], s.sum[r], kv0 * g + r);
    float* orow = out + r * d;
    const float* ar = s.acc.data() + r * d;
    for (int64_t x = 0; x < d; ++x) orow[x] = ar[x] * inv;
  }
}

// Every request of the batch, in parallel over items. An item is one request's KV heads [h0, h0 + hs) and their
// query heads: all KV heads when there are enough requests to keep every thread busy (each cached token row is
// then read whole and in order), one each otherwise.
template <int D, typename KV>
static void decode_loop(float* op, const float* qp, const KV* kp, const KV* vp, const int64_t* tp,
                        const int64_t* lp, int64_t window, int64_t n, int64_t hq, int64_t hkv, int64_t bs,
                        int64_t width, int64_t d, ScoreScale sc, int threads) {
  const int64_t g = hq / hkv;
  const int64_t row = hkv * d;  // elements between consecutive tokens of one block
  const int64_t hs = n >= 4 * threads ? hkv : 1;
  const int64_t per_req = hkv / hs, items = n * per_req;
  // Longest contexts first, handed out one at a time: the threads finish together even when the lengths differ
  // or one thread loses its core for a while to another process (on a 2-core server, the API server's).
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[a] > lp[b]; });
  const int nt = team_size(threads, items);
#pragma omp parallel num_threads(nt)
  {
    AttendScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = order[item / per_req], h0 = (item % per_req) * hs;
      const int64_t first = i * hq + h0 * g;  // the item's query heads are consecutive
      attend_item<D, KV>(op + first * d, qp + first * d, kp, vp, tp + i * width, lp[i], window, bs, row, h0, hs * g, g,
                         d, sc, scratch);
    }
  }
}


// Causal attention of up to R query rows of one query head over a paged context, flash-attention style: key tiles
// of C tokens; the R rows sit in the vector lanes (qt holds them transposed and pre-scaled, qt[x * R + i]), so each
// key element is broadcast against R queries and the running softmax needs no horizontal reductions. Row i sits at
// position p0 + i and attends the tokens [0, p0 + i], or with a sliding window (window > 0) the tokens
// [p0 + i - window + 1, p0 + i]; rows past nrows are padding (qt zero) and not written.
// kc, vc point at the query head's KV head within token rows of `row` floats; ot is [d, R] scratch.
constexpr int kPrefillRows = 16, kPrefillKeys = 8;

// Rows rows[c][0, D) of a tile of kPrefillKeys tokens, widened to float32 into out[c * D + x].
template <int D, typename KV>
static inline void widen_tile(const KV* const* rows, float* __restrict out) {
  for (int c = 0; c < kPrefillKeys; ++c) {
    const KV* __restrict r = rows[c];
#pragma omp simd
    for (int x = 0; x < D; ++x) out[c * D + x] = kv_f(r[x]);
  }
}

template <int D, typename KV>
static void prefill_tile(float* out, int64_t ostride, const float* qt, int64_t nrows, int64_t p0, int64_t window,
                         const KV* kc, const KV* vc, const int64_t* table, int64_t bs, int64_t row, float* ot,
                         int64_t d_rt, ScoreScale sc) {
  constexpr int R = kPrefillRows, C = kPrefillKeys;
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  const int64_t d = D > 0 ? D : d_rt, klen = p0 + nrows;
  constexpr bool kWiden = D > 0 && !std::is_same_v<KV, float>;
  alignas(64) float kw[kWiden ? C * D : 1];  // the tile's keys, then its values, widened (token c at c * D)
  float m[R], l[R];
  std::fill(m, m + R, ninf);
  std::fill(l, l + R, 0.f);
  std::fill(ot, ot + d * R, 0.f);
  // The first key any row sees (row 0's window start), from the tile that holds it.
  const int64_t first = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
  for (int64_t j0 = first / C * C; j0 < klen; j0 += C) {
    const int64_t nc = std::min<int64_t>(C, klen - j0);
    const KV* kr[C];
    const KV* vr[C];
    for (int c = 0; c < C; ++c) {  // past the context, repeat its last token (masked below)
      const int64_t j = j0 + std::min<int64_t>(c, nc - 1);
      const int64_t off = (table[j / bs] * bs + j % bs) * row;
      kr[c] = kc + off;
      vr[c] = vc + off;
    }
    // A bfloat16 tile is widened once (vector code) into float32 scratch, not element by element in the loops below,
    // where each element is broadcast against the rows.
    if constexpr (kWiden) widen_tile<D>(kr, kw);
    float s[C][R] = {};
    for (int64_t x = 0; x < d; ++x) {
      const float* qx = qt + x * R;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const float kv = kWiden ? kw[c * D + x] : kv_f(kr[c][x]);
#pragma omp simd
        for (int i = 0; i < R; ++i) s[c][i] += kv * qx[i];
      }
    }
    if (sc.cap > 0.f) sc.cap_scores(&s[0][0], C * R);  // before the masks below
    if (j0 + C - 1 > p0 || nc < C) {  // the tile reaches past some row's position: mask
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < R; ++i)
          if (c >= nc || j0 + c > p0 + i) s[c][i] = ninf;
    }
    if (window > 0 && j0 <= p0 + R - 1 - window) {  // the tile starts before some row's window: mask
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < R; ++i)
          if (j0 + c <= p0 + i - window) s[c][i] = ninf;
    }
    // Without a window token 0 is in the first tile and visible to every row, so m is finite from the first tile
    // on; with one, a row may see nothing of a tile yet (m stays -inf: the exponentials below are then taken
    // against 0 and give 0, where -inf - -inf would give NaN).
    float mn[R], alpha[R];
    std::copy(m, m + R, mn);
    for (int c = 0; c < C; ++c)
#pragma omp simd
      for (int i = 0; i < R; ++i) mn[i] = std::max(mn[i], s[c][i]);
#pragma omp simd
    for (int i = 0; i < R; ++i) {
      const float base = mn[i] == ninf ? 0.f : mn[i];
      alpha[i] = expf(m[i] - base);
      m[i] = mn[i];
      l[i] *= alpha[i];
      mn[i] = base;  // the exponentials below: s - base
    }
    for (int c = 0; c < C; ++c)
#pragma omp simd
      for (int i = 0; i < R; ++i) {
        const float e = expf(s[c][i] - mn[i]);
        s[c][i] = e;
        l[i] += e;
      }
    if constexpr (kWiden) widen_tile<D>(vr, kw);
    for (int64_t x = 0; x < d; ++x) {
      float* o = ot + x * R;
      float acc[R];
#pragma omp simd
      for (int i = 0; i < R; ++i) acc[i] = o[i] * alpha[i];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const float vv = kWiden ? kw[c * D + x] : kv_f(vr[c][x]);
#pragma omp simd
        for (int i = 0; i < R; ++i) acc[i] += s[c][i] * vv;
      }
      std::copy(acc, acc + R, o);
    }
  }
  for (int64_t i = 0; i < nrows; ++i) {
    const float inv = sc.inv_sum(m[i], l[i], 0);  // sinks: this head's first (prefill_rows_any)
    float* orow = out + i * ostride;
    for (int64_t x = 0; x < d; ++x) orow[x] = ot[x * R + i] * inv;
  }
}

// One tile of work: rows [i0, i0 + R) of query head h of segment s.
struct PrefillTask {
  int64_t seg, i0, h, cost;
};

template <typename KV>
static void attend_span_typed(float* m, float* lsum, float* acc, const float* q, const KV* kc, const KV* vc,
                              const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row, int64_t hq,
                              int64_t g, int64_t d, ScoreScale sc, std::vector<float>& scores) {
  if (d == 64) attend_span<64, KV>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
  else if (d == 128) attend_span<128, KV>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
  else attend_span<0, KV>(m, lsum, acc, q, kc, vc, table, l0, l1, bs, row, hq, g, d, sc, scores);
}

template <typename KV>
static void decode_typed(const PagedDecodeArgs* a) {
  const PagedCache& c = a->cache;
  const int64_t d = c.head_dim;
  const KV* kp = static_cast<const KV*>(c.k);
  const KV* vp = static_cast<const KV*>(c.v);
  switch (d) {
    case 64:
      decode_loop<64, KV>(a->out, a->q, kp, vp, a->block_table, a->seq_lens, a->window, a->n, a->q_heads, c.kv_heads,
                          c.block_size, a->table_width, 64, ScoreScale(a->scale, a->softcap, a->sinks), a->threads);
      break;
    case 128:
      decode_loop<128, KV>(a->out, a->q, kp, vp, a->block_table, a->seq_lens, a->window, a->n, a->q_heads, c.kv_heads,
                           c.block_size, a->table_width, 128, ScoreScale(a->scale, a->softcap, a->sinks), a->threads);
      break;
    default:
      decode_loop<0, KV>(a->out, a->q, kp, vp, a->block_table, a->seq_lens, a->window, a->n, a->q_heads, c.kv_heads,
                         c.block_size, a->table_width, d, ScoreScale(a->scale, a->softcap, a->sinks), a->threads);
  }
}

static void prefill_all(const PagedPrefillArgs* a) {
  const PagedCache& c = a->cache;
  const int64_t hq = a->q_heads, d = c.head_dim, g = hq / c.kv_heads, row = c.kv_heads * d;
  const int64_t width = a->table_width, qstride = a->q_stride, nseg = a->num_segments;
  const int64_t* sp = a->segments;
  const int64_t* tp = a->tables;
  constexpr int R = kPrefillRows;
  std::vector<PrefillTask> tasks;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t len = sp[3 * s + 1], ctx = sp[3 * s + 2];
    for (int64_t i0 = 0; i0 < len; i0 += R)
      for (int64_t h = 0; h < hq; ++h) tasks.push_back({s, i0, h, ctx + i0});
  }
  // Longest first, handed out one at a time: causal tiles differ in cost, and the threads finish together.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const PrefillTask& x, const PrefillTask& y) { return x.cost > y.cost; });
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel num_threads(team_size(a->threads, n))
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n; ++t) {
      const PrefillTask& task = tasks[t];
      const int64_t start = sp[3 * task.seg] + task.i0, len = sp[3 * task.seg + 1], ctx = sp[3 * task.seg + 2];
      prefill_rows_any(a->out + start * hq * d, hq * d, a->q + start * qstride, qstride,
                       std::min<int64_t>(R, len - task.i0), ctx + task.i0, a->window, task.h, c.k, c.v, c.kv_dtype,
                       tp + task.seg * width, c.block_size, row, g, d, ScoreScale(a->scale, a->softcap, a->sinks), scratch);
    }
  }
}
}  // namespace

int64_t prefill_tile_rows() { return kPrefillRows; }

void prefill_rows_any(float* out, int64_t ostride, const float* q, int64_t qstride, int64_t n, int64_t p0,
                      int64_t window, int64_t h, const void* kc, const void* vc, int32_t kv_dtype, const int64_t* table, int64_t bs, int64_t row,
                      int64_t g, int64_t d, ScoreScale sc, std::vector<float>& scratch) {
  constexpr int R = kPrefillRows;
  scratch.resize(2 * d * R);
  float* qt = scratch.data();
  float* ot = qt + d * R;
  const float* qrow = q + h * d;
  for (int64_t i = 0; i < R; ++i)
    for (int64_t x = 0; x < d; ++x) qt[x * R + i] = i < n ? qrow[i * qstride + x] * sc : 0.f;
  float* orow = out + h * d;
  const int64_t kv = (h / g) * d;
  if (sc.sinks != nullptr) sc.sinks += h;  // prefill_tile normalises with this head's sink
  auto run = [&](auto* kp, auto* vp) {
    using KV = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
    switch (d) {
      case 64: prefill_tile<64, KV>(orow, ostride, qt, n, p0, window, kp + kv, vp + kv, table, bs, row, ot, d, sc); break;
      case 128: prefill_tile<128, KV>(orow, ostride, qt, n, p0, window, kp + kv, vp + kv, table, bs, row, ot, d, sc); break;
      default: prefill_tile<0, KV>(orow, ostride, qt, n, p0, window, kp + kv, vp + kv, table, bs, row, ot, d, sc);
    }
  };
  if (kv_dtype == PKV_BF16) run(static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc));
  else run(static_cast<const float*>(kc), static_cast<const float*>(vc));
}

void attend_span_any(float* m, float* lsum, float* acc, const float* q, const void* kc, const void* vc,
                     int32_t kv_dtype, const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row,
                     int64_t hq, int64_t g, int64_t d, ScoreScale sc, std::vector<float>& scores) {
  if (kv_dtype == PKV_BF16)
    attend_span_typed(m, lsum, acc, q, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), table, l0,
                      l1, bs, row, hq, g, d, sc, scores);
  else
    attend_span_typed(m, lsum, acc, q, static_cast<const float*>(kc), static_cast<const float*>(vc), table, l0, l1,
                      bs, row, hq, g, d, sc, scores);
}

// attend_span for R query tokens of one context (SpanJob: internal.h), each token's result as it would be alone.
template <typename KV>
static void attend_spans_typed(const SpanJob* jobs, int64_t R, const KV* kc, const KV* vc, const int64_t* table,
                               int64_t bs, int64_t row, int64_t hq, int64_t g, int64_t d, ScoreScale sc,
                               std::vector<float>& scores) {
#if defined(PAGEDLLM_SPAN_TILES)
  if (kSpanTiles<KV> && (d == 64 || d == 128)) {  // all the tokens together (empty spans keep these initial results)
    for (int64_t j = 0; j < R; ++j) {
      const SpanJob& jb = jobs[j];
      std::fill(jb.m, jb.m + hq, -std::numeric_limits<float>::infinity());
      std::fill(jb.lsum, jb.lsum + hq, 0.f);
      std::fill(jb.acc, jb.acc + hq * d, 0.f);
    }
    if (d == 64) attend_spans_tiled<64, KV>(jobs, R, kc, vc, table, bs, row, hq, g, sc, scores);
    else attend_spans_tiled<128, KV>(jobs, R, kc, vc, table, bs, row, hq, g, sc, scores);
    return;
  }
#endif
  for (int64_t j = 0; j < R; ++j) {
    const SpanJob& jb = jobs[j];
    attend_span_typed(jb.m, jb.lsum, jb.acc, jb.q, kc, vc, table, jb.l0, jb.l1, bs, row, hq, g, d, sc, scores);
  }
}

void attend_spans_any(const SpanJob* jobs, int64_t R, const void* kc, const void* vc, int32_t kv_dtype,
                      const int64_t* table, int64_t bs, int64_t row, int64_t hq, int64_t g, int64_t d, ScoreScale sc,
                      std::vector<float>& scores) {
  if (kv_dtype == PKV_BF16)
    attend_spans_typed(jobs, R, static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), table, bs, row,
                       hq, g, d, sc, scores);
  else
    attend_spans_typed(jobs, R, static_cast<const float*>(kc), static_cast<const float*>(vc), table, bs, row, hq, g,
                       d, sc, scores);
}

void paged_decode(const PagedDecodeArgs* a) {
  if (a->cache.kv_dtype == PKV_BF16) decode_typed<uint16_t>(a);
  else decode_typed<float>(a);
}

void paged_prefill(const PagedPrefillArgs* a) { prefill_all(a); }

// An encoder's bidirectional attention (BERT, RoBERTa: no KV cache, every token of a request attends to all of its
// request's tokens). One item per request and head, handed out to the threads one at a time (a request's length
// sets its cost). Per item the head's keys are transposed once into kt [D][Lp] (Lp: L rounded up to whole vectors,
// zero past L); then R query rows at a time (enc_rows): their scores against every key, vectorised over the keys,
// each key vector loaded once for the R rows; each row's softmax (simd.h max_of, exp_in_place); and the values'
// weighted sums, the R rows' D columns held in registers while each value row is loaded once for them. float32
// throughout; a token's arithmetic is the same whatever the other rows or requests of the call.
namespace {

constexpr int kEncRegs = kLanes == 16 ? 32 : 16;  // vector registers of the build

// Rows [0, R) of one item: queries q (rows qs apart, D = NV vectors), keys kt [D][lp], values v (rows vs apart,
// L of them); scores in s [R][lp]; outputs to out (rows os apart).
template <int NV, int R>
void enc_rows(const float* q, int64_t qs, const float* kt, int64_t lp, int64_t L, const float* v, int64_t vs,
              float scale, float* s, float* out, int64_t os) {
  constexpr int D = NV * kLanes;
  const pvec zero = pv_zero(), sc = pv_splat(scale);
  for (int64_t j0 = 0; j0 < lp; j0 += kLanes) {
    pvec c[R];
    for (int r = 0; r < R; ++r) c[r] = zero;
    for (int x = 0; x < D; ++x) {
      const pvec k = pv_load(kt + x * lp + j0);
      for (int r = 0; r < R; ++r) c[r] = pv_fma(pv_splat(q[r * qs + x]), k, c[r]);
    }
    for (int r = 0; r < R; ++r) pv_store(s + r * lp + j0, pv_fma(c[r], sc, zero));
  }
  float inv[R];
  for (int r = 0; r < R; ++r) inv[r] = 1.f / exp_in_place(s + r * lp, L, max_of(s + r * lp, L));
  pvec o[R][NV];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) o[r][n] = zero;
  for (int64_t j = 0; j < L; ++j) {
    pvec vj[NV];
    for (int n = 0; n < NV; ++n) vj[n] = pv_load(v + j * vs + n * kLanes);
    for (int r = 0; r < R; ++r) {
      const pvec p = pv_splat(s[r * lp + j]);
      for (int n = 0; n < NV; ++n) o[r][n] = pv_fma(p, vj[n], o[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NV; ++n) pv_store(out + r * os + n * kLanes, pv_fma(o[r][n], pv_splat(inv[r]), zero));
}

// Every query row of one item, R at a time and the rest one by one.
template <int NV>
void enc_item(const float* q, int64_t qs, const float* kt, int64_t lp, int64_t L, const float* v, int64_t vs,
              float scale, float* s, float* out, int64_t os) {
  constexpr int R = std::max(1, std::min(4, kEncRegs / 2 / NV));
  int64_t i = 0;
  for (; i + R <= L; i += R) enc_rows<NV, R>(q + i * qs, qs, kt, lp, L, v, vs, scale, s, out + i * os, os);
  for (; i < L; ++i) enc_rows<NV, 1>(q + i * qs, qs, kt, lp, L, v, vs, scale, s, out + i * os, os);
}

using EncItemFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, int64_t, float,
                           float*, float*, int64_t);

// The item kernel for a head of `dim` columns: whole vectors, up to 8 of them (heads of 16, 32, ..., 128 columns
// with AVX-512; 8, 16, ..., 64 with AVX2); null otherwise.
EncItemFn enc_item_fn(int64_t dim) {
  if (dim % kLanes != 0) return nullptr;
  switch (dim / kLanes) {
    case 1: return enc_item<1>;
    case 2: return enc_item<2>;
    case 3: return enc_item<3>;
    case 4: return enc_item<4>;
    case 5: return enc_item<5>;
    case 6: return enc_item<6>;
    case 7: return enc_item<7>;
    case 8: return enc_item<8>;
    default: return nullptr;
  }
}

// Any head size: one row at a time, its scores summed key-vectorised over kt's rows, the values' sums through memory.
void enc_item_any(const float* q, int64_t qs, const float* kt, int64_t lp, int64_t L, const float* v, int64_t vs,
                  int64_t dim, float scale, float* s, float* o, float* out, int64_t os) {
  for (int64_t i = 0; i < L; ++i) {
    const float* qi = q + i * qs;
    std::fill(s, s + lp, 0.f);
    for (int64_t x = 0; x < dim; ++x) {
      const float qx = qi[x];
      const float* kr = kt + x * lp;
#pragma omp simd
      for (int64_t j = 0; j < lp; ++j) s[j] += qx * kr[j];
    }
#pragma omp simd
    for (int64_t j = 0; j < L; ++j) s[j] *= scale;
    const float inv = 1.f / exp_in_place(s, L, max_of(s, L));
    std::fill(o, o + dim, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const float p = s[j];
#pragma omp simd
      for (int64_t x = 0; x < dim; ++x) o[x] += p * v[j * vs + x];
    }
    for (int64_t x = 0; x < dim; ++x) out[i * os + x] = o[x] * inv;
  }
}

}  // namespace

void encoder_attention(float* out, const float* qkv, const int64_t* starts, int64_t nseq, int64_t heads, int64_t dim,
                       float scale, int threads) {
  const int64_t hd = heads * dim, stride = 3 * hd, items = nseq * heads;
  const EncItemFn fn = enc_item_fn(dim);
#pragma omp parallel for schedule(dynamic, 1) num_threads(team_size(threads, items))
  for (int64_t it = 0; it < items; ++it) {
    const int64_t b = it / heads, h = it % heads, a = starts[b], L = starts[b + 1] - a;
    if (L <= 0) continue;
    const int64_t lp = (L + kLanes - 1) / kLanes * kLanes;
    float* kt = scratch<float, 20>(dim * lp + 4 * lp + dim);
    float* s = kt + dim * lp;
    const float* q = qkv + a * stride + h * dim;
    const float* k = q + hd;
    const float* v = k + hd;
    for (int64_t j = 0; j < L; ++j)
      for (int64_t x = 0; x < dim; ++x) kt[x * lp + j] = k[j * stride + x];
    for (int64_t x = 0; x < dim; ++x) std::fill(kt + x * lp + L, kt + (x + 1) * lp, 0.f);
    float* o = out + a * hd + h * dim;
    if (fn != nullptr)
      fn(q, stride, kt, lp, L, v, stride, scale, s, o, hd);
    else
      enc_item_any(q, stride, kt, lp, L, v, stride, dim, scale, s, s + 4 * lp, o, hd);
  }
}

}  // namespace pagedllm
