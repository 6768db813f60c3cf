// Tensor-parallel correctness: the TP-P layer output (rank partials all-reduced) against the TP1
// output of the same weights and batch, with a per-element bound derived from where the two differ.
//
// Both compute o_proj over the same attention core (each rank owns whole Q heads, and the o_proj
// activation scales are per token per 128 channels = per head, so a rank's quantized core is the
// TP1 core's columns). With t_kb the scaled fp32 term of 128-column block kb and A_kb the sum of
// the absolute products inside that block (so |t_kb| <= A_kb), nb = n_q blocks, u = 2^-8 (bf16
// unit roundoff), e = 2^-24 (fp32), g = the in-block accumulation error of the GEMM per unit of
// A_kb beyond fp32 (2^-11 on Hopper: the FP8 tensor cores keep ~13-14 bits over the 4 k32 steps
// of a block; 0 for the CPU twin), f = (nb + 128) e (fp32 accumulation: 128 products in a block,
// nb block terms), and E1 / EP the exact sums of the TP1 core and of the ranks' cores (equal when
// the cores are bit-identical):
//   TP1:  out1 = bf16(S1),  |out1 - S1| <= u|out1|,  |S1 - E1| <= (f + g) sum A
//   rank: p_r = bf16(S_r),  |p_r - S_r| <= u|p_r|,   |S_r - E_r| <= (f + g) sum_r A
//   reduce (NCCL ring/tree rounds every partial sum to bf16; the CPU twin once):
//         |outP - sum p_r| <= u|outP| + (P - 1) u (1 + u)^P sum|p_r|
// so |outP - out1| <= u(|outP| + |out1|) + (u + (P-1) u (1+u)^P) sum|p_r|
//                     + 2 (f (1 + u) + g) sum A + |EP - E1|.
// A second, "tight" ratio leaves out g (both sides run the same in-block MMA sequence when the
// GEMMs pick the same kernel family): reported, not gated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3attn/config.h"
#include "m3attn/tensor.h"
#include "weights/quantize_weights.h"

namespace m3attn {

struct TpBoundModel {
  double block_accum_eps = 1.0 / 2048;  // g above
  int threads = 0;                      // host threads for the exact sums; 0 = hardware
};

struct TpComparison {
  int tp_size = 1;
  int64_t tokens = 0;
  int64_t elements = 0;
  int64_t identical = 0;         // output elements bit-identical to TP1
  int64_t core_differ = 0;       // attention-core elements that differ from TP1's
  int64_t violations = 0;        // elements past the bound (NaN counts)
  double max_abs = 0;            // max |outP - out1|
  double rel_l2 = 0;             // ||outP - out1|| / ||out1||
  double worst_ratio = 0;        // max err / bound
  double worst_tight_ratio = 0;  // max err / bound without g
  double max_ref = 0;            // max |out1|
  bool pass() const { return violations == 0 && elements > 0; }
  std::string to_text() const;  // one line
};

// out_tp, out_1: bf16 [T, hidden]; partials: P x bf16 [T, hidden] (before the reduction);
// core_tp (the ranks' cores side by side) and core_1: bf16 [T, n_q*128]; o: TP1 o_proj
// [hidden, n_q*128]. All CPU tensors.
Result<TpComparison> compare_tp_output(const Tensor& out_tp, const Tensor& out_1,
                                       const std::vector<Tensor>& partials, const Tensor& core_tp,
                                       const Tensor& core_1, const QuantizedMatrix& o,
                                       const TpBoundModel& model = {});

// The GPU check run by `m3attn tp check`: every rank builds the same random weights and the same
// steps (two prefills, then a mixed step: a prompt chunk plus a generation request with drafts),
// runs its shard on its device (CudaMsaLayer over pack_rank weights, a private pool of its KV
// heads), all-reduces the o_proj partials through NCCL, and gathers partials and cores to rank 0;
// rank 0 also runs TP1 on its device and compares every step.
struct TpCheckOptions {
  MsaGeometry geometry;  // TP1
  bool sparse = true;
  bool fused = true;
  uint64_t seed = 1;
  int64_t prompt1 = 300, prompt2 = 77, chunk = 29;
  int draft_len = 2;
  bool graph = false;  // also replay the last step from a captured CUDA graph (all-reduce inside)
  TpBoundModel model;
};

struct TpCheckReport {
  std::vector<TpComparison> steps;  // rank 0 only
  bool graph_checked = false;
  bool graph_identical = false;  // the graph replay's output equals the eager one byte for byte
  bool pass() const;
  std::string to_text() const;
  std::string to_json() const;
};

class Communicator;
// Every rank calls it with the same options (device = comm.device()); rank 0 fills *report.
Status run_tp_check_rank(Communicator& comm, const TpCheckOptions& options, TpCheckReport* report);

// The same check in one process on one device, without NCCL (any P, e.g. 4 and 8 on one GPU): for
// each P of tp_sizes, the P rank layers (pack_rank weights, private pools) run one after another
// and their partials are summed on the host as sum_rank_partials does (fp32, one rounding); the
// TP1 layer runs once. One report per P; `graph` is ignored.
Status run_tp_check_simulated(const TpCheckOptions& options, const std::vector<int>& tp_sizes,
                              int device, std::vector<TpCheckReport>* reports);

}  // namespace m3attn
