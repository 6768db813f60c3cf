// What `m3attn layer` does, as a library function (so tests exercise the exact code the CLI runs):
// one mixed step of one attention layer on a backend, with random or loaded weights, and a report
// of what happened (tokens per phase, blocks selected, time per stage).
//
// Two modes:
//  - scenario (default): context chunks "tokens:cached,..." then `gen` generation requests of
//    1 + draft tokens over gen_context_len cached tokens each; cached prefixes hold random E4M3
//    K / V / index-K, hidden states are random N(0, 1) bf16; weights are random for the geometry
//    (or loaded with weights_path);
//  - golden (inputs_path set): one sequence of T tokens prefilled from position 0 with the hidden
//    states of the inputs file, weights from weights_path (or random for the inputs' width).
// dump_path writes the step's outputs and intermediates (golden_io.h), TP1 only.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "layer/msa_layer.h"
#include "m3attn/config.h"
#include "m3attn/status.h"

namespace m3attn {

enum class Backend { kCpu, kCuda };
Result<Backend> parse_backend(const std::string& name);  // "cpu" | "cuda"
const char* backend_name(Backend backend);

struct ContextSpec {
  int64_t tokens = 0;  // new tokens of the chunk (>= 1)
  int64_t cached = 0;  // tokens already in the cache (>= 0)
};
// "512:1800,100" -> {{512, 1800}, {100, 0}}; "" -> {}. Clear errors for anything else.
Result<std::vector<ContextSpec>> parse_context_list(const std::string& text);

// The CLI's default: hidden 1024, 8 query heads, 2 KV heads.
MsaGeometry default_layer_geometry();

struct LayerRunOptions {
  MsaGeometry geometry = default_layer_geometry();  // random weights (ignored with weights_path)
  bool sparse = true;                               // random weights: MSA layer or dense layer
  bool fused = true;                                // fuse_qkv_index_projection
  std::vector<ContextSpec> context;
  int gen = 0;                  // generation requests
  int draft = 0;                // draft tokens per generation request
  int64_t gen_context_len = 0;  // cached tokens of each generation request (>= 1 when gen > 0)
  uint64_t seed = 1;
  int tp_size = 1;  // simulated tensor parallelism (all ranks run, partials summed)
  Backend backend = Backend::kCpu;
  std::string weights_path;  // safetensors file, index json or checkpoint directory
  int layer_index = 0;       // model.layers.N in weights_path
  float rope_theta = 5e6f;   // used when the weights carry no config
  float eps = 1e-6f;
  std::string inputs_path;  // golden mode
  std::string dump_path;
};

struct LayerRunReport {
  std::string mode;  // "scenario" | "golden"
  std::string backend;
  MsaGeometry geometry;  // TP1
  bool sparse = true;
  bool fused = true;
  int tp_size = 1;
  int layer_index = -1;  // when weights were loaded
  uint64_t seed = 0;

  int context_requests = 0;
  int64_t context_tokens = 0;
  int generation_requests = 0;
  int64_t generation_tokens = 0;
  int draft = 0;
  int64_t total_tokens = 0;
  int64_t pages_used = 0;
  int64_t pool_bytes = 0;  // per rank

  // Sparse layers: per query token, visible blocks (pos / 128 + 1), and what the indexer chose.
  double mean_visible_blocks = 0;
  double mean_selected_blocks = 0;  // valid ids per (token, KV head)
  double mean_distinct_blocks = 0;  // union over the KV heads of one token
  int64_t pruned_tokens = 0;        // tokens where some head dropped a visible block

  std::array<double, kNumLayerStages> stage_seconds{};  // summed over ranks
  double total_seconds = 0;
  double out_rms = 0;      // of attn_out
  bool out_finite = true;  // no NaN / Inf in attn_out
  std::string checksum;    // FNV-1a 64 of the attn_out bytes, hex

  std::string to_text() const;
  std::string to_json() const;  // one JSON object, one line
};

// Everything that went in and came out, for tests (TP1: trace of the layer; TP > 1: reduced out).
struct LayerRunArtifacts {
  Tensor hidden;     // bf16 [T, hidden]
  Tensor attn_out;   // bf16 [T, hidden]
  LayerTrace trace;  // TP1 only
};

// Runs the step. Status codes: kInvalidArgument / kIoError / kDataLoss / kUnsupported for bad
// options or files (the CLI exits 2), anything else for a failed run (exit 1).
Result<LayerRunReport> run_layer(const LayerRunOptions& options,
                                 LayerRunArtifacts* artifacts = nullptr);

}  // namespace m3attn
