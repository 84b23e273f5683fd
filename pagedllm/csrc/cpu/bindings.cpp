// pagedllm._C: the torch-facing side of the native CPU kernels.
//
// `detect_isa()` names the best kernel build this CPU runs (avx512, avx2 or generic). `CpuOps(path)` opens one ISA
// build (a shared library from the same sources, see kernels.h), refuses it if this CPU lacks its instructions or if
// it was built against another interface version, and exposes its kernels on torch tensors: every call checks
// shapes, dtypes, contiguity and index ranges here (a RuntimeError naming what is wrong), then passes raw pointers
// and torch's thread count. `DecodeModel` is the fused decoder (one token or a few of one request) over a model's weights and KV caches, checked
// once when it is built. `ShmAllReduce` is the tensor-parallel sum between the processes of one machine through
// shared memory (shm_allreduce.h): `all_reduce(t)` on tensors, `hook()` for the fused decoder. `ngram_propose` is the
// speculative n-gram proposer's lookup and `apply_token_bitmask` structured output's mask (no ISA-specific code:
// they live here, not in the kernel libraries).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <pybind11/numpy.h>
#include <torch/extension.h>

#include <dlfcn.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "kernels.h"
#include "shm_allreduce.h"

namespace {

// The best kernel build this CPU runs: avx512bf16 (AVX-512 with VNNI and BF16), avx512, avx2 or generic.
std::string detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  if (avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bf16")) return "avx512bf16";
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return "avx2";
#endif
  return "generic";
}

int isa_rank(const std::string& isa) {
  return isa == "avx512bf16" ? 3 : isa == "avx512" ? 2 : isa == "avx2" ? 1 : 0;
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous float32 CPU tensor");
}

void check_index(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous int64 CPU tensor");
}

// The first `blocks` ids of a block table row name cache blocks.
void check_block_ids(const int64_t* row, int64_t blocks, int64_t num_blocks) {
  for (int64_t b = 0; b < blocks; ++b)
    TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, "block id ", row[b], " out of range");
}

// A layer's KV cache pair: contiguous CPU tensors [blocks, B, Hkv, D] of one shape and one dtype, float32 or
// bfloat16.
PagedCache paged_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  for (const torch::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->is_contiguous() &&
                    t->device().is_cpu(),
                "k_cache and v_cache must be contiguous float32 or bfloat16 CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must be of one dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be [blocks, B, Hkv, D] of one shape");
  const int32_t dtype = k_cache.scalar_type() == at::kBFloat16 ? PKV_BF16 : PKV_F32;
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3),
          dtype};
}

// out and q [T, Hq, D] of one shape, float32, out contiguous and q's heads contiguous within a token (its rows may be
// strided); q's head size the caches'; Hkv dividing Hq.
void check_queries(const torch::Tensor& out, const torch::Tensor& q, const PagedCache& c) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D] of one shape");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.device().is_cpu(), "q must be a float32 CPU tensor");
  check_float(out, "out");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "q's heads must be contiguous within a token (rows may be strided)");
  TORCH_CHECK(c.head_dim == q.size(2) && q.size(1) % c.kv_heads == 0, "head sizes do not match");
}

class CpuOps {
 public:
  explicit CpuOps(const std::string& path) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle != nullptr, "cannot open the kernel library ", path, ": ", dlerror());
    using Entry = const PagedllmCpuOps* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(handle, "pagedllm_cpu_ops"));
    TORCH_CHECK(entry != nullptr, path, " has no pagedllm_cpu_ops");
    t_ = entry();
    TORCH_CHECK(t_->abi == PAGEDLLM_CPU_ABI, path, " was built for kernel interface ", t_->abi, ", not ",
                PAGEDLLM_CPU_ABI, ": rebuild (make setup or pip install -e .)");
    TORCH_CHECK(isa_rank(t_->isa) <= isa_rank(detect_isa()), "this CPU cannot run the ", t_->isa,
                " kernels (it has ", detect_isa(), ")");
  }

  const PagedllmCpuOps* table() const { return t_; }
  std::string isa() const { return t_->isa; }
  std::string source_hash() const { return t_->source_hash; }
  int64_t panel_width() const { return t_->panel_width; }

  void silu_and_mul(torch::Tensor out, torch::Tensor x) const {
    check_float(out, "out");
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) && x.size(1) == 2 * out.size(1),
                "x [T, 2I], out [T, I]");
    t_->silu_and_mul(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), out.size(1), at::get_num_threads());
  }

  torch::Tensor encoder_attention(torch::Tensor qkv, torch::Tensor starts, int64_t heads, int64_t dim,
                                  double scale) const {
    check_float(qkv, "qkv");
    check_index(starts, "starts");
    TORCH_CHECK(heads > 0 && dim > 0, "heads and dim must be positive");
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == 3 * heads * dim, "qkv must be [T, 3 * heads * dim]");
    TORCH_CHECK(starts.dim() == 1 && starts.size(0) >= 1, "starts must be [B + 1]");
    const int64_t* st = starts.data_ptr<int64_t>();
    const int64_t n = starts.size(0) - 1;
    TORCH_CHECK(st[0] == 0 && st[n] == qkv.size(0), "starts must run from 0 to the number of tokens");
    for (int64_t b = 0; b < n; ++b) TORCH_CHECK(st[b] <= st[b + 1], "starts must not decrease");
    auto out = torch::empty({qkv.size(0), heads * dim}, qkv.options());
    t_->encoder_attention(out.data_ptr<float>(), qkv.data_ptr<float>(), st, n, heads, dim, static_cast<float>(scale),
                          at::get_num_threads());
    return out;
  }

  void sample_inverse(torch::Tensor out, torch::Tensor probs, torch::Tensor u) const {
    check_index(out, "out");
    check_float(probs, "probs");
    TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.device().is_cpu(),
                "u must be a contiguous float64 CPU tensor");
    TORCH_CHECK(probs.dim() == 2 && u.dim() == 1 && out.dim() == 1 && u.size(0) == probs.size(0) &&
                    out.size(0) == probs.size(0) && probs.size(1) > 0,
                "probs [R, V], u and out [R]");
    t_->sample_inverse(probs.data_ptr<float>(), u.data_ptr<double>(), out.data_ptr<int64_t>(), probs.size(0),
                       probs.size(1), at::get_num_threads());
  }

  void top_k_mask(torch::Tensor logits, torch::Tensor top_k) const {
    check_float(logits, "logits");
    check_index(top_k, "top_k");
    TORCH_CHECK(logits.dim() == 2 && top_k.dim() == 1 && top_k.size(0) == logits.size(0), "logits [R, V], top_k [R]");
    TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
    t_->top_k_mask(logits.data_ptr<float>(), top_k.data_ptr<int64_t>(), logits.size(0), logits.size(1),
                   at::get_num_threads());
  }

  void top_p_mask(torch::Tensor logits, torch::Tensor probs, torch::Tensor top_p) const {
    check_float(logits, "logits");
    check_float(probs, "probs");
    check_float(top_p, "top_p");
    TORCH_CHECK(logits.dim() == 2 && probs.sizes() == logits.sizes() && top_p.dim() == 1 &&
                    top_p.size(0) == logits.size(0),
                "logits and probs [R, V] of one shape, top_p [R]");
    TORCH_CHECK(at::get_overlap_status(logits, probs) == at::MemOverlapStatus::No, "probs must not overlap logits");
    TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
    t_->top_p_mask(logits.data_ptr<float>(), probs.data_ptr<float>(), top_p.data_ptr<float>(), logits.size(0),
                   logits.size(1), at::get_num_threads());
  }

  void sample_rows(torch::Tensor out, torch::Tensor logits, torch::Tensor temperature, std::optional<torch::Tensor> top_k,
                   std::optional<torch::Tensor> top_p, std::optional<torch::Tensor> min_p, torch::Tensor u) const {
    check_index(out, "out");
    check_float(logits, "logits");
    check_float(temperature, "temperature");
    TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.device().is_cpu(),
                "u must be a contiguous float64 CPU tensor");
    TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits [R, V]");
    TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(), "vocabulary too large");
    const int64_t rows = logits.size(0);
    auto per_row = [rows](const torch::Tensor& t, const char* name) {
      TORCH_CHECK(t.dim() == 1 && t.size(0) == rows, name, " must have one entry per row of logits");
    };
    per_row(out, "out");
    per_row(temperature, "temperature");
    per_row(u, "u");
    if (top_k) {
      check_index(*top_k, "top_k");
      per_row(*top_k, "top_k");
    }
    for (const auto& [t, name] : {std::pair{&top_p, "top_p"}, std::pair{&min_p, "min_p"}})
      if (*t) {
        check_float(**t, name);
        per_row(**t, name);
      }
    t_->sample_rows(logits.data_ptr<float>(), temperature.data_ptr<float>(),
                    top_k ? top_k->data_ptr<int64_t>() : nullptr, top_p ? top_p->data_ptr<float>() : nullptr,
                    min_p ? min_p->data_ptr<float>() : nullptr, u.data_ptr<double>(), out.data_ptr<int64_t>(), rows,
                    logits.size(1), at::get_num_threads());
  }

  void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) const {
    check_float(out, "out");
    check_float(x, "x");
    check_float(weight, "weight");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && out.sizes() == x.sizes() && weight.numel() == x.size(1),
                "x, out [T, H], weight [H], H > 0");
    t_->rms_norm(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                 static_cast<float>(eps), at::get_num_threads());
  }

  void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) const {
    check_float(x, "x");
    check_float(residual, "residual");
    check_float(weight, "weight");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && residual.sizes() == x.sizes() && weight.numel() == x.size(1) &&
                    !x.is_same(residual),
                "x, residual [T, H] (two tensors), weight [H], H > 0");
    t_->fused_add_rms_norm(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0),
                           x.size(1), static_cast<float>(eps), at::get_num_threads());
  }

  void gelu_tanh(torch::Tensor out, torch::Tensor x, bool gated) const {
    check_float(out, "out");
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) &&
                    x.size(1) == (gated ? 2 : 1) * out.size(1),
                "x [T, 2I] (gated) or [T, I], out [T, I]");
    t_->gelu_tanh(out.data_ptr<float>(), x.data_ptr<float>(), x.size(0), out.size(1), gated ? 1 : 0,
                  at::get_num_threads());
  }

  void layer_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias,
                  double eps) const {
    check_float(out, "out");
    check_float(x, "x");
    check_float(weight, "weight");
    if (bias) check_float(*bias, "bias");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && out.sizes() == x.sizes() && weight.numel() == x.size(1) &&
                    (!bias || bias->numel() == x.size(1)),
                "x, out [T, H], weight and bias [H], H > 0");
    t_->layer_norm(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                   bias ? bias->data_ptr<float>() : nullptr, x.size(0), x.size(1), static_cast<float>(eps),
                   at::get_num_threads());
  }

  void fused_add_layer_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            std::optional<torch::Tensor> bias, double eps) const {
    check_float(x, "x");
    check_float(residual, "residual");
    check_float(weight, "weight");
    if (bias) check_float(*bias, "bias");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && residual.sizes() == x.sizes() && weight.numel() == x.size(1) &&
                    (!bias || bias->numel() == x.size(1)) && !x.is_same(residual),
                "x, residual [T, H] (two tensors), weight and bias [H], H > 0");
    t_->fused_add_layer_norm(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                             bias ? bias->data_ptr<float>() : nullptr, x.size(0), x.size(1), static_cast<float>(eps),
                             at::get_num_threads());
  }

  void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cache, int64_t heads) const {
    check_float(x, "x");
    check_float(cache, "cache");
    check_index(positions, "positions");
    TORCH_CHECK(x.dim() == 3 && positions.numel() == x.size(0) && heads >= 0 && heads <= x.size(1),
                "x [T, H, D], positions [T]");
    TORCH_CHECK(cache.dim() == 2, "cache must be [max_position, rot]");
    const int64_t rot = cache.size(1), max_pos = cache.size(0);
    TORCH_CHECK(rot <= x.size(2) && rot % 2 == 0, "rotary dims must be even and at most the head size");
    const int64_t* pp = positions.data_ptr<int64_t>();
    for (int64_t t = 0; t < x.size(0); ++t)
      TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " out of range");
    t_->rotary(x.data_ptr<float>(), pp, cache.data_ptr<float>(), x.size(0), x.size(1), x.size(2), heads, rot,
               at::get_num_threads());
  }

  // A weight W [O, I] in panels: [ceil(O / w), I, w], zero past O; written into `out` when given (e.g. a view of
  // the huge-page arena the panels live in, so they need no second copy), else into a new tensor.
  torch::Tensor pack_panels(torch::Tensor weight, std::optional<torch::Tensor> out) const {
    check_float(weight, "weight");
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0, "weight must be a non-empty [O, I]");
    const int64_t rows = weight.size(0), in = weight.size(1), w = t_->panel_width;
    torch::Tensor panels;
    if (out.has_value()) {
      panels = *out;
      check_panels(panels, rows, in, "out");
      TORCH_CHECK(at::get_overlap_status(panels, weight) == at::MemOverlapStatus::No,
                  "out must not overlap the weight");
    } else {
      panels = torch::empty({(rows + w - 1) / w, in, w}, weight.options());
    }
    t_->pack_panels(panels.data_ptr<float>(), weight.data_ptr<float>(), rows, in, at::get_num_threads());
    return panels;
  }

  void check_panels(const torch::Tensor& panels, int64_t out, int64_t in, const char* what) const {
    check_float(panels, what);
    const int64_t w = t_->panel_width;
    TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (out + w - 1) / w && panels.size(1) == in && panels.size(2) == w,
                what, " panels must be [ceil(", out, " / ", w, "), ", in, ", ", w, "]");
  }

  // Attention sinks [heads] as a pointer (null when absent), checked.
  static const float* sinks_ptr(const std::optional<torch::Tensor>& sinks, int64_t heads) {
    if (!sinks.has_value() || !sinks->defined() || sinks->numel() == 0) return nullptr;
    check_float(*sinks, "sinks");
    TORCH_CHECK(sinks->numel() == heads, "sinks must have one logit per query head (", heads, "), got ",
                sinks->numel());
    return sinks->data_ptr<float>();
  }

  // A linear layer's optional bias [O] as a pointer (null when absent), checked.
  static const float* bias_ptr(const std::optional<torch::Tensor>& bias, int64_t out_features) {
    if (!bias.has_value()) return nullptr;
    check_float(*bias, "bias");
    TORCH_CHECK(bias->numel() == out_features, "bias must be [O]");
    return bias->data_ptr<float>();
  }

  torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                             int64_t out_features) const {
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && out_features >= 1, "x must be [M, I]");
    check_panels(panels, out_features, x.size(1), "panels");
    const float* bp = bias_ptr(bias, out_features);
    auto y = torch::empty({x.size(0), out_features}, x.options());
    t_->panel_linear(y.data_ptr<float>(), x.data_ptr<float>(), panels.data_ptr<float>(), bp, x.size(0), x.size(1),
                     out_features, at::get_num_threads());
    return y;
  }

  // A weight W [O, I] in bf16 pair panels: bfloat16 [ceil(O / w), ceil(I / 2), w, 2] ([..., 0] the even input),
  // rounded to nearest even, zero past O and I; written into `out` when given.
  torch::Tensor bf16_pack_panels(torch::Tensor weight, std::optional<torch::Tensor> out) const {
    check_float(weight, "weight");
    TORCH_CHECK(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0, "weight must be a non-empty [O, I]");
    const int64_t rows = weight.size(0), in = weight.size(1);
    torch::Tensor panels;
    if (out.has_value()) {
      panels = *out;
      check_bf16_panels(panels, rows, in, "out");
    } else {
      panels = torch::empty(bf16_panel_shape(rows, in), weight.options().dtype(torch::kBFloat16));
    }
    t_->bf16_pack_panels(reinterpret_cast<uint32_t*>(panels.data_ptr()), weight.data_ptr<float>(), rows, in,
                         at::get_num_threads());
    return panels;
  }

  std::vector<int64_t> bf16_panel_shape(int64_t out, int64_t in) const {
    const int64_t w = t_->panel_width;
    return {(out + w - 1) / w, (in + 1) / 2, w, 2};
  }

  void check_bf16_panels(const torch::Tensor& panels, int64_t out, int64_t in, const char* what) const {
    TORCH_CHECK(panels.device().is_cpu() && panels.scalar_type() == torch::kBFloat16 && panels.is_contiguous(), what,
                " must be a contiguous bfloat16 CPU tensor");
    TORCH_CHECK(panels.sizes().vec() == bf16_panel_shape(out, in), what, " bf16 panels must be ",
                c10::IntArrayRef(bf16_panel_shape(out, in)));
  }

  torch::Tensor bf16_panel_linear(torch::Tensor x, torch::Tensor panels, std::optional<torch::Tensor> bias,
                                  int64_t out_features) const {
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && out_features >= 1, "x must be [M, I]");
    check_bf16_panels(panels, out_features, x.size(1), "panels");
    const float* bp = bias_ptr(bias, out_features);
    auto y = torch::empty({x.size(0), out_features}, x.options());
    t_->bf16_panel_linear(y.data_ptr<float>(), x.data_ptr<float>(),
                          reinterpret_cast<const uint32_t*>(panels.data_ptr()), bp, x.size(0), x.size(1), out_features,
                          at::get_num_threads());
    return y;
  }

  bool bf16_native() const { return t_->bf16_native() != 0; }
  bool bf16_amx(int64_t mode) const {
    TORCH_CHECK(mode >= -1 && mode <= 1, "mode must be -1 (ask), 0 (off) or 1 (on where the CPU has it)");
    return t_->bf16_amx(static_cast<int32_t>(mode)) != 0;
  }

  void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                              int64_t window, double softcap, std::optional<torch::Tensor> sinks) const {
    const PagedCache c = paged_cache(k_cache, v_cache);
    check_queries(out, q, c);
    TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
    check_index(block_table, "block_table");
    check_index(seq_lens, "seq_lens");
    const int64_t n = q.size(0);
    TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == n && seq_lens.numel() == n, "one row per query");
    const int64_t width = block_table.size(1), bs = c.block_size;
    const int64_t* tp = block_table.data_ptr<int64_t>();
    const int64_t* lp = seq_lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * bs, "seq_len ", lp[i], " outside 1..", width * bs);
      check_block_ids(tp + i * width, (lp[i] + bs - 1) / bs, c.num_blocks);
    }
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
    TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, got ", softcap);
    const PagedDecodeArgs args{out.data_ptr<float>(), q.data_ptr<float>(), c, tp, lp, n, q.size(1), width, window,
                               static_cast<float>(scale), at::get_num_threads(), static_cast<float>(softcap),
                               sinks_ptr(sinks, q.size(1))};
    t_->paged_decode(&args);
  }

  void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor segments, double scale,
                               int64_t window, double softcap, std::optional<torch::Tensor> sinks) const {
    const PagedCache c = paged_cache(k_cache, v_cache);
    check_queries(out, q, c);
    check_index(block_tables, "block_tables");
    check_index(segments, "segments");
    TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3, "segments must be [n, 3]: query start, length, context");
    const int64_t nseg = segments.size(0), tokens = q.size(0), bs = c.block_size;
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == nseg, "one block table row per segment");
    const int64_t width = block_tables.size(1);
    const int64_t* sp = segments.data_ptr<int64_t>();
    const int64_t* tp = block_tables.data_ptr<int64_t>();
    for (int64_t s = 0; s < nseg; ++s) {
      const int64_t start = sp[3 * s], len = sp[3 * s + 1], ctx = sp[3 * s + 2];
      TORCH_CHECK(start >= 0 && len >= 1 && start + len <= tokens, "segment ", s, " rows [", start, ", ",
                  start + len, ") outside the ", tokens, " queries");
      TORCH_CHECK(ctx >= 0 && ctx + len <= width * bs, "segment ", s, ": context ", ctx, " + ", len,
                  " tokens past its block table");
      check_block_ids(tp + s * width, (ctx + len + bs - 1) / bs, c.num_blocks);
    }
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
    TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive, got ", softcap);
    const PagedPrefillArgs args{out.data_ptr<float>(), q.data_ptr<float>(), q.stride(0), tokens, q.size(1), c, tp,
                                sp, nseg, width, window, static_cast<float>(scale), at::get_num_threads(),
                                static_cast<float>(softcap),
                                sinks_ptr(sinks, q.size(1))};
    t_->paged_prefill(&args);
  }

  int64_t quant_row_bytes(int64_t type, int64_t in) const { return t_->quant_row_bytes(static_cast<int32_t>(type), in); }
  int64_t quant_dot_max_rows() const { return t_->quant_dot_max_rows(); }

 private:
  const PagedllmCpuOps* t_;
};

// A quantized weight W [out, in] for the kernels: up to four segments of consecutive rows, each a contiguous uint8
// tensor [rows, row_bytes] of one GGML type (the GGUF file's bytes); checked once here and kept alive. The matrix
// takes the bytes over: where the build has an interleaved layout for the type (quant_pack), they are rewritten in
// place into it, so the tensors no longer hold the file's layout.
class QuantMatrix {
 public:
  QuantMatrix(const CpuOps& ops, const std::vector<int64_t>& types, std::vector<torch::Tensor> parts, int64_t in)
      : parts_(std::move(parts)) {
    TORCH_CHECK(!types.empty() && types.size() == parts_.size() && types.size() <= PAGEDLLM_MAX_QSEGMENTS,
                "one to ", PAGEDLLM_MAX_QSEGMENTS, " segments, each with its type");
    TORCH_CHECK(in > 0, "in must be positive");
    m_ = QMatrix{};
    m_.in = in;
    for (size_t i = 0; i < types.size(); ++i) {
      const torch::Tensor& t = parts_[i];
      TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() && t.dim() == 2,
                  "segment ", i, " must be a contiguous uint8 CPU tensor [rows, row_bytes]");
      const int64_t bytes = ops.quant_row_bytes(types[i], in);
      TORCH_CHECK(bytes > 0, "segment ", i, ": no kernel for GGML type ", types[i], " with rows of ", in,
                  " weights");
      TORCH_CHECK(t.size(1) == bytes && t.size(0) > 0, "segment ", i, " must be [rows, ", bytes, "], got ",
                  t.sizes());
      m_.seg[i] = QSegment{t.data_ptr<uint8_t>(), t.size(0), static_cast<int32_t>(types[i]), 0};
      m_.out += t.size(0);
    }
    m_.nseg = static_cast<int32_t>(types.size());
    for (int i = 0; i < m_.nseg; ++i)  // all checked: now the bytes become the kernels'
      m_.seg[i].packed = ops.table()->quant_pack(parts_[i].data_ptr<uint8_t>(), m_.seg[i].type, m_.seg[i].rows, in);
  }

  const QMatrix& matrix() const { return m_; }
  int64_t out_features() const { return m_.out; }
  int64_t in_features() const { return m_.in; }
  int64_t packed_rows() const {
    int64_t n = 0;
    for (int i = 0; i < m_.nseg; ++i) n += m_.seg[i].packed;
    return n;
  }
  int64_t nbytes() const {
    int64_t n = 0;
    for (const auto& t : parts_) n += t.numel();
    return n;
  }

 private:
  std::vector<torch::Tensor> parts_;
  QMatrix m_{};
};

// y [M, out] = x [M, in] W^T (+ bias) on a quantized weight.
torch::Tensor quant_linear(const CpuOps& ops, torch::Tensor x, const QuantMatrix& w, std::optional<torch::Tensor> bias,
                           bool int8) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == w.in_features(), "x must be [M, ", w.in_features(), "]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    check_float(*bias, "bias");
    TORCH_CHECK(bias->numel() == w.out_features(), "bias must be [", w.out_features(), "]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({x.size(0), w.out_features()}, x.options());
  ops.table()->quant_linear(y.data_ptr<float>(), x.data_ptr<float>(), &w.matrix(), bp, x.size(0), int8 ? 1 : 0,
                            at::get_num_threads());
  return y;
}

// Rows `ids` of a quantized weight in float32: [*ids.shape, in] (an embedding lookup).
torch::Tensor quant_dequantize_rows(const CpuOps& ops, const QuantMatrix& w, torch::Tensor ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(), "ids must be an int64 CPU tensor");
  auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.numel(), rows = w.out_features();
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row id ", ip[i], " out of range");
  auto sizes = ids.sizes().vec();
  sizes.push_back(w.in_features());
  auto out = torch::empty(sizes, torch::dtype(torch::kFloat32));
  ops.table()->quant_dequantize_rows(out.data_ptr<float>(), &w.matrix(), ip, n, at::get_num_threads());
  return out;
}

// A mixture-of-experts MLP's weights for the kernels (MoeExperts, moe.cpp), checked once and kept alive: the router
// as float32 panels [ceil(E / w), hidden, w] and its optional bias [E]; every expert's W13 [2 inter, hidden] (gate
// rows, then up rows) and W2 [hidden, inter] either as QuantMatrix lists (one per expert) or stacked panels (float32
// [E, ceil(2 inter / w), hidden, w] and [E, ceil(hidden / w), inter, w], or bf16 pair panels of the same weights,
// [E, *bf16_panel_shape]); optional biases b13 [E, 2 inter] and b2 [E, hidden].
class MoeLayer {
 public:
  MoeLayer(std::shared_ptr<CpuOps> ops, torch::Tensor router, std::optional<torch::Tensor> router_b, int64_t top_k,
           int64_t scoring, bool renorm, int64_t act, double alpha, double limit, int64_t hidden, int64_t inter,
           std::vector<std::shared_ptr<QuantMatrix>> w13_q, std::vector<std::shared_ptr<QuantMatrix>> w2_q,
           std::optional<torch::Tensor> w13_p, std::optional<torch::Tensor> w2_p, std::optional<torch::Tensor> b13,
           std::optional<torch::Tensor> b2)
      : ops_(std::move(ops)), w13q_(std::move(w13_q)), w2q_(std::move(w2_q)) {
    TORCH_CHECK(hidden > 0 && inter > 0, "hidden and inter must be positive");
    TORCH_CHECK(scoring == PMS_SOFTMAX_TOPK || scoring == PMS_TOPK_SOFTMAX, "scoring must be 0 or 1");
    TORCH_CHECK(act == PMA_SILU || act == PMA_SWIGLU_CLAMP, "act must be 0 (SiLU) or 1 (clamped SwiGLU)");
    TORCH_CHECK(act != PMA_SWIGLU_CLAMP || limit > 0, "the clamped SwiGLU needs a positive limit, got ", limit);
    check_float(router, "router");
    const int64_t w = ops_->panel_width();
    TORCH_CHECK(router.dim() == 3 && router.size(1) == hidden && router.size(2) == w, "router must be panels [ceil(E / ",
                w, "), ", hidden, ", ", w, "]");
    const bool quant = !w13q_.empty();
    const int64_t E = quant ? static_cast<int64_t>(w13q_.size()) : (w13_p.has_value() ? w13_p->size(0) : 0);
    TORCH_CHECK(E >= 1 && router.size(0) == (E + w - 1) / w, "the router's panels must cover the ", E, " experts");
    TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in 1..", E, ", got ", top_k);
    m_ = MoeExperts{};
    m_.experts = E, m_.top_k = top_k, m_.hidden = hidden, m_.inter = inter;
    m_.scoring = static_cast<int32_t>(scoring), m_.renorm = renorm ? 1 : 0, m_.act = static_cast<int32_t>(act);
    m_.alpha = static_cast<float>(alpha), m_.limit = static_cast<float>(limit);
    m_.router = router.data_ptr<float>();
    keep_.push_back(router);
    auto opt = [&](const std::optional<torch::Tensor>& t, int64_t numel, const char* name) -> const float* {
      if (!t.has_value() || !t->defined() || t->numel() == 0) return nullptr;
      check_float(*t, name);
      TORCH_CHECK(t->numel() == numel, name, " must have ", numel, " elements");
      keep_.push_back(*t);
      return t->data_ptr<float>();
    };
    m_.router_b = opt(router_b, E, "router bias");
    m_.b13 = opt(b13, E * 2 * inter, "b13");
    m_.b2 = opt(b2, E * hidden, "b2");
    if (quant) {
      TORCH_CHECK(w2q_.size() == static_cast<size_t>(E) && !w13_p.has_value() && !w2_p.has_value(),
                  "quantized experts: one W13 and one W2 QuantMatrix per expert, no panels");
      for (int64_t e = 0; e < E; ++e) {
        TORCH_CHECK(w13q_[e] && w2q_[e], "expert ", e, ": a QuantMatrix for W13 and W2");
        TORCH_CHECK(w13q_[e]->out_features() == 2 * inter && w13q_[e]->in_features() == hidden, "expert ", e,
                    ": W13 must be [", 2 * inter, ", ", hidden, "]");
        TORCH_CHECK(w2q_[e]->out_features() == hidden && w2q_[e]->in_features() == inter, "expert ", e,
                    ": W2 must be [", hidden, ", ", inter, "]");
        q13_.push_back(w13q_[e]->matrix());
        q2_.push_back(w2q_[e]->matrix());
      }
      m_.w13_q = q13_.data(), m_.w2_q = q2_.data();
      return;
    }
    TORCH_CHECK(w13_p.has_value() && w2_p.has_value() && w2q_.empty(), "experts: QuantMatrix lists or two panel tensors");
    const torch::Tensor &a = *w13_p, &b = *w2_p;
    TORCH_CHECK(a.size(0) == E && b.size(0) == E, "W13 and W2 panels of ", E, " experts");
    if (a.scalar_type() == torch::kBFloat16) {
      for (int64_t e = 0; e < E; ++e) {
        ops_->check_bf16_panels(a[e], 2 * inter, hidden, "W13");
        ops_->check_bf16_panels(b[e], hidden, inter, "W2");
      }
      TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "stacked panels must be contiguous");
      m_.w13_16 = reinterpret_cast<const uint32_t*>(a.data_ptr()), m_.w2_16 = reinterpret_cast<const uint32_t*>(b.data_ptr());
      m_.s13_16 = a[0].numel() / 2, m_.s2_16 = b[0].numel() / 2;
    } else {
      check_float(a, "W13");
      check_float(b, "W2");
      for (int64_t e = 0; e < E; ++e) {
        ops_->check_panels(a[e], 2 * inter, hidden, "W13");
        ops_->check_panels(b[e], hidden, inter, "W2");
      }
      m_.w13_f = a.data_ptr<float>(), m_.w2_f = b.data_ptr<float>();
      m_.s13_f = a[0].numel(), m_.s2_f = b[0].numel();
    }
    keep_.push_back(a);
    keep_.push_back(b);
  }

  const MoeExperts& experts() const { return m_; }
  int64_t num_experts() const { return m_.experts; }
  int64_t hidden() const { return m_.hidden; }
  int64_t inter() const { return m_.inter; }

  // y [T, hidden] for x [T, hidden]; int8: a bool [T] mask of the rows whose inputs to quantized experts are int8,
  // or one bool for all rows.
  torch::Tensor forward(torch::Tensor x, py::object int8) const {
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == m_.hidden, "x must be [T, ", m_.hidden, "]");
    torch::Tensor mask;
    int32_t all = 0;
    if (py::isinstance<py::bool_>(int8)) {
      all = int8.cast<bool>() ? 1 : 0;
    } else {
      mask = int8.cast<torch::Tensor>().to(torch::kUInt8).contiguous();
      TORCH_CHECK(mask.dim() == 1 && mask.size(0) == x.size(0), "int8 must be a bool or a [", x.size(0), "] mask");
    }
    auto y = torch::empty_like(x);
    ops_->table()->moe_forward(y.data_ptr<float>(), x.data_ptr<float>(), &m_, x.size(0),
                               mask.defined() ? mask.data_ptr<uint8_t>() : nullptr, all, at::get_num_threads());
    return y;
  }

 private:
  std::shared_ptr<CpuOps> ops_;
  std::vector<std::shared_ptr<QuantMatrix>> w13q_, w2q_;
  std::vector<QMatrix> q13_, q2_;
  std::vector<torch::Tensor> keep_;
  MoeExperts m_{};
};

// A bias or an optional norm: an empty tensor means none.
const float* optional_ptr(const torch::Tensor& t, int64_t numel, const char* name) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  check_float(t, name);
  TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements");
  return t.data_ptr<float>();
}

// The fused decoder (decoder.cpp) over one model's weights and caches: sixteen tensors per layer in
// layer_w (norm1, qkv, qkv_b, q_norm, k_norm, o, o_b, norm2, gate_up, gate_up_b, down, down_b, post_attn_norm,
// post_mlp_norm, norm1_b, norm2_b; the four linear weights as float32 panels or bf16 pair panels, an empty tensor
// for an absent bias, norm or q/k norm), one cache pair and rotary table per layer, and
// optionally four entries per layer in `quant` (qkv, o, gate_up, down): a QuantMatrix runs that linear quantized (its
// panels are then ignored and may be empty), None on its panels; optionally each layer's sliding window in `windows`
// (0: full attention). Everything is checked here once; a step passes only the token's few index tensors.
class DecodeModel {
 public:
  static constexpr int kPerLayer = 16, kLinears = 4, kLoraEntries = 5;

  DecodeModel(std::shared_ptr<CpuOps> ops, std::vector<torch::Tensor> layer_w, std::vector<torch::Tensor> k_caches,
              std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> cos_sin, double scale, double eps,
              torch::Tensor final_norm, uintptr_t all_reduce_fn, uintptr_t all_reduce_ctx,
              std::vector<std::shared_ptr<QuantMatrix>> quant, std::vector<int64_t> windows, int64_t act,
              std::vector<int64_t> groups, std::vector<double> softcaps, std::vector<int64_t> kinds,
              double residual_mult, torch::Tensor final_norm_b, std::vector<std::shared_ptr<MoeLayer>> moe,
              std::vector<double> clips, std::vector<torch::Tensor> sinks, std::vector<torch::Tensor> lora)
      : ops_(std::move(ops)), t_(ops_->table()), quant_(std::move(quant)), moe_(std::move(moe)) {
    TORCH_CHECK(act == PDA_SILU || act == PDA_GELU_TANH, "act must be 0 (SiLU) or 1 (GELU, tanh approximation)");
    const size_t layers = k_caches.size();
    TORCH_CHECK(windows.empty() || windows.size() == layers, "windows: none, or one per layer (0: full attention)");
    TORCH_CHECK(groups.empty() || groups.size() == layers, "groups: none, or one KV cache group per layer");
    TORCH_CHECK(softcaps.empty() || softcaps.size() == layers, "softcaps: none, or one per layer (0: none)");
    // The layer description's kinds (DecoderSpec): layer_norm, plain_mlp, parallel, qk_norm_full (0 or 1 each).
    TORCH_CHECK(kinds.empty() || kinds.size() == 4, "kinds: none, or [layer_norm, plain_mlp, parallel, qk_norm_full]");
    for (int64_t k : kinds) TORCH_CHECK(k == 0 || k == 1, "kinds are 0 or 1");
    num_groups_ = 1;
    for (int64_t g : groups) {
      TORCH_CHECK(g >= 0, "KV cache groups must be >= 0, got ", g);
      num_groups_ = std::max(num_groups_, g + 1);
    }
    TORCH_CHECK(layers >= 1 && layer_w.size() == kPerLayer * layers && v_caches.size() == layers &&
                    cos_sin.size() == layers,
                kPerLayer, " weights, two caches and a rotary table per layer");
    TORCH_CHECK(lora.empty() || lora.size() == kLoraEntries * kLinears * layers,
                "lora: none, or (a, b, widths, a_scale, b_scale) per linear layer: qkv, o, gate_up, down (empty "
                "tensors: none)");
    TORCH_CHECK(quant_.empty() || quant_.size() == kLinears * layers,
                "quant: none, or one entry (a QuantMatrix or None) per linear layer: qkv, o, gate_up, down");
    check_float(final_norm, "final_norm");
    const PagedCache c0 = paged_cache(k_caches[0], v_caches[0]);
    DecoderSpec& s = spec_;
    if (!kinds.empty()) s.layer_norm = kinds[0], s.plain_mlp = kinds[1], s.parallel = kinds[2], s.qk_norm_full = kinds[3];
    s.residual_mult = static_cast<float>(residual_mult);
    s.num_blocks = c0.num_blocks, s.block_size = c0.block_size, s.kv_heads = c0.kv_heads, s.head_dim = c0.head_dim;
    s.kv_dtype = c0.kv_dtype;
    // Linear j (0 qkv, 1 o, 2 gate_up, 3 down) of layer l: its quantized weight, or null for panels.
    auto qm = [&](size_t l, int j) -> const QuantMatrix* { return quant_.empty() ? nullptr : quant_[kLinears * l + j].get(); };
    constexpr int kSlot[kLinears] = {1, 5, 8, 10};  // where each linear's panels sit among a layer's tensors
    auto bf16 = [](const torch::Tensor& p) { return p.scalar_type() == torch::kBFloat16; };
    TORCH_CHECK(moe_.empty() || moe_.size() == layers, "moe: none, or one entry (a MoeLayer or None) per layer");
    TORCH_CHECK(clips.empty() || clips.size() == layers, "clips: none, or one per layer (0: none)");
    TORCH_CHECK(sinks.empty() || sinks.size() == layers, "sinks: none, or one tensor per layer (empty: none)");
    auto moe_at = [&](size_t l) -> const MoeLayer* { return moe_.empty() ? nullptr : moe_[l].get(); };
    auto in_of = [&](size_t l, int j) -> int64_t {  // input size of layer l's linear j
      const QuantMatrix* q = qm(l, j);
      if (q != nullptr) return q->in_features();
      const torch::Tensor& p = layer_w[kPerLayer * l + kSlot[j]];
      if (bf16(p) && p.dim() == 4) return 2 * p.size(1);  // bf16 pair panels (even input sizes)
      TORCH_CHECK(p.dim() == 3, "the linear weights must be panels, bf16 panels or quantized");
      return p.size(1);
    };
    s.hidden = in_of(0, 0), s.q_heads = in_of(0, 1) / s.head_dim;
    s.inter = 0;  // the dense MLP's intermediate size (any MoE layer's where every layer is one)
    for (size_t l = 0; l < layers && s.inter == 0; ++l)
      if (moe_at(l) == nullptr) s.inter = in_of(l, 3);
    for (size_t l = 0; l < layers && s.inter == 0; ++l) s.inter = moe_at(l)->inter();
    const int64_t d = s.head_dim, qkv_out = (s.q_heads + 2 * s.kv_heads) * d;
    TORCH_CHECK(s.q_heads > 0 && s.q_heads % s.kv_heads == 0 && in_of(0, 1) == s.q_heads * d,
                "o's input must be Hq D with Hq a multiple of the caches' Hkv");
    TORCH_CHECK(final_norm.numel() == s.hidden, "final_norm must be [H]");
    TORCH_CHECK(cos_sin[0].dim() == 2, "rotary tables must be [max_position, rot]");
    s.rot = cos_sin[0].size(1), s.max_position = cos_sin[0].size(0);
    TORCH_CHECK(s.rot > 0 && s.rot <= d && s.rot % 2 == 0, "rotary dims must be even and at most the head size");
    const int64_t outs[kLinears] = {qkv_out, s.hidden, (s.plain_mlp ? 1 : 2) * s.inter, s.hidden};
    const int64_t ins[kLinears] = {s.hidden, s.q_heads * d, s.hidden, s.inter};
    const char* names[kLinears] = {"qkv", "o", "gate_up", "down"};
    for (size_t l = 0; l < layers; ++l) {
      const torch::Tensor* w = layer_w.data() + kPerLayer * l;
      const PagedCache c = paged_cache(k_caches[l], v_caches[l]);
      TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && c.kv_dtype == c0.kv_dtype,
                  "caches of one shape and dtype");
      check_float(cos_sin[l], "cos_sin");
      const float* panels[kLinears];
      const uint32_t* panels16[kLinears];
      QMatrix quants[kLinears];
      const MoeLayer* moe = moe_at(l);
      TORCH_CHECK(moe == nullptr || moe->hidden() == s.hidden, "layer ", l, ": the experts' hidden size must be ",
                  s.hidden);
      for (int j = 0; j < kLinears; ++j) {
        const QuantMatrix* q = qm(l, j);
        quants[j] = QMatrix{};
        panels[j] = nullptr;
        panels16[j] = nullptr;
        if (moe != nullptr && j >= 2) continue;  // the experts replace gate_up and down
        if (q != nullptr) {
          TORCH_CHECK(q->out_features() == outs[j] && q->in_features() == ins[j], names[j],
                      ": quantized weight must be [", outs[j], ", ", ins[j], "]");
          quants[j] = q->matrix();
        } else if (bf16(w[kSlot[j]])) {
          ops_->check_bf16_panels(w[kSlot[j]], outs[j], ins[j], names[j]);
          panels16[j] = reinterpret_cast<const uint32_t*>(w[kSlot[j]].data_ptr());
        } else {
          ops_->check_panels(w[kSlot[j]], outs[j], ins[j], names[j]);
          panels[j] = w[kSlot[j]].data_ptr<float>();
        }
      }
      TORCH_CHECK(cos_sin[l].dim() == 2 && cos_sin[l].size(1) == s.rot && cos_sin[l].size(0) == s.max_position,
                  "rotary tables of one shape");
      DecoderLayer L{};
      L.norm1 = optional_ptr(w[0], s.hidden, "norm1");
      L.qkv = panels[0], L.o = panels[1], L.gate_up = panels[2], L.down = panels[3];
      L.qkv_b = optional_ptr(w[2], qkv_out, "qkv bias");
      L.q_norm = optional_ptr(w[3], s.qk_norm_full ? s.q_heads * d : d, "q_norm");
      L.k_norm = optional_ptr(w[4], s.qk_norm_full ? s.kv_heads * d : d, "k_norm");
      TORCH_CHECK(!s.qk_norm_full || (L.q_norm != nullptr && L.k_norm != nullptr), "q/k norms over the projection");
      L.o_b = optional_ptr(w[6], s.hidden, "o bias");
      L.norm2 = optional_ptr(w[7], s.hidden, "norm2");
      L.gate_up_b = optional_ptr(w[9], s.plain_mlp ? s.inter : 2 * s.inter, "gate_up bias");
      L.down_b = optional_ptr(w[11], s.hidden, "down bias");
      L.post_attn_norm = optional_ptr(w[12], s.hidden, "post_attn_norm");
      L.post_mlp_norm = optional_ptr(w[13], s.hidden, "post_mlp_norm");
      L.norm1_b = optional_ptr(w[14], s.hidden, "norm1 bias");
      L.norm2_b = optional_ptr(w[15], s.hidden, "norm2 bias");
      TORCH_CHECK(s.layer_norm || (L.norm1_b == nullptr && L.norm2_b == nullptr), "norm biases are LayerNorm's");
      TORCH_CHECK(s.parallel || (L.norm1 == nullptr) == (L.norm2 == nullptr), "norm1 and norm2: both or neither");
      L.cos_sin = cos_sin[l].data_ptr<float>();
      L.k_cache = const_cast<void*>(c.k), L.v_cache = const_cast<void*>(c.v);
      L.qkv_q = quants[0], L.o_q = quants[1], L.gate_up_q = quants[2], L.down_q = quants[3];
      L.qkv16 = panels16[0], L.o16 = panels16[1], L.gate_up16 = panels16[2], L.down16 = panels16[3];
      L.moe = moe != nullptr ? &moe->experts() : nullptr;
      L.clip_qkv = clips.empty() ? 0.f : static_cast<float>(clips[l]);
      L.sinks = sinks.empty() ? nullptr : CpuOps::sinks_ptr(sinks[l], s.q_heads);
      TORCH_CHECK(L.clip_qkv >= 0.f, "layer ", l, ": clip_qkv must be 0 (none) or positive");
      L.window = windows.empty() ? 0 : windows[l];
      L.group = groups.empty() ? 0 : groups[l];
      L.softcap = softcaps.empty() ? 0.f : static_cast<float>(softcaps[l]);
      TORCH_CHECK(L.softcap >= 0.f, "layer ", l, ": softcap must be 0 (none) or positive");
      TORCH_CHECK(L.window >= 0, "layer ", l, ": window must be 0 (none) or positive");
      for (int j = 0; j < kLinears; ++j) {  // LoRA slots: a [S, W, in], b [S, W, out] (B^T), width int32 [S],
        L.lora[j] = DecoderLora{};          // and for int8 slots the rows' scales [S, W] of each
        if (lora.empty()) continue;
        const torch::Tensor* e = lora.data() + kLoraEntries * (kLinears * l + j);
        const torch::Tensor &a = e[0], &b = e[1], &wd = e[2], &sa = e[3], &sb = e[4];
        if (!a.defined() || a.numel() == 0) continue;
        const auto dt = a.scalar_type();
        const int32_t kind = dt == torch::kBFloat16 ? PLK_BF16 : dt == torch::kChar ? PLK_INT8 : PLK_F32;
        TORCH_CHECK((dt == torch::kFloat32 || kind != PLK_F32) && b.scalar_type() == dt && a.is_contiguous() &&
                        b.is_contiguous() && a.device().is_cpu() && b.device().is_cpu(),
                    names[j], ": LoRA slots must be contiguous CPU float32, bfloat16 or int8 tensors of one dtype");
        TORCH_CHECK(a.dim() == 3 && a.size(1) <= 4096, names[j], ": LoRA slots at most 4096 wide");
        if (kind == PLK_INT8)
          for (const torch::Tensor* sc : {&sa, &sb})
            TORCH_CHECK(sc->scalar_type() == torch::kFloat32 && sc->is_contiguous() && sc->dim() == 2 &&
                            sc->size(0) == a.size(0) && sc->size(1) == a.size(1),
                        names[j], ": int8 LoRA slots need float32 row scales [S, W] for a and b");
        TORCH_CHECK(a.dim() == 3 && a.size(2) == ins[j] && b.dim() == 3 && b.size(0) == a.size(0) &&
                        b.size(2) == outs[j] && b.size(1) == a.size(1),
                    names[j], ": LoRA slots must be a [S, W, ", ins[j], "] and b [S, W, ", outs[j], "] (B^T)");
        TORCH_CHECK(wd.scalar_type() == torch::kInt32 && wd.is_contiguous() && wd.numel() == a.size(0),
                    names[j], ": LoRA widths must be int32 [S]");
        L.lora[j] = DecoderLora{a.data_ptr(),
                                b.data_ptr(),
                                wd.data_ptr<int32_t>(),
                                a.size(1),
                                a.size(0),
                                kind,
                                kind == PLK_INT8 ? sa.data_ptr<float>() : nullptr,
                                kind == PLK_INT8 ? sb.data_ptr<float>() : nullptr};
        lora_slots_ = std::max(lora_slots_, a.size(0));
      }
      layers_.push_back(L);
    }
    s.layers = layers_.data();
    s.num_layers = static_cast<int64_t>(layers);
    s.final_norm = final_norm.data_ptr<float>();
    s.final_norm_b = optional_ptr(final_norm_b, s.hidden, "final norm bias");
    TORCH_CHECK(s.layer_norm || s.final_norm_b == nullptr, "a final norm bias is LayerNorm's");
    s.scale = static_cast<float>(scale);
    s.eps = static_cast<float>(eps);
    s.act = static_cast<int32_t>(act);
    // Tensor parallelism: a C function summing a vector over the ranks (e.g. the shared-memory all-reduce's hook),
    // called by one thread between barriers; 0 on one rank.
    s.all_reduce = reinterpret_cast<AllReduceFn>(all_reduce_fn);
    s.reduce_ctx = reinterpret_cast<void*>(all_reduce_ctx);
    handle_ = t_->decoder_create(&s);
    // Keep every tensor alive as long as the pointers above are in use.
    keep_ = std::move(layer_w);
    for (auto* list : {&k_caches, &v_caches, &cos_sin}) keep_.insert(keep_.end(), list->begin(), list->end());
    keep_.push_back(final_norm);
    if (final_norm_b.defined()) keep_.push_back(final_norm_b);
    keep_.insert(keep_.end(), sinks.begin(), sinks.end());
    keep_.insert(keep_.end(), lora.begin(), lora.end());
  }

  ~DecodeModel() { t_->decoder_destroy(handle_); }
  DecodeModel(const DecodeModel&) = delete;
  DecodeModel& operator=(const DecodeModel&) = delete;

  // x [R, H] in place: the step's tokens, row r at position positions[r] with cache slot slot_mapping[g, r], of the
  // request whose block table is row table_rows[r] of block_table [g, B, W], in a layer of KV cache group g (one
  // group: slot_mapping [R] and block_table [B, W] will do); it attends to that request's positions
  // 0 .. positions[r], whose keys and values are cached or written by the step's rows (a decode token and its
  // drafts). Consecutive rows of one request read their context together.
  // prompt: the rows are consecutive prompt tokens of one request, computed as the layer-by-layer path computes
  // prompt tokens: on bf16 panels (builds with AVX512-BF16), or with prompt_int8 on int8 inputs as generated rows.
  // lora_slots: int32 [R], each row's LoRA slot (-1: none), or None.
  void operator()(torch::Tensor x, torch::Tensor positions, torch::Tensor slot_mapping, torch::Tensor block_table,
                  torch::Tensor table_rows, bool prompt, std::optional<torch::Tensor> lora_slots,
                  bool prompt_int8) const {
    check_float(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == spec_.hidden, "x must be [R, H]");
    for (auto* t : {&positions, &slot_mapping, &block_table, &table_rows}) {
      check_index(*t, "index tensors");
      TORCH_CHECK(t->numel() >= 1, "empty index tensor");
    }
    const int64_t rows = x.size(0);
    TORCH_CHECK(positions.numel() == rows && table_rows.numel() == rows,
                "positions and table_rows must have ", rows, " entries, one per row of x");
    TORCH_CHECK(slot_mapping.numel() == num_groups_ * rows, "slot_mapping must be [", num_groups_, ", ", rows,
                "]: a slot per row in each KV cache group");
    const int64_t ng = num_groups_;
    TORCH_CHECK(block_table.dim() == 3 ? block_table.size(0) == ng : block_table.dim() == 2 && ng == 1,
                "block_table must be [B, W], or [groups, B, W] with ", ng, " KV cache groups");
    const int64_t* pp = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* of = table_rows.data_ptr<int64_t>();
    const int64_t reqs = block_table.size(-2), width = block_table.size(-1), bs = spec_.block_size;
    const int64_t* table = block_table.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(of[r] >= 0 && of[r] < reqs, "table row ", of[r], " of row ", r, " outside 0..", reqs - 1);
      TORCH_CHECK(pp[r] >= 0 && pp[r] < spec_.max_position, "position ", pp[r], " out of the rotary table's range");
      TORCH_CHECK(pp[r] < width * bs, "position ", pp[r], " past the block table's ", width * bs, " tokens");
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t slot = slots[g * rows + r];
        TORCH_CHECK(slot >= 0 && slot < spec_.num_blocks * bs, "slot ", slot, " out of range");
        check_block_ids(table + (g * reqs + of[r]) * width, pp[r] / bs + 1, spec_.num_blocks);
      }
    }
    if (prompt) {
      TORCH_CHECK(prompt_int8 || t_->bf16_native() != 0,
                  "prompt rows on bf16 panels run in the fused decoder only where the CPU has AVX512-BF16");
      for (int64_t r = 1; r < rows; ++r)
        TORCH_CHECK(pp[r] == pp[0] + r && of[r] == of[0], "prompt rows must be consecutive tokens of one request");
    }
    const int32_t* lora = nullptr;
    if (lora_slots.has_value() && lora_slots->defined()) {
      const torch::Tensor& ls = *lora_slots;
      TORCH_CHECK(ls.scalar_type() == torch::kInt32 && ls.is_contiguous() && ls.numel() == rows,
                  "lora_slots must be int32 [", rows, "]");
      lora = ls.data_ptr<int32_t>();
      for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK(lora[r] >= -1 && lora[r] < lora_slots_, "LoRA slot ", lora[r], " of row ", r, " out of range");
    }
    const int32_t mode = prompt ? (prompt_int8 ? 2 : 1) : 0;  // decoder_run's prompt: 1 bf16 panels, 2 int8 inputs
    t_->decoder_run(handle_, x.data_ptr<float>(), rows, pp, slots, table, reqs, width, of, mode, at::get_num_threads(),
                    lora);
  }

 private:
  std::shared_ptr<CpuOps> ops_;
  const PagedllmCpuOps* t_;
  DecoderSpec spec_{};
  int64_t num_groups_ = 1;  // KV cache groups: slot_mapping and block_table have one of each per group
  int64_t lora_slots_ = 0;  // LoRA slots of the layers (0: none)
  std::vector<DecoderLayer> layers_;
  std::vector<torch::Tensor> keep_;
  std::vector<std::shared_ptr<QuantMatrix>> quant_;  // kept alive with their tensors
  std::vector<std::shared_ptr<MoeLayer>> moe_;       // one per layer (null: dense), or none
  void* handle_ = nullptr;
};

// t += the other ranks' t, in place, for the Python side; the GIL is released while the ranks meet.
torch::Tensor shm_all_reduce(pagedllm::ShmAllReduce& self, torch::Tensor t) {
  TORCH_CHECK(t.device().is_cpu(), "all_reduce needs a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "all_reduce needs a dense tensor, got layout ", t.layout());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "all_reduce needs a float32 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor (it sums in place): call .contiguous() first");
  TORCH_CHECK(!t.requires_grad(), "all_reduce works in place outside autograd: the tensor must not require grad");
  float* data = t.data_ptr<float>();
  const int64_t n = t.numel();
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = self.run(data, n);
  }
  if (!ok) throw std::runtime_error(self.error());
  return t;
}

// The n-gram proposer's lookup, the contract of pagedllm/spec_decode/ngram_proposer.py: the longest n-gram,
// min_n <= n <= max_n, that ends `tokens` and also occurs earlier in it (the latest such occurrence among equally long
// ones); up to k tokens that followed it, fewer where the sequence ends first, none without a match. One backward
// scan: the first occurrence found at a length is the latest, and one of max_n (or as long as the sequence allows)
// ends the search.
std::vector<int64_t> ngram_propose(const py::array_t<int64_t, py::array::c_style>& tokens, int64_t min_n,
                                   int64_t max_n, int64_t k) {
  TORCH_CHECK(tokens.ndim() == 1, "ngram_propose needs a 1-D array of token ids, got ", tokens.ndim(), " dimensions");
  TORCH_CHECK(min_n >= 1 && max_n >= min_n, "ngram_propose needs 1 <= min_n <= max_n, got ", min_n, " and ", max_n);
  const int64_t len = tokens.shape(0);
  std::vector<int64_t> out;
  if (k <= 0 || len <= min_n) return out;
  const int64_t* t = tokens.data();
  const int64_t last = t[len - 1], cap = std::min(max_n, len - 1);
  int64_t best = 0, best_end = -1;
  for (int64_t e = len - 2; e >= min_n - 1; --e) {
    if (t[e] != last) continue;
    int64_t m = 1;  // tokens matched, backwards from e and from the last token
    while (m < cap && m <= e && t[e - m] == t[len - 1 - m]) ++m;
    if (m > best) {
      best = m, best_end = e;
      if (m == cap) break;
    }
  }
  if (best < min_n) return out;
  out.assign(t + best_end + 1, t + std::min(len, best_end + 1 + k));
  return out;
}

// Structured output's mask, the contract of ModelRunner._apply_grammar: logits[rows[i], t] = -inf for every token t
// whose bit in bitmask row i is 0 (bit t % 32 of word t / 32, least significant first), and for every token at or
// past the bitmask's 32 * words. A word of all ones (the usual one inside a JSON string) is skipped, one of zeros
// (most words of a key or a number) filled; the rows are split between torch's threads.
void apply_token_bitmask(torch::Tensor& logits, const py::array_t<int32_t, py::array::c_style>& bitmask,
                         const py::array_t<int64_t, py::array::c_style>& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 &&
                  logits.device().is_cpu(),
              "apply_token_bitmask needs float32 CPU logits [rows, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.ndim() == 2, "apply_token_bitmask needs an int32 bitmask [n, words]");
  TORCH_CHECK(rows.ndim() == 1 && rows.shape(0) == bitmask.shape(0),
              "apply_token_bitmask needs int64 rows, one per bitmask row");
  const int64_t n = bitmask.shape(0), words = bitmask.shape(1), vocab = logits.size(1), stride = logits.stride(0);
  const int64_t* row_ids = rows.data();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "apply_token_bitmask: row ", row_ids[i],
                " is outside the ", logits.size(0), " logits rows");
  float* base = logits.data_ptr<float>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, 32 * words), full = covered / 32;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + row_ids[i] * stride;
      const uint32_t* m = mask + i * words;
      for (int64_t w = 0; w < full; ++w) {
        const uint32_t bits = m[w];
        if (bits == 0xFFFFFFFFu) continue;
        float* p = row + 32 * w;
        if (bits == 0) {
          for (int b = 0; b < 32; ++b) p[b] = kNegInf;  // a constant count: vector stores
          continue;
        }
        for (uint32_t zeros = ~bits; zeros != 0; zeros &= zeros - 1) p[__builtin_ctz(zeros)] = kNegInf;
      }
      for (int64_t t = 32 * full; t < covered; ++t)
        if (!((m[full] >> (t - 32 * full)) & 1u)) row[t] = kNegInf;
      std::fill(row + covered, row + vocab, kNegInf);
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedllm's native CPU kernels: the torch-facing bindings of one ISA build at a time";
  m.def("detect_isa", &detect_isa, "the best kernel build this CPU runs: avx512, avx2 or generic");
  m.attr("abi") = PAGEDLLM_CPU_ABI;
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("bitmask"), py::arg("rows"),
        "-inf in logits row rows[i] for the tokens whose bit in bitmask row i is 0 (and past the bitmask)");
  m.def("ngram_propose", &ngram_propose, py::arg("tokens"), py::arg("min_n"), py::arg("max_n"), py::arg("k"),
        "up to k draft tokens: what followed the latest longest earlier occurrence of the n-gram ending tokens");
  py::class_<CpuOps, std::shared_ptr<CpuOps>>(m, "CpuOps")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def_property_readonly("isa", &CpuOps::isa)
      .def_property_readonly("source_hash", &CpuOps::source_hash)
      .def("panel_width", &CpuOps::panel_width)
      .def("encoder_attention", &CpuOps::encoder_attention, py::arg("qkv"), py::arg("starts"), py::arg("heads"),
           py::arg("dim"), py::arg("scale"),
           "an encoder's bidirectional attention: qkv [T, 3 H D], each run [starts[b], starts[b + 1]) over its own "
           "tokens -> [T, H D]")
      .def("silu_and_mul", &CpuOps::silu_and_mul)
      .def("rms_norm", &CpuOps::rms_norm)
      .def("sample_inverse", &CpuOps::sample_inverse, py::arg("out"), py::arg("probs"), py::arg("u"),
           "out [R] = the token at u [R] (float64 in [0, 1)) of each row's cumulative distribution (probs [R, V])")
      .def("top_k_mask", &CpuOps::top_k_mask, py::arg("logits"), py::arg("top_k"),
           "in place: logits [R, V] to -inf outside each row's top_k largest (ties: lower ids; rows with 0 < k < V)")
      .def("top_p_mask", &CpuOps::top_p_mask, py::arg("logits"), py::arg("probs"), py::arg("top_p"),
           "in place: logits [R, V] to -inf outside each row's nucleus (rows with top_p < 1; probs = softmax(logits))")
      .def("sample_rows", &CpuOps::sample_rows, py::arg("out"), py::arg("logits"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
           "out [R] = each row's token: the argmax where temperature < 1e-5, else the draw at u [R] (float64 in [0, 1)) "
           "after temperature, top-k, top-p and min-p (each [R] or None); logits [R, V] are not modified")
      .def("fused_add_rms_norm", &CpuOps::fused_add_rms_norm)
      .def("gelu_tanh", &CpuOps::gelu_tanh, py::arg("out"), py::arg("x"), py::arg("gated"),
           "out [T, I] = gelu(x[:, :I], tanh) * x[:, I:] (gated, x [T, 2I]) or gelu(x, tanh) (x [T, I])")
      .def("layer_norm", &CpuOps::layer_norm, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias"),
           py::arg("eps"))
      .def("fused_add_layer_norm", &CpuOps::fused_add_layer_norm, py::arg("x"), py::arg("residual"),
           py::arg("weight"), py::arg("bias"), py::arg("eps"), "in place: residual += x; x = layer_norm(residual)")
      .def("rotary_inplace", &CpuOps::rotary_inplace)
      .def("pack_panels", &CpuOps::pack_panels, py::arg("weight"), py::arg("out") = py::none())
      .def("panel_linear", &CpuOps::panel_linear, py::arg("x"), py::arg("panels"), py::arg("bias"),
           py::arg("out_features"))
      .def("bf16_pack_panels", &CpuOps::bf16_pack_panels, py::arg("weight"), py::arg("out") = py::none())
      .def("bf16_panel_shape", &CpuOps::bf16_panel_shape, py::arg("out_features"), py::arg("in_features"))
      .def("bf16_panel_linear", &CpuOps::bf16_panel_linear, py::arg("x"), py::arg("panels"), py::arg("bias"),
           py::arg("out_features"))
      .def("bf16_native", &CpuOps::bf16_native, "whether this build multiplies bf16 in hardware (AVX512-BF16)")
      .def("bf16_amx", &CpuOps::bf16_amx, py::arg("mode") = -1,
           "AMX for many rows' bf16 panels: mode 0 off, 1 on where the CPU and the OS have it, -1 ask; whether it is on")
      .def("quant_dot_max_rows", &CpuOps::quant_dot_max_rows,
           "rows up to which quant_linear runs on int8 products (more: de-quantized float32 panels)")
      .def("quant_row_bytes", &CpuOps::quant_row_bytes, py::arg("type"), py::arg("in_features"),
           "bytes of a row of in_features weights of GGML type `type`; 0 when no kernel runs it")
      .def(
          "quant_matrix",
          [](const CpuOps& self, const std::vector<int64_t>& types, std::vector<torch::Tensor> parts, int64_t in) {
            return std::make_shared<QuantMatrix>(self, types, std::move(parts), in);
          },
          py::arg("types"), py::arg("parts"), py::arg("in_features"),
          "a quantized weight from its row segments (uint8 [rows, row_bytes] each, of GGML type types[i])")
      .def("quant_linear", &quant_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
           py::arg("int8") = false,
           "y [M, out] = x [M, in] W^T (+ bias) on a QuantMatrix; where it is wholly packed, int8 chooses int8 inputs "
           "or de-quantized panels for any M; elsewhere int8 inputs up to quant_dot_max_rows rows, panels beyond")
      .def("dequantize_rows", &quant_dequantize_rows, py::arg("weight"), py::arg("ids"),
           "rows `ids` of a QuantMatrix in float32: [*ids.shape, in]")
      .def("paged_decode_attention", &CpuOps::paged_decode_attention, py::arg("out"), py::arg("q"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
           py::arg("softcap") = 0.0, py::arg("sinks") = py::none())
      .def("paged_prefill_attention", &CpuOps::paged_prefill_attention, py::arg("out"), py::arg("q"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("segments"), py::arg("scale"),
           py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none())
      .def(
          "moe_layer",
          [](std::shared_ptr<CpuOps> self, torch::Tensor router, std::optional<torch::Tensor> router_b, int64_t top_k,
             int64_t scoring, bool renorm, int64_t act, double alpha, double limit, int64_t hidden, int64_t inter,
             std::vector<std::shared_ptr<QuantMatrix>> w13_quant, std::vector<std::shared_ptr<QuantMatrix>> w2_quant,
             std::optional<torch::Tensor> w13_panels, std::optional<torch::Tensor> w2_panels,
             std::optional<torch::Tensor> b13, std::optional<torch::Tensor> b2) {
            return std::make_shared<MoeLayer>(std::move(self), router, router_b, top_k, scoring, renorm, act, alpha,
                                              limit, hidden, inter, std::move(w13_quant), std::move(w2_quant),
                                              w13_panels, w2_panels, b13, b2);
          },
          py::arg("router"), py::arg("router_bias"), py::arg("top_k"), py::arg("scoring"), py::arg("renorm"),
          py::arg("act"), py::arg("alpha"), py::arg("limit"), py::arg("hidden"), py::arg("inter"),
          py::arg("w13_quant") = std::vector<std::shared_ptr<QuantMatrix>>{},
          py::arg("w2_quant") = std::vector<std::shared_ptr<QuantMatrix>>{}, py::arg("w13_panels") = py::none(),
          py::arg("w2_panels") = py::none(), py::arg("b13") = py::none(), py::arg("b2") = py::none(),
          "a mixture-of-experts MLP's weights for the fused experts kernel (MoeExperts in kernels.h)")
      .def(
          "decode_model",
          [](std::shared_ptr<CpuOps> self, std::vector<torch::Tensor> layer_w, std::vector<torch::Tensor> k_caches,
             std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> cos_sin, double scale, double eps,
             torch::Tensor final_norm, uintptr_t all_reduce_fn, uintptr_t all_reduce_ctx,
             std::vector<std::shared_ptr<QuantMatrix>> quant, std::vector<int64_t> windows, int64_t act,
             std::vector<int64_t> groups, std::vector<double> softcaps, std::vector<int64_t> kinds,
             double residual_mult, std::optional<torch::Tensor> final_norm_b,
             std::vector<std::shared_ptr<MoeLayer>> moe, std::vector<double> clips, std::vector<torch::Tensor> sinks,
             std::vector<torch::Tensor> lora) {
            return std::make_unique<DecodeModel>(std::move(self), std::move(layer_w), std::move(k_caches),
                                                 std::move(v_caches), std::move(cos_sin), scale, eps, final_norm,
                                                 all_reduce_fn, all_reduce_ctx, std::move(quant), std::move(windows),
                                                 act, std::move(groups), std::move(softcaps), std::move(kinds),
                                                 residual_mult, final_norm_b.value_or(torch::Tensor()),
                                                 std::move(moe), std::move(clips), std::move(sinks), std::move(lora));
          },
          py::arg("layer_w"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos_sin"), py::arg("scale"),
          py::arg("eps"), py::arg("final_norm"), py::arg("all_reduce_fn") = 0, py::arg("all_reduce_ctx") = 0,
          py::arg("quant") = std::vector<std::shared_ptr<QuantMatrix>>{}, py::arg("windows") = std::vector<int64_t>{},
          py::arg("act") = 0, py::arg("groups") = std::vector<int64_t>{},
          py::arg("softcaps") = std::vector<double>{}, py::arg("kinds") = std::vector<int64_t>{},
          py::arg("residual_mult") = 1.0, py::arg("final_norm_b") = py::none(),
          py::arg("moe") = std::vector<std::shared_ptr<MoeLayer>>{}, py::arg("clips") = std::vector<double>{},
          py::arg("sinks") = std::vector<torch::Tensor>{}, py::arg("lora") = std::vector<torch::Tensor>{},
          "the fused decoder (a decode step's tokens: one per request, or a request's token and its drafts) over these "
          "weights and caches; with tensor parallelism, the all-reduce hook (a C AllReduceFn and its context, as "
          "integers)");
  py::class_<MoeLayer, std::shared_ptr<MoeLayer>>(m, "MoeLayer")
      .def_property_readonly("num_experts", &MoeLayer::num_experts)
      .def_property_readonly("hidden", &MoeLayer::hidden)
      .def_property_readonly("inter", &MoeLayer::inter)
      .def("__call__", &MoeLayer::forward, py::arg("x"), py::arg("int8"),
           "y [T, hidden] = the MoE MLP of x [T, hidden]; int8: a bool, or a bool [T] mask of the rows whose inputs "
           "to quantized experts are int8 (generated tokens)");
  py::class_<QuantMatrix, std::shared_ptr<QuantMatrix>>(m, "QuantMatrix")
      .def_property_readonly("out_features", &QuantMatrix::out_features)
      .def_property_readonly("in_features", &QuantMatrix::in_features)
      .def_property_readonly("nbytes", &QuantMatrix::nbytes)
      .def_property_readonly("packed_rows", &QuantMatrix::packed_rows,
                             "rows the kernels hold in their interleaved layout (quant_pack), the rest as stored");
  py::class_<DecodeModel>(m, "DecodeModel")
      .def("__call__", &DecodeModel::operator(), py::arg("x"), py::arg("positions"), py::arg("slot_mapping"),
           py::arg("block_table"), py::arg("table_rows"), py::arg("prompt") = false, py::arg("lora_slots") = py::none(),
           py::arg("prompt_int8") = false);
#ifdef PAGEDLLM_SOURCE_HASH
  m.attr("source_hash") = PAGEDLLM_SOURCE_HASH;  // of the sources this module was built from (setup.py)
#endif
  using pagedllm::ShmAllReduce;
  py::class_<ShmAllReduce>(m, "ShmAllReduce",
                           "sum all-reduce of float32 vectors between the processes of one machine, through the "
                           "POSIX shared-memory segment `name` (created by the rank with create=True)")
      .def(py::init([](const std::string& name, int rank, int world_size, int64_t max_floats, bool create,
                       double timeout_s) {
             py::gil_scoped_release nogil;  // a peer may wait for its creator up to timeout_s
             return std::make_unique<ShmAllReduce>(name, rank, world_size, max_floats, create, timeout_s);
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("max_floats"), py::arg("create"),
           py::arg("timeout_s") = 30.0)
      .def("wait_for_peers", &ShmAllReduce::wait_for_peers, py::call_guard<py::gil_scoped_release>(),
           "wait until every rank opened the segment; the creator then unlinks its name")
      .def("all_reduce", &shm_all_reduce, py::arg("tensor"),
           "sum a contiguous float32 CPU tensor over the ranks, in place; returns it")
      .def("close", &ShmAllReduce::close, "leave the group (peers still waiting for this rank fail at once)")
      .def(
          "hook",
          [](ShmAllReduce& self) {
            return py::make_tuple(reinterpret_cast<uintptr_t>(&pagedllm_shm_all_reduce),
                                  reinterpret_cast<uintptr_t>(&self));
          },
          "(fn, ctx) as integers: the fused decoder's AllReduceFn and its context (valid while this object lives)")
      .def(
          "check",
          [](const ShmAllReduce& self) {
            if (self.broken()) throw std::runtime_error(self.error());
          },
          "after calls through hook(): raise the error of one that failed (or that this object is closed)")
      .def_property_readonly("error",
                             [](const ShmAllReduce& self) -> std::optional<std::string> {
                               if (!self.broken()) return std::nullopt;
                               return self.error();
                             })
      .def_property_readonly("closed", &ShmAllReduce::closed)
      .def_property_readonly("name", &ShmAllReduce::name)
      .def_property_readonly("rank", &ShmAllReduce::rank)
      .def_property_readonly("world_size", &ShmAllReduce::world_size)
      .def_property_readonly("max_floats", &ShmAllReduce::max_floats)
      .def_property_readonly("timeout_s", &ShmAllReduce::timeout_s)
      .def_property_readonly("calls", &ShmAllReduce::calls);
}
