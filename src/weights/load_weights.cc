// load_attention_weights: HF tensor names -> AttentionWeights (formats: see packing.h).
#include <cmath>
#include <cstring>
#include <string>

#include "core/numeric.h"
#include "weights/hf_config.h"
#include "weights/packing.h"

namespace m3attn {

namespace {

constexpr const char* kKnownPrefixes[] = {"model.", "language_model.model.",
                                          "model.language_model.", "language_model."};

class LayerReader {
 public:
  LayerReader(const Checkpoint& ckpt, std::string base) : ckpt_(ckpt), base_(std::move(base)) {}

  std::string name(const std::string& leaf) const { return base_ + leaf; }
  const SafetensorsEntry* find(const std::string& leaf) const { return ckpt_.find(name(leaf)); }

  // A projection `<proj>.weight` of shape [rows, cols] in any supported format.
  Result<QuantizedMatrix> projection(const std::string& proj, int64_t rows, int64_t cols) const {
    const std::string wname = name(proj + ".weight");
    const SafetensorsEntry* e = ckpt_.find(wname);
    if (e == nullptr) return invalid_argument("checkpoint has no tensor \"", wname, "\"");
    if (e->shape != std::vector<int64_t>{rows, cols})
      return invalid_argument("tensor \"", wname, "\" has shape ", e->shape_string(),
                              ", expected [", rows, ", ", cols, "]");
    if (!e->supported)
      return unsupported("tensor \"", wname, "\" has dtype ", e->dtype_string,
                         " (projections must be BF16, F32 or F8_E4M3)");
    Result<QuantizedMatrix> q = Status::Ok();
    if (e->dtype == DType::kBF16 || e->dtype == DType::kF32) {
      auto t = ckpt_.read(wname);  // a copy: always aligned
      M3_RETURN_IF_ERROR(t.status());
      q = quantize_blocks_128(t.value().view());
    } else if (e->dtype == DType::kE4M3) {
      q = fp8(proj, wname, *e);
    } else {
      return unsupported("tensor \"", wname, "\" has dtype ", e->dtype_string,
                         " (projections must be BF16, F32 or F8_E4M3)");
    }
    if (!q.ok())
      return make_status(q.status().code(), "tensor \"", wname, "\": ", q.status().message());
    return q;
  }

  // A norm weight `<norm>.weight`: BF16 or F32 [128], kept as BF16.
  Result<Tensor> norm(const std::string& leaf) const {
    const std::string n = name(leaf + ".weight");
    const SafetensorsEntry* e = ckpt_.find(n);
    if (e == nullptr) return invalid_argument("checkpoint has no tensor \"", n, "\"");
    if (e->shape != std::vector<int64_t>{kHeadDim})
      return invalid_argument("tensor \"", n, "\" has shape ", e->shape_string(), ", expected [",
                              kHeadDim, "]");
    if (!e->supported || (e->dtype != DType::kBF16 && e->dtype != DType::kF32))
      return unsupported("tensor \"", n, "\" has dtype ", e->dtype_string,
                         " (norm weights must be BF16 or F32)");
    auto t = ckpt_.read(n);
    M3_RETURN_IF_ERROR(t.status());
    if (e->dtype == DType::kBF16) return std::move(t).value();
    Tensor out(DType::kBF16, {kHeadDim});
    for (int i = 0; i < kHeadDim; ++i) {
      const float x = t.value().ptr<float>()[i];
      M3_CHECK_ARG(std::isfinite(x), "tensor \"", n, "\"[", i, "] is not finite");
      out.ptr<uint16_t>()[i] = float_to_bf16(x);
    }
    return out;
  }

 private:
  Result<QuantizedMatrix> fp8(const std::string& proj, const std::string& wname,
                              const SafetensorsEntry& e) const {
    const int64_t rows = e.shape[0], cols = e.shape[1];
    auto w = ckpt_.read(wname);
    M3_RETURN_IF_ERROR(w.status());
    const std::string inv_name = name(proj + ".weight_scale_inv");
    const std::string sc_name = name(proj + ".weight_scale");
    if (const SafetensorsEntry* s = ckpt_.find(inv_name)) {
      if (!s->supported || s->dtype != DType::kF32)
        return unsupported("tensor \"", inv_name, "\" has dtype ", s->dtype_string,
                           " (128x128 block scales must be F32)");
      auto st = ckpt_.read(inv_name);
      M3_RETURN_IF_ERROR(st.status());
      return from_fp8_block(w.value().view(), st.value().view());
    }
    const SafetensorsEntry* s = ckpt_.find(sc_name);
    if (s == nullptr)
      return invalid_argument("FP8 weight has neither \"", inv_name, "\" nor \"", sc_name, "\"");
    const bool e8m0 = s->dtype_string == "F8_E8M0" || s->dtype_string == "U8";
    if (e8m0) {
      if (s->shape != std::vector<int64_t>{rows, cols / 32})
        return invalid_argument("tensor \"", sc_name, "\" has shape ", s->shape_string(),
                                ", expected MXFP8 scales [", rows, ", ", cols / 32, "]");
      // U8 and F8_E8M0 hold the same bits: view the raw bytes as E8M0.
      const SafetensorsFile* f = ckpt_.file_of(sc_name);
      const uint8_t* bytes = f->bytes(*s);
      const TensorView sv =
          TensorView::contiguous(const_cast<uint8_t*>(bytes), DType::kE8M0, {rows, cols / 32});
      return requantize_mxfp8(w.value().view(), sv);
    }
    if (s->supported && s->dtype == DType::kF32) {
      auto st = ckpt_.read(sc_name);
      M3_RETURN_IF_ERROR(st.status());
      return from_fp8_block(w.value().view(), st.value().view());
    }
    return unsupported("tensor \"", sc_name, "\" has dtype ", s->dtype_string,
                       " (expected F8_E8M0/U8 MXFP8 scales or F32 block scales)");
  }

  const Checkpoint& ckpt_;
  std::string base_;
};

}  // namespace

Result<AttentionWeights> load_attention_weights(const Checkpoint& ckpt, int layer,
                                                const AttentionLoadOptions& options) {
  M3_CHECK_ARG(layer >= 0, "layer index ", layer, " is negative");
  const M3Config* cfg = options.config;
  if (cfg != nullptr)
    M3_CHECK_ARG(layer < cfg->num_layers && layer < static_cast<int>(cfg->sparse_layer.size()),
                 "layer ", layer, " is outside the config's ", cfg->num_layers, " layers (",
                 cfg->sparse_layer.size(), " sparse flags)");
  const std::string tail = "layers." + std::to_string(layer) + ".self_attn.";
  std::string base;
  if (!options.prefix.empty()) {
    base = options.prefix + tail;
  } else {
    for (const char* p : kKnownPrefixes) {
      if (ckpt.contains(std::string(p) + tail + "q_proj.weight")) {
        base = std::string(p) + tail;
        break;
      }
    }
    if (base.empty())
      return invalid_argument("checkpoint has no tensor \"model.", tail,
                              "q_proj.weight\" (also tried the prefixes language_model.model., "
                              "model.language_model. and language_model.)");
  }
  const LayerReader rd(ckpt, base);

  // Geometry from the shapes.
  const SafetensorsEntry* qe = rd.find("q_proj.weight");
  const SafetensorsEntry* ke = rd.find("k_proj.weight");
  if (qe == nullptr)
    return invalid_argument("checkpoint has no tensor \"", rd.name("q_proj.weight"), "\"");
  if (ke == nullptr)
    return invalid_argument("checkpoint has no tensor \"", rd.name("k_proj.weight"), "\"");
  M3_CHECK_ARG(qe->shape.size() == 2 && qe->shape[0] > 0 && qe->shape[0] % kHeadDim == 0,
               "tensor \"", rd.name("q_proj.weight"), "\" has shape ", qe->shape_string(),
               ", expected [n_q * ", kHeadDim, ", hidden]");
  M3_CHECK_ARG(ke->shape.size() == 2 && ke->shape[0] > 0 && ke->shape[0] % kHeadDim == 0,
               "tensor \"", rd.name("k_proj.weight"), "\" has shape ", ke->shape_string(),
               ", expected [n_kv * ", kHeadDim, ", hidden]");
  AttentionWeights w;
  MsaGeometry& g = w.geometry;
  g.hidden = static_cast<int>(qe->shape[1]);
  g.n_q = static_cast<int>(qe->shape[0] / kHeadDim);
  g.n_kv = static_cast<int>(ke->shape[0] / kHeadDim);
  g.rope_theta = cfg ? static_cast<float>(cfg->rope_theta) : options.rope_theta;
  g.eps = cfg ? cfg->eps : options.eps;
  M3_RETURN_IF_ERROR(g.validate());
  if (cfg != nullptr) {
    M3_CHECK_ARG(g.hidden == cfg->hidden && g.n_q == cfg->n_q && g.n_kv == cfg->n_kv, "layer ",
                 layer, " tensor shapes give ", g.to_string(), " but the config says hidden ",
                 cfg->hidden, ", q heads ", cfg->n_q, ", kv heads ", cfg->n_kv);
  }
  const bool has_index = rd.find("index_q_proj.weight") != nullptr;
  w.sparse = cfg ? cfg->sparse_layer[layer] : has_index;
  if (cfg != nullptr && !w.sparse && has_index)
    return invalid_argument("layer ", layer, " is dense in the config but the checkpoint has \"",
                            rd.name("index_q_proj.weight"), "\"");

  const int64_t d = kHeadDim;
  auto take = [](Result<QuantizedMatrix> r, QuantizedMatrix* out) -> Status {
    M3_RETURN_IF_ERROR(r.status());
    *out = std::move(r).value();
    return Status::Ok();
  };
  auto take_norm = [](Result<Tensor> r, Tensor* out) -> Status {
    M3_RETURN_IF_ERROR(r.status());
    *out = std::move(r).value();
    return Status::Ok();
  };
  M3_RETURN_IF_ERROR(take(rd.projection("q_proj", g.n_q * d, g.hidden), &w.q));
  M3_RETURN_IF_ERROR(take(rd.projection("k_proj", g.n_kv * d, g.hidden), &w.k));
  M3_RETURN_IF_ERROR(take(rd.projection("v_proj", g.n_kv * d, g.hidden), &w.v));
  M3_RETURN_IF_ERROR(take(rd.projection("o_proj", g.hidden, g.n_q * d), &w.o));
  M3_RETURN_IF_ERROR(take_norm(rd.norm("q_norm"), &w.q_norm));
  M3_RETURN_IF_ERROR(take_norm(rd.norm("k_norm"), &w.k_norm));
  if (w.sparse) {
    M3_RETURN_IF_ERROR(take(rd.projection("index_q_proj", g.n_idx() * d, g.hidden), &w.index_q));
    M3_RETURN_IF_ERROR(take(rd.projection("index_k_proj", d, g.hidden), &w.index_k));
    M3_RETURN_IF_ERROR(take_norm(rd.norm("index_q_norm"), &w.index_q_norm));
    M3_RETURN_IF_ERROR(take_norm(rd.norm("index_k_norm"), &w.index_k_norm));
  }
  M3_RETURN_IF_ERROR(w.validate());
  return w;
}

Result<AttentionWeights> load_attention_weights(const SafetensorsFile& file, int layer,
                                                const AttentionLoadOptions& options) {
  auto ckpt = Checkpoint::from_files({file});
  M3_RETURN_IF_ERROR(ckpt.status());
  return load_attention_weights(ckpt.value(), layer, options);
}

}  // namespace m3attn
