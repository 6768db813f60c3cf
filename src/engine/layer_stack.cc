#include "engine/layer_stack.h"

namespace m3attn {

Status LayerStackConfig::validate() const {
  M3_RETURN_IF_ERROR(geometry.validate());
  M3_CHECK_ARG(num_dense >= 0 && num_sparse >= 0 && num_layers() >= 1,
               "a layer stack needs num_dense >= 0, num_sparse >= 0 and at least one layer, got ",
               num_dense, " dense and ", num_sparse, " sparse");
  M3_CHECK_ARG(num_pages >= 1, "num_pages must be >= 1, got ", num_pages);
  M3_CHECK_ARG(max_tokens_per_step >= 1 && max_requests_per_step >= 1 && max_pages_per_request >= 1,
               "capacities must be >= 1: max_tokens_per_step ", max_tokens_per_step,
               ", max_requests_per_step ", max_requests_per_step, ", max_pages_per_request ",
               max_pages_per_request);
  M3_CHECK_ARG(max_position >= 1, "max_position must be >= 1, got ", max_position);
  return Status::Ok();
}

}  // namespace m3attn
