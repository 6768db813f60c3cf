#include "layer/layer_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "cache/page_allocator.h"
#include "cache/page_pool.h"
#include "cache/step_plan.h"
#include "core/numeric.h"
#include "core/rope.h"
#include "layer/cuda_msa_layer.h"
#include "layer/golden_io.h"
#include "layer/tensor_parallel.h"
#include "weights/hf_config.h"
#include "weights/packing.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <memory>

#include "core/cuda_check.h"
#endif

namespace m3attn {

MsaGeometry default_layer_geometry() {
  MsaGeometry g;
  g.hidden = 1024;
  g.n_q = 8;
  g.n_kv = 2;
  return g;
}

Result<Backend> parse_backend(const std::string& name) {
  if (name == "cpu") return Backend::kCpu;
  if (name == "cuda") return Backend::kCuda;
  return invalid_argument("unknown backend '", name, "' (expected cpu or cuda)");
}

const char* backend_name(Backend backend) { return backend == Backend::kCpu ? "cpu" : "cuda"; }

namespace {

// A non-negative decimal integer filling the whole string.
bool parse_count(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 12) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = v;
  return true;
}

}  // namespace

Result<std::vector<ContextSpec>> parse_context_list(const std::string& text) {
  std::vector<ContextSpec> out;
  if (text.empty()) return out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t colon = item.find(':');
    ContextSpec c;
    const std::string tokens = item.substr(0, colon);
    const std::string cached = colon == std::string::npos ? "0" : item.substr(colon + 1);
    M3_CHECK_ARG(parse_count(tokens, &c.tokens) && parse_count(cached, &c.cached),
                 "context chunk '", item,
                 "' is not TOKENS or TOKENS:CACHED (non-negative integers), e.g. 512:1800");
    M3_CHECK_ARG(c.tokens >= 1, "context chunk '", item, "' must bring at least one token");
    out.push_back(c);
  }
  M3_CHECK_ARG(!text.empty() && text.back() != ',', "context list '", text, "' ends with a comma");
  return out;
}

namespace {

// Fills bytes with E4M3 codes of N(0, 1) samples (a table of 4096 samples indexed by a fast RNG:
// cached prefixes only need plausible, deterministic values).
void fill_random_e4m3(uint8_t* p, int64_t n, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  uint8_t table[4096];
  for (uint8_t& c : table) c = float_to_e4m3(normal(gen));
  int64_t i = 0;
  while (i < n) {
    uint64_t r = gen();
    for (int k = 0; k < 5 && i < n; ++k, ++i) {
      p[i] = table[r & 4095];
      r >>= 12;
    }
  }
}

// The shortest decimal that round-trips a float, as a double (JSON shows 1e-06, not 9.99e-07).
double float_decimal(float x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(x));
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, static_cast<double>(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}

std::string fnv1a_hex(const void* data, int64_t n) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (int64_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

Status check_options(const LayerRunOptions& o) {
#if defined(M3ATTN_WITH_CUDA)
  if (o.backend == Backend::kCuda) {
    if (!cuda_backend_available())
      return unsupported("--backend cuda needs a CUDA device (none found; use --backend cpu)");
    if (o.tp_size != 1)
      return unsupported("--backend cuda runs TP1 only (got --tp ", o.tp_size,
                         "); simulate TP with --backend cpu");
  }
#else
  if (o.backend == Backend::kCuda)
    return unsupported("this build has no CUDA backend (use --backend cpu)");
#endif
  M3_CHECK_ARG(o.tp_size == 1 || o.tp_size == 2 || o.tp_size == 4 || o.tp_size == 8,
               "tensor-parallel size ", o.tp_size, " is not one of 1, 2, 4, 8");
  M3_CHECK_ARG(o.gen >= 0, "generation request count must be >= 0, got ", o.gen);
  M3_CHECK_ARG(o.draft >= 0, "draft length must be >= 0, got ", o.draft);
  M3_CHECK_ARG(o.layer_index >= 0, "layer index must be >= 0, got ", o.layer_index);
  for (const ContextSpec& c : o.context)
    M3_CHECK_ARG(c.tokens >= 1 && c.cached >= 0, "context chunk ", c.tokens, ":", c.cached,
                 " is invalid");
  if (!o.inputs_path.empty()) {
    M3_CHECK_ARG(o.context.empty() && o.gen == 0,
                 "--inputs runs one sequence prefilled from position 0: drop --context and --gen");
  } else {
    M3_CHECK_ARG(!o.context.empty() || o.gen > 0, "the step is empty: give --context and/or --gen");
    M3_CHECK_ARG(o.gen == 0 || o.gen_context_len >= 1,
                 "generation requests need --context-len >= 1 cached tokens, got ",
                 o.gen_context_len);
  }
  M3_CHECK_ARG(o.dump_path.empty() || o.tp_size == 1, "--dump needs --tp 1");
  M3_CHECK_ARG(std::isfinite(o.rope_theta) && o.rope_theta > 0, "rope theta must be > 0, got ",
               o.rope_theta);
  M3_CHECK_ARG(std::isfinite(o.eps) && o.eps > 0, "eps must be > 0, got ", o.eps);
  return Status::Ok();
}

Result<AttentionWeights> load_weights(const LayerRunOptions& o) {
  Result<Checkpoint> ckpt = Checkpoint::open(o.weights_path);
  M3_RETURN_IF_ERROR(ckpt.status());
  AttentionLoadOptions lo;
  lo.rope_theta = o.rope_theta;
  lo.eps = o.eps;
  M3Config config;
  std::error_code ec;
  if (std::filesystem::is_directory(o.weights_path, ec) &&
      std::filesystem::exists(std::filesystem::path(o.weights_path) / "config.json", ec)) {
    Result<M3Config> c = load_m3_config(o.weights_path);
    M3_RETURN_IF_ERROR(c.status());
    config = std::move(c.value());
    lo.config = &config;
  }
  return load_attention_weights(ckpt.value(), o.layer_index, lo);
}

// Per-token block statistics from every rank's block ids (union over all KV heads of a token).
void block_stats(const StepPlan& plan, const std::vector<LayerTrace>& traces, LayerRunReport* rep) {
  const int64_t T = plan.num_tokens();
  if (T == 0) return;
  double visible = 0, selected = 0, distinct = 0;
  int64_t heads_seen = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t vis = plan.positions[static_cast<size_t>(t)] / kPageSize + 1;
    visible += static_cast<double>(vis);
    std::set<int32_t> all;
    bool pruned = false;
    for (const LayerTrace& tr : traces) {
      const int n_kv = static_cast<int>(tr.block_ids.shape()[1]);
      const int32_t* ids = tr.block_ids.ptr<int32_t>() + t * n_kv * kTopK;
      for (int h = 0; h < n_kv; ++h) {
        int valid = 0;
        for (int i = 0; i < kTopK; ++i) {
          if (ids[h * kTopK + i] < 0) continue;
          ++valid;
          all.insert(ids[h * kTopK + i]);
        }
        selected += valid;
        ++heads_seen;
        pruned |= valid < vis;
      }
    }
    distinct += static_cast<double>(all.size());
    rep->pruned_tokens += pruned;
  }
  rep->mean_visible_blocks = visible / static_cast<double>(T);
  rep->mean_selected_blocks = heads_seen ? selected / static_cast<double>(heads_seen) : 0;
  rep->mean_distinct_blocks = distinct / static_cast<double>(T);
}

#if defined(M3ATTN_WITH_CUDA)
// The step on CudaMsaLayer: the host pool (random cached prefixes, as the CPU backend fills it) is
// copied to the device, the layer runs once eagerly with per-stage CUDA events, and attn_out and
// the trace (with the K / V / index-K rows read back from the device pool) come back to the host.
Status run_cuda_step(const AttentionWeights& weights, bool fused, const Tensor& rope,
                     const PagePool& host_pool, const StepPlan& step, const Tensor& hidden,
                     Tensor* out, LayerTrace* trace) {
  const int64_t T = step.num_tokens();
  Result<PackedRankWeights> packed = pack_rank(weights, 1, 0);
  M3_RETURN_IF_ERROR(packed.status());
  CudaLayerCapacity cap;
  cap.max_tokens = std::max<int64_t>(T, 1);
  cap.max_requests = std::max(step.num_requests(), 1);
  cap.max_pages = std::max(step.max_pages, 1);
  MsaLayerOptions lo;
  lo.fuse_qkv_index_projection = fused;
  Result<std::unique_ptr<CudaMsaLayer>> layer =
      CudaMsaLayer::create(packed.value(), rope.view(), cap, lo);
  M3_RETURN_IF_ERROR(layer.status());
  Result<std::unique_ptr<CudaStepMetadata>> meta = CudaStepMetadata::create(cap);
  M3_RETURN_IF_ERROR(meta.status());
  Result<CudaBuffer> pool = CudaBuffer::create(static_cast<size_t>(host_pool.bytes()));
  M3_RETURN_IF_ERROR(pool.status());
  M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(pool.value().data(), host_pool.data(),
                                     static_cast<size_t>(host_pool.bytes()),
                                     cudaMemcpyHostToDevice));
  const size_t hidden_bytes = static_cast<size_t>(std::max<int64_t>(hidden.nbytes(), 16));
  Result<CudaBuffer> d_hidden = CudaBuffer::create(hidden_bytes);
  M3_RETURN_IF_ERROR(d_hidden.status());
  if (hidden.nbytes() > 0)
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_hidden.value().data(), hidden.data(),
                                       static_cast<size_t>(hidden.nbytes()),
                                       cudaMemcpyHostToDevice));
  int dev = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  const Device d = Device::cuda(dev);
  CudaLayerCaches caches;
  caches.kv_cache = host_pool.layout().kv_cache_view(pool.value().data(), 0, d);
  if (weights.sparse)
    caches.index_cache = host_pool.layout().index_cache_view(pool.value().data(), 0, d);
  M3_RETURN_IF_ERROR(
      meta.value()->upload(step, host_pool.num_pages(), rope.shape()[0], {}, nullptr));
  const TensorView hv = TensorView::contiguous(d_hidden.value().data(), DType::kBF16,
                                               {T, int64_t{weights.geometry.hidden}}, d);
  M3_RETURN_IF_ERROR(layer.value()->plan(*meta.value(), hv, caches));
  LayerTimes times;
  M3_RETURN_IF_ERROR(layer.value()->run_timed(nullptr, &times));
  M3_RETURN_IF_ERROR(layer.value()->download_trace(trace, out, nullptr));
  trace->times = times;
  return Status::Ok();
}
#endif

}  // namespace

Result<LayerRunReport> run_layer(const LayerRunOptions& o, LayerRunArtifacts* artifacts) {
  M3_RETURN_IF_ERROR(check_options(o));
  const bool golden = !o.inputs_path.empty();
  LayerRunReport rep;
  rep.mode = golden ? "golden" : "scenario";
  rep.backend = backend_name(o.backend);
  rep.tp_size = o.tp_size;
  rep.seed = o.seed;

  // ---- weights and inputs ----
  AttentionWeights weights;
  GoldenInputs inputs;
  if (!o.weights_path.empty()) {
    Result<AttentionWeights> w = load_weights(o);
    M3_RETURN_IF_ERROR(w.status());
    weights = std::move(w.value());
    rep.layer_index = o.layer_index;
  }
  if (golden) {
    Result<GoldenInputs> in = read_golden_inputs(
        o.inputs_path, o.weights_path.empty() ? 0 : int64_t{weights.geometry.hidden});
    M3_RETURN_IF_ERROR(in.status());
    inputs = std::move(in.value());
  }
  if (o.weights_path.empty()) {
    MsaGeometry g = o.geometry;
    g.rope_theta = o.rope_theta;
    g.eps = o.eps;
    if (golden) g.hidden = static_cast<int>(inputs.hidden.shape()[1]);
    Result<AttentionWeights> w = random_attention_weights(g, o.seed, o.sparse);
    M3_RETURN_IF_ERROR(w.status());
    weights = std::move(w.value());
  }
  const MsaGeometry g = weights.geometry;
  rep.geometry = g;
  rep.sparse = weights.sparse;
  rep.fused = weights.sparse && o.fused;
  M3_RETURN_IF_ERROR(rank_geometry(g, o.tp_size).status());

  // ---- requests and pages ----
  StepDescription desc;
  std::vector<std::pair<int64_t, int64_t>> prefixes;  // (request id, cached tokens)
  int64_t pages = 0, max_len = 1;
  int64_t next_id = 0;
  if (golden) {
    desc.context.push_back({next_id++, 0, inputs.num_tokens()});
  } else {
    for (const ContextSpec& c : o.context) {
      prefixes.emplace_back(next_id, c.cached);
      desc.context.push_back({next_id++, c.cached, c.tokens});
    }
    for (int i = 0; i < o.gen; ++i) {
      prefixes.emplace_back(next_id, o.gen_context_len);
      desc.generation.push_back({next_id++, o.gen_context_len});
    }
    desc.draft_len = o.draft;
  }
  for (const ContextChunk& c : desc.context) {
    M3_CHECK_ARG(c.cached_len + c.num_tokens < (int64_t{1} << 31), "context of ",
                 c.cached_len + c.num_tokens, " tokens is too long");
    pages += CacheManager::pages_for(c.cached_len + c.num_tokens);
    max_len = std::max(max_len, c.cached_len + c.num_tokens);
  }
  for (const GenerationRequest& r : desc.generation) {
    M3_CHECK_ARG(r.cached_len + 1 + desc.draft_len < (int64_t{1} << 31), "generation context of ",
                 r.cached_len, " tokens is too long");
    pages += CacheManager::pages_for(r.cached_len + 1 + desc.draft_len);
    max_len = std::max(max_len, r.cached_len + 1 + desc.draft_len);
  }
  pages += 1;  // one spare page that no request owns
  CacheManager cache(pages);
  for (const auto& [id, cached] : prefixes) {
    M3_RETURN_IF_ERROR(cache.add_request(id));
    M3_RETURN_IF_ERROR(cache.reserve(id, cached));
  }
  Result<StepPlan> plan = plan_step(cache, desc);
  M3_RETURN_IF_ERROR(plan.status());
  const StepPlan& step = plan.value();
  const int64_t T = step.num_tokens();
  rep.context_requests = step.num_context_requests;
  rep.context_tokens = step.num_context_tokens;
  rep.generation_requests = step.num_generation_requests;
  rep.generation_tokens = step.num_generation_tokens;
  rep.draft = step.draft_len;
  rep.total_tokens = T;
  rep.pages_used = pages - cache.num_free_pages();

  // ---- the layer(s) ----
  Result<Tensor> rope = make_rope_table(max_len, g.rope_theta);
  M3_RETURN_IF_ERROR(rope.status());
  MsaLayerOptions lo;
  lo.fuse_qkv_index_projection = o.fused;
  Result<TensorParallelLayer> tp =
      TensorParallelLayer::create(weights, o.tp_size, rope.value().view(), pages, lo);
  M3_RETURN_IF_ERROR(tp.status());
  for (int r = 0; r < o.tp_size; ++r) {
    PagePool& pool = tp.value().pool(r);
    // Cached prefixes are random data (seeded per rank; rows the step writes are overwritten).
    fill_random_e4m3(pool.data(), pool.bytes(), o.seed * 1000003ull + static_cast<uint64_t>(r));
    rep.pool_bytes = pool.bytes();
  }
  Tensor hidden;
  if (golden) {
    hidden = std::move(inputs.hidden);
  } else {
    hidden = Tensor(DType::kBF16, {T, g.hidden});
    std::mt19937_64 gen(o.seed ^ 0x9e3779b97f4a7c15ull);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < hidden.numel(); ++i)
      hidden.ptr<uint16_t>()[i] = float_to_bf16(normal(gen));
  }
  Tensor out(DType::kBF16, {T, g.hidden});
  std::vector<LayerTrace> traces;
  if (o.backend == Backend::kCpu) {
    M3_RETURN_IF_ERROR(tp.value().step(step, hidden.view(), out.view(), nullptr, &traces));
  } else {
#if defined(M3ATTN_WITH_CUDA)
    traces.resize(1);
    M3_RETURN_IF_ERROR(run_cuda_step(weights, o.fused, rope.value(), tp.value().pool(0), step,
                                     hidden, &out, &traces[0]));
#endif
  }

  // ---- report ----
  for (const LayerTrace& t : traces)
    for (int s = 0; s < kNumLayerStages; ++s)
      rep.stage_seconds[static_cast<size_t>(s)] += t.times.seconds[static_cast<size_t>(s)];
  for (double s : rep.stage_seconds) rep.total_seconds += s;
  if (rep.sparse) block_stats(step, traces, &rep);
  double ss = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double x = bf16_to_float(out.ptr<uint16_t>()[i]);
    rep.out_finite &= std::isfinite(x);
    ss += x * x;
  }
  rep.out_rms = out.numel() ? std::sqrt(ss / static_cast<double>(out.numel())) : 0.0;
  rep.checksum = fnv1a_hex(out.data(), out.nbytes());

  if (!o.dump_path.empty()) {
    std::map<std::string, std::string> meta = {{"geometry", g.to_string()},
                                               {"sparse", rep.sparse ? "true" : "false"},
                                               {"fused", rep.fused ? "true" : "false"},
                                               {"mode", rep.mode}};
    if (rep.layer_index >= 0) meta["layer"] = std::to_string(rep.layer_index);
    M3_RETURN_IF_ERROR(write_golden_dump(o.dump_path, out.view(), traces[0], meta));
  }
  if (artifacts) {
    artifacts->hidden = std::move(hidden);
    artifacts->attn_out = std::move(out);
    if (o.tp_size == 1) artifacts->trace = std::move(traces[0]);
  }
  return rep;
}

std::string LayerRunReport::to_text() const {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  os << "m3attn layer: " << backend << " backend, " << (sparse ? "sparse (MSA)" : "dense")
     << " layer, " << (sparse ? (fused ? "fused" : "unfused") : "qkv") << " projection, TP"
     << tp_size << ", " << mode << "\n";
  os << "geometry: " << geometry.to_string();
  if (layer_index >= 0) {
    os << " (loaded weights, layer " << layer_index << ")\n";
  } else {
    os << " (random weights, seed " << seed << ")\n";
  }
  os << "step: " << context_requests << " context request" << (context_requests == 1 ? "" : "s")
     << " (" << context_tokens << " tokens), " << generation_requests << " generation request"
     << (generation_requests == 1 ? "" : "s") << " x " << (1 + draft) << " (draft " << draft << ", "
     << generation_tokens << " tokens) = " << total_tokens << " tokens, " << pages_used
     << " pages, pool " << pool_bytes << " B per rank\n";
  if (sparse) {
    os << std::setprecision(2) << "blocks: visible " << mean_visible_blocks
       << " per token, selected " << mean_selected_blocks << " per (token, kv head), distinct "
       << mean_distinct_blocks << " per token, " << pruned_tokens << " of " << total_tokens
       << " tokens pruned (> 16 visible)\n";
  }
  os << std::setprecision(4) << "time (s" << (tp_size > 1 ? ", summed over ranks" : "") << "):";
  for (int s = 0; s < kNumLayerStages; ++s) {
    if (!sparse && static_cast<LayerStage>(s) == LayerStage::kIndexer) continue;
    os << " " << layer_stage_name(static_cast<LayerStage>(s)) << " "
       << stage_seconds[static_cast<size_t>(s)];
  }
  os << ", total " << total_seconds << "\n";
  os << std::setprecision(5) << "attn_out: rms " << out_rms << ", "
     << (out_finite ? "finite" : "NOT FINITE") << ", fnv1a " << checksum << "\n";
  return os.str();
}

std::string LayerRunReport::to_json() const {
  nlohmann::json j;
  j["mode"] = mode;
  j["backend"] = backend;
  j["geometry"] = {{"hidden", geometry.hidden},
                   {"q_heads", geometry.n_q},
                   {"kv_heads", geometry.n_kv},
                   {"packed_width", geometry.packed_width()},
                   {"rope_theta", float_decimal(geometry.rope_theta)},
                   {"eps", float_decimal(geometry.eps)}};
  j["sparse"] = sparse;
  j["fused"] = fused;
  j["tp"] = tp_size;
  if (layer_index >= 0) {
    j["layer"] = layer_index;
  } else {
    j["seed"] = seed;
  }
  j["tokens"] = {{"context_requests", context_requests},
                 {"context", context_tokens},
                 {"generation_requests", generation_requests},
                 {"generation", generation_tokens},
                 {"draft", draft},
                 {"total", total_tokens}};
  j["pages_used"] = pages_used;
  j["pool_bytes_per_rank"] = pool_bytes;
  if (sparse)
    j["blocks"] = {{"mean_visible", mean_visible_blocks},
                   {"mean_selected_per_head", mean_selected_blocks},
                   {"mean_distinct_per_token", mean_distinct_blocks},
                   {"pruned_tokens", pruned_tokens}};
  nlohmann::json times = nlohmann::json::object();
  for (int s = 0; s < kNumLayerStages; ++s)
    times[layer_stage_name(static_cast<LayerStage>(s))] = stage_seconds[static_cast<size_t>(s)];
  times["total"] = total_seconds;
  j["seconds"] = times;
  j["attn_out"] = {{"rms", out_rms}, {"finite", out_finite}, {"fnv1a", checksum}};
  return j.dump();
}

}  // namespace m3attn
