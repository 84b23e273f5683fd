// The fused one-token decoder: a whole Llama-family decoder stack for one decode token in one parallel region.
//
// Per layer (weights of DecoderLayer; linear weights as panels; a null bias or q/k norm means none):
//   residual += x (residual = x at the first layer); h = rms_norm(residual) * norm1
//   q, k, v = h Wqkv^T (+ b); per-head rms_norm of q and k (Qwen3); rotary on q and k at the token's position;
//   k, v written to the layer's cache at the token's slot
//   a = attention(q, the cached keys and values of the request's blocks over its context) * scale
//   residual += a Wo^T (+ b); h = rms_norm(residual) * norm2
//   x = (silu(gate) * up)(h Wgu^T (+ b)) Wd^T (+ b)
// and then x = rms_norm(residual + x) * final_norm: x [H] enters as the token's embedding and leaves as the final
// hidden state, exactly what the layer-by-layer path computes.
//
// Why: a single request's decode step is bound by reading the weights, and the layer-by-layer path dispatches about
// twelve ops per layer, each a fork and join of the thread team. Here the work split between the threads costs five
// barriers a layer: each thread keeps its own copy of the residual stream and normalises it itself (a few hundred
// floats, cheaper than a barrier); the qkv rows split on head boundaries, so each thread normalises, rotates and
// caches the heads it computed; attention splits the context between the threads (flash-decoding: every thread
// reads each of its cached tokens once for all heads, and the partial results merge per head); gate and up split on
// the same rows, so SiLU-and-mul needs no barrier of its own.
//
// Quantized weights (a layer's QMatrix with segments) run on int8 copies of their input, and bf16 weights
// (`--dtype bfloat16`) on bf16 copies, which each thread makes itself (a few hundred values, cheaper than sharing
// one through a barrier).
//
// Tensor parallelism: with an all_reduce hook, the output projection and the down projection leave partial sums,
// which thread 0 reduces between two extra barriers before their bias is added.
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

struct Decoder {
  DecoderSpec spec;
  std::vector<DecoderLayer> layers;
};

// An input vector quantized for the quantized weights (one per thread): q [n], d and s [n / 32].
struct Q8Vec {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  explicit Q8Vec(int64_t n) : q(n), d(n / 32 + 1), s(n / 32 + 1) {}
  void set(const float* x, int64_t n) { quantize_input(x, n, q.data(), d.data(), s.data()); }
};

// An input vector rounded to bf16 pairs for the bf16 weights (one per thread).
struct Bf16Vec {
  std::vector<uint32_t> pairs;
  explicit Bf16Vec(int64_t n) : pairs((n + 1) / 2) {}
  void set(const float* x, int64_t n) {  // one row's pairs are its bf16 values in order (an odd tail's pair: zero)
    auto* half = reinterpret_cast<uint16_t*>(pairs.data());
    bf16_round_row(half, x, n);
    if (n & 1) half[n] = 0;
  }
};

// Outputs [o0, o1) of a linear layer through its panels, its quantized rows on xq (x quantized), or its bf16 panels
// on xb (x rounded to bf16).
inline void gemv_any(const float* panels, const QMatrix& qw, const uint32_t* w16, const float* x, const Q8Vec& xq,
                     const Bf16Vec& xb, const float* bias, float* y, int64_t o0, int64_t o1, int64_t in) {
  if (qw.nseg > 0)
    quant_gemv_range(qw, xq.q.data(), xq.d.data(), xq.s.data(), bias, y, o0, o1);
  else if (w16 != nullptr)
    bf16_gemv_range(w16, xb.pairs.data(), bias, y, o0, o1, (in + 1) / 2);
  else
    gemv_panels(panels, x, bias, y, o0, o1, in);
}

// y[lo, hi) += bias[lo, hi) (after a reduction).
static inline void add_bias(float* y, const float* bias, int64_t lo, int64_t hi) {
  if (bias == nullptr) return;
#pragma omp simd
  for (int64_t k = lo; k < hi; ++k) y[k] += bias[k];
}

}  // namespace

void* decoder_create(const DecoderSpec* spec) {
  auto* dec = new Decoder{*spec, std::vector<DecoderLayer>(spec->layers, spec->layers + spec->num_layers)};
  dec->spec.layers = dec->layers.data();
  return dec;
}

void decoder_destroy(void* decoder) { delete static_cast<Decoder*>(decoder); }

void decoder_run(const void* decoder, float* xp, int64_t pos, int64_t slot, const int64_t* table, int64_t len,
                 int threads) {
  const Decoder& dec = *static_cast<const Decoder*>(decoder);
  const DecoderSpec& s = dec.spec;
  const int64_t hidden = s.hidden, bs = s.block_size, hkv = s.kv_heads, d = s.head_dim, hq = s.q_heads;
  const int64_t inter = s.inter, qkv_out = (hq + 2 * hkv) * d, layers = s.num_layers;
  const int64_t half = s.rot / 2, cs_off = pos * s.rot, row = hkv * d, g = hq / hkv;
  const float sc = s.scale, ep = s.eps;
  const AllReduceFn reduce = s.all_reduce;
  const int nt = std::max(1, threads);
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
    Q8Vec xq(std::max({hidden, hq * d, inter}));  // this thread's quantized copy of a quantized layer's input
    Bf16Vec xb(std::max({hidden, hq * d, inter}));  // and bf16 copy of a bf16 layer's
    auto quantize = [&](const QMatrix& qw, const uint32_t* w16, const float* x, int64_t len) {
      if (qw.nseg > 0) xq.set(x, len);
      else if (w16 != nullptr) xb.set(x, len);
    };
    int64_t a, b, ha, hb, ia, ib, ra, rb, qa, qb;
    share(qkv_out / d, t, n, 1, ha, hb);  // heads of q|k|v
    share(inter, t, n, kPanel, ia, ib);
    share(hidden, t, n, kPanel, ra, rb);
    share(len, t, n, 1, a, b);  // this thread's span of the context
    share(hq, t, n, 1, qa, qb);
    float* pm = part + t * hq * (d + 2);
    for (int64_t l = 0; l < layers; ++l) {
      const DecoderLayer& w = dec.layers[l];
      if (l == 0) {
        std::copy(xp, xp + hidden, res);
        rms_row(h, res, w.norm1, hidden, ep);
      } else {
        add_rms_row(h, res, xp, w.norm1, hidden, ep);
      }
      quantize(w.qkv_q, w.qkv16, h, hidden);
      gemv_any(w.qkv, w.qkv_q, w.qkv16, h, xq, xb, w.qkv_b, qkv, ha * d, hb * d, hidden);
      for (int64_t hh = ha; hh < hb; ++hh) {
        float* v = qkv + hh * d;
        if (hh < hq && w.q_norm != nullptr) rms_row(v, v, w.q_norm, d, ep);
        if (hh >= hq && hh < hq + hkv && w.k_norm != nullptr) rms_row(v, v, w.k_norm, d, ep);
        if (hh < hq + hkv) rotate_head(v, w.cos_sin + cs_off, half);
        if (hh >= hq) {  // a key or value head: to the cache
          const int64_t off = slot * row + (hh - (hh >= hq + hkv ? hq + hkv : hq)) * d;
          void* cache = hh >= hq + hkv ? w.v_cache : w.k_cache;
          if (s.kv_dtype == PKV_BF16) bf16_round_row(static_cast<uint16_t*>(cache) + off, v, d);  // as torch rounds
          else std::copy(v, v + d, static_cast<float*>(cache) + off);
        }
      }
#pragma omp barrier
      attend_span_any(pm, pm + hq, pm + 2 * hq, qkv, w.k_cache, w.v_cache, s.kv_dtype, table, a, b, bs, row, hq, g,
                      d, sc, scores);
#pragma omp barrier
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
      quantize(w.o_q, w.o16, att, hq * d);
      gemv_any(w.o, w.o_q, w.o16, att, xq, xb, reduce ? nullptr : w.o_b, xp, ra, rb, hq * d);
#pragma omp barrier
      if (reduce != nullptr) {
        if (t == 0) reduce(xp, hidden, s.reduce_ctx);
#pragma omp barrier
        add_bias(xp, w.o_b, ra, rb);  // each thread its rows; the add_rms below reads all: one more barrier
#pragma omp barrier
      }
      add_rms_row(h, res, xp, w.norm2, hidden, ep);
      quantize(w.gate_up_q, w.gate_up16, h, hidden);
      gemv_any(w.gate_up, w.gate_up_q, w.gate_up16, h, xq, xb, w.gate_up_b, gu, ia, ib, hidden);
      gemv_any(w.gate_up, w.gate_up_q, w.gate_up16, h, xq, xb, w.gate_up_b, gu, inter + ia, inter + ib, hidden);
#pragma omp simd
      for (int64_t k = ia; k < ib; ++k) act[k] = silu_mul(gu[k], gu[inter + k]);
#pragma omp barrier
      quantize(w.down_q, w.down16, act, inter);
      gemv_any(w.down, w.down_q, w.down16, act, xq, xb, reduce ? nullptr : w.down_b, xp, ra, rb, inter);
#pragma omp barrier
      if (reduce != nullptr) {
        if (t == 0) reduce(xp, hidden, s.reduce_ctx);
#pragma omp barrier
        add_bias(xp, w.down_b, ra, rb);
#pragma omp barrier
      }
    }
    if (t == 0) add_rms_row(xp, res, xp, s.final_norm, hidden, ep);
  }
}

}  // namespace pagedllm
