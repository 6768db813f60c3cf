#include "engine/layer_stack.h"

#include "dist/communicator.h"
#include "weights/packing.h"

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
  M3_CHECK_ARG(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size,
               "tensor parallelism: need tp_size >= 1 and 0 <= tp_rank < tp_size, got rank ",
               tp_rank, " of ", tp_size);
  M3_RETURN_IF_ERROR(rank_geometry(geometry, tp_size).status());
  if (tp_size > 1) {
    M3_CHECK_ARG(tp_comm != nullptr, "tensor parallelism: tp_size ", tp_size,
                 " needs a communicator");
    M3_CHECK_ARG(tp_comm->size() == tp_size && tp_comm->rank() == tp_rank,
                 "tensor parallelism: the communicator is rank ", tp_comm->rank(), " of ",
                 tp_comm->size(), ", the stack rank ", tp_rank, " of ", tp_size);
  }
  return Status::Ok();
}

}  // namespace m3attn
