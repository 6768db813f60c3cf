// A small producer test sized for compute-sanitizer (memcheck and racecheck must finish in well
// under a minute): every kernel family on a few hundred tokens, each bulk-copy variant on a grid
// of a few blocks so that every shared-memory stage and both mbarrier parities are reused many
// times, and one CUDA-graph replay of the default bulk-copy call. Checks: per-batch vs the CPU
// twin (within one E4M3 step, V exact), every other kernel byte for byte against the per-batch
// kernel, the graph replay byte for byte against the eager call.
#include "producer_gpu_test_util.h"

namespace m3attn::producer_gpu_test {
namespace {

// Runs `p` (host params into in / packed / out) once through a captured CUDA graph on a
// non-blocking stream, starting from the current contents of `out`, and downloads the results.
void run_graph_once(const ProducerParams& p, const Inputs& in, const Packed& packed, Outputs& out,
                    const ProducerCudaOptions& opt) {
  Mirror m;
  mirror_inputs(m, in);
  m.add(packed.data);
  mirror_outputs(m, out);
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());  // uploads (legacy stream) before `stream`
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status s = run_producer_cuda(m.device_params(p), stream, opt);
  M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(s.ok()) << s.to_string();
  cudaGraphExec_t exec;
  M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  wait_or_exit("graph replay", stream);
  download_outputs(m, out);
  cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
}

// n_q 8, n_kv 1 (12 heads per fused row), T 203: 2436 fused tasks = 38 64-task tiles + 4 tasks; on
// 3 blocks each block runs ~13 tiles through its 2-4 stages. Slots include -1 (the inputs'
// padding rows) and rows only 4-byte aligned in the pool.
TEST(ProducerGpu, SanitizerSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  constexpr int64_t kT = 203;
  const int64_t pages = pages_for(kT);
  const Inputs in = make_inputs(8, 1, kT, pages, rng);
  const Layout lay = separate_layout(1, pages, 3, 260, 4);
  ProducerCudaOptions persistent, tma_default;
  persistent.kernel = ProducerCudaKernel::kPersistent;
  persistent.persistent_blocks = 3;
  // plans, interleaved, 64-task tiles in 3 stages, 4 blocks per SM, tail blocks
  tma_default.kernel = ProducerCudaKernel::kTmaPipeline;
  tma_default.persistent_blocks = 3;
  ProducerCudaOptions tile128_default_tail = tma_default, three_per_sm = tma_default;
  tile128_default_tail.tma_tile_tasks = 128;  // the default tail blocks come with 128-task tiles
  three_per_sm.tma_blocks_per_sm = 3;         // the default is 4 blocks per SM with 3 stages
  three_per_sm.tma_stages = 4;
  struct Choice {
    const char* name;
    ProducerCudaOptions opt;
  };
  const Choice choices[] = {
      {"persistent", persistent},
      {"bulk-copy defaults", tma_default},
      {"bulk-copy 128-task tiles, 2 stages", tma_options(2, 3, true, true, 128)},
      {"bulk-copy 3 stages, no plans, equal shares", tma_options(3, 3, false, false, 64)},
      {"bulk-copy tail blocks", tail_options(1, 2, 32, 3)},
      {"bulk-copy 128-task tiles, default tail", tile128_default_tail},
      {"bulk-copy 3 blocks per SM, 4 stages", three_per_sm},
      {"auto", ProducerCudaOptions{}}};
  for (const ProducerMode mode : kModes) {
    SCOPED_TRACE(producer_mode_name(mode));
    const Packed packed = packed_for(in, mode, rng);
    const Outputs init = make_outputs(in, lay, rng);
    const Outputs ref = per_batch_reference(mode, in, lay, packed, init);
    for (const Choice& c : choices) {
      Outputs out = init.clone();
      run_on_gpu({make_params(mode, in, packed, out, lay)}, in, {&packed}, out, c.opt);
      expect_match(in, uses_main(mode), uses_index(mode), lay, init, ref, out, /*exact=*/true,
                   std::string(c.name) + " vs per-batch (exact)");
    }
    Outputs graph = init.clone();
    run_graph_once(make_params(mode, in, packed, graph, lay), in, packed, graph, tma_default);
    expect_match(in, uses_main(mode), uses_index(mode), lay, init, ref, graph, /*exact=*/true,
                 "bulk-copy defaults, graph replay vs per-batch (exact)");
  }
}

}  // namespace
}  // namespace m3attn::producer_gpu_test