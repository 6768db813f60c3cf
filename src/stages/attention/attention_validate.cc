// Host validation of the attention stage (SPEC section 8): shared by the CPU twin and the CUDA
// launcher.
#include <cmath>
#include <cstdint>
#include <limits>

#include "cache/cache_view.h"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "stages/indexer/indexer.h"
#include "stages/quantize/quantize.h"

namespace m3attn {

QuantizeParams attention_out_quantize_params(const AttentionParams& p) {
  QuantizeParams q;
  q.rows = p.batch.num_tokens;
  q.in = p.out;
  q.out = p.out_q;
  q.scales = p.out_scales;
  return q;
}

Status validate_attention(const AttentionParams& p) {
  M3_CHECK_ARG(p.n_q > 0, "attention: n_q (query heads) must be > 0, got ", p.n_q);
  M3_CHECK_ARG(p.n_kv > 0, "attention: n_kv (KV heads) must be > 0, got ", p.n_kv);
  M3_CHECK_ARG(p.n_q % p.n_kv == 0, "attention: n_q ", p.n_q, " is not a multiple of n_kv ", p.n_kv,
               " (GQA groups must be whole)");
  M3_CHECK_ARG(std::isfinite(p.softmax_scale) && p.softmax_scale >= 0.0f,
               "attention: softmax_scale ", p.softmax_scale,
               " must be finite and > 0 (or 0 for 1/sqrt(128))");
  M3_RETURN_IF_ERROR(validate_batch_view(p.batch, "attention"));
  const int64_t T = p.batch.num_tokens;
  M3_CHECK_ARG(T <= std::numeric_limits<int32_t>::max(), "attention: token count ", T,
               " exceeds the int32 range of positions and grid indices");

  M3_RETURN_IF_ERROR(check_packed(p.q, DType::kE4M3, {T, p.n_q, kHeadDim}, 16, "attention q"));

  M3_RETURN_IF_ERROR(validate_kv_cache(p.kv_cache, p.n_kv, "attention KV cache"));

  if (p.sparse) {
    M3_RETURN_IF_ERROR(validate_block_ids(p.block_ids, T, p.n_kv, "attention block_ids"));
  }

  const int64_t width = int64_t{p.n_q} * kHeadDim;
  M3_RETURN_IF_ERROR(check_dtype(p.out, DType::kBF16, "attention out"));
  M3_RETURN_IF_ERROR(check_shape(p.out, {T, width}, "attention out"));
  M3_CHECK_ARG(p.out.stride[1] == 1, "attention out: last stride must be 1, got ", p.out.stride[1]);
  M3_CHECK_ARG(p.out.stride[0] >= width, "attention out: row stride ", p.out.stride[0],
               " is smaller than the row width ", width);
  M3_CHECK_ARG(p.out.stride[0] % 8 == 0, "attention out: row stride ", p.out.stride[0],
               " is not a multiple of 8 elements (16-byte rows)");
  M3_RETURN_IF_ERROR(check_alignment(p.out, 16, "attention out"));

  const bool quantized = attention_quantizes_out(p);
  M3_CHECK_ARG(quantized == (p.out_scales.data != nullptr),
               "attention out_q / out_scales: give both or neither (out_q ",
               p.out_q.data != nullptr ? "set" : "null", ", out_scales ",
               p.out_scales.data != nullptr ? "set" : "null", ")");
  if (quantized) M3_RETURN_IF_ERROR(validate_quantize(attention_out_quantize_params(p)));

  const TensorView none;
  M3_RETURN_IF_ERROR(check_same_device(
      {&p.q, &p.kv_cache, p.sparse ? &p.block_ids : &none, &p.out, &p.batch.query_start,
       &p.batch.positions, &p.batch.seq_lens, &p.batch.page_table, quantized ? &p.out_q : &none,
       quantized ? &p.out_scales : &none},
      "attention"));
  return Status::Ok();
}

}  // namespace m3attn
