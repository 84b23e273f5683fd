// The fused experts of a mixture-of-experts MLP (MoeExperts in kernels.h): routing, every expert's gated MLP over the
// rows routed to it, and the weighted sum, in one parallel region.
//
// A step's (row, expert) pairs are sorted by expert (and, within an expert, int8 rows before panel rows), so each
// expert's rows are one contiguous group: its weights are read (or de-quantized) once for all of them, on the dense
// linears' paths (quant_gemv_rows on int8 copies of the inputs, quant_panel_rows_range on bf16 copies for prompt
// rows, bf16_gemm_range, panel_rows_range). At batch 1 a step reads only the chosen experts' bytes.
//
// The threads split every expert's outputs (the intermediate columns of gate|up, the hidden columns of down), so the
// work stays balanced however the rows are routed, and the whole layer costs three barriers: after routing, after
// the sort, after gate|up. Each thread then sums its own hidden columns of every row over the row's experts in
// ascending expert order, so the caller's next barrier finishes the layer.
//
// moe_rows runs inside a caller's parallel region (the fused decoder's); moe_forward is the ops table's entry for the
// layer-by-layer path, which opens its own region over tiles of rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "internal.h"
#include "simd.h"

namespace pagedllm {
namespace {

// Row r's top-k experts and weights from its logits l [E] (routing as MoeExperts says).
void route_row(const MoeExperts& m, const float* l, float* w, int64_t* ids) {
  const int64_t E = m.experts, k = m.top_k;
  // The k largest logits, descending (ties: the lower expert first, as torch.topk on the CPU).
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    ids[j] = best;
  }
  if (m.scoring == PMS_TOPK_SOFTMAX) {  // softmax over the chosen logits alone
    const float mx = l[ids[0]];
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += (w[j] = expf(l[ids[j]] - mx));
    for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    return;
  }
  // softmax over every expert, then the chosen ones' probabilities (renormalised where asked)
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += expf(l[e] - mx);
  for (int64_t j = 0; j < k; ++j) w[j] = expf(l[ids[j]] - mx) / sum;
  if (m.renorm) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) s += w[j];
    for (int64_t j = 0; j < k; ++j) w[j] /= s;
  }
}

inline float expert_act(const MoeExperts& m, float g, float u) {
  if (m.act == PMA_SWIGLU_CLAMP) {
    g = std::min(g, m.limit);
    u = std::min(std::max(u, -m.limit), m.limit);
    return (u + 1.f) * (g / (1.f + expf(-m.alpha * g)));
  }
  return silu_mul(g, u);
}

// This thread's copies of one group's input rows, in the form its weights' path reads.
struct GroupInput {
  int8_t* q = nullptr;
  float *d = nullptr, *s = nullptr;
  int32_t* s16 = nullptr;
  uint32_t* pairs = nullptr;
  float* xt = nullptr;  // transposed (float32 panels) or in pack_row_blocks' blocks (de-quantized float32 panels)
  float* t = nullptr;   // one panel's sums of every row
};

enum Path { kInt8, kQuantBf16, kQuantF32, kBf16, kF32 };

// x [rows, in] (rows contiguous) into this thread's inputs for `path`.
void prepare(Path path, const float* x, int64_t rows, int64_t in, GroupInput& g) {
  const int64_t nb = in / 32;
  switch (path) {
    case kInt8:
      g.q = scratch<int8_t, 10>(rows * in);
      g.d = scratch<float, 10>(rows * nb + 1);
      g.s = scratch<float, 11>(rows * nb + 1);
      g.s16 = scratch<int32_t, 10>(rows * 2 * nb + 2);
      for (int64_t r = 0; r < rows; ++r)
        quantize_input(x + r * in, in, g.q + r * in, g.d + r * nb, g.s + r * nb, g.s16 + r * 2 * nb);
      break;
    case kQuantBf16:
    case kBf16:
      g.pairs = scratch<uint32_t, 10>(rows * ((in + 1) / 2));
      bf16_pairs_blocked_serial(g.pairs, x, rows, in, scratch<uint16_t, 10>(in + 1));
      g.t = scratch<float, 12>(rows * kPanel);
      break;
    case kQuantF32:
      g.xt = scratch<float, 13>(rows * in);
      pack_row_blocks(x, rows, in, g.xt);
      g.t = scratch<float, 12>(std::max<int64_t>(rows, kPanelBlock) * kPanel);
      break;
    case kF32:
      g.xt = scratch<float, 13>(rows * in);
      if (rows == 1) std::copy(x, x + in, g.xt);
      else
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < in; ++i) g.xt[i * rows + r] = x[r * in + i];
      break;
  }
}

// Outputs [o0, o1) of expert e's W13 (which = 0) or W2 (which = 1) for `rows` prepared rows, into y (ldy apart).
void expert_linear(const MoeExperts& m, Path path, int64_t e, int which, const GroupInput& g, int64_t rows, float* y,
                   int64_t ldy, int64_t o0, int64_t o1) {
  const int64_t in = which == 0 ? m.hidden : m.inter;
  const float* bias = which == 0 ? (m.b13 ? m.b13 + e * 2 * m.inter : nullptr) : (m.b2 ? m.b2 + e * m.hidden : nullptr);
  switch (path) {
    case kInt8:
      quant_gemv_rows(which == 0 ? m.w13_q[e] : m.w2_q[e], g.q, g.d, g.s, g.s16, rows, bias, y, ldy, o0, o1);
      break;
    case kQuantBf16:
      quant_panel_rows_range(which == 0 ? m.w13_q[e] : m.w2_q[e], g.pairs, rows, bias, y, ldy, o0, o1, g.t);
      break;
    case kQuantF32:
      quant_f32_panel_rows_range(which == 0 ? m.w13_q[e] : m.w2_q[e], g.xt, rows, bias, y, ldy, o0, o1, g.t);
      break;
    case kBf16:
      bf16_gemm_range(which == 0 ? m.w13_16 + e * m.s13_16 : m.w2_16 + e * m.s2_16, g.pairs, rows, bias, y, ldy, o0,
                      o1, (in + 1) / 2, g.t);
      break;
    case kF32:
      panel_rows_range(which == 0 ? m.w13_f + e * m.s13_f : m.w2_f + e * m.s2_f, g.xt, rows, in, bias, y, ldy, o0, o1);
      break;
  }
}

}  // namespace

int64_t moe_shared_floats(const MoeExperts& m, int64_t rows) {
  const int64_t a = rows * m.top_k;
  // logits, weights, ids, sorted order, slot of each pair, group bounds (as floats' worth of int64s), gate|up,
  // activations, expert outputs
  return rows * m.experts + a + 1 + 2 * (3 * a + 2 * m.experts + 2) + a * 3 * m.inter + a * m.hidden;
}

void moe_rows(const MoeExperts& m, const float* x, int64_t R, const uint8_t* int8_rows, int32_t int8, float* y,
              float* shared, int t, int n) {
  const int64_t E = m.experts, k = m.top_k, H = m.hidden, I = m.inter, A = R * k;
  float* logits = shared;
  float* wts = logits + R * E;
  const int64_t off = R * E + A;
  int64_t* ids = reinterpret_cast<int64_t*>(shared + off + (off & 1));  // 8-byte aligned
  int64_t* order = ids + A;      // pair indices (r * k + j), sorted by expert, then kind, then row
  int64_t* pos = order + A;      // pair a's place in `order`
  int64_t* groups = pos + A;     // group g: its pairs order[groups[2g] .. groups[2g + 2]); kind by groups[2g + 1]
  float* gu = reinterpret_cast<float*>(groups + 2 * E + 2);
  float* act = gu + A * 2 * I;
  float* ye = act + A * I;
  // Routing: each thread its rows.
  for (int64_t r = t; r < R; r += n) {
    float* l = logits + r * E;
    gemv_panels(m.router, x + r * H, m.router_b, l, 0, E, H);
    route_row(m, l, wts + r * k, ids + r * k);
  }
#pragma omp barrier
  const bool quant = m.w13_q != nullptr;
  // float or bf16 experts take every row alike: one group an expert (the kinds split quantized experts only)
  auto is_int8 = [&](int64_t r) { return !quant || (int8_rows ? int8_rows[r] != 0 : int8 != 0); };
  if (t == 0) {  // counting sort of the pairs by (expert, kind): groups[2e] int8 rows' start, groups[2e + 1] others'
    std::fill(groups, groups + 2 * E + 1, 0);
    for (int64_t a = 0; a < A; ++a) ++groups[2 * ids[a] + (is_int8(a / k) ? 0 : 1) + 1];
    for (int64_t b = 1; b <= 2 * E; ++b) groups[b] += groups[b - 1];
    std::vector<int64_t> fill(groups, groups + 2 * E);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t b = 2 * ids[a] + (is_int8(a / k) ? 0 : 1);
      pos[a] = fill[b];
      order[fill[b]++] = a;
    }
  }
#pragma omp barrier
  const bool bf16 = bf16_native();
  auto path_of = [&](int64_t b) -> Path {  // group b = 2 e + kind
    if (!quant) return m.w13_16 != nullptr ? kBf16 : kF32;
    if (b % 2 == 0) return kInt8;
    return bf16 ? kQuantBf16 : kQuantF32;
  };
  GroupInput g;
  float* rows_in = scratch<float, 14>(R * std::max(H, I));  // one group's gathered input rows
  int64_t ia, ib, ra, rb;
  share(I, t, n, kPanel, ia, ib);
  share(H, t, n, kPanel, ra, rb);
  // The int8 rows' copies, each row quantized once (every group it joins gathers them): q, d, s, s16 per row.
  const int64_t nb = H / 32;
  GroupInput all;
  bool any_int8 = false;
  for (int64_t b = 0; b < 2 * E && quant && ia < ib; b += 2) any_int8 = any_int8 || groups[b + 1] > groups[b];
  if (any_int8) {
    all.q = scratch<int8_t, 16>(R * H);
    all.d = scratch<float, 16>(R * nb + 1);
    all.s = scratch<float, 17>(R * nb + 1);
    all.s16 = scratch<int32_t, 16>(R * 2 * nb + 2);
    for (int64_t r = 0; r < R; ++r)
      if (is_int8(r)) quantize_input(x + r * H, H, all.q + r * H, all.d + r * nb, all.s + r * nb, all.s16 + r * 2 * nb);
  }
  // gate|up and the activation: this thread's intermediate columns of every group.
  for (int64_t b = 0; b < 2 * E && ia < ib; ++b) {
    const int64_t b0 = groups[b], b1 = groups[b + 1], rows = b1 - b0, e = b / 2;
    if (rows == 0) continue;
    const Path path = path_of(b);
    if (path == kInt8) {  // gathered from the rows' quantized copies
      g.q = scratch<int8_t, 10>(rows * H);
      g.d = scratch<float, 10>(rows * nb + 1);
      g.s = scratch<float, 11>(rows * nb + 1);
      g.s16 = scratch<int32_t, 10>(rows * 2 * nb + 2);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = order[b0 + i] / k;
        std::copy(all.q + r * H, all.q + (r + 1) * H, g.q + i * H);
        std::copy(all.d + r * nb, all.d + (r + 1) * nb, g.d + i * nb);
        std::copy(all.s + r * nb, all.s + (r + 1) * nb, g.s + i * nb);
        std::copy(all.s16 + r * 2 * nb, all.s16 + (r + 1) * 2 * nb, g.s16 + i * 2 * nb);
      }
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = x + order[b0 + i] / k * H;
        std::copy(src, src + H, rows_in + i * H);
      }
      prepare(path, rows_in, rows, H, g);
    }
    float* gb = gu + b0 * 2 * I;
    expert_linear(m, path, e, 0, g, rows, gb, 2 * I, ia, ib);
    expert_linear(m, path, e, 0, g, rows, gb, 2 * I, I + ia, I + ib);
    for (int64_t i = 0; i < rows; ++i) {
      const float* gr = gb + i * 2 * I;
      float* ar = act + (b0 + i) * I;
      for (int64_t c = ia; c < ib; ++c) ar[c] = expert_act(m, gr[c], gr[I + c]);
    }
  }
#pragma omp barrier
  // down: this thread's hidden columns of every group (its activation rows are contiguous).
  for (int64_t b = 0; b < 2 * E && ra < rb; ++b) {
    const int64_t b0 = groups[b], b1 = groups[b + 1], rows = b1 - b0;
    if (rows == 0) continue;
    const Path path = path_of(b);
    prepare(path, act + b0 * I, rows, I, g);
    expert_linear(m, path, b / 2, 1, g, rows, ye + b0 * H, H, ra, rb);
  }
  // The weighted sum of this thread's columns, each row's experts in ascending order.
  for (int64_t r = 0; r < R; ++r) {
    float* yr = y + r * H;
    std::fill(yr + ra, yr + rb, 0.f);
    int64_t done = -1;  // the last expert added
    for (int64_t j = 0; j < k; ++j) {
      int64_t next = -1;  // the lowest expert above `done` among the row's
      for (int64_t i = 0; i < k; ++i)
        if (ids[r * k + i] > done && (next < 0 || ids[r * k + i] < ids[r * k + next])) next = i;
      done = ids[r * k + next];
      const float wj = wts[r * k + next];
      const float* src = ye + pos[r * k + next] * H;
#pragma omp simd
      for (int64_t c = ra; c < rb; ++c) yr[c] += wj * src[c];
    }
  }
}

void moe_forward(float* y, const float* x, const MoeExperts* mp, int64_t rows, const uint8_t* int8_rows,
                 int32_t int8, int threads) {
  const MoeExperts& m = *mp;
  constexpr int64_t kTile = 256;  // rows per pass: bounds the scratch (gate|up of every pair) for long prompts
  const int64_t tile = std::min(rows, kTile);
  float* shared = scratch<float, 15>(moe_shared_floats(m, tile));  // the calling thread's, handed to the team
  const int nt = std::max(1, threads);
  for (int64_t r0 = 0; r0 < rows; r0 += tile) {
    const int64_t R = std::min(tile, rows - r0);
#pragma omp parallel num_threads(nt)
    moe_rows(m, x + r0 * m.hidden, R, int8_rows ? int8_rows + r0 : nullptr, int8, y + r0 * m.hidden, shared,
             omp_get_thread_num(), omp_get_num_threads());
  }
}

}  // namespace pagedllm
