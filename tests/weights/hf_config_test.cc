#include "weights/hf_config.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "weights/weights_test_util.h"

namespace m3attn {
namespace {

using nlohmann::json;

std::vector<int> m3_freq() {
  std::vector<int> f(60, 1);
  f[0] = f[1] = f[2] = 0;
  return f;
}

// The checkpoint spelling of MiniMax-M3 (SPEC section 1).
json checkpoint_config() {
  return json{{"architectures", {"MiniMaxM3ForCausalLM"}},
              {"hidden_size", 6144},
              {"num_hidden_layers", 60},
              {"num_attention_heads", 64},
              {"num_key_value_heads", 4},
              {"head_dim", 128},
              {"rotary_dim", 64},
              {"rope_theta", 5000000.0},
              {"rms_norm_eps", 1e-6},
              {"use_gemma_norm", true},
              {"vocab_size", 200064},
              {"sparse_attention_config",
               {{"sparse_num_index_heads", 4},
                {"sparse_index_dim", 128},
                {"sparse_block_size", 128},
                {"sparse_topk_blocks", 16},
                {"sparse_init_block", 0},
                {"sparse_local_block", 1},
                {"sparse_attention_freq", m3_freq()}}}};
}

// The HF transformers spelling.
json hf_config() {
  std::vector<std::string> types(60, "minimax_m3_sparse");
  types[0] = types[1] = types[2] = "full_attention";
  return json{
      {"hidden_size", 6144},
      {"num_hidden_layers", 60},
      {"num_attention_heads", 64},
      {"num_key_value_heads", 4},
      {"head_dim", 128},
      {"rms_norm_eps", 1e-6},
      {"vocab_size", 200064},
      {"index_n_heads", 4},
      {"index_head_dim", 128},
      {"index_block_size", 128},
      {"index_topk_blocks", 16},
      {"index_local_blocks", 1},
      {"layer_types", types},
      {"rope_parameters",
       {{"rope_type", "default"}, {"rope_theta", 5000000.0}, {"partial_rotary_factor", 0.5}}}};
}

void expect_m3(const M3Config& c) {
  EXPECT_EQ(c.hidden, 6144);
  EXPECT_EQ(c.num_layers, 60);
  EXPECT_EQ(c.n_q, 64);
  EXPECT_EQ(c.n_kv, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.n_idx, 4);
  EXPECT_EQ(c.index_dim, 128);
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.rope_theta, 5e6);
  EXPECT_FLOAT_EQ(c.eps, 1e-6f);
  EXPECT_EQ(c.vocab, 200064);
  ASSERT_EQ(c.sparse_layer.size(), 60u);
  for (int l = 0; l < 60; ++l) EXPECT_EQ(c.sparse_layer[l], l >= 3) << "layer " << l;
  EXPECT_EQ(c.num_sparse_layers(), 57);
  EXPECT_EQ(c.block_size, 128);
  EXPECT_EQ(c.topk_blocks, 16);
  const MsaGeometry g = c.geometry();
  EXPECT_TRUE(g.validate().ok());
  EXPECT_EQ(g.packed_width(), 9856);
  EXPECT_FLOAT_EQ(g.rope_theta, 5e6f);
}

TEST(HfConfig, CheckpointSpelling) {
  auto c = parse_m3_config(checkpoint_config().dump());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  expect_m3(c.value());
  EXPECT_NE(c.value().to_string().find("57 sparse"), std::string::npos);
}

TEST(HfConfig, HfSpelling) {
  auto c = parse_m3_config(hf_config().dump());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  expect_m3(c.value());
}

TEST(HfConfig, BothSpellingsTogetherAndNestedTextConfig) {
  json both = hf_config();
  const json ck = checkpoint_config();
  for (auto& [k, v] : ck.items()) both[k] = v;
  auto c = parse_m3_config(both.dump());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  expect_m3(c.value());

  json vl = {{"architectures", {"MiniMaxM3VLForConditionalGeneration"}},
             {"vision_config", {{"hidden_size", 1024}}},
             {"text_config", checkpoint_config()}};
  auto v = parse_m3_config(vl.dump());
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  expect_m3(v.value());
  // Errors name the nested keys.
  vl["text_config"].erase("num_key_value_heads");
  auto bad = parse_m3_config(vl.dump());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("text_config.num_key_value_heads"), std::string::npos)
      << bad.status().to_string();
}

TEST(HfConfig, RotaryWidthSources) {
  // Checkpoint spelling with the factor alone, and with both in agreement.
  json a = checkpoint_config();
  a.erase("rotary_dim");
  a["partial_rotary_factor"] = 0.5;
  auto ra = parse_m3_config(a.dump());
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  EXPECT_EQ(ra.value().rotary_dim, 64);
  json b = hf_config();
  b["rotary_dim"] = 64;
  auto rb = parse_m3_config(b.dump());
  ASSERT_TRUE(rb.ok()) << rb.status().to_string();
  EXPECT_EQ(rb.value().rotary_dim, 64);
}

// Each mutation of a valid config is rejected with a code and a message naming the problem.
struct BadConfig {
  const char* what;
  std::function<json()> make;
  StatusCode code;
  const char* needle;
};

TEST(HfConfig, MalformedCorpusIsRejected) {
  auto ck = [](std::function<void(json&)> f) {
    return [f] {
      json j = checkpoint_config();
      f(j);
      return j;
    };
  };
  auto hf = [](std::function<void(json&)> f) {
    return [f] {
      json j = hf_config();
      f(j);
      return j;
    };
  };
  const auto kInv = StatusCode::kInvalidArgument;
  const auto kUns = StatusCode::kUnsupported;
  std::vector<BadConfig> corpus = {
      {"not an object",
       [] {
         return json::array({1, 2});
       },
       kInv, "must be a JSON object"},
      {"missing hidden", ck([](json& j) { j.erase("hidden_size"); }), kInv,
       "\"hidden_size\" is missing"},
      {"hidden as string", ck([](json& j) { j["hidden_size"] = "6144"; }), kInv,
       "\"hidden_size\" must be an integer"},
      {"heads as float", ck([](json& j) { j["num_attention_heads"] = 64.0; }), kInv,
       "\"num_attention_heads\" must be an integer"},
      {"negative kv heads", ck([](json& j) { j["num_key_value_heads"] = -4; }), kInv,
       "\"num_key_value_heads\" = -4 is outside"},
      {"missing eps", ck([](json& j) { j.erase("rms_norm_eps"); }), kInv,
       "\"rms_norm_eps\" is missing"},
      {"zero eps", ck([](json& j) { j["rms_norm_eps"] = 0.0; }), kInv,
       "rms_norm_eps must be finite and > 0"},
      {"no theta", ck([](json& j) { j.erase("rope_theta"); }), kInv, "rope theta is missing"},
      {"negative theta", ck([](json& j) { j["rope_theta"] = -1.0; }), kInv,
       "rope theta must be finite and > 0"},
      {"theta disagrees", hf([](json& j) { j["rope_theta"] = 1e4; }), kInv, "rope theta disagrees"},
      {"rope type", hf([](json& j) { j["rope_parameters"]["rope_type"] = "yarn"; }), kUns,
       "rope_type \"yarn\""},
      {"not m3", ck([](json& j) { j.erase("sparse_attention_config"); }), kInv,
       "not a MiniMax-M3 config"},
      {"sparse config not object", ck([](json& j) { j["sparse_attention_config"] = 1; }), kInv,
       "\"sparse_attention_config\" must be an object"},
      {"missing index heads",
       ck([](json& j) { j["sparse_attention_config"].erase("sparse_num_index_heads"); }), kInv,
       "\"sparse_attention_config.sparse_num_index_heads\" is missing"},
      {"missing freq",
       ck([](json& j) { j["sparse_attention_config"].erase("sparse_attention_freq"); }), kInv,
       "sparse_attention_freq\" is missing"},
      {"freq value 2",
       ck([](json& j) { j["sparse_attention_config"]["sparse_attention_freq"][5] = 2; }), kInv,
       "sparse_attention_freq\"[5] = 2 must be 0 or 1"},
      {"freq too short",
       ck([](json& j) { j["sparse_attention_config"]["sparse_attention_freq"].erase(59); }), kInv,
       "has 59 entries but num_hidden_layers is 60"},
      {"block 64", ck([](json& j) { j["sparse_attention_config"]["sparse_block_size"] = 64; }),
       kUns, "sparse block size 64 is not supported"},
      {"topk 8", ck([](json& j) { j["sparse_attention_config"]["sparse_topk_blocks"] = 8; }), kUns,
       "top-k blocks 8 is not supported"},
      {"init block 1", ck([](json& j) { j["sparse_attention_config"]["sparse_init_block"] = 1; }),
       kUns, "sparse_init_block 1 is not supported"},
      {"local block 2", ck([](json& j) { j["sparse_attention_config"]["sparse_local_block"] = 2; }),
       kUns, "local blocks 2 is not supported"},
      {"index dim 64", ck([](json& j) { j["sparse_attention_config"]["sparse_index_dim"] = 64; }),
       kUns, "index head dim 64 is not supported"},
      {"index heads != kv",
       ck([](json& j) { j["sparse_attention_config"]["sparse_num_index_heads"] = 2; }), kUns,
       "index head count 2 must equal num_key_value_heads 4"},
      {"head dim 64", ck([](json& j) { j["head_dim"] = 64; }), kUns,
       "head_dim 64 is not supported"},
      {"head dim absent (HF default 96)", ck([](json& j) { j.erase("head_dim"); }), kUns,
       "head_dim 96 is not supported"},
      {"q not multiple of kv", ck([](json& j) { j["num_key_value_heads"] = 3; }), kInv,
       "not a multiple of num_key_value_heads 3"},
      {"gemma norm off", ck([](json& j) { j["use_gemma_norm"] = false; }), kUns,
       "use_gemma_norm = false"},
      {"rotary 128", ck([](json& j) { j["rotary_dim"] = 128; }), kUns,
       "rotary width 128 is not supported"},
      {"checkpoint without rotary source", ck([](json& j) { j.erase("rotary_dim"); }), kUns,
       "rotary width 128 is not supported"},
      {"rotary vs factor", ck([](json& j) {
         j["rope_parameters"] = {{"partial_rotary_factor", 1.0}};
       }),
       kInv,
       "rotary width disagrees: \"rotary_dim\" = 64 but head_dim 128 x partial_rotary_factor 1"},
      {"HF rotary_dim without factor (the trap)", hf([](json& j) {
         j["rope_parameters"].erase("partial_rotary_factor");
         j["rotary_dim"] = 64;
       }),
       kInv, "HF transformers rotates all 128 channels"},
      {"HF without factor rotates everything",
       hf([](json& j) { j["rope_parameters"].erase("partial_rotary_factor"); }), kUns,
       "rotary width 128 is not supported"},
      {"factor disagrees between spellings", hf([](json& j) { j["partial_rotary_factor"] = 0.25; }),
       kInv, "partial_rotary_factor disagrees"},
      {"fractional rotary width",
       hf([](json& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.3; }), kInv,
       "is not a whole number of channels"},
      {"HF missing layer_types", hf([](json& j) { j.erase("layer_types"); }), kInv,
       "\"layer_types\" is missing"},
      {"HF unknown layer type", hf([](json& j) { j["layer_types"][7] = "sliding_attention"; }),
       kUns, "\"layer_types\"[7] = \"sliding_attention\" is not supported"},
      {"HF missing topk", hf([](json& j) { j.erase("index_topk_blocks"); }), kInv,
       "\"index_topk_blocks\" is missing"},
      {"HF local blocks 0", hf([](json& j) { j["index_local_blocks"] = 0; }), kUns,
       "local blocks 0 is not supported"},
      {"spellings disagree on topk",
       [] {
         json j = hf_config();
         const json c = checkpoint_config();
         for (auto& [k, v] : c.items()) j[k] = v;
         j["index_topk_blocks"] = 32;
         return j;
       },
       kInv, "top-k blocks disagrees"},
      {"spellings disagree on layers",
       [] {
         json j = hf_config();
         const json c = checkpoint_config();
         for (auto& [k, v] : c.items()) j[k] = v;
         j["layer_types"][3] = "full_attention";
         return j;
       },
       kInv, "sparse layer pattern disagrees"},
      {"text_config not object",
       [] {
         return json{{"text_config", 3}};
       },
       kInv, "\"text_config\" must be an object"},
      {"hidden not multiple of 128", ck([](json& j) { j["hidden_size"] = 6100; }), kUns,
       "hidden_size 6100 is not a multiple of 128"},
  };
  for (const BadConfig& b : corpus) {
    SCOPED_TRACE(b.what);
    auto c = parse_m3_config(b.make().dump(), "cfg.json");
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), b.code) << c.status().to_string();
    EXPECT_NE(c.status().message().find(b.needle), std::string::npos) << c.status().to_string();
    EXPECT_EQ(c.status().message().rfind("cfg.json", 0), 0u) << c.status().to_string();
  }
  auto not_json = parse_m3_config("{\"hidden_size\": ", "cfg.json");
  EXPECT_EQ(not_json.status().code(), StatusCode::kDataLoss);
}

TEST(HfConfig, LoadFromFileAndDirectory) {
  weights_test::ScratchDir dir("hfcfg");
  dir.write_text("config.json", checkpoint_config().dump(2));
  auto by_dir = load_m3_config(dir.path());
  ASSERT_TRUE(by_dir.ok()) << by_dir.status().to_string();
  expect_m3(by_dir.value());
  auto by_file = load_m3_config(dir.file("config.json"));
  ASSERT_TRUE(by_file.ok());
  auto missing = load_m3_config(dir.file("nope.json"));
  EXPECT_EQ(missing.status().code(), StatusCode::kIoError);
}

}  // namespace
}  // namespace m3attn
