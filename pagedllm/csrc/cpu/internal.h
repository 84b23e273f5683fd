// Functions one kernel source of an ISA build calls in another (the fused decoder reuses the attention span and the
// panel GEMV). Internal to the library: hidden like everything but the ops table.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace pagedllm {

// The calling thread's scratch buffer number Tag of at least n elements, reused by its later calls: grown when
// needed (then zeroed once by the vector), never cleared again, so its contents are whatever the last user left.
// Per-call std::vectors of a few MB had the kernels spend ~3% of a batched run clearing memory they overwrite.
template <typename T, int Tag>
T* scratch(std::size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Rows of a GEMM whose inputs pass twice this many bytes (a prompt chunk of several hundred tokens on) go in blocks
// of about this size, each passed by every panel of the weight while it stays in L2, instead of every panel
// streaming all the rows from L3 (quant.cpp quant_linear_panels, bf16.cpp bf16_panel_linear).
constexpr int64_t kRowBlockBytes = int64_t{768} << 10;

// The rows of one block for `rows` rows of `row_bytes` inputs each, in whole units of `unit` rows: all of them up to
// two blocks' worth (their inputs then still mostly in L2: a 512-row block ran ~1.5x as fast as 432 + 80 rows), else
// blocks of about kRowBlockBytes, evened out.
inline int64_t row_block(int64_t rows, int64_t row_bytes, int64_t unit) {
  const int64_t most = std::max<int64_t>(32, kRowBlockBytes / row_bytes / 32 * 32);
  const int64_t blocks = rows > 2 * most ? (rows + most - 1) / most : 1;
  const int64_t per = (rows + blocks - 1) / blocks;
  return (per + unit - 1) / unit * unit;
}

// The attention scale and, for soft-capped attention logits (Gemma 2), the cap: a score s = q.k * scale becomes
// cap * tanh(s / cap) before the softmax (cap 0: none), as transformers computes it. It converts to the scale where
// only that is needed (queries pre-scaled, products scaled).
// Attention sinks (gpt-oss): one learned logit per query head that joins each row's softmax denominator without a
// value, sinks[h] for head h (null: none); inv_sum gives the factor that turns a row's accumulator into its output.
struct ScoreScale {
  float scale, cap;
  const float* sinks = nullptr;
  ScoreScale(float s, float c = 0.f, const float* k = nullptr) : scale(s), cap(c), sinks(k) {}  // NOLINT: a plain scale converts implicitly
  // 1 / l without a sink; with one (head h), the output acc * exp(m - top) / (l exp(m - top) + exp(sink - top)),
  // top = max(m, sink): m and l are the row's score max and its sum of exp(score - m).
  float inv_sum(float m, float l, int64_t h) const {
    if (sinks == nullptr) return 1.f / l;
    const float s = sinks[h], top = std::max(m, s), a = expf(m - top);
    return a / (l * a + expf(s - top));
  }
  operator float() const { return scale; }                    // NOLINT
  // s[0, n) soft-capped in place (before any masking: -inf must stay -inf).
  // tanh(z) as 1 - 2 / (e^2z + 1), vectorised through expf (scalar std::tanh cost Gemma 2's decode ~10%); its
  // absolute error (~1e-7, times the cap) is far below what moves a softmax. exp overflows to inf for large z: 1.
  void cap_scores(float* s, int64_t n) const {
    if (cap <= 0.f) return;
    const float inv2 = 2.f / cap, c = cap;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] = c * (1.f - 2.f / (expf(s[i] * inv2) + 1.f));
  }
  float capped(float v) const { return cap > 0.f ? cap * (1.f - 2.f / (expf(v * 2.f / cap) + 1.f)) : v; }
};

// Single-query attention of `hq` consecutive query heads q [hq, d] over the tokens [l0, l1) of one paged context:
// query head r reads KV head r / g counted from kc and vc (which may point past a token row's start, to skip KV
// heads); a cached token is `row` elements of kv_dtype (PagedllmKvDtype), read once for every head. The result is
// flash-decoding's unnormalised partial result, per head: its score max m[r], its sum of exp lsum[r] and acc[r] =
// sum of exp(score - m[r]) * value. An empty span gives m = -inf, lsum = 0, acc = 0.
void attend_span_any(float* m, float* lsum, float* acc, const float* q, const void* kc, const void* vc,
                     int32_t kv_dtype, const int64_t* table, int64_t l0, int64_t l1, int64_t bs, int64_t row,
                     int64_t hq, int64_t g, int64_t d, ScoreScale sc, std::vector<float>& scores);

// attend_span_any for R query tokens of one context at once: token j's hq heads q, its span [l0, l1), where its m,
// lsum and acc go. Each token's results are bit for bit what attend_span_any gives it alone; a cached token row that
// several spans cover is read from memory once for all of them.
struct SpanJob {
  const float* q;
  int64_t l0, l1;
  float *m, *lsum, *acc;
};
void attend_spans_any(const SpanJob* jobs, int64_t R, const void* kc, const void* vc, int32_t kv_dtype,
                      const int64_t* table, int64_t bs, int64_t row, int64_t hq, int64_t g, int64_t d, ScoreScale sc,
                      std::vector<float>& scores);

// Query head h of up to prefill_tile_rows() consecutive prompt tokens of one request (the first at position p0, token
// i attending [0, p0 + i], or its last `window` tokens when window > 0, its keys and values already cached):
// paged_prefill's arithmetic, row for row (a row's result depends on its query and its context alone). Token i's
// q|k|v row at q + i * qstride, its attention output at out + i * ostride + h * d. scratch: the caller's, any size.
void prefill_rows_any(float* out, int64_t ostride, const float* q, int64_t qstride, int64_t n, int64_t p0,
                      int64_t window, int64_t h, const void* kc, const void* vc, int32_t kv_dtype, const int64_t* table, int64_t bs, int64_t row,
                      int64_t g, int64_t d, ScoreScale sc, std::vector<float>& scratch);
int64_t prefill_tile_rows();

// y[o] for outputs [o0, o1) of one input row x [in] from W's panels (any alignment: a panel shared with a
// neighbouring range is read whole and written in part); bias may be null.
void gemv_panels(const float* wp, const float* x, const float* bias, float* y, int64_t o0, int64_t o1, int64_t in);

// y[m][o] for outputs [o0, o1) (any alignment) of `rows` input rows, given transposed (xt[i * rows + m]; for one row
// that is the row itself), from W's panels: over each panel, the rows in near-equal blocks of at most kPanelBlock
// (the panel read from memory once, from cache by the other blocks). A row's sums run over the inputs in order in
// one accumulator pair, whatever its block, so its outputs do not depend on the other rows (gemv_panels sums in
// another order).
void panel_rows_range(const float* wp, const float* xt, int64_t rows, int64_t in, const float* bias, float* y,
                      int64_t ys, int64_t o0, int64_t o1);

// Input rows up to which quant_linear runs on int8 products without its `int8` flag (beyond: de-quantized panels).
// With AVX512-BF16 the de-quantized bf16 panels overtake the int8 products of weights as stored from about 5 rows
// (~400 against ~80 GFLOP/s on Zen 4, with a de-quantization per call that costs about as much as 4 rows of int8
// products); on float32 panels from about 32. (Packed weights run int8 products at ~480 GFLOP/s, but prompt tokens
// keep the panels for their precision: quant.cpp.)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int64_t kQuantDotMaxRows = 4;
#else
constexpr int64_t kQuantDotMaxRows = 32;
#endif
int64_t quant_dot_max_rows();

// Quantized weights (quant.cpp): an input row x [in] (in a multiple of 32) to int8 blocks of 32 (q [in]; d, s
// [in / 32]: each block's scale and scale times the sum of its q; s16 [in / 16]: the sums of q over 16); then outputs
// [o0, o1) of `rows` such rows on W (row m: q + m * in, d and s + m * in / 32, s16 + m * in / 16; its outputs at
// y + m * ldy), each row's as it would be alone (a weight row is decoded once for up to four input rows, whose sums
// are kept apart in the same order).
void quantize_input(const float* x, int64_t in, int8_t* q, float* d, float* s, int32_t* s16);
void quant_gemv_rows(const QMatrix& w, const int8_t* q, const float* d, const float* s, const int32_t* s16,
                     int64_t rows, const float* bias, float* y, int64_t ldy, int64_t o0, int64_t o1);
// Outputs [o0, o1) of `rows` input rows on W's de-quantized bf16 panels (xt: the rows' bf16 pairs as
// bf16_pairs_blocked lays them out), into y (row m at y + m * ldy): the sums quant_linear's panels give each row (the
// path of prompt rows) whatever the number of rows; t: scratch of rows * kPanel floats. Builds with AVX512-BF16
// only (elsewhere prompt rows run on float32 panels).
void quant_panel_rows_range(const QMatrix& w, const uint32_t* xt, int64_t rows, const float* bias, float* y,
                            int64_t ldy, int64_t o0, int64_t o1, float* t);

// quant_panel_rows_range on float32 panels (builds without AVX512-BF16): xb the rows in pack_row_blocks' blocks; t
// scratch of max(rows, kPanelBlock) * kPanel floats; the sums quant_linear's float32 panels give each row.
void quant_f32_panel_rows_range(const QMatrix& w, const float* xb, int64_t rows, const float* bias, float* y,
                                int64_t ldy, int64_t o0, int64_t o1, float* t);

// The MoE MLP of R rows x [R, hidden] into y (moe.cpp), called by every thread of an enclosing parallel region (t of
// n); it meets the others at three barriers and returns with its own share of y's columns written (the caller's
// next barrier completes y). shared: moe_shared_floats(m, R) floats, the same for every thread.
int64_t moe_shared_floats(const MoeExperts& m, int64_t rows);
void moe_rows(const MoeExperts& m, const float* x, int64_t R, const uint8_t* int8_rows, int32_t int8, float* y,
              float* shared, int t, int n);

// Rows of x [mb, in] in blocks of kPanelBlock (the last one shorter), each block of n rows transposed: row m0 + m's
// input i at xb[m0 * in + i * n + m].
void pack_row_blocks(const float* x, int64_t mb, int64_t in, float* xb);
// One panel (kPanel outputs of a weight, [in, kPanel]) against mb input rows in pack_row_blocks' layout: row m's
// outputs [0, nout) go to y + m * ys (bias added when given); acc: scratch of mb * kPanel floats. The panel is
// read in slices that stay in L1 for all the rows; each output's sum still runs over the inputs in order, so a
// row's result is the same whatever the other rows.
void panel_block(const float* panel, const float* xb, int64_t mb, int64_t in, float* y, int64_t ys, const float* bias,
                 int64_t nout, float* acc);

// bfloat16 (bf16.cpp): round-to-nearest-even of one float; a row of n floats to bf16; one bf16 pair panel (kPanel
// outputs, ceil(in / 2) pairs) from nout float32 rows `ld` apart (zero past them); input rows [rows, in] to bf16
// pairs in the blocks bf16_panel_block reads (rows in near-equal blocks of at most its block size, rows [m0, m1) at
// xt + m0 * in2 interleaved pair by pair: xt[m0 * in2 + i2 * (m1 - m0) + m - m0]; one row is its plain pairs); and
// one panel against mb such rows (row m's outputs [0, nout) to y + m * ys).
uint16_t to_bf16(float f);
void bf16_round_row(uint16_t* dst, const float* x, int64_t n);
void bf16_panel_from_rows(uint32_t* panel, const float* rows, int64_t ld, int64_t nout, int64_t in);
void bf16_pairs_blocked(uint32_t* xt, const float* x, int64_t rows, int64_t in, int threads);
// The same by the calling thread alone, with scratch [in + 1] (unused for one row, rounded in place).
void bf16_pairs_blocked_serial(uint32_t* xt, const float* x, int64_t rows, int64_t in, uint16_t* scratch);
void bf16_panel_block(const uint32_t* panel, const uint32_t* xt, int64_t mb, int64_t in2, float* y, int64_t ys,
                      const float* bias, int64_t nout);
bool bf16_native();
// AMX for bf16 panels (bf16.cpp): mode 0 turns it off, 1 on where the CPU and the OS have it (and PAGEDLLM_AMX is
// not 0), -1 asks; returns whether it is on. While on, bf16_pairs_blocked(_serial) write rows of a multiple of 32
// inputs as plain pairs (row m at xt + m * in2) and bf16_panel_block multiplies them on the tiles.
int32_t bf16_amx(int32_t mode);
// Whether rows of in2 input pairs run on AMX now (then as plain pairs, 32 rows at a time): in2 a multiple of 16.
bool bf16_amx_rows(int64_t in2);
// An AMX tile configuration (LDTILECFG's 64 bytes, palette 1): tile t holds rows[t] rows of colsb[t] bytes.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// Whether AMX is on (bf16_amx) and the CPU has its int8 products too: quant.cpp then runs 16 int8 input rows at a
// time on the tiles against packed Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 groups, the same sums as its VNNI kernels.
bool amx_int8_on();
// Outputs [o0, o1) of `rows` input rows, their bf16 pairs xt as bf16_pairs_blocked lays them out (one row: its plain
// pairs), from W's bf16 panels into y (row m at y + m * ldy): the same sums as bf16_panel_linear's for each row
// whatever the number of rows; bias may be null; t: scratch of rows * kPanel floats.
void bf16_gemm_range(const uint32_t* wp, const uint32_t* xt, int64_t rows, const float* bias, float* y, int64_t ldy,
                     int64_t o0, int64_t o1, int64_t in2, float* t);

// The ops table's entries, one per kernel family source (attention.cpp, elementwise.cpp, linear.cpp, decoder.cpp,
// quant.cpp, bf16.cpp, sampling.cpp).
void paged_decode(const PagedDecodeArgs* args);
void paged_prefill(const PagedPrefillArgs* args);
void silu_and_mul(float* out, const float* x, int64_t rows, int64_t inner, int threads);
void rms_norm(float* out, const float* x, const float* w, int64_t rows, int64_t h, float eps, int threads);
void fused_add_rms_norm(float* x, float* residual, const float* w, int64_t rows, int64_t h, float eps, int threads);
void gelu_tanh(float* out, const float* x, int64_t rows, int64_t inner, int gated, int threads);
void layer_norm(float* out, const float* x, const float* w, const float* b, int64_t rows, int64_t h, float eps,
                int threads);
void fused_add_layer_norm(float* x, float* residual, const float* w, const float* b, int64_t rows, int64_t h,
                          float eps, int threads);
void rotary(float* x, const int64_t* positions, const float* cache, int64_t rows, int64_t h, int64_t d, int64_t heads,
            int64_t rot, int threads);
void pack_panels(float* dst, const float* w, int64_t out, int64_t in, int threads);
void panel_linear(float* y, const float* x, const float* panels, const float* bias, int64_t rows, int64_t in,
                  int64_t out, int threads);
void* decoder_create(const DecoderSpec* spec);
void decoder_run(const void* decoder, float* x, int64_t rows, const int64_t* pos, const int64_t* slots,
                 const int64_t* tables, int64_t reqs, int64_t width, const int64_t* table_of, int32_t prompt,
                 int threads, const int32_t* lora_slot);
void decoder_destroy(void* decoder);
int64_t quant_row_bytes(int32_t type, int64_t in);
int64_t quant_pack(uint8_t* data, int32_t type, int64_t rows, int64_t in);
void quant_linear(float* y, const float* x, const QMatrix* w, const float* bias, int64_t rows, int32_t int8,
                  int threads);
void quant_dequantize_rows(float* out, const QMatrix* w, const int64_t* ids, int64_t n, int threads);
void moe_forward(float* y, const float* x, const MoeExperts* m, int64_t rows, const uint8_t* int8_rows, int32_t int8,
                 int threads);
void bf16_pack_panels(uint32_t* dst, const float* w, int64_t out, int64_t in, int threads);
void bf16_panel_linear(float* y, const float* x, const uint32_t* panels, const float* bias, int64_t rows, int64_t in,
                       int64_t out, int threads);
int32_t bf16_has_native();
void sample_inverse(const float* probs, const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads);
void top_k_mask(float* logits, const int64_t* k, int64_t rows, int64_t vocab, int threads);
void top_p_mask(float* logits, const float* probs, const float* p, int64_t rows, int64_t vocab, int threads);
void encoder_attention(float* out, const float* qkv, const int64_t* starts, int64_t nseq, int64_t heads, int64_t dim,
                       float scale, int threads);
void sample_rows(const float* logits, const float* temperature, const int64_t* k, const float* p, const float* min_p,
                 const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads);

}  // namespace pagedllm
