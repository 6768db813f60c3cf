// Bounded mutation fuzzing of the parsers that read files from outside: safetensors headers,
// checkpoint indexes and config.json. Every input must give a Status or a value that satisfies the
// parser's own invariants; none may crash or read out of bounds (run under ASan/UBSan to make
// the second part visible). Seeds are printed; iteration counts keep the suite fast.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/test_util.h"
#include "weights/hf_config.h"
#include "weights/safetensors.h"

namespace m3attn {
namespace {

using testing::fresh_seed;
using testing::Rng;

std::vector<uint8_t> valid_image() {
  static Tensor a(DType::kF32, {3, 4});
  static Tensor b(DType::kBF16, {5});
  static Tensor c(DType::kE4M3, {2, 2, 2});
  a.fill_bytes(1);
  b.fill_bytes(2);
  c.fill_bytes(3);
  return encode_safetensors({{"layer.a", a.view()}, {"layer.b", b.view()}, {"c", c.view()}},
                            {{"format", "pt"}})
      .value();
}

// One random edit: overwrite, insert, erase or truncate.
void mutate(std::vector<uint8_t>& bytes, Rng& rng, size_t hot_prefix) {
  const int kind = static_cast<int>(rng.integer(0, 9));
  const size_t limit = std::min(bytes.size(), hot_prefix);
  const size_t at = limit == 0 ? 0 : static_cast<size_t>(rng.integer(0, limit - 1));
  static const char kJsonBytes[] = "{}[]\",:0123456789-.eE \\u";
  const uint8_t value = rng.integer(0, 1) ? static_cast<uint8_t>(rng.integer(0, 255))
                                          : static_cast<uint8_t>(kJsonBytes[rng.integer(0, 24)]);
  if (bytes.empty()) {
    bytes.push_back(value);
  } else if (kind <= 5) {
    bytes[at] = value;
  } else if (kind == 6) {
    bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at), value);
  } else if (kind == 7) {
    bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(at));
  } else {
    bytes.resize(static_cast<size_t>(rng.integer(0, static_cast<int64_t>(bytes.size()))));
  }
}

void check_accepted(const SafetensorsFile& f) {
  for (const SafetensorsEntry& e : f.entries()) {
    ASSERT_GE(e.offset, 8);
    ASSERT_GE(e.size, 0);
    ASSERT_LE(e.offset + e.size, f.file_size());
    ASSERT_NE(f.find(e.name), nullptr);
    ASSERT_NE(f.bytes(e), nullptr);
    if (e.supported) {
      auto t = f.read(e.name);
      ASSERT_TRUE(t.ok()) << t.status().to_string();
      ASSERT_EQ(t.value().nbytes(), e.size);
    } else {
      ASSERT_FALSE(f.read(e.name).ok());
    }
  }
}

TEST(FuzzSafetensors, MutatedImages) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<uint8_t> base = valid_image();
  int accepted = 0;
  for (int iter = 0; iter < 6000; ++iter) {
    std::vector<uint8_t> bytes = base;
    const int edits = static_cast<int>(rng.integer(1, 6));
    // Most edits land in the length field and the header, where the parsing happens.
    for (int e = 0; e < edits; ++e) mutate(bytes, rng, iter % 4 == 0 ? bytes.size() : 8 + 200);
    auto f = SafetensorsFile::from_bytes(std::move(bytes), "fuzz");
    if (!f.ok()) {
      const StatusCode c = f.status().code();
      ASSERT_TRUE(c == StatusCode::kDataLoss || c == StatusCode::kUnsupported)
          << f.status().to_string();
      ASSERT_FALSE(f.status().message().empty());
      continue;
    }
    ++accepted;
    check_accepted(f.value());
  }
  RecordProperty("accepted", accepted);
}

TEST(FuzzSafetensors, DeepNestingAndHugeNumbers) {
  auto image = [](const std::string& header) {
    std::vector<uint8_t> out;
    const uint64_t len = header.size();
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(len >> (8 * i)));
    out.insert(out.end(), header.begin(), header.end());
    return out;
  };
  const std::string deep(200000, '[');
  EXPECT_FALSE(SafetensorsFile::from_bytes(image(deep)).ok());
  EXPECT_FALSE(
      SafetensorsFile::from_bytes(image(std::string(100000, '[') + std::string(100000, ']'))).ok());
  const std::string nested_value =
      "{\"w\":" + std::string(50000, '[') + std::string(50000, ']') + "}";
  EXPECT_FALSE(SafetensorsFile::from_bytes(image(nested_value)).ok());
  EXPECT_FALSE(SafetensorsFile::from_bytes(
                   image(R"({"w":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})"))
                   .ok());
  EXPECT_FALSE(
      SafetensorsFile::from_bytes(
          image(R"({"w":{"dtype":"F32","shape":[99999999999999999999999],"data_offsets":[0,4]}})"))
          .ok());
  // A header length beyond the 100 MB limit is refused before anything is parsed.
  std::vector<uint8_t> big(16, ' ');
  const uint64_t len = (100u << 20) + 1;
  for (int i = 0; i < 8; ++i) big[i] = static_cast<uint8_t>(len >> (8 * i));
  auto r = SafetensorsFile::from_bytes(big);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
}

nlohmann::json m3_config() {
  std::vector<int> freq(60, 1);
  freq[0] = freq[1] = freq[2] = 0;
  return {{"hidden_size", 6144},
          {"num_hidden_layers", 60},
          {"num_attention_heads", 64},
          {"num_key_value_heads", 4},
          {"head_dim", 128},
          {"rotary_dim", 64},
          {"rope_theta", 5e6},
          {"rms_norm_eps", 1e-6},
          {"use_gemma_norm", true},
          {"vocab_size", 200064},
          {"rope_parameters", {{"rope_theta", 5e6}, {"partial_rotary_factor", 0.5}}},
          {"sparse_attention_config",
           {{"sparse_num_index_heads", 4},
            {"sparse_index_dim", 128},
            {"sparse_block_size", 128},
            {"sparse_topk_blocks", 16},
            {"sparse_init_block", 0},
            {"sparse_local_block", 1},
            {"sparse_attention_freq", freq}}}};
}

void check_config(const M3Config& c) {
  ASSERT_EQ(c.head_dim, 128);
  ASSERT_EQ(c.index_dim, 128);
  ASSERT_EQ(c.rotary_dim, 64);
  ASSERT_EQ(c.block_size, 128);
  ASSERT_EQ(c.topk_blocks, 16);
  ASSERT_EQ(c.n_idx, c.n_kv);
  ASSERT_GT(c.n_kv, 0);
  ASSERT_EQ(c.n_q % c.n_kv, 0);
  ASSERT_EQ(static_cast<int>(c.sparse_layer.size()), c.num_layers);
  ASSERT_TRUE(c.geometry().validate().ok()) << c.geometry().validate().to_string();
}

TEST(FuzzConfig, TextMutations) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::string text = m3_config().dump();
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<uint8_t> bytes(text.begin(), text.end());
    const int edits = static_cast<int>(rng.integer(1, 4));
    for (int e = 0; e < edits; ++e) mutate(bytes, rng, bytes.size());
    auto c = parse_m3_config(std::string(bytes.begin(), bytes.end()), "fuzz.json");
    if (c.ok())
      check_config(c.value());
    else
      ASSERT_FALSE(c.status().message().empty());
  }
}

TEST(FuzzConfig, ValueSubstitutions) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const nlohmann::json base = m3_config();
  const nlohmann::json odd[] = {nullptr,
                                "128",
                                -1,
                                0,
                                1,
                                127,
                                4294967296LL,
                                1e300,
                                -0.0,
                                0.5,
                                true,
                                nlohmann::json::array(),
                                nlohmann::json::object(),
                                {1, 2},
                                18446744073709551615ULL};
  std::vector<nlohmann::json::json_pointer> paths;
  const nlohmann::json flat = base.flatten();
  for (const auto& [k, v] : flat.items()) paths.emplace_back(k);
  for (const char* k : {"/rope_parameters", "/sparse_attention_config",
                        "/sparse_attention_config/sparse_attention_freq"})
    paths.emplace_back(k);
  for (int iter = 0; iter < 3000; ++iter) {
    nlohmann::json j = base;
    const int edits = static_cast<int>(rng.integer(1, 3));
    for (int e = 0; e < edits; ++e) {
      const auto& p =
          paths[static_cast<size_t>(rng.integer(0, static_cast<int64_t>(paths.size()) - 1))];
      // An earlier edit may have replaced a parent with a scalar: such an edit is skipped.
      try {
        if (rng.integer(0, 4) == 0) {
          if (j.contains(p.parent_pointer()) && j[p.parent_pointer()].is_object())
            j[p.parent_pointer()].erase(p.back());
        } else {
          j[p] = odd[rng.integer(0, 14)];
        }
      } catch (const nlohmann::json::exception&) {
      }
    }
    if (rng.integer(0, 3) == 0) j = nlohmann::json{{"text_config", j}};
    auto c = parse_m3_config(j.dump(), "fuzz.json");
    if (c.ok()) check_config(c.value());
  }
}

}  // namespace
}  // namespace m3attn
