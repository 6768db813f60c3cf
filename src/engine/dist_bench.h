// The serving benchmark over several ranks (one process, or one thread, per rank): what
// `m3attn tp bench` runs on each rank.
//
// Attention tensor parallelism (kTensor): every rank runs the same scheduler over the whole
// workload and its shard of every layer (LayerStackConfig::tp_*), the o_proj partials all-reduced
// after each layer. Tokens are counted once.
//
// Attention data parallelism (kData): the workload's requests and concurrency are dealt over the
// ranks (rank r gets n / P, plus one when r < n % P); each rank runs a TP1 stack and its own
// scheduler. Steps are in lock-step, as the MoE collectives of the full model would force: before
// each step the ranks agree (host all-reduce) on whether anyone still has work; a rank with none
// runs one dummy generation request (cache/dp_dummy.h: 1 + draft tokens, pages taken from its
// target cache and from a 32-token-page draft cache, rolled back after the step and checked to
// leave both caches exactly as before). Tokens are summed over the ranks.
//
// Time: after every step the ranks take the slowest rank's step time (host all-reduce, max); that
// advances every rank's clock, so the duration is the lock-step duration and TTFT / TPOT are what a
// request would see. Throughput = tokens / duration, and per GPU = that / P.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/bench.h"
#include "engine/metrics.h"

namespace m3attn {

class Communicator;
class HostCollective;

enum class ParallelMode { kTensor, kData };
const char* parallel_mode_name(ParallelMode mode);  // "tp" | "dp"

struct DistBenchOptions {
  std::string backend = "cuda";  // kData also runs on "cpu" (tests)
  MsaGeometry geometry;          // the model's (TP1) geometry
  int num_dense = 3;
  int num_sparse = 1;
  Workload workload;  // the whole run: kData deals requests and concurrency over the ranks
  int64_t max_tokens_per_step = 8192;  // per rank
  int64_t num_pages = 0;  // per rank; 0 = ceil(concurrency / P for kData) * pages per request
  ParallelMode mode = ParallelMode::kTensor;
  bool fused = true;
  bool warmup = false;      // an unmeasured short run first (graph capture, workspaces)
  int64_t draft_pages = 0;  // kData: the dummy's draft cache (32-token pages); 0 = 64
};

struct DistBenchReport {
  DistBenchOptions options;
  int ranks = 1;
  int64_t steps = 0;         // lock-step steps
  double duration_us = 0;    // sum of the slowest rank's step times
  double wall_s = 0;         // rank 0's host wall time of the measured run
  int requests = 0;          // finished, all ranks
  int64_t input_tokens = 0;  // all ranks (kData) or once (kTensor)
  int64_t output_tokens = 0;
  double output_tokens_per_s = 0, total_tokens_per_s = 0;
  double output_tokens_per_s_per_gpu = 0, total_tokens_per_s_per_gpu = 0;
  ServingMetrics rank0;  // this rank's own metrics, lock-step clock (rank 0's in the printout)
  std::vector<int> rank_requests;    // requests dealt to each rank
  std::vector<int64_t> dummy_steps;  // kData: dummy steps each rank ran
  bool rollbacks_verified = true;    // every dummy left both caches as before (all ranks)
  int64_t graph_replays = 0;         // rank 0
  bool finite = true;                // every rank's last hidden states are finite
  double final_rms = 0;              // rank 0's last step
  std::string to_text() const;
  std::string to_json() const;
};

// Runs one rank: every rank of `coll` calls it with the same options. tp_comm: the NCCL
// communicator for kTensor with P > 1 (null otherwise). Errors: invalid_argument / unsupported for
// bad options; anything else for a failed run. Only rank 0's report is complete (the others carry
// the totals).
Result<DistBenchReport> run_dist_bench_rank(const DistBenchOptions& options, HostCollective& coll,
                                            Communicator* tp_comm);

}  // namespace m3attn
