// Host validation of the indexer (SPEC section 8): shared by the CPU twin and the CUDA launcher.
#include <cstdint>
#include <limits>

#include "cache/cache_view.h"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"

namespace m3attn {

Status validate_block_ids(const TensorView& block_ids, int64_t num_tokens, int n_kv,
                          const char* what) {
  return check_packed(block_ids, DType::kI32, {num_tokens, n_kv, kTopK}, 16, what);
}

Status validate_indexer(const IndexerParams& p) {
  M3_CHECK_ARG(p.n_kv > 0, "indexer: n_kv (index heads) must be > 0, got ", p.n_kv);
  if (p.top_k != kTopK)
    return unsupported("indexer: top_k ", p.top_k, " is not supported (this build selects ", kTopK,
                       " blocks)");
  M3_RETURN_IF_ERROR(validate_batch_view(p.batch, "indexer"));
  const int64_t T = p.batch.num_tokens;
  M3_CHECK_ARG(T <= std::numeric_limits<int32_t>::max(), "indexer: token count ", T,
               " exceeds the int32 range of positions and grid indices");

  M3_RETURN_IF_ERROR(
      check_packed(p.index_q, DType::kE4M3, {T, p.n_kv, kHeadDim}, 16, "indexer index_q"));

  M3_RETURN_IF_ERROR(validate_index_cache(p.index_cache, "indexer index cache"));

  M3_RETURN_IF_ERROR(validate_block_ids(p.block_ids, T, p.n_kv, "indexer block_ids"));

  M3_RETURN_IF_ERROR(
      check_same_device({&p.index_q, &p.index_cache, &p.block_ids, &p.batch.query_start,
                         &p.batch.positions, &p.batch.seq_lens, &p.batch.page_table},
                        "indexer"));
  return Status::Ok();
}

}  // namespace m3attn
