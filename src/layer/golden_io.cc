#include "layer/golden_io.h"

#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "m3attn/config.h"

namespace m3attn {

namespace {
constexpr const char* kHidden = "input.hidden_states";
constexpr const char* kPositions = "input.positions";
}  // namespace

Result<GoldenInputs> golden_inputs_from_file(const SafetensorsFile& file, int64_t hidden_size) {
  const std::string& src = file.path();
  const SafetensorsEntry* h = file.find(kHidden);
  M3_CHECK_ARG(h != nullptr, src, ": missing tensor ", kHidden);
  M3_CHECK_ARG(h->dtype == DType::kBF16 || h->dtype == DType::kF32, src, ": ", kHidden,
               " must be BF16 or F32, got ", dtype_name(h->dtype));
  M3_CHECK_ARG(h->shape.size() == 2, src, ": ", kHidden, " must be [T, hidden], got ",
               h->shape_string());
  const int64_t T = h->shape[0], H = h->shape[1];
  M3_CHECK_ARG(T > 0, src, ": ", kHidden, " has no tokens");
  M3_CHECK_ARG(T < (int64_t{1} << 31), src, ": ", kHidden, " has ", T, " tokens (max 2^31 - 1)");
  if (hidden_size > 0) {
    M3_CHECK_ARG(H == hidden_size, src, ": ", kHidden, " width ", H,
                 " does not match the layer's hidden size ", hidden_size);
  } else {
    M3_CHECK_ARG(H > 0 && H % kQuantBlock == 0, src, ": ", kHidden, " width ", H,
                 " must be a positive multiple of ", kQuantBlock);
  }
  const SafetensorsEntry* p = file.find(kPositions);
  M3_CHECK_ARG(p != nullptr, src, ": missing tensor ", kPositions);
  M3_CHECK_ARG(p->dtype == DType::kI32, src, ": ", kPositions, " must be I32, got ",
               dtype_name(p->dtype));
  M3_CHECK_ARG(p->shape.size() == 1 && p->shape[0] == T, src, ": ", kPositions, " must be [", T,
               "], got ", p->shape_string());

  Result<TensorView> hv = file.view(kHidden);
  M3_RETURN_IF_ERROR(hv.status());
  Result<Tensor> pos = file.read(kPositions);
  M3_RETURN_IF_ERROR(pos.status());
  const int32_t* pp = pos.value().ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    M3_CHECK_ARG(pp[t] == t, src, ": ", kPositions, "[", t, "] = ", pp[t], ", expected ", t,
                 " (one sequence prefilled from position 0)");

  GoldenInputs in;
  in.positions = std::move(pos.value());
  in.hidden = Tensor(DType::kBF16, {T, H});
  uint16_t* dst = in.hidden.ptr<uint16_t>();
  if (h->dtype == DType::kBF16) {
    std::memcpy(dst, file.bytes(*h), static_cast<size_t>(T * H * 2));
  } else {
    const uint8_t* raw = file.bytes(*h);
    for (int64_t i = 0; i < T * H; ++i) {
      float x;
      std::memcpy(&x, raw + i * 4, 4);  // the data region need not be 4-byte aligned
      dst[i] = float_to_bf16(x);
    }
  }
  for (int64_t i = 0; i < T * H; ++i) {
    const float x = bf16_to_float(dst[i]);
    M3_CHECK_ARG(std::isfinite(x), src, ": ", kHidden, " holds a non-finite value at token ", i / H,
                 ", channel ", i % H);
  }
  return in;
}

Result<GoldenInputs> read_golden_inputs(const std::string& path, int64_t hidden_size) {
  Result<SafetensorsFile> f = SafetensorsFile::open(path);
  M3_RETURN_IF_ERROR(f.status());
  return golden_inputs_from_file(f.value(), hidden_size);
}

Status write_golden_inputs(const std::string& path, const TensorView& hidden,
                           const TensorView& positions) {
  return write_safetensors(path, {{kHidden, hidden}, {kPositions, positions}});
}

std::vector<NamedTensor> golden_dump_tensors(const TensorView& attn_out, const LayerTrace& trace) {
  std::vector<NamedTensor> out = {{"output.attn_out", attn_out},
                                  {"output.attn_core", trace.attn_core.view()}};
  const bool sparse = !trace.block_ids.shape().empty();
  if (sparse) out.emplace_back("output.block_ids", trace.block_ids.view());
  out.emplace_back("inter.q", trace.q.view());
  out.emplace_back("inter.k", trace.k.view());
  out.emplace_back("inter.v", trace.v.view());
  if (sparse) {
    out.emplace_back("inter.index_q", trace.index_q.view());
    out.emplace_back("inter.index_k", trace.index_k.view());
  }
  return out;
}

Status write_golden_dump(const std::string& path, const TensorView& attn_out,
                         const LayerTrace& trace,
                         const std::map<std::string, std::string>& metadata) {
  return write_safetensors(path, golden_dump_tensors(attn_out, trace), metadata);
}

}  // namespace m3attn
