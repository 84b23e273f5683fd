// The interface between the torch bindings (bindings.cpp) and one ISA build of the kernels.
//
// Every kernel source is compiled once per instruction set (generic, avx2, avx512: see setup.py) into its own shared
// library, which exports one symbol, `pagedllm_cpu_ops`, returning the table below. The bindings open the library of
// the ISA picked at run time and call through the table. The kernels see raw pointers and sizes only: no torch, no
// Python. The bindings check shapes, dtypes and index ranges before calling; the kernels assume valid input.
//
// Why one library per ISA rather than one library with three namespaces: the C++ standard library's templates
// (std::vector, std::sort, ...) instantiated in an AVX-512 object are weak symbols, and the linker would keep one
// copy for the whole library, possibly the AVX-512 one, which the AVX2 path would then call on a CPU without
// AVX-512. Separate libraries, hidden visibility and -Bsymbolic keep each build's copies its own.
#pragma once

#include <cstdint>

extern "C" {

// Bumped whenever this table or an argument struct changes: the bindings refuse a library of another version.
#define PAGEDLLM_CPU_ABI 20

// The element type of a KV cache: float32, or bfloat16 (the upper half of a float32, rounded to nearest even when
// written; read by widening, so attention still sums in float32).
enum PagedllmKvDtype { PKV_F32 = 0, PKV_BF16 = 1 };

// A paged KV cache of one layer: keys and values [num_blocks, block_size, kv_heads, head_dim], contiguous, of
// kv_dtype elements.
struct PagedCache {
  const void* k;
  const void* v;
  int64_t num_blocks, block_size, kv_heads, head_dim;
  int32_t kv_dtype;
};

// Single-query attention of n requests: out, q [n, q_heads, head_dim] contiguous; request i attends the first
// seq_lens[i] tokens of its context, whose blocks are block_table[i * table_width ...]; with a sliding window
// (window > 0) only the last `window` of them (a query at position p sees the keys at p - window + 1 .. p).
struct PagedDecodeArgs {
  float* out;
  const float* q;
  PagedCache cache;
  const int64_t* block_table;
  const int64_t* seq_lens;
  int64_t n, q_heads, table_width, window;
  float scale;
  int threads;
  float softcap;  // > 0: each score s (scaled) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)
  const float* sinks;  // [q_heads]: each head's sink logit in its softmax's denominator (gpt-oss); null: none
};

// Causal attention of each segment's query rows over its context and itself: segments[3 s .. 3 s + 2] = query start,
// query length, context length; q rows are q_stride floats apart (heads contiguous within a row), out [tokens,
// q_heads, head_dim] contiguous; rows outside every segment are left untouched. window > 0: each row sees only the
// last `window` tokens up to itself, as in PagedDecodeArgs.
struct PagedPrefillArgs {
  float* out;
  const float* q;
  int64_t q_stride, tokens, q_heads;
  PagedCache cache;
  const int64_t* tables;
  const int64_t* segments;
  int64_t num_segments, table_width, window;
  float scale;
  int threads;
  float softcap;  // as PagedDecodeArgs
  const float* sinks;  // as PagedDecodeArgs
};

// GGML block-quantized weights as the GGUF file stores them (the values are GGML's type ids). A row of `in` weights
// is in / B blocks of the type's bytes (B = 32, or 256 for the K types), rows back to back.
enum PagedllmQuantType {
  PQ_Q4_0 = 2,
  PQ_Q4_1 = 3,
  PQ_Q5_0 = 6,
  PQ_Q5_1 = 7,
  PQ_Q8_0 = 8,
  PQ_Q2_K = 10,
  PQ_Q3_K = 11,
  PQ_Q4_K = 12,
  PQ_Q5_K = 13,
  PQ_Q6_K = 14,
  PQ_IQ4_NL = 20,
  PQ_IQ4_XS = 23,
  PQ_MXFP4 = 39,  // OCP microscaling FP4 (gpt-oss experts): an E8M0 scale byte, 32 E2M1 nibbles as IQ4_NL's
};

// `rows` consecutive output rows of one type; the first `packed` of them (a multiple of 16, see quant_pack) in the
// kernels' interleaved layout, the rest as the GGUF file stores them.
struct QSegment {
  const uint8_t* data;
  int64_t rows;
  int32_t type;
  int64_t packed;
};

#define PAGEDLLM_MAX_QSEGMENTS 4

// A quantized weight W [out, in]: its rows in up to four segments, in order (a merged q|k|v may mix types); nseg 0
// means no quantized weight.
struct QMatrix {
  QSegment seg[PAGEDLLM_MAX_QSEGMENTS];
  int32_t nseg;
  int64_t out, in;
};

// A mixture-of-experts MLP (moe.cpp). The router (float32 panels of [experts, hidden], pack_panels, and an optional
// bias) scores each row; `scoring` picks its top_k experts and their weights:
//   PMS_SOFTMAX_TOPK: softmax over all experts' logits (float32), the top_k largest; with `renorm` divided by their
//                     sum (Mixtral, Qwen3-MoE, OLMoE);
//   PMS_TOPK_SOFTMAX: the top_k logits, softmax over them alone (gpt-oss).
// Expert e is a gated MLP: g|u = x W13_e^T (+ b13_e) with W13_e [2 inter, hidden] (gate rows, then up rows), then
//   PMA_SILU:         a = silu(g) * u
//   PMA_SWIGLU_CLAMP: g = min(g, limit), u = clamp(u, -limit, limit), a = (u + 1) * g * sigmoid(alpha g) (gpt-oss)
// and its output a W2_e^T (+ b2_e), W2_e [hidden, inter]. A row's output is the sum of its experts' outputs times
// their weights, added in ascending expert order (as transformers' eager loop adds them). All experts' weights are
// of one kind: quantized (w13_q[e], w2_q[e]), bf16 pair panels (bf16_pack_panels, expert e at w13_16 + e * s13_16
// uint32s, w2_16 + e * s2_16), or float32 panels (w13_f + e * s13_f floats, w2_f + e * s2_f). Under tensor
// parallelism `inter` is this rank's share of every expert's intermediate dimension and the output a partial sum.
enum PagedllmMoeScoring { PMS_SOFTMAX_TOPK = 0, PMS_TOPK_SOFTMAX = 1 };
enum PagedllmMoeAct { PMA_SILU = 0, PMA_SWIGLU_CLAMP = 1 };

struct MoeExperts {
  int64_t experts, top_k, hidden, inter;
  int32_t scoring, renorm, act;
  float alpha, limit;
  const float *router, *router_b;
  const QMatrix *w13_q, *w2_q;
  const uint32_t *w13_16, *w2_16;
  int64_t s13_16, s2_16;
  const float *w13_f, *w2_f;
  int64_t s13_f, s2_f;
  const float *b13, *b2;  // [experts, 2 inter], [experts, hidden]; null: none
};

// One decoder layer's weights for the fused decoder; linear weights as panels (see pack_panels), or quantized where
// the layer's QMatrix has segments, or in bf16 pair panels where its *16 pointer is set (bf16_pack_panels; the
// float32 panel pointer is then unused); a null bias or q/k norm means none.
// post_attn_norm and post_mlp_norm (Gemma's norms of the attention and MLP outputs before they join the residual
// stream) are null for Llama-shaped layers.
// One linear layer's LoRA adapter slots (pagedllm/lora/layers.py LoRASlots): slot s holds A [W, in] at a + s W in
// and B transposed, [W, out], at b + s W out; their first width[s] rows are the adapter's (0: an empty slot). A row
// with slot s gets y += B_s (A_s x) after the layer's own product. a == null: the layer takes no adapter.
enum PagedllmLoraKind { PLK_F32 = 0, PLK_BF16 = 1, PLK_INT8 = 2 };
struct DecoderLora {
  const void* a;         // of `kind`: float32, bfloat16 (uint16_t) or int8
  const void* b;
  const int32_t* width;  // [slots]
  int64_t stride;        // W
  int64_t slots;
  int32_t kind;          // PagedllmLoraKind; the sums stay float32
  const float* a_scale;  // PLK_INT8: [slots, W], each row of A is a_scale times its int8 values; else null
  const float* b_scale;  // PLK_INT8: [slots, W], each row of B^T likewise
};

struct DecoderLayer {
  const float *norm1, *qkv, *qkv_b, *q_norm, *k_norm, *o, *o_b, *norm2, *gate_up, *gate_up_b, *down, *down_b;
  const float *post_attn_norm, *post_mlp_norm;
  QMatrix qkv_q, o_q, gate_up_q, down_q;
  const uint32_t *qkv16, *o16, *gate_up16, *down16;
  const float* cos_sin;  // [max_position, rot]: cos | sin
  void *k_cache, *v_cache;  // of the spec's kv_dtype
  int64_t window;           // sliding-window attention over the last `window` tokens; 0: the whole context
  int64_t group;            // the KV cache group whose slots and block tables the layer reads (see decoder_run)
  float softcap;            // attention-logit soft-capping (as PagedDecodeArgs); 0: none
  const float *norm1_b, *norm2_b;  // LayerNorm biases (DecoderSpec::layer_norm; null: none)
  const MoeExperts* moe;           // a mixture-of-experts MLP (its gate_up and down unused); null: the dense MLP
  float clip_qkv;                  // > 0: q, k (after their norms) and v clamped to +-clip_qkv (OLMoE); 0: none
  const float* sinks;              // [q_heads] attention sinks (gpt-oss, as PagedDecodeArgs); null: none
  DecoderLora lora[4];             // LoRA slots of qkv, o, gate_up, down (decoder_run's lora_slot picks a row's)
};

// Sums data [n] over the tensor-parallel group in place (called by one thread, between barriers).
typedef void (*AllReduceFn)(float* data, int64_t n, void* ctx);

enum PagedllmDecoderAct { PDA_SILU = 0, PDA_GELU_TANH = 1 };

struct DecoderSpec {
  const DecoderLayer* layers;
  int64_t num_layers;
  const float* final_norm;
  int64_t num_blocks, block_size, kv_heads, head_dim, q_heads, hidden, inter, rot, max_position;
  float scale, eps;
  int32_t kv_dtype;  // PagedllmKvDtype of every layer's cache
  int32_t act;       // the MLP's gate activation: PDA_SILU or PDA_GELU_TANH (a plain MLP's activation)
  // The layer description (model/layers/description.py): LayerNorm (with biases) instead of RMSNorm for the norms
  // before attention and the MLP and the final one; a plain MLP (gate_up holds the up projection alone, act(up));
  // attention and MLP in parallel from the same normed input, both added to the residual stream (residual +
  // attention + MLP, no norm2); each layer output times residual_mult as it joins the residual stream; q/k norms
  // over the whole projection (all heads at once: q_norm [Hq D], k_norm [Hkv D]) instead of per head. A null
  // norm1 / norm2 (OLMo 2): the layer input is the residual stream itself.
  int32_t layer_norm, plain_mlp, parallel, qk_norm_full;
  float residual_mult;
  const float* final_norm_b;
  // Tensor parallelism: the partial sums of the attention output projection and of the MLP down projection are
  // all-reduced through this hook (null: one rank), and their biases are added after the reduction.
  AllReduceFn all_reduce;
  void* reduce_ctx;
};

struct PagedllmCpuOps {
  int abi;
  const char* isa;
  const char* source_hash;  // of the sources it was built from (setup.py), to detect a stale build
  int64_t panel_width;      // outputs per panel of pack_panels
  // out [rows, inner] = silu(x[:, :inner]) * x[:, inner:] for x [rows, 2 inner].
  void (*silu_and_mul)(float* out, const float* x, int64_t rows, int64_t inner, int threads);
  // out = x * rsqrt(mean(x^2) + eps) * w, row by row (x, out [rows, h]; out may be x).
  void (*rms_norm)(float* out, const float* x, const float* w, int64_t rows, int64_t h, float eps, int threads);
  // In place: residual += x; x = rms_norm(residual) * w.
  void (*fused_add_rms_norm)(float* x, float* residual, const float* w, int64_t rows, int64_t h, float eps,
                             int threads);
  // GELU with the tanh approximation, the fused decoder's: gated, out [rows, inner] = gelu(x[:, :inner]) *
  // x[:, inner:] for x [rows, 2 inner]; else out = gelu(x) for x [rows, inner].
  void (*gelu_tanh)(float* out, const float* x, int64_t rows, int64_t inner, int gated, int threads);
  // LayerNorm row by row: out = (x - mean) * rsqrt(var + eps) * w + b (b may be null; out may be x).
  void (*layer_norm)(float* out, const float* x, const float* w, const float* b, int64_t rows, int64_t h, float eps,
                     int threads);
  // In place: residual += x; x = layer_norm(residual) * w + b.
  void (*fused_add_layer_norm)(float* x, float* residual, const float* w, const float* b, int64_t rows, int64_t h,
                               float eps, int threads);
  // In place on x [rows, h, d]: rotate the first `heads` heads of each row by positions[row] (HF's rotate-half over
  // the first rot dims); cache [max_position, rot] holds cos | sin.
  void (*rotary)(float* x, const int64_t* positions, const float* cache, int64_t rows, int64_t h, int64_t d,
                 int64_t heads, int64_t rot, int threads);
  // dst [ceil(out / panel_width), in, panel_width] = w [out, in] transposed in strips, zero past `out` (dst and w
  // must not overlap).
  void (*pack_panels)(float* dst, const float* w, int64_t out, int64_t in, int threads);
  // y [rows, out] = x [rows, in] W^T (+ bias) from W's panels.
  void (*panel_linear)(float* y, const float* x, const float* panels, const float* bias, int64_t rows, int64_t in,
                       int64_t out, int threads);
  void (*paged_decode)(const PagedDecodeArgs* args);
  void (*paged_prefill)(const PagedPrefillArgs* args);
  // The fused decoder: built once per weights and caches, run per step on x [rows, hidden] in place: row r a token
  // at position pos[r] with cache slot slots[g * rows + r] of the request whose block table is row table_of[r] of
  // tables [g][reqs, width] in a layer of KV cache group g (DecoderLayer::group), attending to that request's positions 0 .. pos[r] (its own key and value included, and those of
  // its earlier rows in the step: a decode token and its draft tokens). A run of consecutive rows of one request
  // reads its context once.
  void* (*decoder_create)(const DecoderSpec* spec);
  // prompt != 0: the rows are consecutive prompt tokens of one request (positions pos[0], pos[0] + 1, ...), computed
  // as the layer-by-layer path computes prompt tokens: their quantized weights on bf16 panels (prompt 1: AVX512-BF16
  // builds only) or on int8 inputs as generated rows (prompt 2).
  // lora_slot [rows]: each row's LoRA adapter slot in every layer's DecoderLora (-1: none); null: no adapters.
  void (*decoder_run)(const void* decoder, float* x, int64_t rows, const int64_t* pos, const int64_t* slots,
                      const int64_t* tables, int64_t reqs, int64_t width, const int64_t* table_of, int32_t prompt,
                      int threads, const int32_t* lora_slot);
  void (*decoder_destroy)(void* decoder);
  // Bytes of a row of `in` weights of a quantized type; 0 when the type has no kernel or `in` is not a whole number
  // of its blocks.
  int64_t (*quant_row_bytes)(int32_t type, int64_t in);
  // Rewrites `rows` rows of a type (GGUF bytes, [rows, quant_row_bytes]) in place into this build's interleaved
  // layout, in whole groups of 16 rows, and returns how many rows it rewrote (0: the build or the type has none).
  int64_t (*quant_pack)(uint8_t* data, int32_t type, int64_t rows, int64_t in);
  // y [rows, w.out] = x [rows, w.in] W^T (+ bias) on the quantized weight (quant.cpp), with the inputs quantized to
  // int8 in blocks of 32 or on the de-quantized weight in bf16 or float32 panels: where the weight is wholly packed
  // (quant_pack), `int8` chooses, whatever the rows; elsewhere int8 up to quant_dot_max_rows() rows, panels beyond.
  void (*quant_linear)(float* y, const float* x, const QMatrix* w, const float* bias, int64_t rows, int32_t int8,
                       int threads);
  // out [n, w.in] = rows ids[0..n) of W in float32 (ids in range).
  void (*quant_dequantize_rows)(float* out, const QMatrix* w, const int64_t* ids, int64_t n, int threads);
  // quant_linear runs up to this many rows on int8 products (each row's result independent of the others), more
  // on float32 panels de-quantized per call.
  int64_t (*quant_dot_max_rows)(void);
  // dst [ceil(out / panel_width), ceil(in / 2), panel_width] uint32 = w [out, in] rounded to bf16 pairs (bf16.cpp).
  void (*bf16_pack_panels)(uint32_t* dst, const float* w, int64_t out, int64_t in, int threads);
  // y [rows, out] = x [rows, in] W^T (+ bias) from W's bf16 panels, x rounded to bf16, float32 sums.
  void (*bf16_panel_linear)(float* y, const float* x, const uint32_t* panels, const float* bias, int64_t rows,
                            int64_t in, int64_t out, int threads);
  // 1 where this build multiplies bf16 in hardware (AVX512-BF16), 0 where it widens to float32.
  int32_t (*bf16_native)(void);
  // AMX for the bf16 panels of many rows (prompt rows on quantized weights, bf16 weights): mode 0 off, 1 on where
  // the CPU and the OS have it, -1 asks; returns whether it is on (on by default where it can be, unless the
  // environment sets PAGEDLLM_AMX=0). Each row's sums are still independent of the other rows.
  int32_t (*bf16_amx)(int32_t mode);
  // y [rows, hidden] = the MoE MLP of x [rows, hidden] (MoeExperts). Row r's inputs to quantized experts are int8
  // where int8_rows[r] != 0 (int8_rows null: every row as `int8` says), else bf16 or float32 panels de-quantized per
  // call: the row's kind decides for every type (quant_linear lets it decide for packed weights only, and runs a
  // type it does not pack by the number of rows), so each row's result is what it would be alone.
  void (*moe_forward)(float* y, const float* x, const MoeExperts* m, int64_t rows, const uint8_t* int8_rows,
                      int32_t int8, int threads);
  // The sampler's pieces alone (sample_rows below runs them; the tests hold them to the torch path's tokens):
  // out[r] = the token at u[r] in [0, 1) of row r's cumulative distribution (probs [rows, vocab], unnormalised;
  // sampling.cpp).
  void (*sample_inverse)(const float* probs, const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads);
  // In place on logits [rows, vocab]: -inf outside each row's k[r] largest (ties: lower ids; rows with 0 < k[r] <
  // vocab), or outside each row's nucleus, for the rows with p[r] < 1 (probs = softmax(logits) row by row).
  void (*top_k_mask)(float* logits, const int64_t* k, int64_t rows, int64_t vocab, int threads);
  void (*top_p_mask)(float* logits, const float* probs, const float* p, int64_t rows, int64_t vocab, int threads);
  // out[r] for each row of logits [rows, vocab] (read only): the first largest logit where temperature[r] < 1e-5,
  // else the token at u[r] of softmax(logits[r] / temperature[r]) after top-k (k[r]; k null: none), top-p (p[r] < 1;
  // p null: none) and min-p (min_p[r] > 0; null: none), each computed as the torch path does but for rounding.
  void (*sample_rows)(const float* logits, const float* temperature, const int64_t* k, const float* p,
                      const float* min_p, const double* u, int64_t* out, int64_t rows, int64_t vocab, int threads);
  // An encoder's bidirectional attention: qkv [T, 3 H D] (each token's q | k | v, heads of D), the requests' token
  // runs [starts[b], starts[b + 1]) for b < nseq; every token attends to all tokens of its own run. out [T, H D].
  void (*encoder_attention)(float* out, const float* qkv, const int64_t* starts, int64_t nseq, int64_t heads,
                            int64_t dim, float scale, int threads);
};

__attribute__((visibility("default"))) const PagedllmCpuOps* pagedllm_cpu_ops(void);
}
