// The library behind `m3attn layer` (src/layer/layer_runner.h, golden_io.h): flag parsing helpers,
// the scenario run and its report, the golden-file round trip (--weights / --inputs / --dump give
// exactly what the layer computes), and bad files rejected with the codes the CLI maps to exit 2.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "cache/page_pool.h"
#include "cache/step_plan.h"
#include "core/rope.h"
#include "layer/golden_io.h"
#include "layer/layer_runner.h"
#include "support/test_util.h"
#include "weights/packing.h"
#include "weights/safetensors.h"

namespace m3attn {
namespace {

using testing::Rng;

std::string temp_path(const std::string& name, uint64_t seed) {
  return ::testing::TempDir() + "m3attn_layer_" + std::to_string(seed) + "_" + name;
}

bool usage_error(const Status& s) {  // what the CLI turns into exit code 2
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kUnsupported ||
         s.code() == StatusCode::kIoError || s.code() == StatusCode::kDataLoss ||
         s.code() == StatusCode::kOutOfRange;
}

TEST(LayerCommandTest, ParsesContextLists) {
  Result<std::vector<ContextSpec>> r = parse_context_list("512:1800,100,1:0");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r.value().size(), 3u);
  EXPECT_EQ(r.value()[0].tokens, 512);
  EXPECT_EQ(r.value()[0].cached, 1800);
  EXPECT_EQ(r.value()[1].tokens, 100);
  EXPECT_EQ(r.value()[1].cached, 0);
  EXPECT_EQ(r.value()[2].tokens, 1);
  EXPECT_TRUE(parse_context_list("").value().empty());
  for (const char* bad : {"0:5", "5:", ":5", "a", "5:x", "5,,6", "5,", "-1:3", "5:-3", "1:2:3"}) {
    Result<std::vector<ContextSpec>> b = parse_context_list(bad);
    EXPECT_FALSE(b.ok()) << bad;
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(parse_backend("cpu").value(), Backend::kCpu);
  EXPECT_EQ(parse_backend("cuda").value(), Backend::kCuda);
  EXPECT_FALSE(parse_backend("gpu").ok());
}

LayerRunOptions small_options(uint64_t seed) {
  LayerRunOptions o;
  o.geometry.hidden = 256;
  o.geometry.n_q = 4;
  o.geometry.n_kv = 2;
  o.seed = seed;
  return o;
}

TEST(LayerCommandTest, ScenarioReport) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  LayerRunOptions o = small_options(seed);
  o.context = {{100, 2000}, {7, 0}};
  o.gen = 3;
  o.draft = 2;
  o.gen_context_len = 129;
  LayerRunArtifacts art;
  Result<LayerRunReport> r = run_layer(o, &art);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const LayerRunReport& rep = r.value();
  EXPECT_EQ(rep.mode, "scenario");
  EXPECT_EQ(rep.context_requests, 2);
  EXPECT_EQ(rep.context_tokens, 107);
  EXPECT_EQ(rep.generation_requests, 3);
  EXPECT_EQ(rep.generation_tokens, 9);
  EXPECT_EQ(rep.total_tokens, 116);
  EXPECT_EQ(rep.pages_used, 17 + 1 + 3 * 2);
  // Visible blocks: 100 tokens at 2000..2099 (16 or 17), 7 at 0..6 (1), 9 at 129..131 (2).
  double visible = 0;
  for (int p = 2000; p < 2100; ++p) visible += p / 128 + 1;
  visible += 7 * 1 + 9 * 2;
  EXPECT_NEAR(rep.mean_visible_blocks, visible / 116, 1e-9);
  EXPECT_EQ(rep.pruned_tokens, 2100 - 2048) << "tokens at positions >= 2048 see 17 blocks";
  EXPECT_LE(rep.mean_selected_blocks, 16.0);
  EXPECT_GE(rep.mean_distinct_blocks, rep.mean_selected_blocks);
  EXPECT_TRUE(rep.out_finite);
  EXPECT_GT(rep.out_rms, 0.0);
  EXPECT_GT(rep.total_seconds, 0.0);
  EXPECT_EQ(art.attn_out.shape(), (std::vector<int64_t>{116, 256}));
  EXPECT_EQ(art.trace.block_ids.shape(), (std::vector<int64_t>{116, 2, kTopK}));

  // Text and JSON describe the same run.
  const std::string text = rep.to_text();
  EXPECT_NE(text.find("116 tokens"), std::string::npos) << text;
  const nlohmann::json j = nlohmann::json::parse(rep.to_json());
  EXPECT_EQ(j["tokens"]["total"], 116);
  EXPECT_EQ(j["tokens"]["draft"], 2);
  EXPECT_EQ(j["blocks"]["pruned_tokens"], 52);
  EXPECT_EQ(j["attn_out"]["fnv1a"], rep.checksum);
  EXPECT_TRUE(j["seconds"].contains("indexer"));

  // Deterministic for a seed, different for another; the unfused path gives the same bytes.
  Result<LayerRunReport> again = run_layer(o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again.value().checksum, rep.checksum);
  o.fused = false;
  Result<LayerRunReport> unfused = run_layer(o);
  ASSERT_TRUE(unfused.ok());
  EXPECT_EQ(unfused.value().checksum, rep.checksum);
  o.fused = true;
  o.seed = seed + 1;
  Result<LayerRunReport> other = run_layer(o);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other.value().checksum, rep.checksum);

  // Simulated TP4 (KV heads replicated) runs and reports the same step.
  o.seed = seed;
  o.tp_size = 4;
  Result<LayerRunReport> tp = run_layer(o);
  ASSERT_TRUE(tp.ok()) << tp.status().to_string();
  EXPECT_EQ(tp.value().total_tokens, 116);
  EXPECT_EQ(tp.value().pruned_tokens, rep.pruned_tokens);
  EXPECT_TRUE(tp.value().out_finite);
}

TEST(LayerCommandTest, RejectsBadOptions) {
  const LayerRunOptions good = small_options(1);
  auto bad = [](const LayerRunOptions& o, StatusCode code, const char* what) {
    Result<LayerRunReport> r = run_layer(o);
    EXPECT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), code) << what << ": " << r.status().to_string();
    EXPECT_TRUE(usage_error(r.status())) << what;
  };
  LayerRunOptions o = good;
  bad(o, StatusCode::kInvalidArgument, "empty step");
  o.gen = 2;
  o.gen_context_len = 0;
  bad(o, StatusCode::kInvalidArgument, "generation without a context length");
  o = good;
  o.context = {{10, 0}};
  o.backend = Backend::kCuda;
  if (!cuda_backend_available()) bad(o, StatusCode::kUnsupported, "cuda backend without a device");
  o.tp_size = 2;
  bad(o, StatusCode::kUnsupported, "cuda backend with tp 2");  // TP1 only, device or not
  o.tp_size = 1;
  o.backend = Backend::kCpu;
  o.tp_size = 3;
  bad(o, StatusCode::kInvalidArgument, "tp 3");
  o.tp_size = 8;  // 4 query heads cannot be split 8 ways
  EXPECT_FALSE(run_layer(o).ok());
  o.tp_size = 2;
  o.dump_path = "x.safetensors";
  bad(o, StatusCode::kInvalidArgument, "dump with tp 2");
  o = good;
  o.context = {{10, 0}};
  o.inputs_path = "in.safetensors";
  bad(o, StatusCode::kInvalidArgument, "inputs with context");
  o = good;
  o.context = {{10, 0}};
  o.geometry.hidden = 100;
  bad(o, StatusCode::kInvalidArgument, "hidden not a multiple of 128");
  o = good;
  o.context = {{10, 0}};
  o.draft = -1;
  bad(o, StatusCode::kInvalidArgument, "negative draft");
}

// A golden round trip: weights and inputs written to files, the runner's dump equals a direct
// MsaLayer computation from the same quantized weights, bit for bit.
void golden_round_trip(bool sparse, bool bf16_weights, uint64_t seed) {
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  MsaGeometry g;
  g.hidden = 256;
  g.n_q = 4;
  g.n_kv = 2;
  Result<AttentionWeights> w = random_attention_weights(g, seed, sparse);
  ASSERT_TRUE(w.ok());
  const int layer = 5;
  const std::string wpath = temp_path(sparse ? "w_sparse" : "w_dense", seed);
  std::vector<Tensor> keep;  // BF16 copies must outlive the write
  std::vector<NamedTensor> tensors;
  if (bf16_weights) {
    // Dequantized weights as BF16: loading quantizes them again (to the same E4M3 codes and
    // scales up to the requantization; the direct computation below uses the loaded weights).
    for (const NamedTensor& nt : attention_weight_tensors(w.value(), layer)) {
      if (nt.first.find("weight_scale_inv") != std::string::npos) continue;
      if (nt.second.dtype != DType::kE4M3) {
        tensors.push_back(nt);
        continue;
      }
      const std::string base = nt.first.substr(0, nt.first.size() - 7);  // strip ".weight"
      Result<TensorView> s = [&]() -> Result<TensorView> {
        for (const NamedTensor& x : attention_weight_tensors(w.value(), layer))
          if (x.first == base + ".weight_scale_inv") return x.second;
        return invalid_argument("no scale");
      }();
      ASSERT_TRUE(s.ok());
      const int64_t N = nt.second.shape[0], K = nt.second.shape[1];
      Tensor b(DType::kBF16, {N, K});
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
          b.ptr<uint16_t>()[n * K + k] =
              float_to_bf16(e4m3_to_float(nt.second.ptr<uint8_t>()[n * K + k]) *
                            s.value().ptr<float>()[(n / 128) * (K / 128) + k / 128]);
      keep.push_back(std::move(b));
      tensors.emplace_back(nt.first, keep.back().view());
    }
  } else {
    tensors = attention_weight_tensors(w.value(), layer);
  }
  ASSERT_TRUE(write_safetensors(wpath, tensors).ok());

  const int64_t T = rng.integer(130, 300);
  Tensor hidden(DType::kBF16, {T, g.hidden});
  testing::fill_bf16_normal(hidden, rng);
  Tensor positions(DType::kI32, {T});
  for (int64_t t = 0; t < T; ++t) positions.ptr<int32_t>()[t] = static_cast<int32_t>(t);
  const std::string ipath = temp_path("inputs", seed);
  ASSERT_TRUE(write_golden_inputs(ipath, hidden.view(), positions.view()).ok());

  LayerRunOptions o;
  o.weights_path = wpath;
  o.layer_index = layer;
  o.inputs_path = ipath;
  o.dump_path = temp_path("dump", seed);
  o.fused = !bf16_weights;  // both paths are exercised
  Result<LayerRunReport> rep = run_layer(o);
  ASSERT_TRUE(rep.ok()) << rep.status().to_string();
  EXPECT_EQ(rep.value().mode, "golden");
  EXPECT_EQ(rep.value().total_tokens, T);
  EXPECT_EQ(rep.value().sparse, sparse);
  EXPECT_EQ(rep.value().layer_index, layer);
  EXPECT_EQ(rep.value().geometry.hidden, g.hidden);
  EXPECT_EQ(rep.value().geometry.n_q, g.n_q);
  EXPECT_EQ(rep.value().geometry.n_kv, g.n_kv);

  // Direct computation: same file through the loader, a fresh pool, one prefill step.
  Result<SafetensorsFile> wf = SafetensorsFile::open(wpath);
  ASSERT_TRUE(wf.ok());
  Result<AttentionWeights> loaded = load_attention_weights(wf.value(), layer);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  Result<PackedRankWeights> packed = pack_rank(loaded.value(), 1, 0);
  ASSERT_TRUE(packed.ok());
  Result<Tensor> rope = make_rope_table(T, 5e6);
  ASSERT_TRUE(rope.ok());
  Result<MsaLayer> ml = MsaLayer::create(std::move(packed.value()), rope.value().view());
  ASSERT_TRUE(ml.ok());
  PagePoolConfig cfg;
  cfg.num_pages = CacheManager::pages_for(T);
  cfg.n_kv = g.n_kv;
  cfg.with_index = sparse;
  PagePool pool = PagePool::create(cfg).value();
  CacheManager cache(cfg.num_pages);
  Result<StepPlan> step = plan_step(cache, {{{0, 0, T}}, {}, 0});
  ASSERT_TRUE(step.ok());
  Tensor out(DType::kBF16, {T, g.hidden});
  LayerIO io;
  io.hidden = hidden.view();
  io.attn_out = out.view();
  io.kv_cache = pool.kv_cache(0).value();
  if (sparse) io.index_cache = pool.index_cache(0).value();
  LayerTrace trace;
  ASSERT_TRUE(ml.value().step(step.value(), io, &trace).ok());

  Result<SafetensorsFile> dump = SafetensorsFile::open(o.dump_path);
  ASSERT_TRUE(dump.ok()) << dump.status().to_string();
  const std::vector<NamedTensor> want = golden_dump_tensors(out.view(), trace);
  EXPECT_EQ(dump.value().entries().size(), want.size());
  EXPECT_EQ(want.size(), sparse ? 8u : 5u);
  for (const NamedTensor& nt : want) {
    const SafetensorsEntry* e = dump.value().find(nt.first);
    ASSERT_NE(e, nullptr) << nt.first;
    EXPECT_EQ(e->dtype, nt.second.dtype) << nt.first;
    EXPECT_EQ(static_cast<int>(e->shape.size()), nt.second.ndim) << nt.first;
    const int64_t bytes = nt.second.numel() * dtype_size(nt.second.dtype);
    ASSERT_EQ(e->size, bytes) << nt.first;
    EXPECT_EQ(std::memcmp(dump.value().bytes(*e), nt.second.data, static_cast<size_t>(bytes)), 0)
        << nt.first << " differs from the direct computation";
  }
  if (sparse) {
    const SafetensorsEntry* e = dump.value().find("inter.index_k");
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->shape, (std::vector<int64_t>{T, 128}));
    EXPECT_EQ(dump.value().find("inter.q")->shape, (std::vector<int64_t>{T, g.n_q, 128}));
  }
  std::remove(wpath.c_str());
  std::remove(ipath.c_str());
  std::remove(o.dump_path.c_str());
}

TEST(LayerCommandTest, GoldenRoundTripSparseFp8) {
  golden_round_trip(true, false, testing::fresh_seed());
}
TEST(LayerCommandTest, GoldenRoundTripSparseBf16) {
  golden_round_trip(true, true, testing::fresh_seed());
}
TEST(LayerCommandTest, GoldenRoundTripDense) {
  golden_round_trip(false, false, testing::fresh_seed());
}

TEST(LayerCommandTest, BadGoldenFilesAreRejected) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t T = 5, H = 256;
  Tensor hidden(DType::kBF16, {T, H});
  testing::fill_bf16_normal(hidden, rng);
  Tensor pos(DType::kI32, {T});
  for (int t = 0; t < T; ++t) pos.ptr<int32_t>()[t] = t;
  auto reject = [&](const std::vector<NamedTensor>& tensors, int64_t hidden_size, StatusCode code,
                    const char* what) {
    const std::string path = temp_path("bad_inputs", seed);
    ASSERT_TRUE(write_safetensors(path, tensors).ok()) << what;
    Result<GoldenInputs> r = read_golden_inputs(path, hidden_size);
    EXPECT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), code) << what << ": " << r.status().to_string();
    EXPECT_NE(r.status().message().find("input."), std::string::npos)
        << what << ": the message names the tensor: " << r.status().message();
    std::remove(path.c_str());
  };
  const auto kInvalid = StatusCode::kInvalidArgument;
  reject({{"input.positions", pos.view()}}, 0, kInvalid, "no hidden states");
  reject({{"input.hidden_states", hidden.view()}}, 0, kInvalid, "no positions");
  reject({{"input.hidden_states", hidden.view()}, {"input.positions", pos.view()}}, 512, kInvalid,
         "hidden width differs from the weights");
  Tensor shifted = pos.clone();
  shifted.ptr<int32_t>()[3] = 7;
  reject({{"input.hidden_states", hidden.view()}, {"input.positions", shifted.view()}}, 0, kInvalid,
         "positions not 0..T-1");
  Tensor short_pos(DType::kI32, {T - 1});
  for (int t = 0; t < T - 1; ++t) short_pos.ptr<int32_t>()[t] = t;
  reject({{"input.hidden_states", hidden.view()}, {"input.positions", short_pos.view()}}, 0,
         kInvalid, "positions of the wrong length");
  Tensor f32_pos(DType::kF32, {T});
  reject({{"input.hidden_states", hidden.view()}, {"input.positions", f32_pos.view()}}, 0, kInvalid,
         "f32 positions");
  Tensor i32_hidden(DType::kI32, {T, H});
  reject({{"input.hidden_states", i32_hidden.view()}, {"input.positions", pos.view()}}, 0, kInvalid,
         "i32 hidden states");
  Tensor nan_hidden = hidden.clone();
  nan_hidden.ptr<uint16_t>()[7] = 0x7fc0;
  reject({{"input.hidden_states", nan_hidden.view()}, {"input.positions", pos.view()}}, 0, kInvalid,
         "NaN hidden states");

  // F32 hidden states are accepted and rounded to bf16.
  Tensor f32_hidden(DType::kF32, {T, H});
  for (int64_t i = 0; i < T * H; ++i)
    f32_hidden.ptr<float>()[i] = bf16_to_float(hidden.ptr<uint16_t>()[i]);
  const std::string ok_path = temp_path("f32_inputs", seed);
  ASSERT_TRUE(write_safetensors(ok_path, {{"input.hidden_states", f32_hidden.view()},
                                          {"input.positions", pos.view()}})
                  .ok());
  Result<GoldenInputs> ok = read_golden_inputs(ok_path, H);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(std::memcmp(ok.value().hidden.data(), hidden.data(), hidden.nbytes()), 0);

  // Files that are not there, not safetensors, or truncated.
  Result<GoldenInputs> missing = read_golden_inputs(temp_path("does_not_exist", seed));
  EXPECT_EQ(missing.status().code(), StatusCode::kIoError);
  const std::string trunc = temp_path("truncated", seed);
  {
    std::ifstream in(ok_path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream outf(trunc, std::ios::binary);
    outf.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 100));
  }
  Result<GoldenInputs> truncated = read_golden_inputs(trunc);
  EXPECT_EQ(truncated.status().code(), StatusCode::kDataLoss) << truncated.status().to_string();

  // The runner reports them as usage errors (exit code 2), weights files included.
  LayerRunOptions o;
  o.inputs_path = trunc;
  Result<LayerRunReport> r = run_layer(o);
  EXPECT_TRUE(!r.ok() && usage_error(r.status())) << r.status().to_string();
  o.inputs_path = ok_path;
  o.weights_path = ok_path;  // a safetensors file without any attention tensors
  r = run_layer(o);
  EXPECT_TRUE(!r.ok() && usage_error(r.status())) << r.status().to_string();
  o.weights_path = temp_path("no_weights_here", seed);
  r = run_layer(o);
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().to_string();
  o.weights_path.clear();
  o.dump_path = temp_path("no_such_dir", seed) + "/dump.safetensors";
  r = run_layer(o);
  EXPECT_TRUE(!r.ok() && usage_error(r.status())) << r.status().to_string();
  std::remove(ok_path.c_str());
  std::remove(trunc.c_str());
}

}  // namespace
}  // namespace m3attn
