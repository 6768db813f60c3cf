#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "weights/hf_config.h"
#include "weights/packing.h"
#include "weights/weights_test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;
using weights_test::ScratchDir;

constexpr int kHidden = 256, kNq = 4, kNkv = 2;

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}
bool same_matrix(const QuantizedMatrix& a, const QuantizedMatrix& b) {
  return same_bytes(a.w, b.w) && same_bytes(a.scales, b.scales);
}

// BF16 source tensors of one small layer under HF names.
struct Bf16Layer {
  std::map<std::string, Tensor> t;  // leaf name ("q_proj") -> tensor
  explicit Bf16Layer(uint64_t seed, bool sparse = true) {
    Rng rng(seed);
    auto add = [&](const char* leaf, std::vector<int64_t> shape) {
      Tensor x(DType::kBF16, std::move(shape));
      testing::fill_bf16_normal(x, rng, 0.05f);
      t.emplace(leaf, std::move(x));
    };
    add("q_proj", {kNq * 128, kHidden});
    add("k_proj", {kNkv * 128, kHidden});
    add("v_proj", {kNkv * 128, kHidden});
    add("o_proj", {kHidden, kNq * 128});
    add("q_norm", {128});
    add("k_norm", {128});
    if (sparse) {
      add("index_q_proj", {kNkv * 128, kHidden});
      add("index_k_proj", {128, kHidden});
      add("index_q_norm", {128});
      add("index_k_norm", {128});
    }
  }
  std::vector<NamedTensor> named(const std::string& prefix, int layer,
                                 const std::string& skip = "") const {
    std::vector<NamedTensor> out;
    for (const auto& [leaf, x] : t)
      if (leaf != skip)
        out.emplace_back(
            prefix + "layers." + std::to_string(layer) + ".self_attn." + leaf + ".weight",
            x.view());
    return out;
  }
};

void expect_matches_bf16(const AttentionWeights& w, const Bf16Layer& src) {
  EXPECT_EQ(w.geometry.hidden, kHidden);
  EXPECT_EQ(w.geometry.n_q, kNq);
  EXPECT_EQ(w.geometry.n_kv, kNkv);
  const std::pair<const char*, const QuantizedMatrix*> mats[] = {{"q_proj", &w.q},
                                                                 {"k_proj", &w.k},
                                                                 {"v_proj", &w.v},
                                                                 {"o_proj", &w.o},
                                                                 {"index_q_proj", &w.index_q},
                                                                 {"index_k_proj", &w.index_k}};
  for (const auto& [leaf, m] : mats) {
    SCOPED_TRACE(leaf);
    auto want = quantize_blocks_128(src.t.at(leaf).view());
    ASSERT_TRUE(want.ok());
    EXPECT_TRUE(same_matrix(*m, want.value()));
  }
  EXPECT_TRUE(same_bytes(w.q_norm, src.t.at("q_norm")));
  EXPECT_TRUE(same_bytes(w.k_norm, src.t.at("k_norm")));
  EXPECT_TRUE(same_bytes(w.index_q_norm, src.t.at("index_q_norm")));
  EXPECT_TRUE(same_bytes(w.index_k_norm, src.t.at("index_k_norm")));
}

TEST(LoadWeights, Bf16RoundTripThroughTheWriter) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  const Bf16Layer src(seed);
  ScratchDir dir("load_bf16");
  // Layer 3 of a checkpoint that also holds layer 2 (must not be confused with it).
  const Bf16Layer other(seed + 1);
  auto tensors = src.named("model.", 3);
  for (auto& nt : other.named("model.", 2)) tensors.push_back(nt);
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), tensors).ok());
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  auto w = load_attention_weights(ckpt.value(), 3);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_TRUE(w.value().sparse);
  EXPECT_FLOAT_EQ(w.value().geometry.rope_theta, 5e6f);
  expect_matches_bf16(w.value(), src);
  auto w2 = load_attention_weights(ckpt.value(), 2);
  ASSERT_TRUE(w2.ok());
  EXPECT_FALSE(same_matrix(w2.value().q, w.value().q));
}

TEST(LoadWeights, Fp8BlockRoundTripIsBitExactWithVlPrefixAndShards) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  MsaGeometry g;
  g.hidden = kHidden;
  g.n_q = kNq;
  g.n_kv = kNkv;
  auto ref = random_attention_weights(g, seed);
  ASSERT_TRUE(ref.ok());
  const auto tensors = attention_weight_tensors(ref.value(), 5, "language_model.model.");
  ScratchDir dir("load_fp8");
  // Two shards and an index.
  std::vector<NamedTensor> a(tensors.begin(), tensors.begin() + 7);
  std::vector<NamedTensor> b(tensors.begin() + 7, tensors.end());
  ASSERT_TRUE(write_safetensors(dir.file("part-1.safetensors"), a).ok());
  ASSERT_TRUE(write_safetensors(dir.file("part-2.safetensors"), b).ok());
  std::string index = R"({"weight_map":{)";
  for (size_t i = 0; i < tensors.size(); ++i)
    index += (i ? "," : "") + std::string("\"") + tensors[i].first + "\":\"part-" +
             (i < 7 ? "1" : "2") + ".safetensors\"";
  index += "}}";
  dir.write_text("model.safetensors.index.json", index);
  auto ckpt = Checkpoint::open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_EQ(ckpt.value().num_files(), 2u);
  auto w = load_attention_weights(ckpt.value(), 5);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  const AttentionWeights& r = ref.value();
  EXPECT_TRUE(same_matrix(w.value().q, r.q));
  EXPECT_TRUE(same_matrix(w.value().k, r.k));
  EXPECT_TRUE(same_matrix(w.value().v, r.v));
  EXPECT_TRUE(same_matrix(w.value().o, r.o));
  EXPECT_TRUE(same_matrix(w.value().index_q, r.index_q));
  EXPECT_TRUE(same_matrix(w.value().index_k, r.index_k));
  EXPECT_TRUE(same_bytes(w.value().index_k_norm, r.index_k_norm));
  // The packed weights of the loaded layer equal those of the original.
  auto p0 = pack_rank(w.value(), 2, 1);
  auto p1 = pack_rank(r, 2, 1);
  ASSERT_TRUE(p0.ok() && p1.ok());
  EXPECT_TRUE(same_matrix(p0.value().fused, p1.value().fused));
}

TEST(LoadWeights, Mxfp8IsRequantizedWithE8M0OrU8Scales) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Bf16Layer src(seed);  // norms and the shapes
  std::vector<NamedTensor> named;
  std::map<std::string, std::pair<Tensor, Tensor>> mx;  // leaf -> (e4m3 w, e8m0 scales)
  for (const auto& [leaf, x] : src.t) {
    const std::string base = "model.layers.0.self_attn." + leaf;
    if (x.shape().size() == 1) {
      named.emplace_back(base + ".weight", x.view());
      continue;
    }
    const int64_t n = x.shape()[0], k = x.shape()[1];
    Tensor w(DType::kE4M3, {n, k});
    testing::fill_e4m3_normal(w, rng, 30.0f);
    Tensor s(DType::kE8M0, {n, k / 32});
    for (int64_t i = 0; i < s.numel(); ++i)
      s.ptr<uint8_t>()[i] = static_cast<uint8_t>(rng.integer(117, 130));
    auto& slot = mx[leaf] = {std::move(w), std::move(s)};
    named.emplace_back(base + ".weight", slot.first.view());
    named.emplace_back(base + ".weight_scale", slot.second.view());
  }
  auto image = encode_safetensors(named);
  ASSERT_TRUE(image.ok());
  // The same file with the scales spelled "U8" (padded with JSON whitespace to the same length).
  std::vector<uint8_t> u8 = image.value();
  const std::string from = "\"F8_E8M0\"", to = "\"U8\"     ";
  std::string text(u8.begin(), u8.end());
  int replaced = 0;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at)) {
    text.replace(at, from.size(), to);
    ++replaced;
  }
  ASSERT_EQ(replaced, 6);
  u8.assign(text.begin(), text.end());
  for (const auto& bytes : {image.value(), u8}) {
    auto file = SafetensorsFile::from_bytes(bytes, "mx");
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    auto w = load_attention_weights(file.value(), 0);
    ASSERT_TRUE(w.ok()) << w.status().to_string();
    const std::pair<const char*, const QuantizedMatrix*> mats[] = {
        {"q_proj", &w.value().q},
        {"k_proj", &w.value().k},
        {"v_proj", &w.value().v},
        {"o_proj", &w.value().o},
        {"index_q_proj", &w.value().index_q},
        {"index_k_proj", &w.value().index_k}};
    for (const auto& [leaf, m] : mats) {
      SCOPED_TRACE(leaf);
      auto want = requantize_mxfp8(mx.at(leaf).first.view(), mx.at(leaf).second.view());
      ASSERT_TRUE(want.ok());
      EXPECT_TRUE(same_matrix(*m, want.value()));
    }
  }
}

TEST(LoadWeights, DenseLayerAndConfigChecks) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  const Bf16Layer dense(seed, /*sparse=*/false);
  auto f = SafetensorsFile::from_bytes(encode_safetensors(dense.named("model.", 0)).value());
  ASSERT_TRUE(f.ok());
  auto w = load_attention_weights(f.value(), 0);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_FALSE(w.value().sparse);

  M3Config cfg;
  cfg.hidden = kHidden;
  cfg.num_layers = 2;
  cfg.n_q = kNq;
  cfg.n_kv = kNkv;
  cfg.rope_theta = 1e4;
  cfg.eps = 1e-5f;
  cfg.sparse_layer = {false, true};
  AttentionLoadOptions opt;
  opt.config = &cfg;
  auto wc = load_attention_weights(f.value(), 0, opt);
  ASSERT_TRUE(wc.ok()) << wc.status().to_string();
  EXPECT_FLOAT_EQ(wc.value().geometry.rope_theta, 1e4f);
  EXPECT_FLOAT_EQ(wc.value().geometry.eps, 1e-5f);

  // Config says layer 1 is sparse, but it has no index projections.
  auto f1 = SafetensorsFile::from_bytes(encode_safetensors(dense.named("model.", 1)).value());
  auto ws = load_attention_weights(f1.value(), 1, opt);
  ASSERT_FALSE(ws.ok());
  EXPECT_NE(ws.status().message().find("model.layers.1.self_attn.index_q_proj.weight"),
            std::string::npos)
      << ws.status().to_string();
  cfg.n_q = 8;
  auto wq = load_attention_weights(f.value(), 0, opt);
  ASSERT_FALSE(wq.ok());
  EXPECT_NE(wq.status().message().find("the config says hidden 256, q heads 8"), std::string::npos)
      << wq.status().to_string();
  cfg.n_q = kNq;
  EXPECT_FALSE(load_attention_weights(f.value(), 2, opt).ok());  // beyond the config's layers

  // Config says dense but the checkpoint has index projections.
  const Bf16Layer sparse(seed + 2);
  auto f2 = SafetensorsFile::from_bytes(encode_safetensors(sparse.named("model.", 0)).value());
  auto wd = load_attention_weights(f2.value(), 0, opt);
  ASSERT_FALSE(wd.ok());
  EXPECT_NE(wd.status().message().find("dense in the config"), std::string::npos);
}

TEST(LoadWeights, ErrorsNameTheTensor) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  const Bf16Layer src(seed);
  const std::string base = "model.layers.0.self_attn.";
  auto load = [&](std::vector<NamedTensor> tensors) {
    auto f = SafetensorsFile::from_bytes(encode_safetensors(tensors).value());
    EXPECT_TRUE(f.ok());
    return load_attention_weights(f.value(), 0);
  };
  auto expect = [](const Result<AttentionWeights>& r, const std::string& needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  expect(load(src.named("model.", 0, "k_norm")), "no tensor \"" + base + "k_norm.weight\"");
  expect(load(src.named("model.", 0, "index_k_proj")),
         "no tensor \"" + base + "index_k_proj.weight\"");
  expect(load(src.named("model.", 0, "q_proj")), "no tensor \"" + base + "q_proj.weight\"");
  expect(load(src.named("other.", 0)), "no tensor \"model.layers.0.self_attn.q_proj.weight\"");

  // Shape mismatch: v_proj with one head too many.
  Tensor big_v(DType::kBF16, {3 * 128, kHidden});
  big_v.fill_bytes(0);
  auto tensors = src.named("model.", 0, "v_proj");
  tensors.emplace_back(base + "v_proj.weight", big_v.view());
  expect(load(tensors), "\"" + base + "v_proj.weight\" has shape [384, 256], expected [256, 256]");

  // A norm of the wrong length.
  Tensor short_norm(DType::kBF16, {64});
  short_norm.fill_bytes(0);
  tensors = src.named("model.", 0, "q_norm");
  tensors.emplace_back(base + "q_norm.weight", short_norm.view());
  expect(load(tensors), "\"" + base + "q_norm.weight\" has shape [64], expected [128]");

  // FP8 without any scale.
  Tensor fp8(DType::kE4M3, {kNq * 128, kHidden});
  fp8.fill_bytes(0x38);
  tensors = src.named("model.", 0, "q_proj");
  tensors.emplace_back(base + "q_proj.weight", fp8.view());
  expect(load(tensors), "neither \"" + base + "q_proj.weight_scale_inv\"");

  // FP8 block scales of the wrong shape: the error names the projection.
  Tensor bad_scale(DType::kF32, {1, 1});
  bad_scale.fill_bytes(0);
  tensors.emplace_back(base + "q_proj.weight_scale_inv", bad_scale.view());
  expect(load(tensors), "tensor \"" + base + "q_proj.weight\": FP8 block scales");

  // I32 projection: unsupported, named.
  Tensor i32(DType::kI32, {kNq * 128, kHidden});
  i32.fill_bytes(0);
  tensors = src.named("model.", 0, "q_proj");
  tensors.emplace_back(base + "q_proj.weight", i32.view());
  auto r = load(tensors);
  expect(r, "\"" + base + "q_proj.weight\" has dtype I32");
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);

  // NaN in a BF16 projection.
  Tensor nan_k = src.t.at("k_proj").clone();
  weights_test::poke<uint16_t>(nan_k, kHidden + 3, 0x7fc0);
  tensors = src.named("model.", 0, "k_proj");
  tensors.emplace_back(base + "k_proj.weight", nan_k.view());
  expect(load(tensors), "tensor \"" + base + "k_proj.weight\": weight [1, 3] is not finite");

  EXPECT_FALSE(load_attention_weights(Checkpoint(), -1).ok());
}

}  // namespace
}  // namespace m3attn
