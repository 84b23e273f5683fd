// Top-k and nucleus (top-p) filtering of sampling rows without sorting the vocabulary, and sampling by the inverse
// of a row's cumulative distribution; and sample_rows, the sampler's whole step on a row in one call.
//
// sample_rows reads each row of logits once into a thread's scratch row (divided by the temperature), filters it
// there (top_k_row and top_p_row below, the latter on the row's own softmax) and draws: among the kept candidates
// when a filter left few (their weights exp(logit - max) summed in double, in id order), else by inverse_cdf_row over
// the whole row; min-p zeroes the weights below min_p times the largest. Greedy rows take the first largest logit.
// It makes the torch path's choices but for rounding: its softmax is its own (its sum in float32 lanes, as torch's,
// but in another order: ~1e-6 relative apart), so a top-p cut whose mass lies within that of p, or a u within
// rounding of a token's boundary, may fall the other way. With top-k, top-p runs on top-k's candidates alone.
// The logits are not modified and nothing is allocated per row. (The torch steps it replaces on the CPU copied and
// rewrote the [rows, vocab] logits some five times: 2-10x slower at 16 and 64 rows, bench/RESULTS.md.)
//
// sample_inverse draws token out[r] of row r at u[r] in [0, 1): the first token with mass whose running sum passes
// u[r] * (the row's sum), in one pass over the row plus one over the blocks up to the token. The row's probs need
// not be normalised.
//
// top_k_mask sets logits[r, i] = -inf outside the k[r] largest logits of row r (ties: the lower ids), for the rows
// with 0 < k[r] < vocab: the tokens of the reference's `_mask_outside_top_k`. Only the logits within a distance of
// the largest that holds k of them (found by counting passes, the distance doubling) are ordered.
//
// top_p_mask sets logits[r, i] = -inf for every token i outside row r's nucleus, for the rows whose p[r] < 1: the
// same tokens as the torch reference (sample/sampler.py, `_apply_top_k_top_p`). That reference orders a row's tokens
// by logit descending, then id ascending (a stable sort), and keeps a token while the mass before it is < p, the
// mass before token j being float32(running sum of probs, in double, up to and including j) - probs[j] in float32:
// torch's CPU cumsum of a float32 row sums in double. probs is softmax(logits) of the row, computed by the caller.
//
// A stable sort of 49152 logits costs ~5 ms on one core, and a nucleus is mostly a few to a few hundred tokens. So
// only a prefix of that order is sorted, the candidates: the tokens whose logit is at least the smallest logit of the
// tokens whose prob is >= t, for the first t of the largest prob, a quarter of it, a sixteenth, ... above which the
// mass exceeds p + kMargin (one vectorized pass each). A logit threshold takes every tie with it, so the candidates
// are a prefix of the reference's order. Their mass exceeds p by far more than rounding, so the cut falls inside
// them or right after them, and every later token is outside the nucleus in the reference too: the mass before it
// is no smaller. (Should the sum in float32 lanes ever mislead, the walk sees it and takes all tokens.) Where no t
// reaches p + kMargin (p within kMargin of 1), all tokens are candidates. A row's result does not depend on the
// others'.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "internal.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace {

// Candidates must hold p + kMargin by a float32 sum in lanes (its error can near 1e-5 in the worst case, ~1e-7 in
// practice): enough to make the double check of the walk below hold nearly always (else all tokens are candidates).
constexpr double kMargin = 1e-5;

// Rows with a temperature below this are greedy (the sampler's threshold).
constexpr float kGreedyTemperature = 1e-5f;

// The mass of the tokens whose prob is >= t, and the smallest logit among them (+inf: none), in one pass: float32
// sums in lanes, then in double.
double mass_at_least(const float* logits, const float* probs, int64_t vocab, float t, float& low) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  double sum = 0;
  low = inf;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 tv = _mm256_set1_ps(t), infv = _mm256_set1_ps(inf);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, m0 = infv, m1 = infv;
  for (; i + 16 <= vocab; i += 16) {
    const __m256 q0 = _mm256_loadu_ps(probs + i), q1 = _mm256_loadu_ps(probs + i + 8);
    const __m256 in0 = _mm256_cmp_ps(q0, tv, _CMP_GE_OQ), in1 = _mm256_cmp_ps(q1, tv, _CMP_GE_OQ);
    a0 = _mm256_add_ps(a0, _mm256_and_ps(in0, q0));
    a1 = _mm256_add_ps(a1, _mm256_and_ps(in1, q1));
    m0 = _mm256_min_ps(m0, _mm256_blendv_ps(infv, _mm256_loadu_ps(logits + i), in0));
    m1 = _mm256_min_ps(m1, _mm256_blendv_ps(infv, _mm256_loadu_ps(logits + i + 8), in1));
  }
  alignas(32) float a[8], m[8];
  _mm256_store_ps(a, _mm256_add_ps(a0, a1));
  _mm256_store_ps(m, _mm256_min_ps(m0, m1));
  for (int j = 0; j < 8; ++j) {
    sum += a[j];
    low = std::min(low, m[j]);
  }
#endif
  for (; i < vocab; ++i)
    if (probs[i] >= t) {
      sum += probs[i];
      low = std::min(low, logits[i]);
    }
  return sum;
}

// The number of logits >= t, in one pass.
int64_t count_at_least(const float* logits, int64_t vocab, float t) {
  int64_t n = 0, i = 0;
#if defined(__AVX2__)
  const __m256 tv = _mm256_set1_ps(t);
  for (; i + 8 <= vocab; i += 8)
    n += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + i), tv, _CMP_GE_OQ))));
#endif
  for (; i < vocab; ++i) n += logits[i] >= t;
  return n;
}

// The largest logit of a row and its smallest finite one (top = -inf: no finite logit above -inf).
void logit_range(const float* logits, int64_t vocab, float& top, float& low) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  top = -inf;
  low = inf;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 ninf = _mm256_set1_ps(-inf), pinf = _mm256_set1_ps(inf);
  __m256 hi = ninf, lo = pinf;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 x = _mm256_loadu_ps(logits + i);
    hi = _mm256_max_ps(hi, x);
    lo = _mm256_min_ps(lo, _mm256_blendv_ps(x, pinf, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ)));
  }
  alignas(32) float h[8], l[8];
  _mm256_store_ps(h, hi);
  _mm256_store_ps(l, lo);
  top = *std::max_element(h, h + 8);
  low = *std::min_element(l, l + 8);
#endif
  for (; i < vocab; ++i) {
    top = std::max(top, logits[i]);
    if (logits[i] > -inf) low = std::min(low, logits[i]);
  }
}

// Appends the ids of the tokens whose logit is >= floor, in order.
void collect(const float* logits, int64_t vocab, float floor, std::vector<int32_t>& cand) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 f = _mm256_set1_ps(floor);
  for (; i + 8 <= vocab; i += 8) {
    unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + i), f, _CMP_GE_OQ)));
    for (; bits != 0; bits &= bits - 1) cand.push_back(static_cast<int32_t>(i + __builtin_ctz(bits)));
  }
#endif
  for (; i < vocab; ++i)
    if (logits[i] >= floor) cand.push_back(static_cast<int32_t>(i));
}

// Orders token ids as the torch path's stable descending sort of the logits does: logit descending, then id.
struct ByLogit {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); }
};

// Keeps the logits of the first `keep` candidates of a row, -inf everywhere else.
void keep_first(float* logits, int64_t vocab, const std::vector<int32_t>& cand, size_t keep, std::vector<float>& kept) {
  kept.resize(keep);
  for (size_t j = 0; j < keep; ++j) kept[j] = logits[cand[j]];
  std::fill(logits, logits + vocab, -std::numeric_limits<float>::infinity());
  for (size_t j = 0; j < keep; ++j) logits[cand[j]] = kept[j];
}

// Masks a row outside its nucleus (the torch path's tokens; see the top of this file). Returns how many it keeps:
// the first that many of cand, in the filter's order. That is vocab when it keeps every token: cand then holds every
// token in that order (sample_row relies on it).
size_t top_p_row(float* logits, const float* probs, float p, int64_t vocab, std::vector<int32_t>& cand,
                 std::vector<float>& kept) {
  // The candidates: every token whose logit is at least the smallest logit of the tokens with prob >= t, for the
  // largest t of max_prob * 4^-k whose tokens hold more than p + kMargin (all tokens where none does).
  const float top = max_of(probs, vocab);
  float floor_logit = -std::numeric_limits<float>::infinity();
  const bool near_one = static_cast<double>(p) + kMargin >= 1.0;  // no threshold can hold p + kMargin: all tokens
  for (float t = top; !near_one && t > 0 && t >= top * 0x1p-64f; t *= 0.25f) {
    float low;
    if (mass_at_least(logits, probs, vocab, t, low) >= static_cast<double>(p) + kMargin) {
      floor_logit = low;
      break;
    }
  }
  size_t keep;
  double run;
  for (;;) {
    cand.clear();
    collect(logits, vocab, floor_logit, cand);
    std::sort(cand.begin(), cand.end(), ByLogit{logits});
    keep = cand.size();
    run = 0;
    for (size_t j = 0; j < cand.size(); ++j) {
      const float q = probs[cand[j]];
      run += q;
      if (static_cast<float>(run) - q >= p) {
        keep = j;
        break;
      }
    }
    // The cut is inside the candidates, or right after them when their mass exceeds p by far more than rounding
    // (the mass before the next token is then >= p); should it not (it cannot, by the margin), all are candidates.
    if (keep < cand.size() || run >= static_cast<double>(p) + kMargin / 2 ||
        floor_logit == -std::numeric_limits<float>::infinity())
      break;
    floor_logit = -std::numeric_limits<float>::infinity();
  }
  if (keep == static_cast<size_t>(vocab)) return keep;  // every token kept
  keep_first(logits, vocab, cand, keep, kept);
  return keep;
}

// Keeps the k largest logits of a row (ties: the lower ids), -inf elsewhere. The candidates are the logits >= the
// largest minus d, d doubling from 1 until there are k of them (all, once d is past the smallest finite logit).
// Returns how many it keeps (k, or fewer with a smaller vocabulary): the first that many of cand.
size_t top_k_row(float* logits, int64_t k, int64_t vocab, std::vector<int32_t>& cand, std::vector<float>& kept) {
  float top, low;
  logit_range(logits, vocab, top, low);
  float floor_logit = -std::numeric_limits<float>::infinity();  // fewer than k finite logits: all are candidates
  if (std::isfinite(top)) {
    float above = top;  // a floor that holds fewer than k tokens (or the largest logit)
    int64_t n = 0;      // the tokens at or above floor_logit, once found
    bool found = false;
    for (float d = 1.f; !found && top - d > low; d *= 2.f) {
      n = count_at_least(logits, vocab, top - d);
      if (n >= k) {
        floor_logit = top - d;
        found = true;
      } else {
        above = top - d;
      }
    }
    if (!found) {  // the finite logits, however many: past them, -inf stays -inf whichever -inf tokens "are kept"
      n = count_at_least(logits, vocab, low);
      floor_logit = low;
      found = n >= k;
    }
    // A peaked row's doubling can jump from a handful of tokens to most of the vocabulary, and sorting those costs
    // more than counting: bisect the floor between the two, a counting pass a step, while it holds far more than k.
    for (int step = 0; found && step < 16 && n > 4 * k + 64; ++step) {
      const float mid = 0.5f * (floor_logit + above);
      if (!(mid > floor_logit && mid < above)) break;
      const int64_t m = count_at_least(logits, vocab, mid);
      if (m >= k) {
        floor_logit = mid;
        n = m;
      } else {
        above = mid;
      }
    }
  }
  cand.clear();
  collect(logits, vocab, floor_logit, cand);
  const size_t keep = std::min(cand.size(), static_cast<size_t>(k));
  std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), ByLogit{logits});
  keep_first(logits, vocab, cand, keep, kept);
  return keep;
}

constexpr int64_t kBlock = 16;

// The sum of probs [b, e) (e - b <= kBlock), in double.
inline double block_sum(const float* probs, int64_t b, int64_t e) {
#if defined(__AVX2__)
  if (e - b == kBlock) {
    const __m256d v = _mm256_add_pd(
        _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(probs + b)), _mm256_cvtps_pd(_mm_loadu_ps(probs + b + 4))),
        _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(probs + b + 8)), _mm256_cvtps_pd(_mm_loadu_ps(probs + b + 12))));
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  }
#endif
  double part = 0;
  for (int64_t i = b; i < e; ++i) part += probs[i];
  return part;
}

// The token at u (in [0, 1)) of a row's cumulative distribution: the first whose running sum (in double) passes
// u * total, skipping tokens without mass; the last token with mass should rounding run past the end.
int64_t inverse_cdf_row(const float* probs, int64_t vocab, double u) {
  double total = 0;
  for (int64_t b = 0; b < vocab; b += kBlock) total += block_sum(probs, b, std::min(vocab, b + kBlock));
  const double target = u * total;
  double run = 0;
  for (int64_t b = 0; b < vocab; b += kBlock) {
    const int64_t e = std::min(vocab, b + kBlock);
    const double part = block_sum(probs, b, e);
    if (run + part <= target) {  // not in this block
      run += part;
      continue;
    }
    for (int64_t i = b; i < e; ++i)
      if (probs[i] > 0) {
        run += probs[i];
        if (run > target) return i;
      }
  }
  for (int64_t i = vocab - 1; i > 0; --i)  // rounding ran past the end
    if (probs[i] > 0) return i;
  return 0;
}

// The first largest element of a row (torch.argmax's answer: the first NaN if there is one, the largest then), in
// one pass over blocks that stay in L1: each block's max (vector code, which would not carry a NaN through: NaNs are
// looked for apart), the first block holding the largest remembered, then searched.
int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t kSpan = 256;
  float best = 0.f;
  int64_t first = -1;  // the first block holding `best`
  for (int64_t b = 0; b < n; b += kSpan) {
    const int64_t e = std::min(n, b + kSpan);
    int nan = 0;
#pragma omp simd reduction(| : nan)
    for (int64_t i = b; i < e; ++i) nan |= x[i] != x[i];
    if (nan)
      for (int64_t i = b; i < e; ++i)
        if (std::isnan(x[i])) return i;
    const float m = max_of(x + b, e - b);
    if (first < 0 || m > best) {
      best = m;
      first = b;
    }
  }
  for (int64_t i = std::max<int64_t>(first, 0); i < n; ++i)
    if (x[i] == best) return i;
  return 0;
}

// One thread's working rows for sample_row (kept between calls: a row is ~200 KB, which malloc would map afresh).
struct SampleScratch {
  std::vector<float> w, q, kept;
  std::vector<int32_t> cand;
  std::vector<double> mass;
};

// The token at u of the distribution over `n` candidate tokens ids[0, n) (ascending) of a row of scaled logits w
// whose largest is top: weights exp(w - top), those below min_p (of the largest weight, 1) zeroed; the first
// candidate whose running sum (in double) passes u * total, the last with mass should rounding run past it.
int64_t draw_among(const float* w, const int32_t* ids, size_t n, float top, float min_p, double u,
                   std::vector<double>& mass) {
  mass.resize(n);
  double total = 0;
  for (size_t j = 0; j < n; ++j) {
    const float e = std::exp(w[ids[j]] - top);
    mass[j] = e < min_p ? 0.0 : static_cast<double>(e);
    total += mass[j];
  }
  const double target = u * total;
  double run = 0;
  int64_t last = ids[0];
  for (size_t j = 0; j < n; ++j) {
    if (mass[j] <= 0) continue;
    last = ids[j];
    run += mass[j];
    if (run > target) return ids[j];
  }
  return last;
}

// The nucleus of a row's first n candidates ids[0, n) in the filter's order (all its tokens with mass: top-k's): how
// many of them top-p keeps, with probs exp(w - top) / their sum and top_p_row's rule.
size_t nucleus_of(const float* w, const int32_t* ids, size_t n, float top, float p, std::vector<double>& mass) {
  mass.resize(n);
  double total = 0;
  for (size_t j = 0; j < n; ++j) total += mass[j] = std::exp(w[ids[j]] - top);
  double run = 0;
  for (size_t j = 0; j < n; ++j) {
    const float q = static_cast<float>(mass[j] / total);
    run += q;
    if (j > 0 && static_cast<float>(run) - q >= p) return j;
  }
  return n;
}

// sample_rows for one random row: scale by 1 / t (a division, as the torch path's), top-k, top-p (on the row's own
// softmax, or on top-k's candidates alone), min-p, then the draw at u. The draw runs over the kept candidates when a
// filter left few, else over the whole row (exp_into, then inverse_cdf_row).
int64_t sample_row(const float* logits, int64_t vocab, float t, int64_t k, float p, float min_p, double u,
                   SampleScratch& s) {
  s.w.resize(vocab);
  float* w = s.w.data();
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) w[i] = logits[i] / t;
  const float top = max_of(w, vocab);  // the filters keep it
  if (!(top > -std::numeric_limits<float>::infinity())) return 0;  // no token has mass (every logit -inf)
  const size_t few = static_cast<size_t>(vocab / 64);
  size_t keep = static_cast<size_t>(vocab);  // the candidates, when fewer: s.cand[0, keep), in the filter's order
  if (k > 0 && k < vocab) keep = top_k_row(w, k, vocab, s.cand, s.kept);
  if (p < 1.f && keep <= few) {
    keep = nucleus_of(w, s.cand.data(), keep, top, p, s.mass);
  } else if (p < 1.f) {
    s.q.resize(vocab);
    const float sum = exp_into<true>(w, s.q.data(), vocab, top);
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < vocab; ++i) s.q[i] *= inv;
    const size_t kp = top_p_row(w, s.q.data(), p, vocab, s.cand, s.kept);
    // Keeping every token, top_p_row has still ordered them all into cand: top-k's candidates (if any) come first.
    if (kp < static_cast<size_t>(vocab)) keep = kp;
  }
  if (keep <= few) {  // few candidates: draw among them, in id order
    std::sort(s.cand.begin(), s.cand.begin() + keep);
    return draw_among(w, s.cand.data(), keep, top, min_p, u, s.mass);
  }
  exp_into<true>(w, w, vocab, top);  // in place: w holds the weights exp(w - top) from here on
  if (min_p > 0.f)
    for (int64_t i = 0; i < vocab; ++i)
      if (w[i] < min_p) w[i] = 0.f;
  return inverse_cdf_row(w, vocab, u);
}

}  // namespace

void sample_rows(const float* logits, const float* temperature, const int64_t* k, const float* p, const float* min_p,
                 const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, 1)) schedule(dynamic, 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * vocab;
    if (temperature[r] < kGreedyTemperature) {
      out[r] = argmax_row(row, vocab);
      continue;
    }
    thread_local SampleScratch s;
    out[r] = sample_row(row, vocab, temperature[r], k ? k[r] : vocab, p ? p[r] : 1.f, min_p ? min_p[r] : 0.f,
                        u[r], s);
  }
}

void sample_inverse(const float* probs, const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel for num_threads(team_for_grain(threads, rows, 1)) schedule(dynamic, 1)
  for (int64_t r = 0; r < rows; ++r) out[r] = inverse_cdf_row(probs + r * vocab, vocab, u[r]);
}

void top_k_mask(float* logits, const int64_t* k, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel num_threads(team_for_grain(threads, rows, 1))
  {
    std::vector<int32_t> cand;
    std::vector<float> kept;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r)
      if (k[r] > 0 && k[r] < vocab) top_k_row(logits + r * vocab, k[r], vocab, cand, kept);
  }
}

void top_p_mask(float* logits, const float* probs, const float* p, int64_t rows, int64_t vocab, int threads) {
#pragma omp parallel num_threads(team_for_grain(threads, rows, 1))
  {
    std::vector<int32_t> cand;
    std::vector<float> kept;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r)
      if (p[r] < 1.f) top_p_row(logits + r * vocab, probs + r * vocab, p[r], vocab, cand, kept);
  }
}

}  // namespace pagedllm
