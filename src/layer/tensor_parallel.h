// Attention tensor parallelism simulated in one process (SPEC section 2): every rank runs its own
// MsaLayer over its own heads and its own paged pool (the page ids, hence the StepPlan, are
// shared), and the row-parallel o_proj partials are summed the way an all-reduce would: each rank's
// bf16 partial widened to fp32, summed in rank order, rounded once to bf16.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/page_pool.h"
#include "cache/step_plan.h"
#include "layer/msa_layer.h"
#include "weights/packing.h"

namespace m3attn {

// out = bf16(sum_r fp32(partials[r])) elementwise, r ascending. All bf16 [T, N] CPU views with last
// stride 1; out may not overlap a partial.
Status sum_rank_partials(const std::vector<TensorView>& partials, const TensorView& out);

class TensorParallelLayer {
 public:
  TensorParallelLayer() = default;
  TensorParallelLayer(TensorParallelLayer&&) noexcept = default;
  TensorParallelLayer& operator=(TensorParallelLayer&&) noexcept = default;

  // Packs `weights` (TP1) for tp_size ranks and gives each rank a one-layer pool of num_pages
  // pages with its own KV heads. `rope` must outlive the object.
  static Result<TensorParallelLayer> create(const AttentionWeights& weights, int tp_size,
                                            const TensorView& rope, int64_t num_pages,
                                            const MsaLayerOptions& options = {});

  int tp_size() const { return static_cast<int>(ranks_.size()); }
  const MsaLayer& rank_layer(int r) const { return ranks_[static_cast<size_t>(r)]; }
  PagePool& pool(int r) { return pools_[static_cast<size_t>(r)]; }
  const PagePool& pool(int r) const { return pools_[static_cast<size_t>(r)]; }

  // Runs every rank on `hidden` (bf16 [T, hidden]) and writes the reduced output to attn_out.
  // Optional: each rank's bf16 partial [T, hidden] and trace.
  Status step(const StepPlan& step, const TensorView& hidden, const TensorView& attn_out,
              std::vector<Tensor>* partials = nullptr, std::vector<LayerTrace>* traces = nullptr);

 private:
  std::vector<MsaLayer> ranks_;
  std::vector<PagePool> pools_;
};

}  // namespace m3attn
