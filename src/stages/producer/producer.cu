// CUDA launcher of the producer: the same validation as the CPU twin, the CUDA-only rules (every
// view on the current CUDA device, the launch geometry), then one kernel. No sync, no allocation,
// no copy: the launch is CUDA-graph capturable and its grid depends only on T and the mode.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "m3attn/config.h"
#include "stages/producer/producer.h"
#include "stages/producer/producer_kernel.cuh"

namespace m3attn {

namespace {

namespace pk = producer_kernel;

int heads_per_row(ProducerMode mode, int n_q, int n_kv) {
  return static_cast<int>(producer_packed_width(mode, n_q, n_kv) / kHeadDim);
}

template <ProducerMode kMode, int kU>
Status launch(const pk::KernelArgs& args, int64_t tasks, cudaStream_t stream) {
  constexpr int64_t per_block = pk::tasks_per_block(kU);
  const auto blocks = static_cast<uint32_t>((tasks + per_block - 1) / per_block);
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(pk::producer_kernel<kMode, kU>, dim3(blocks),
                                     dim3(pk::kThreads), 0, stream, args.programmatic, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <ProducerMode kMode>
Status launch_persistent(const pk::KernelArgs& args, int64_t tasks, int blocks,
                         cudaStream_t stream) {
  const int64_t batches = pk::num_batches(tasks, pk::kPersistentTasks);
  const auto grid = static_cast<uint32_t>(std::min<int64_t>(batches, blocks));
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(pk::producer_persistent_kernel<kMode>, dim3(grid),
                                     dim3(pk::kThreads), 0, stream, args.programmatic, args,
                                     static_cast<uint32_t>(batches)));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// The bulk-copy pipeline: dynamic shared memory sized from the heads per row (host attribute
// calls only: capturable), grid = SMs x resident blocks (or the caller's), capped at the tiles;
// with tail blocks that wave plus the tail blocks (set_tma_tail). `o` has its defaults resolved
// (dispatch).
template <ProducerMode kMode, int kStages, bool kPlan, int kMinBlocks = pk::kTmaMinBlocks>
Status launch_tma(const pk::KernelArgs& args, int64_t tasks, const ProducerCudaOptions& o, int sms,
                  cudaStream_t stream) {
  int blocks = o.persistent_blocks;
  pk::TmaGeometry g =
      pk::make_tma_geometry(tasks, static_cast<int>(args.heads.divisor), kPlan, o.tma_tile_tasks);
  g.interleave = o.tma_interleave > 0;
  const size_t smem = pk::tma_smem_bytes(g, kStages);
  auto* kernel = &pk::producer_tma_kernel<kMode, kStages, kPlan, kMinBlocks>;
  M3_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
  if (blocks == 0) {
    int per_sm = 0;
    M3_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, pk::kTmaThreads, smem));
    M3_CHECK_ARG(per_sm > 0, "producer bulk-copy kernel: ", smem,
                 " bytes of shared memory per block do not fit one SM");
    blocks = sms * per_sm;
  }
  const uint32_t grid =
      o.tma_tail > 0 ? pk::set_tma_tail(g, tasks, static_cast<uint32_t>(blocks), o.tma_tail_rounds,
                                        o.tma_tail_tiles, o.tma_tail_tile_tasks)
                     : static_cast<uint32_t>(std::min<int64_t>(g.num_tiles, blocks));
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(grid), dim3(pk::kTmaThreads), smem, stream,
                                     args.programmatic, args, g));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// `o` has its defaults resolved (dispatch): stages and plans are the kernel's.
template <ProducerMode kMode, bool kPlan>
Status launch_tma_stages(const pk::KernelArgs& args, int64_t tasks, const ProducerCudaOptions& o,
                         int sms, cudaStream_t stream) {
  if (o.tma_blocks_per_sm == 4) {  // built with task plans only (the default)
    if constexpr (kPlan) {
      if (o.tma_stages == 2) return launch_tma<kMode, 2, kPlan, 4>(args, tasks, o, sms, stream);
      if (o.tma_stages == 3) return launch_tma<kMode, 3, kPlan, 4>(args, tasks, o, sms, stream);
    }
    return unsupported("producer: the bulk-copy kernel for 4 blocks per SM has task plans and 2 ",
                       "or 3 stages, not ", o.tma_stages, " stages, plans ", o.tma_task_plan);
  }
  switch (o.tma_stages) {
    case 2:
      return launch_tma<kMode, 2, kPlan>(args, tasks, o, sms, stream);
    case 3:
      return launch_tma<kMode, 3, kPlan>(args, tasks, o, sms, stream);
    case 4:
      return launch_tma<kMode, 4, kPlan>(args, tasks, o, sms, stream);
  }
  return unsupported("producer: no bulk-copy kernel with ", o.tma_stages, " stages");
}

template <ProducerMode kMode>
Status launch_tma_variant(const pk::KernelArgs& args, int64_t tasks, const ProducerCudaOptions& o,
                          int sms, cudaStream_t stream) {
  return o.tma_task_plan > 0 ? launch_tma_stages<kMode, true>(args, tasks, o, sms, stream)
                             : launch_tma_stages<kMode, false>(args, tasks, o, sms, stream);
}

template <ProducerMode kMode>
Status launch_mode(const pk::KernelArgs& args, int64_t tasks, const ProducerCudaOptions& o, int sms,
                   cudaStream_t stream) {
  ProducerCudaKernel kernel = o.kernel;
  if (kernel == ProducerCudaKernel::kAuto)
    kernel = pk::use_tma_variant(tasks) ? ProducerCudaKernel::kTmaPipeline
                                        : ProducerCudaKernel::kPerBatch;
  if (kernel == ProducerCudaKernel::kTmaPipeline)
    return launch_tma_variant<kMode>(args, tasks, o, sms, stream);
  if (kernel == ProducerCudaKernel::kPersistent)
    return launch_persistent<kMode>(
        args, tasks,
        o.persistent_blocks > 0 ? o.persistent_blocks : sms * pk::kPersistentBlocksPerSm, stream);
  if (pk::use_small_variant(tasks)) return launch<kMode, pk::kTasksSmall>(args, tasks, stream);
  return launch<kMode, pk::kTasksLarge>(args, tasks, stream);
}

// The one dispatch point from the run-time mode to the kernel template; resolves the defaults.
Status dispatch(ProducerMode mode, const pk::KernelArgs& args, int64_t tasks,
                const ProducerCudaOptions& options, int sms, cudaStream_t stream) {
  ProducerCudaOptions o = options;
  if (o.tma_interleave == 0) o.tma_interleave = pk::kTmaInterleaveDefault ? 1 : -1;
  if (o.tma_task_plan == 0) o.tma_task_plan = pk::kTmaTaskPlanDefault ? 1 : -1;
  if (o.tma_tile_tasks == 0) o.tma_tile_tasks = pk::tma_default_tile_tasks(tasks);
  if (o.tma_stages == 0) o.tma_stages = pk::tma_default_stages(o.tma_tile_tasks);
  if (o.tma_blocks_per_sm == 0)
    o.tma_blocks_per_sm =
        pk::tma_default_blocks_per_sm(o.tma_tile_tasks, o.tma_stages, o.tma_task_plan > 0);
  if (o.tma_tail == 0) o.tma_tail = pk::tma_default_tail(o.tma_tile_tasks) ? 1 : -1;
  if (o.tma_tail_rounds == 0) o.tma_tail_rounds = pk::kTmaTailRoundsDefault;
  if (o.tma_tail_tiles == 0) o.tma_tail_tiles = pk::tma_default_tail_tiles(o.tma_tile_tasks);
  if (o.tma_tail_tile_tasks == 0) o.tma_tail_tile_tasks = pk::kTmaTailTileDefault;
  switch (mode) {
    case ProducerMode::kFused:
      return launch_mode<ProducerMode::kFused>(args, tasks, o, sms, stream);
    case ProducerMode::kMain:
      return launch_mode<ProducerMode::kMain>(args, tasks, o, sms, stream);
    case ProducerMode::kIndex:
      return launch_mode<ProducerMode::kIndex>(args, tasks, o, sms, stream);
  }
  return unsupported("producer: no CUDA kernel for mode ", static_cast<int>(mode));
}

}  // namespace

const char* producer_cuda_kernel_name(ProducerCudaKernel kernel) {
  switch (kernel) {
    case ProducerCudaKernel::kAuto:
      return "auto";
    case ProducerCudaKernel::kPerBatch:
      return "per-batch";
    case ProducerCudaKernel::kPersistent:
      return "persistent";
    case ProducerCudaKernel::kTmaPipeline:
      return "tma-pipeline";
  }
  return "unknown";
}

Status run_producer_cuda(const ProducerParams& p, cudaStream_t stream) {
  return run_producer_cuda(p, stream, ProducerCudaOptions{});
}

Status run_producer_cuda(const ProducerParams& p, cudaStream_t stream,
                         const ProducerCudaOptions& options) {
  M3_RETURN_IF_ERROR(validate_producer(p));
  const int kernel = static_cast<int>(options.kernel);
  M3_CHECK_ARG(kernel >= 0 && kernel <= static_cast<int>(ProducerCudaKernel::kTmaPipeline),
               "run_producer_cuda: unknown kernel choice ", kernel);
  M3_CHECK_ARG(options.persistent_blocks >= 0, "run_producer_cuda: persistent_blocks ",
               options.persistent_blocks, " must be >= 0 (0 = SMs x ", pk::kPersistentBlocksPerSm,
               ")");
  M3_CHECK_ARG(options.tma_stages == 0 ||
                   (options.tma_stages >= 2 && options.tma_stages <= pk::kTmaStagesMax),
               "run_producer_cuda: tma_stages ", options.tma_stages,
               " must be 0 (default: by tile size) or in [2, ", pk::kTmaStagesMax, "]");
  M3_CHECK_ARG(options.tma_interleave >= -1 && options.tma_interleave <= 1,
               "run_producer_cuda: tma_interleave ", options.tma_interleave,
               " must be 0 (default), 1 (on) or -1 (off)");
  M3_CHECK_ARG(options.tma_tile_tasks == 0 || options.tma_tile_tasks == pk::kTmaTileTasks ||
                   options.tma_tile_tasks == pk::kTmaTileTasksSmall,
               "run_producer_cuda: tma_tile_tasks ", options.tma_tile_tasks,
               " must be 0 (default: by batch size), ", pk::kTmaTileTasks, " or ",
               pk::kTmaTileTasksSmall);
  M3_CHECK_ARG(options.tma_task_plan >= -1 && options.tma_task_plan <= 1,
               "run_producer_cuda: tma_task_plan ", options.tma_task_plan,
               " must be 0 (default), 1 (on) or -1 (off)");
  M3_CHECK_ARG(options.tma_tail >= -1 && options.tma_tail <= 1, "run_producer_cuda: tma_tail ",
               options.tma_tail, " must be 0 (default), 1 (on) or -1 (off)");
  M3_CHECK_ARG(
      options.tma_blocks_per_sm == 0 || options.tma_blocks_per_sm == pk::kTmaMinBlocks ||
          (options.tma_blocks_per_sm == 4 && options.tma_stages >= 2 && options.tma_stages <= 3),
      "run_producer_cuda: tma_blocks_per_sm ", options.tma_blocks_per_sm,
      " must be 0 (default: by tile size and stages), ", pk::kTmaMinBlocks,
      ", or 4 with tma_stages 2 or 3 (got ", options.tma_stages, ")");
  M3_CHECK_ARG(options.tma_tail_rounds >= 0 && options.tma_tail_rounds <= pk::kTmaTailMax,
               "run_producer_cuda: tma_tail_rounds ", options.tma_tail_rounds,
               " must be 0 (default) or in [1, ", pk::kTmaTailMax, "]");
  M3_CHECK_ARG(options.tma_tail_tiles >= 0 && options.tma_tail_tiles <= pk::kTmaTailMax,
               "run_producer_cuda: tma_tail_tiles ", options.tma_tail_tiles,
               " must be 0 (default) or in [1, ", pk::kTmaTailMax, "]");
  // The tail tile must fit the stage's tile (the tile size's default may depend on T).
  const int tile_max =
      options.tma_tile_tasks != 0 ? options.tma_tile_tasks : pk::kTmaTileTasksSmall;
  M3_CHECK_ARG(
      options.tma_tail_tile_tasks == 0 || (options.tma_tail_tile_tasks >= pk::kTmaTailTileMin &&
                                           options.tma_tail_tile_tasks <= tile_max),
      "run_producer_cuda: tma_tail_tile_tasks ", options.tma_tail_tile_tasks,
      " must be 0 (default ", pk::kTmaTailTileDefault, ") or in [", pk::kTmaTailTileMin, ", ",
      tile_max, "] (the tile size, ", pk::kTmaTileTasksSmall, " when it is left to the default)");
  // validate_producer puts every view the mode uses on packed's device; that must be a CUDA device
  // and the current one (the kernel runs there).
  const Device dev = p.packed.device;
  M3_CHECK_ARG(dev.type == DeviceType::kCUDA, "run_producer_cuda (", producer_mode_name(p.mode),
               ") needs CUDA tensors, got ", dev.to_string());
  int current = -1;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  M3_CHECK_ARG(dev.index == current, "run_producer_cuda: tensors are on ", dev.to_string(),
               " but the current CUDA device is cuda:", current);

  const int64_t t = p.num_tokens;
  if (t == 0) return Status::Ok();

  const int heads = heads_per_row(p.mode, p.n_q, p.n_kv);
  // The kernel indexes tasks (token, head) in 32 bits and sizes its per-block token staging for
  // H >= 2 heads per row (always true for valid head counts).
  M3_CHECK_ARG(heads >= pk::kMinHeadsPerRow, "producer launch: ", heads,
               " heads per packed row is below the kernel's minimum ", pk::kMinHeadsPerRow);
  const int64_t tasks = t * heads;
  constexpr int64_t kMaxTasks = std::numeric_limits<int32_t>::max();
  M3_CHECK_ARG(tasks <= kMaxTasks, "producer launch geometry: T ", t, " x ", heads,
               " heads = ", tasks, " tasks exceeds the kernel's limit of ", kMaxTasks);

  // Persistent grids: the device's SMs x resident blocks per SM (host attribute queries, no sync:
  // capturable), unless the caller fixes them.
  int sms = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current));
  sms = std::max(sms, 1);

  pk::KernelArgs a = pk::make_kernel_args(p, heads);
  a.programmatic = options.programmatic_launch;
  return dispatch(p.mode, a, tasks, options, sms, stream);
}

}  // namespace m3attn
