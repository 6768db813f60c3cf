#include "weights/hf_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

namespace m3attn {

using nlohmann::json;

int M3Config::num_sparse_layers() const {
  int n = 0;
  for (bool s : sparse_layer) n += s ? 1 : 0;
  return n;
}

MsaGeometry M3Config::geometry() const {
  MsaGeometry g;
  g.hidden = hidden;
  g.n_q = n_q;
  g.n_kv = n_kv;
  g.rope_theta = static_cast<float>(rope_theta);
  g.eps = eps;
  return g;
}

std::string M3Config::to_string() const {
  std::ostringstream os;
  os << "hidden " << hidden << ", layers " << num_layers << " (" << num_sparse_layers()
     << " sparse), q heads " << n_q << ", kv heads " << n_kv << ", head dim " << head_dim
     << ", index heads " << n_idx << " x " << index_dim << ", rotary " << rotary_dim << ", theta "
     << rope_theta << ", eps " << eps << ", block " << block_size << ", top-k " << topk_blocks
     << ", vocab " << vocab;
  return os.str();
}

namespace {

// Typed access to one JSON object; `where` prefixes key names in messages
// ("sparse_attention_config.").
class Fields {
 public:
  Fields(const json& obj, std::string source, std::string where)
      : obj_(obj), source_(std::move(source)), where_(std::move(where)) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  const json& at(const char* key) const { return obj_[key]; }
  std::string name(const char* key) const { return where_ + key; }

  // An integer in [lo, hi]; absent -> nullopt (or an error when required).
  Status get_int(const char* key, bool required, std::optional<int64_t>* out, int64_t lo = 0,
                 int64_t hi = std::numeric_limits<int32_t>::max()) const {
    out->reset();
    if (!has(key)) {
      if (required)
        return invalid_argument(source_, ": required key \"", name(key), "\" is missing");
      return Status::Ok();
    }
    const json& v = obj_[key];
    if (!v.is_number_integer())
      return invalid_argument(source_, ": \"", name(key), "\" must be an integer, got ", v.dump());
    const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}
                          ? INT64_MAX
                          : v.get<int64_t>();
    if (x < lo || x > hi)
      return invalid_argument(source_, ": \"", name(key), "\" = ", x, " is outside [", lo, ", ", hi,
                              "]");
    *out = x;
    return Status::Ok();
  }

  Status get_number(const char* key, bool required, std::optional<double>* out) const {
    out->reset();
    if (!has(key)) {
      if (required)
        return invalid_argument(source_, ": required key \"", name(key), "\" is missing");
      return Status::Ok();
    }
    const json& v = obj_[key];
    if (!v.is_number())
      return invalid_argument(source_, ": \"", name(key), "\" must be a number, got ", v.dump());
    *out = v.get<double>();
    return Status::Ok();
  }

 private:
  const json& obj_;
  std::string source_;
  std::string where_;
};

// Merges one setting given by up to two spellings: they must agree when both are present.
template <typename T>
Status merge(const std::string& source, const char* what, const std::optional<T>& a,
             const std::string& a_name, const std::optional<T>& b, const std::string& b_name,
             std::optional<T>* out) {
  if (a && b && *a != *b)
    return invalid_argument(source, ": ", what, " disagrees between \"", a_name, "\" (", *a,
                            ") and \"", b_name, "\" (", *b, ")");
  *out = a ? a : b;
  return Status::Ok();
}

}  // namespace

Result<M3Config> parse_m3_config(const std::string& json_text, const std::string& source) {
  const json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return data_loss(source, " is not valid JSON");
  if (!doc.is_object()) return invalid_argument(source, ": the config must be a JSON object");
  const json* root = &doc;
  std::string prefix;
  if (doc.contains("text_config")) {
    if (!doc["text_config"].is_object())
      return invalid_argument(source, ": \"text_config\" must be an object");
    root = &doc["text_config"];
    prefix = "text_config.";
  }
  const Fields top(*root, source, prefix);
  M3Config c;
  std::optional<int64_t> i;
  std::optional<double> d;

  M3_RETURN_IF_ERROR(top.get_int("hidden_size", true, &i, 1));
  c.hidden = static_cast<int>(*i);
  M3_RETURN_IF_ERROR(top.get_int("num_hidden_layers", true, &i, 1, 100000));
  c.num_layers = static_cast<int>(*i);
  M3_RETURN_IF_ERROR(top.get_int("num_attention_heads", true, &i, 1, 1 << 16));
  c.n_q = static_cast<int>(*i);
  M3_RETURN_IF_ERROR(top.get_int("num_key_value_heads", true, &i, 1, 1 << 16));
  c.n_kv = static_cast<int>(*i);
  M3_RETURN_IF_ERROR(top.get_int("head_dim", false, &i, 1, 1 << 16));
  if (i) {
    c.head_dim = static_cast<int>(*i);
  } else {
    M3_CHECK_ARG(c.hidden % c.n_q == 0, source, ": head_dim is absent and hidden_size ", c.hidden,
                 " is not a multiple of num_attention_heads ", c.n_q);
    c.head_dim = c.hidden / c.n_q;  // what HF assumes
  }
  M3_RETURN_IF_ERROR(top.get_int("vocab_size", false, &i, 1, INT64_MAX));
  c.vocab = i.value_or(0);
  M3_RETURN_IF_ERROR(top.get_number("rms_norm_eps", true, &d));
  c.eps = static_cast<float>(*d);

  // rope theta: top-level rope_theta and/or rope_parameters.rope_theta; partial_rotary_factor at
  // the top level and/or inside rope_parameters.
  std::optional<double> theta_top, theta_params, factor_top, factor_params;
  M3_RETURN_IF_ERROR(top.get_number("rope_theta", false, &theta_top));
  M3_RETURN_IF_ERROR(top.get_number("partial_rotary_factor", false, &factor_top));
  if (top.has("rope_parameters")) {
    const json& rp = top.at("rope_parameters");
    M3_CHECK_ARG(rp.is_object(), source, ": \"", top.name("rope_parameters"),
                 "\" must be an object");
    const Fields params(rp, source, prefix + "rope_parameters.");
    M3_RETURN_IF_ERROR(params.get_number("rope_theta", false, &theta_params));
    M3_RETURN_IF_ERROR(params.get_number("partial_rotary_factor", false, &factor_params));
    if (params.has("rope_type")) {
      const json& t = rp["rope_type"];
      if (!t.is_string() || t.get<std::string>() != "default")
        return unsupported(source, ": rope_parameters.rope_type ", t.dump(),
                           " is not supported (only \"default\")");
    }
  }
  std::optional<double> theta, factor;
  M3_RETURN_IF_ERROR(merge(source, "rope theta", theta_top, prefix + "rope_theta", theta_params,
                           prefix + "rope_parameters.rope_theta", &theta));
  M3_RETURN_IF_ERROR(merge(source, "partial_rotary_factor", factor_top,
                           prefix + "partial_rotary_factor", factor_params,
                           prefix + "rope_parameters.partial_rotary_factor", &factor));
  M3_CHECK_ARG(
      theta.has_value(), source,
      ": rope theta is missing (neither \"rope_theta\" nor \"rope_parameters.rope_theta\")");
  c.rope_theta = *theta;

  // ---- sparse attention settings, both spellings ----
  const bool has_ckpt = top.has("sparse_attention_config");
  const bool has_hf = top.has("index_n_heads") || top.has("index_head_dim") ||
                      top.has("index_block_size") || top.has("index_topk_blocks") ||
                      top.has("index_local_blocks") || top.has("layer_types");
  if (!has_ckpt && !has_hf)
    return invalid_argument(source,
                            ": not a MiniMax-M3 config: neither \"sparse_attention_config\" nor "
                            "the HF \"index_*\" / \"layer_types\" keys are present");
  std::optional<int64_t> c_heads, c_dim, c_block, c_topk, c_init, c_local;
  std::optional<std::vector<bool>> c_layers;
  if (has_ckpt) {
    const json& sc = top.at("sparse_attention_config");
    M3_CHECK_ARG(sc.is_object(), source, ": \"", top.name("sparse_attention_config"),
                 "\" must be an object");
    const Fields s(sc, source, prefix + "sparse_attention_config.");
    M3_RETURN_IF_ERROR(s.get_int("sparse_num_index_heads", true, &c_heads, 1, 1 << 16));
    M3_RETURN_IF_ERROR(s.get_int("sparse_index_dim", true, &c_dim, 1, 1 << 16));
    M3_RETURN_IF_ERROR(s.get_int("sparse_block_size", true, &c_block, 1, 1 << 20));
    M3_RETURN_IF_ERROR(s.get_int("sparse_topk_blocks", true, &c_topk, 1, 1 << 20));
    M3_RETURN_IF_ERROR(s.get_int("sparse_init_block", false, &c_init, 0, 1 << 20));
    M3_RETURN_IF_ERROR(s.get_int("sparse_local_block", false, &c_local, 0, 1 << 20));
    M3_CHECK_ARG(s.has("sparse_attention_freq"), source, ": required key \"",
                 s.name("sparse_attention_freq"), "\" is missing");
    const json& freq = sc["sparse_attention_freq"];
    M3_CHECK_ARG(freq.is_array(), source, ": \"", s.name("sparse_attention_freq"),
                 "\" must be an array of 0/1 per layer");
    std::vector<bool> layers;
    for (size_t l = 0; l < freq.size(); ++l) {
      const json& f = freq[l];
      const bool ok = f.is_boolean() ||
                      (f.is_number_integer() && (f.get<int64_t>() == 0 || f.get<int64_t>() == 1));
      M3_CHECK_ARG(ok, source, ": \"", s.name("sparse_attention_freq"), "\"[", l, "] = ", f.dump(),
                   " must be 0 or 1");
      layers.push_back(f.is_boolean() ? f.get<bool>() : f.get<int64_t>() == 1);
    }
    c_layers = layers;
  }
  std::optional<int64_t> h_heads, h_dim, h_block, h_topk, h_local;
  std::optional<std::vector<bool>> h_layers;
  if (has_hf) {
    M3_RETURN_IF_ERROR(top.get_int("index_n_heads", !has_ckpt, &h_heads, 1, 1 << 16));
    M3_RETURN_IF_ERROR(top.get_int("index_head_dim", !has_ckpt, &h_dim, 1, 1 << 16));
    M3_RETURN_IF_ERROR(top.get_int("index_block_size", !has_ckpt, &h_block, 1, 1 << 20));
    M3_RETURN_IF_ERROR(top.get_int("index_topk_blocks", !has_ckpt, &h_topk, 1, 1 << 20));
    M3_RETURN_IF_ERROR(top.get_int("index_local_blocks", false, &h_local, 0, 1 << 20));
    if (top.has("layer_types")) {
      const json& lt = top.at("layer_types");
      M3_CHECK_ARG(lt.is_array(), source, ": \"", top.name("layer_types"),
                   "\" must be an array of strings");
      std::vector<bool> layers;
      for (size_t l = 0; l < lt.size(); ++l) {
        const json& t = lt[l];
        const std::string s = t.is_string() ? t.get<std::string>() : t.dump();
        if (s == "minimax_m3_sparse") {
          layers.push_back(true);
        } else if (s == "full_attention") {
          layers.push_back(false);
        } else {
          return unsupported(source, ": \"", top.name("layer_types"), "\"[", l, "] = \"", s,
                             "\" is not supported (\"minimax_m3_sparse\" or \"full_attention\")");
        }
      }
      h_layers = layers;
    } else if (!has_ckpt) {
      return invalid_argument(source, ": required key \"", top.name("layer_types"),
                              "\" is missing");
    }
  }
  const std::string sp = prefix + "sparse_attention_config.";
  std::optional<int64_t> heads, idim, block, topk, local;
  M3_RETURN_IF_ERROR(merge(source, "index head count", c_heads, sp + "sparse_num_index_heads",
                           h_heads, prefix + "index_n_heads", &heads));
  M3_RETURN_IF_ERROR(merge(source, "index head dim", c_dim, sp + "sparse_index_dim", h_dim,
                           prefix + "index_head_dim", &idim));
  M3_RETURN_IF_ERROR(merge(source, "sparse block size", c_block, sp + "sparse_block_size", h_block,
                           prefix + "index_block_size", &block));
  M3_RETURN_IF_ERROR(merge(source, "top-k blocks", c_topk, sp + "sparse_topk_blocks", h_topk,
                           prefix + "index_topk_blocks", &topk));
  M3_RETURN_IF_ERROR(merge(source, "local blocks", c_local, sp + "sparse_local_block", h_local,
                           prefix + "index_local_blocks", &local));
  if (c_layers && h_layers && *c_layers != *h_layers)
    return invalid_argument(source, ": the sparse layer pattern disagrees between \"", sp,
                            "sparse_attention_freq\" and \"", prefix, "layer_types\"");
  c.sparse_layer = c_layers ? *c_layers : *h_layers;
  c.n_idx = static_cast<int>(*heads);
  c.index_dim = static_cast<int>(*idim);
  c.block_size = static_cast<int>(*block);
  c.topk_blocks = static_cast<int>(*topk);
  c.init_blocks = static_cast<int>(c_init.value_or(0));
  c.local_blocks = static_cast<int>(local.value_or(1));

  // ---- the rotary width trap ----
  std::optional<int64_t> rotary_key;
  M3_RETURN_IF_ERROR(top.get_int("rotary_dim", false, &rotary_key, 0, 1 << 16));
  std::optional<int64_t> from_factor;
  if (factor) {
    const double w = *factor * c.head_dim;
    M3_CHECK_ARG(std::isfinite(w) && *factor > 0 && *factor <= 1 && w == std::floor(w), source,
                 ": partial_rotary_factor ", *factor, " times head_dim ", c.head_dim,
                 " is not a whole number of channels in (0, head_dim]");
    from_factor = static_cast<int64_t>(w);
  }
  if (rotary_key && from_factor && *rotary_key != *from_factor)
    return invalid_argument(source, ": rotary width disagrees: \"", prefix,
                            "rotary_dim\" = ", *rotary_key, " but head_dim ", c.head_dim,
                            " x partial_rotary_factor ", *factor, " = ", *from_factor);
  if (rotary_key && !from_factor && !has_ckpt)
    // HF spelling: transformers ignores rotary_dim and would rotate all head_dim channels.
    return invalid_argument(source, ": rotary width disagrees: \"", prefix,
                            "rotary_dim\" = ", *rotary_key,
                            " but without partial_rotary_factor HF transformers rotates "
                            "all ",
                            c.head_dim, " channels; add partial_rotary_factor ",
                            static_cast<double>(*rotary_key) / c.head_dim);
  c.rotary_dim = static_cast<int>(rotary_key ? *rotary_key : from_factor.value_or(c.head_dim));

  // ---- use_gemma_norm ----
  if (top.has("use_gemma_norm")) {
    const json& g = top.at("use_gemma_norm");
    M3_CHECK_ARG(g.is_boolean(), source, ": \"", top.name("use_gemma_norm"),
                 "\" must be true or false");
    if (!g.get<bool>())
      return unsupported(source,
                         ": use_gemma_norm = false is not supported (m3attn implements "
                         "the Gemma-style y * (1 + w) RMSNorm)");
  }

  // ---- consistency and what m3attn implements ----
  M3_CHECK_ARG(static_cast<int>(c.sparse_layer.size()) == c.num_layers, source,
               ": the sparse layer pattern has ", c.sparse_layer.size(),
               " entries but num_hidden_layers is ", c.num_layers);
  M3_CHECK_ARG(c.n_q % c.n_kv == 0, source, ": num_attention_heads ", c.n_q,
               " is not a multiple of num_key_value_heads ", c.n_kv);
  M3_CHECK_ARG(std::isfinite(c.eps) && c.eps > 0, source,
               ": rms_norm_eps must be finite and > 0, got ", *d);
  M3_CHECK_ARG(std::isfinite(c.rope_theta) && c.rope_theta > 0 &&
                   std::isfinite(static_cast<float>(c.rope_theta)),
               source, ": rope theta must be finite and > 0, got ", c.rope_theta);
  if (c.head_dim != kHeadDim)
    return unsupported(source, ": head_dim ", c.head_dim, " is not supported (only ", kHeadDim,
                       ")");
  if (c.index_dim != kHeadDim)
    return unsupported(source, ": index head dim ", c.index_dim, " is not supported (only ",
                       kHeadDim, ")");
  if (c.rotary_dim != kRotaryDim)
    return unsupported(source, ": rotary width ", c.rotary_dim, " is not supported (only ",
                       kRotaryDim, " of ", kHeadDim, " channels rotate)");
  if (c.n_idx != c.n_kv)
    return unsupported(source, ": index head count ", c.n_idx, " must equal num_key_value_heads ",
                       c.n_kv, " (one index head per KV head)");
  if (c.block_size != kPageSize)
    return unsupported(source, ": sparse block size ", c.block_size, " is not supported (only ",
                       kPageSize, ", the KV page size)");
  if (c.topk_blocks != kTopK)
    return unsupported(source, ": top-k blocks ", c.topk_blocks, " is not supported (only ", kTopK,
                       ")");
  if (c.init_blocks != 0)
    return unsupported(source, ": sparse_init_block ", c.init_blocks,
                       " is not supported (MSA has no initial/sink blocks)");
  if (c.local_blocks != 1)
    return unsupported(source, ": local blocks ", c.local_blocks,
                       " is not supported (exactly the query's own block is forced)");
  if (c.hidden % kQuantBlock != 0)
    return unsupported(source, ": hidden_size ", c.hidden, " is not a multiple of ", kQuantBlock,
                       " (FP8 block quantization)");
  return c;
}

Result<M3Config> load_m3_config(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  std::ifstream in(p, std::ios::binary);
  if (!in) return io_error("cannot open ", p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_m3_config(ss.str(), p.string());
}

}  // namespace m3attn
