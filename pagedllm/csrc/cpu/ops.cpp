// The one symbol an ISA build of the kernels exports: its ops table (kernels.h).
#include "internal.h"
#include "simd.h"

#ifndef PAGEDLLM_SOURCE_HASH
#define PAGEDLLM_SOURCE_HASH "unknown"
#endif

extern "C" const PagedllmCpuOps* pagedllm_cpu_ops(void) {
  static const PagedllmCpuOps table = {
      PAGEDLLM_CPU_ABI,
      PAGEDLLM_ISA_NAME,
      PAGEDLLM_SOURCE_HASH,
      pagedllm::kPanel,
      pagedllm::silu_and_mul,
      pagedllm::rms_norm,
      pagedllm::fused_add_rms_norm,
      pagedllm::gelu_tanh,
      pagedllm::layer_norm,
      pagedllm::fused_add_layer_norm,
      pagedllm::rotary,
      pagedllm::pack_panels,
      pagedllm::panel_linear,
      pagedllm::paged_decode,
      pagedllm::paged_prefill,
      pagedllm::decoder_create,
      pagedllm::decoder_run,
      pagedllm::decoder_destroy,
      pagedllm::quant_row_bytes,
      pagedllm::quant_pack,
      pagedllm::quant_linear,
      pagedllm::quant_dequantize_rows,
      pagedllm::quant_dot_max_rows,
      pagedllm::bf16_pack_panels,
      pagedllm::bf16_panel_linear,
      pagedllm::bf16_has_native,
      pagedllm::bf16_amx,
      pagedllm::moe_forward,
      pagedllm::sample_inverse,
      pagedllm::top_k_mask,
      pagedllm::top_p_mask,
      pagedllm::sample_rows,
      pagedllm::encoder_attention,
  };
  return &table;
}
