// What `m3attn bench` does, as a library function: a serving run of the attention part of an
// M3-shaped model (LayerStack) under the continuous-batching scheduler, once with the fused
// [Q|K|V|iQ|iK] projection + fused producer and once with the unfused baseline, over identical step
// sequences, and a report of the serving metrics of both with the fused/unfused ratios.
//
// The run measures attention only: the MoE blocks, the LM head and the sampler are outside this
// project, so no token is ever sampled. Inputs are synthetic hidden states; every generation step
// "produces" 1 + draft_len tokens (all drafts accepted), capped at the output length. Time is the
// sum of the stack's step times (device time on CUDA), so the host work between steps (planning,
// metrics) does not count.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/device.h"
#include "engine/layer_stack.h"
#include "engine/metrics.h"
#include "engine/scheduler.h"
#include "m3attn/config.h"

namespace m3attn {

struct BenchOptions {
  std::string backend = "cpu";  // "cpu" | "cuda"
  MsaGeometry geometry;
  int num_dense = 3;
  int num_sparse = 1;
  Workload workload;
  int64_t max_tokens_per_step = 8192;
  int64_t num_pages = 0;  // 0 = concurrency * pages per request
  bool run_fused = true;
  bool run_unfused = true;
  // Before each measured run, a short unmeasured warm-up (concurrency requests of
  // min(input, 256) prompt tokens and min(output, 4) output tokens) so that one-time costs
  // (workspaces, plans, graph capture of full decode batches) stay out of the numbers.
  bool warmup = false;
  // Hash the final hidden states of every step (a fused/unfused identity check over the whole run;
  // costs a host copy per step). Otherwise only the last step's hidden states are kept.
  bool digest_every_step = false;
  // CUDA: prefill / mixed steps replay each layer's front half as a graph (LayerStackConfig).
  bool capture_mixed_front = true;
  // CUDA: LayerStackConfig::programmatic_launch / attention_quantize (same bytes, launch choices).
  bool programmatic_launch = false;
  bool attention_quantize = true;
};

struct BenchProgress {
  int run = 0;   // 0-based index of the measured run
  int runs = 1;  // measured runs in total
  bool fused = true;
  bool warmup = false;  // the step belonged to the warm-up
  int finished = 0;     // requests finished in this run
  int total = 0;        // requests of this run
  int64_t steps = 0;
  double sim_us = 0;  // simulated clock of this run
};
using BenchProgressFn = std::function<void(const BenchProgress&)>;

struct BenchRun {
  bool fused = true;
  ServingMetrics metrics;
  double wall_s = 0;                   // host wall time of the measured run (planning included)
  int64_t graph_replays = 0;           // steps the stack ran as a captured graph
  std::string digest;                  // FNV-1a 64 (hex) of the hashed final hidden states
  double final_rms = 0;                // of the last step's hidden states
  bool finite = true;                  // no NaN / Inf in any hashed hidden state
  std::vector<uint16_t> final_hidden;  // bf16 bits of the last step, [T, hidden]
};

struct BenchReport {
  BenchOptions options;  // as run (num_pages resolved)
  std::string backend;
  int64_t pages_per_request = 0;
  int64_t pool_bytes = 0;  // KV + index pool of all layers
  std::vector<BenchRun> runs;
  // With both runs: did every hashed hidden state match bit for bit, and the relative L2 distance
  // of the last step's hidden states (unfused as the reference).
  bool compared = false;
  bool digests_equal = false;
  double final_rel_l2 = 0;

  const BenchRun* run(bool fused) const;
  std::string to_text() const;
  std::string to_json() const;  // one JSON object, one line
};

// Status codes: invalid_argument / unsupported for bad options (the CLI exits 2), anything else for
// a failed run (exit 1).
Result<BenchReport> run_bench(const BenchOptions& options, const BenchProgressFn& progress = {});

// The stack factory for a backend name ("cpu", or "cuda" in a CUDA build); unsupported otherwise.
Result<std::unique_ptr<LayerStack>> create_layer_stack(const std::string& backend,
                                                       const LayerStackConfig& config);

}  // namespace m3attn
