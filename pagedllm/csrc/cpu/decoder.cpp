// The fused decoder: a whole Llama-family decoder stack for the tokens of a decode step in one parallel region: one
// decode token, a few consecutive tokens of one request (a decode token and its draft tokens, speculative decoding),
// or the decode tokens (and drafts) of several requests, each row attending to its own request's context.
//
// Per layer (weights of DecoderLayer; linear weights as panels; a null bias or q/k norm means none):
//   residual += x (residual = x at the first layer); h = rms_norm(residual) * norm1
//   q, k, v = h Wqkv^T (+ b); per-head rms_norm of q and k (Qwen3); rotary on q and k at the token's position;
//   k, v written to the layer's cache at the token's slot
//   a = attention(q, the cached keys and values of the request's blocks over its context) * scale
//   residual += a Wo^T (+ b); h = rms_norm(residual) * norm2
//   x = (silu(gate) * up)(h Wgu^T (+ b)) Wd^T (+ b)
// Gemma's layers: the attention and MLP outputs are normalised (post_attn_norm, post_mlp_norm) before they join the
// residual stream, and the gate's activation is GELU (tanh approximation).
// and then x = rms_norm(residual + x) * final_norm: x [H] (each row of x [R, H]) enters as the token's embedding and leaves as the final
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
// Several tokens: each goes through exactly the arithmetic it would alone (the same sums in the same order, context
// spans and merges), so speculative decoding verifies its drafts bit for bit as plain decoding would compute them,
// and a request's tokens do not depend on the others of its batch, while each weight is read once for all of them
// (linear_rows). Attention runs per run of consecutive rows of one request (one block table): their spans of one
// context are read together.
//
// Quantized weights (a layer's QMatrix with segments) run on int8 copies of their input, and bf16 weights
// (`--dtype bfloat16`) on bf16 copies, which each thread makes itself (a few hundred values, cheaper than sharing
// one through a barrier).
//
// Prompt tokens (`prompt`: rows that are consecutive prompt tokens of one request, a short prompt chunk such as the
// uncached tail of a prefix-cache hit): what the layer-by-layer path computes for them, bit for bit, without its
// dozen dispatches a layer. Their quantized weights run on bf16 copies of the input against the de-quantized bf16
// panels (prompt 1; quant_panel_rows_range: builds with AVX512-BF16; the bindings refuse it elsewhere), or on int8
// copies as generated rows do (prompt 2: PAGEDLLM_PROMPT_INT8=1, the model runner gives prompt rows int8 inputs), and
// their attention is paged_prefill's (prefill_rows_any), tiles of rows x query heads shared between the threads.
//
// Mixture-of-experts layers (DecoderLayer::moe) run their experts through moe_rows in the same region.
//
// Tensor parallelism: with an all_reduce hook, the output projection and the down projection leave partial sums,
// which thread 0 reduces between two extra barriers before their bias is added.
#include <initializer_list>
#include <utility>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

struct Decoder {
  DecoderSpec spec;
  std::vector<DecoderLayer> layers;
};

// The step's input rows quantized for the quantized weights (one per thread): row r of width n at q + r n, d and
// s + r n / 32, s16 + r n / 16.
struct Q8Rows8 {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> s16;
  Q8Rows8(int64_t rows, int64_t n)
      : q(rows * n), d(rows * (n / 32 + 1)), s(rows * (n / 32 + 1)), s16(rows * (n / 16 + 2)) {}
  void set(const float* x, int64_t rows, int64_t n) {  // x [rows, n]
    for (int64_t r = 0; r < rows; ++r)
      quantize_input(x + r * n, n, q.data() + r * n, d.data() + r * (n / 32), s.data() + r * (n / 32),
                     s16.data() + r * (n / 16));
  }
};

// The step's input rows rounded to bf16 pairs for the bf16 weights (one per thread), as bf16_gemm_range reads them.
struct Bf16Rows {
  std::vector<uint32_t> pairs;
  std::vector<uint16_t> scratch;  // one rounded row (several rows)
  std::vector<float> out;         // one panel's sums of every row (bf16_gemm_range)
  Bf16Rows(int64_t rows, int64_t n)
      : pairs(rows * ((n + 1) / 2)), scratch(rows > 1 ? n + 1 : 0), out(rows * kPanel) {}
  void set(const float* x, int64_t rows, int64_t n) {
    bf16_pairs_blocked_serial(pairs.data(), x, rows, n, scratch.data());
  }
};

// Outputs [o0, o1) of a linear layer for the step's rows x [rows, in] (outputs of row r at y + r * ys): through its
// quantized rows on xq (x quantized), its bf16 panels on xb (x rounded to bf16) or its float32 panels on xt (x
// transposed; unused for one row), each weight decoded or read from memory once for all the rows. Each row's outputs
// are what they would be for that row alone.
inline void linear_rows(const float* panels, const QMatrix& qw, const uint32_t* w16, const float* x, int64_t rows,
                        const Q8Rows8& xq, Bf16Rows& xb, std::vector<float>& xt, const float* bias, float* y,
                        int64_t ys, int64_t o0, int64_t o1, int64_t in, bool prompt) {
  if (qw.nseg > 0 && prompt) {
    quant_panel_rows_range(qw, xb.pairs.data(), rows, bias, y, ys, o0, o1, xb.out.data());
  } else if (qw.nseg > 0) {
    quant_gemv_rows(qw, xq.q.data(), xq.d.data(), xq.s.data(), xq.s16.data(), rows, bias, y, ys, o0, o1);
  } else if (w16 != nullptr) {
    bf16_gemm_range(w16, xb.pairs.data(), rows, bias, y, ys, o0, o1, (in + 1) / 2, xb.out.data());
  } else {
    if (rows > 1)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < in; ++i) xt[i * rows + r] = x[r * in + i];
    panel_rows_range(panels, rows > 1 ? xt.data() : x, rows, in, bias, y, ys, o0, o1);
  }
}

// Rows up to which every thread shrinks every LoRA row itself (decoder_run's lora).
constexpr int64_t kLoraShareRows = 4;
// The widest LoRA slot (rank columns of a merged layer) the decoder takes (the bindings check it).
constexpr int64_t kMaxLoraWidth = 4096;

// The step's rows by LoRA slot: rows[start[s], start[s + 1]) have slot s (rows of no slot are left out).
struct LoraGroups {
  std::vector<int64_t> rows, start;
  LoraGroups(const int32_t* slot, int64_t n) {
    if (slot == nullptr) return;
    int64_t slots = 0;
    for (int64_t r = 0; r < n; ++r) slots = std::max<int64_t>(slots, slot[r] + 1);
    start.assign(slots + 1, 0);
    for (int64_t r = 0; r < n; ++r)
      if (slot[r] >= 0) ++start[slot[r] + 1];
    for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
    rows.resize(start[slots]);
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < n; ++r)
      if (slot[r] >= 0) rows[at[slot[r]]++] = r;
  }
  int64_t slots() const { return start.empty() ? 0 : static_cast<int64_t>(start.size()) - 1; }
};

// The sum of a vector's lanes, in lane order (the same for every row, whatever rows share its call).
static inline float lanes_sum(pvec v) {
  float lanes[kLanes];
  pv_store(lanes, v);
  float sum = 0.f;
  for (int k = 0; k < kLanes; ++k) sum += lanes[k];
  return sum;
}

// LoRA (DecoderLora): t [rows, W] = A_s x_r for each row r of slot s, part `part` of `parts` of each slot's rank
// columns (a contiguous share: threads writing neighbouring columns of t would share its cache lines). Each row of
// A_s is read once for up to four rows of its slot at a time; each row's dot product is the same arithmetic (one
// vector of partial sums, its lanes summed in order, the tail after) whatever rows it is computed with.
template <typename W>
inline void lora_shrink(const DecoderLora& L, const float* x, int64_t in, const LoraGroups& g, float* t, int part,
                        int parts) {
  const int64_t body = in / kLanes * kLanes;
  for (int64_t s = 0; s < g.slots() && s < L.slots; ++s) {
    const int64_t w = L.width[s];
    const W* a = static_cast<const W*>(L.a) + s * L.stride * in;
    for (int64_t k = w * part / parts; k < w * (part + 1) / parts; ++k) {
      const W* ak = a + k * in;
      for (int64_t j = g.start[s]; j < g.start[s + 1];) {
        const int64_t m = g.start[s + 1] - j >= 4 ? 4 : 1;  // four rows at a time, then one
        const float* xr[4];
        pvec acc[4];
        for (int64_t q = 0; q < m; ++q) {
          xr[q] = x + g.rows[j + q] * in;
          acc[q] = pv_zero();
        }
        if (m == 4) {
          for (int64_t i = 0; i < body; i += kLanes) {
            const pvec av = pv_load(ak + i);
            for (int64_t q = 0; q < 4; ++q) acc[q] = pv_fma(av, pv_load(xr[q] + i), acc[q]);
          }
        } else {
          for (int64_t i = 0; i < body; i += kLanes) acc[0] = pv_fma(pv_load(ak + i), pv_load(xr[0] + i), acc[0]);
        }
        for (int64_t q = 0; q < m; ++q) {
          float sum = lanes_sum(acc[q]);
          for (int64_t i = body; i < in; ++i) sum += kv_f(ak[i]) * xr[q][i];
          if (L.a_scale != nullptr) sum *= L.a_scale[s * L.stride + k];
          t[g.rows[j + q] * L.stride + k] = sum;
        }
        j += m;
      }
    }
  }
}

// y[r, o0:o1] += sum_k t[r, k] B_s^T[k, o0:o1] for each row r of slot s (after lora_shrink): B is held transposed
// ([W, out] a slot), and the outputs go in blocks of four vectors held in registers over k, the block of B^T read
// (from cache) for each row of the slot. Each output is the same chain of k products whatever rows share the call.
template <typename W>
inline void lora_expand(const DecoderLora& L, const float* t, int64_t out, const LoraGroups& g, float* y,
                        int64_t ys, int64_t o0, int64_t o1) {
  constexpr int64_t kBlock = 4 * kLanes;
  for (int64_t s = 0; s < g.slots() && s < L.slots; ++s) {
    const int64_t w = L.width[s];
    if (w == 0) continue;
    const W* bt = static_cast<const W*>(L.b) + s * L.stride * out;
    for (int64_t j = g.start[s]; j < g.start[s + 1]; ++j) {
      const int64_t r = g.rows[j];
      const float* tr = t + r * L.stride;
      float tb[kMaxLoraWidth];  // t_r times B's row scales (int8 slots)
      if (L.b_scale != nullptr) {
        for (int64_t k = 0; k < w; ++k) tb[k] = tr[k] * L.b_scale[s * L.stride + k];
        tr = tb;
      }
      float* yr = y + r * ys;
      int64_t o = o0;
      for (; o + kBlock <= o1; o += kBlock) {
        pvec acc[4];
        for (int q = 0; q < 4; ++q) acc[q] = pv_load(yr + o + q * kLanes);
        for (int64_t k = 0; k < w; ++k) {
          const pvec tk = pv_splat(tr[k]);
          const W* bk = bt + k * out + o;
          for (int q = 0; q < 4; ++q) acc[q] = pv_fma(tk, pv_load(bk + q * kLanes), acc[q]);
        }
        for (int q = 0; q < 4; ++q) pv_store(yr + o + q * kLanes, acc[q]);
      }
      for (; o + kLanes <= o1; o += kLanes) {  // then one vector at a time
        pvec acc = pv_load(yr + o);
        for (int64_t k = 0; k < w; ++k) acc = pv_fma(pv_splat(tr[k]), pv_load(bt + k * out + o), acc);
        pv_store(yr + o, acc);
      }
      for (; o < o1; ++o) {
        float acc = yr[o];
        for (int64_t k = 0; k < w; ++k) acc = std::fma(tr[k], kv_f(bt[k * out + o]), acc);
        yr[o] = acc;
      }
    }
  }
}

// y[0, n) += x[0, n).
static inline void add_rows_n(float* y, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) y[k] += x[k];
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

void decoder_run(const void* decoder, float* xp, int64_t rows, const int64_t* pos, const int64_t* slot_groups,
                 const int64_t* table_groups, int64_t reqs, int64_t width, const int64_t* table_of, int32_t prompt,
                 int threads, const int32_t* lora_slot) {
  const Decoder& dec = *static_cast<const Decoder*>(decoder);
  const DecoderSpec& s = dec.spec;
  const int64_t hidden = s.hidden, bs = s.block_size, hkv = s.kv_heads, d = s.head_dim, hq = s.q_heads;
  const int64_t inter = s.inter, qkv_out = (hq + 2 * hkv) * d, layers = s.num_layers, R = rows;
  const int64_t half = s.rot / 2, row = hkv * d, g = hq / hkv, pd = hq * (d + 2);
  const float sc = s.scale, ep = s.eps, rm = s.residual_mult;
  const int64_t up_out = s.plain_mlp ? inter : 2 * inter;  // gate_up's outputs
  const AllReduceFn reduce = s.all_reduce;
  const int nt = std::max(1, threads);
  const bool prompt_bf16 = prompt == 1;  // prompt rows whose quantized weights take bf16 inputs (2: int8)
  // Shared between the threads, per token: q|k|v, the attention output, SiLU-and-mul's output, gate|up, and every
  // thread's partial attention (max, sum, accumulator per head).
  // With parallel attention and MLP, the attention output waits in `ao` while the MLP runs.
  std::vector<float> shared(R * (qkv_out + hq * d + inter + 2 * inter) + nt * R * pd + (s.parallel ? R * hidden : 0));
  float* qkv = shared.data();
  float* att = qkv + R * qkv_out;
  float* act = att + R * hq * d;
  float* gu = act + R * inter;
  float* part = gu + R * 2 * inter;
  float* ao = part + nt * R * pd;

  int64_t moe_floats = 0;  // the MoE layers' shared scratch (moe_rows)
  for (const DecoderLayer& w : dec.layers)
    if (w.moe != nullptr) moe_floats = std::max(moe_floats, moe_shared_floats(*w.moe, R));
  float* moe_shared = scratch<float, 15>(moe_floats);  // the calling thread's, handed to the team
  const LoraGroups lora_groups(lora_slot, R);
  int64_t lora_width = 0;  // the widest slot of any linear
  if (lora_slot != nullptr)
    for (const DecoderLayer& w : dec.layers)
      for (const DecoderLora& L : w.lora) lora_width = std::max(lora_width, L.a != nullptr ? L.stride : 0);
  std::vector<float> lora_shared(R > kLoraShareRows ? R * lora_width : 0);

#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> mine(2 * R * hidden);
    float* res = mine.data();  // this thread's copy of the residual stream of every token
    float* h = res + R * hidden;
    std::vector<float> scores;
    // A row of a layer output as it joins the residual stream: itself, normalised by a post norm (Gemma, OLMo 2),
    // or times the residual multiplier (Granite), into this thread's scratch.
    std::vector<float> post(hidden);
    auto joining = [&](const float* x, const float* norm) -> const float* {
      if (norm != nullptr) {
        rms_row(post.data(), x, norm, hidden, ep);
        return post.data();
      }
      if (rm == 1.f) return x;
#pragma omp simd
      for (int64_t k = 0; k < hidden; ++k) post[k] = x[k] * rm;
      return post.data();
    };
    // out = the norm of x (RMSNorm, or LayerNorm with its bias; none: x itself); residual += x first in add_norm.
    auto norm_row = [&](float* out, const float* x, const float* w, const float* b) {
      if (w == nullptr) std::copy(x, x + hidden, out);
      else if (s.layer_norm) layer_norm_row(out, x, w, b, hidden, ep);
      else rms_row(out, x, w, hidden, ep);
    };
    auto add_norm = [&](float* out, float* residual, const float* x, const float* w, const float* b) {
#pragma omp simd
      for (int64_t k = 0; k < hidden; ++k) residual[k] += x[k];
      norm_row(out, residual, w, b);
    };
    std::vector<SpanJob> jobs(R);
    const int64_t tile_rows = prefill_tile_rows(), tasks = prompt ? (R + tile_rows - 1) / tile_rows * hq : 0;
    // This thread's quantized (or bf16) copy of the tokens' input to a quantized (bf16) layer.
    const int64_t widest = std::max({hidden, hq * d, inter});
    bool any_q = false, any_16 = false, any_32 = false;  // the copies only the layers' weight kinds need
    for (const DecoderLayer& w : dec.layers)
      for (const auto& [qw, w16] : {std::pair{&w.qkv_q, w.qkv16}, {&w.o_q, w.o16}, {&w.gate_up_q, w.gate_up16},
                                    {&w.down_q, w.down16}}) {
        any_q = any_q || qw->nseg > 0;
        any_16 = any_16 || (qw->nseg == 0 && w16 != nullptr);
        any_32 = any_32 || (qw->nseg == 0 && w16 == nullptr);
      }
    Q8Rows8 xq(any_q && !prompt_bf16 ? R : 0, widest);
    Bf16Rows xb(any_16 || (any_q && prompt_bf16) ? R : 0, widest);
    std::vector<float> xt(any_32 && R > 1 ? R * widest : 0);  // this thread's transposed copy, for float32 panels
    auto quantize = [&](const QMatrix& qw, const uint32_t* w16, const float* x, int64_t len) {
      if (qw.nseg > 0 && !prompt_bf16) xq.set(x, R, len);
      else if (qw.nseg > 0 || w16 != nullptr) xb.set(x, R, len);
    };
    auto linear = [&](const float* panels, const QMatrix& qw, const uint32_t* w16, const float* x, int64_t in,
                      const float* bias, float* y, int64_t ys, int64_t o0, int64_t o1) {
      linear_rows(panels, qw, w16, x, R, xq, xb, xt, bias, y, ys, o0, o1, in, prompt_bf16);
    };
    // LoRA adapters of the step's rows (lora_slot): the rows' shrunk inputs of the current linear. Up to
    // kLoraShareRows rows every thread shrinks every row into its own copy (cheaper than a barrier); more rows share
    // the work (rank columns dealt out in turn) and one copy, behind a barrier. Each value is the same dot product
    // either way, so a row's result does not depend on the others'.
    std::vector<float> lora_own(R <= kLoraShareRows ? R * lora_width : 0);
    float* lora_t = R <= kLoraShareRows ? lora_own.data() : lora_shared.data();
    auto lora = [&](const DecoderLora& L, const float* x, int64_t in, int64_t out, float* y, int64_t ys,
                    std::initializer_list<std::pair<int64_t, int64_t>> ranges) {
      if (lora_slot == nullptr || L.a == nullptr) return;
      const int part = R <= kLoraShareRows ? 0 : t, parts = R <= kLoraShareRows ? 1 : n;
      if (L.kind == PLK_BF16) lora_shrink<uint16_t>(L, x, in, lora_groups, lora_t, part, parts);
      else if (L.kind == PLK_INT8) lora_shrink<int8_t>(L, x, in, lora_groups, lora_t, part, parts);
      else lora_shrink<float>(L, x, in, lora_groups, lora_t, part, parts);
      if (parts > 1) {
#pragma omp barrier
      }
      for (const auto& [o0, o1] : ranges) {
        if (L.kind == PLK_BF16) lora_expand<uint16_t>(L, lora_t, out, lora_groups, y, ys, o0, o1);
        else if (L.kind == PLK_INT8) lora_expand<int8_t>(L, lora_t, out, lora_groups, y, ys, o0, o1);
        else lora_expand<float>(L, lora_t, out, lora_groups, y, ys, o0, o1);
      }
    };
    int64_t ha, hb, ia, ib, ra, rb, qa, qb;
    share(qkv_out / d, t, n, 1, ha, hb);  // heads of q|k|v
    share(inter, t, n, kPanel, ia, ib);
    share(hidden, t, n, kPanel, ra, rb);
    share(R * hq, t, n, 1, qa, qb);  // (token, query head) pairs to merge
    float* pm = part + t * R * pd;
    for (int64_t l = 0; l < layers; ++l) {
      const DecoderLayer& w = dec.layers[l];
      const int64_t* slots = slot_groups + w.group * R;  // the layer's KV cache group's slots and block tables
      const int64_t* tables = table_groups + w.group * reqs * width;
      const ScoreScale ss(sc, w.softcap, w.sinks);
      const float* post_mlp = l > 0 ? dec.layers[l - 1].post_mlp_norm : nullptr;
      for (int64_t r = 0; r < R; ++r) {
        if (l == 0) {
          std::copy(xp + r * hidden, xp + (r + 1) * hidden, res + r * hidden);
          norm_row(h + r * hidden, res + r * hidden, w.norm1, w.norm1_b);
        } else {
          if (s.parallel) add_rows_n(res + r * hidden, joining(ao + r * hidden, nullptr), hidden);  // its attention
          add_norm(h + r * hidden, res + r * hidden, joining(xp + r * hidden, post_mlp), w.norm1, w.norm1_b);
        }
      }
      quantize(w.qkv_q, w.qkv16, h, hidden);
      linear(w.qkv, w.qkv_q, w.qkv16, h, hidden, w.qkv_b, qkv, qkv_out, ha * d, hb * d);
      lora(w.lora[0], h, hidden, qkv_out, qkv, qkv_out, {{ha * d, hb * d}});
      const bool head_norms = !s.qk_norm_full;
      if (s.qk_norm_full) {  // OLMo 2: q and k each normalised whole (every head), each thread its rows
#pragma omp barrier
        for (int64_t r = t; r < R; r += n) {
          float* q = qkv + r * qkv_out;
          rms_row(q, q, w.q_norm, hq * d, ep);
          rms_row(q + hq * d, q + hq * d, w.k_norm, hkv * d, ep);
        }
#pragma omp barrier
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t hh = ha; hh < hb; ++hh) {
          float* v = qkv + r * qkv_out + hh * d;
          if (head_norms && hh < hq && w.q_norm != nullptr) rms_row(v, v, w.q_norm, d, ep);
          if (head_norms && hh >= hq && hh < hq + hkv && w.k_norm != nullptr) rms_row(v, v, w.k_norm, d, ep);
          if (w.clip_qkv > 0.f)
            for (int64_t k = 0; k < d; ++k) v[k] = std::min(std::max(v[k], -w.clip_qkv), w.clip_qkv);
          if (hh < hq + hkv) rotate_head(v, w.cos_sin + pos[r] * s.rot, half);
          if (hh >= hq) {  // a key or value head: to the cache
            const int64_t off = slots[r] * row + (hh - (hh >= hq + hkv ? hq + hkv : hq)) * d;
            void* cache = hh >= hq + hkv ? w.v_cache : w.k_cache;
            if (s.kv_dtype == PKV_BF16) bf16_round_row(static_cast<uint16_t*>(cache) + off, v, d);  // as torch rounds
            else std::copy(v, v + d, static_cast<float*>(cache) + off);
          }
        }
#pragma omp barrier
      if (prompt) {  // prompt rows: tiles of rows x query heads, dealt out in turn
        for (int64_t k = t; k < tasks; k += n) {
          const int64_t i0 = k / hq * tile_rows, hh = k % hq;
          prefill_rows_any(att + i0 * hq * d, hq * d, qkv + i0 * qkv_out, qkv_out, std::min(tile_rows, R - i0),
                           pos[0] + i0, w.window, hh, w.k_cache, w.v_cache, s.kv_dtype, tables + table_of[0] * width, bs, row,
                           g, d, ss, scores);
        }
      } else {
        for (int64_t r = 0; r < R; ++r) {  // token r attends to the context up to itself (or its window's part of
          int64_t a, b;                    // it): this thread's span of that
          const int64_t lo = w.window > 0 ? std::max<int64_t>(0, pos[r] + 1 - w.window) : 0;
          share(pos[r] + 1 - lo, t, n, 1, a, b);
          a += lo, b += lo;
          float* pr = pm + r * pd;
          jobs[r] = SpanJob{qkv + r * qkv_out, a, b, pr, pr + hq, pr + 2 * hq};
        }
        for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {  // each run of one request's rows over its block table
          for (r1 = r0 + 1; r1 < R && table_of[r1] == table_of[r0];) ++r1;
          attend_spans_any(jobs.data() + r0, r1 - r0, w.k_cache, w.v_cache, s.kv_dtype, tables + table_of[r0] * width,
                           bs, row, hq, g, d, ss, scores);
        }
#pragma omp barrier
        for (int64_t rr = qa; rr < qb; ++rr) {  // merge the threads' partial results of token r's query head
          const int64_t r = rr / hq, q = rr % hq;
          float mx = -std::numeric_limits<float>::infinity();
          for (int u = 0; u < n; ++u) mx = std::max(mx, part[(u * R + r) * pd + q]);
          float total = 0.f;
          float* o = att + r * hq * d + q * d;
          std::fill(o, o + d, 0.f);
          for (int u = 0; u < n; ++u) {
            const float* pu = part + (u * R + r) * pd;
            const float f = pu[hq + q] > 0.f ? expf(pu[q] - mx) : 0.f;
            total += f * pu[hq + q];
            const float* au = pu + 2 * hq + q * d;
#pragma omp simd
            for (int64_t k = 0; k < d; ++k) o[k] += f * au[k];
          }
          const float inv = ss.inv_sum(mx, total, q);
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) o[k] *= inv;
        }
      }
#pragma omp barrier
      quantize(w.o_q, w.o16, att, hq * d);
      float* y = s.parallel ? ao : xp;  // parallel: the attention output waits while the MLP runs on h
      linear(w.o, w.o_q, w.o16, att, hq * d, reduce ? nullptr : w.o_b, y, hidden, ra, rb);
      lora(w.lora[1], att, hq * d, hidden, y, hidden, {{ra, rb}});
#pragma omp barrier
      if (reduce != nullptr) {
        if (t == 0) reduce(y, R * hidden, s.reduce_ctx);
#pragma omp barrier
        for (int64_t r = 0; r < R; ++r) add_bias(y + r * hidden, w.o_b, ra, rb);  // each thread its rows; the
#pragma omp barrier                                                               // add_norm below reads all
      }
      if (!s.parallel)
        for (int64_t r = 0; r < R; ++r)
          add_norm(h + r * hidden, res + r * hidden, joining(xp + r * hidden, w.post_attn_norm), w.norm2, w.norm2_b);
      if (w.moe != nullptr) {  // the experts (moe.cpp): their own barriers, this thread's columns of xp at the end
        moe_rows(*w.moe, h, R, nullptr, prompt_bf16 ? 0 : 1, xp, moe_shared, t, n);
      } else {
      quantize(w.gate_up_q, w.gate_up16, h, hidden);
      linear(w.gate_up, w.gate_up_q, w.gate_up16, h, hidden, w.gate_up_b, gu, up_out, ia, ib);
      if (!s.plain_mlp)
        linear(w.gate_up, w.gate_up_q, w.gate_up16, h, hidden, w.gate_up_b, gu, up_out, inter + ia, inter + ib);
      if (s.plain_mlp) lora(w.lora[2], h, hidden, up_out, gu, up_out, {{ia, ib}});
      else lora(w.lora[2], h, hidden, up_out, gu, up_out, {{ia, ib}, {inter + ia, inter + ib}});
      for (int64_t r = 0; r < R; ++r) {
        const float* gr = gu + r * up_out;
        float* ar = act + r * inter;
        if (s.plain_mlp) {
#pragma omp simd
          for (int64_t k = ia; k < ib; ++k) ar[k] = gelu_tanh(gr[k]);
        } else if (s.act == PDA_GELU_TANH) {
#pragma omp simd
          for (int64_t k = ia; k < ib; ++k) ar[k] = gelu_tanh_mul(gr[k], gr[inter + k]);
        } else {
#pragma omp simd
          for (int64_t k = ia; k < ib; ++k) ar[k] = silu_mul(gr[k], gr[inter + k]);
        }
      }
#pragma omp barrier
      quantize(w.down_q, w.down16, act, inter);
      linear(w.down, w.down_q, w.down16, act, inter, reduce ? nullptr : w.down_b, xp, hidden, ra, rb);
      lora(w.lora[3], act, inter, hidden, xp, hidden, {{ra, rb}});
      }
#pragma omp barrier
      if (reduce != nullptr) {
        if (t == 0) reduce(xp, R * hidden, s.reduce_ctx);
#pragma omp barrier
        for (int64_t r = 0; r < R; ++r) add_bias(xp + r * hidden, w.down_b, ra, rb);
#pragma omp barrier
      }
    }
    if (t == 0) {
      const float* post_mlp = dec.layers[layers - 1].post_mlp_norm;
      for (int64_t r = 0; r < R; ++r) {
        if (s.parallel) add_rows_n(res + r * hidden, joining(ao + r * hidden, nullptr), hidden);
        add_norm(xp + r * hidden, res + r * hidden, joining(xp + r * hidden, post_mlp), s.final_norm, s.final_norm_b);
      }
    }
  }
}

}  // namespace pagedllm
