// GPU tests of the CUDA indexer (see indexer_gpu_test_util.h): guards against bad device data,
// CUDA-graph replay, rejected calls.
#include <gtest/gtest.h>

#include <string>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

TEST(IndexerGpu, GuardsAgainstBadDeviceData) {
  M3_REQUIRE_GPU();
  check_guards({0, 1, 2, 3, 4});
}

// The single pass's final selection (rank_lean) on a small batch (the sanitizers run it): integer
// inputs (many exact ties among the block maxima: rank_lean's tie path), one and several tokens
// per request, a NaN key; the two-kernel path (select_short_kernel automatic, with 2 and with 4
// warps per row) against the twin, the single pass with one CTA and in clusters of 2 and 4 (the
// cluster sharing the rows at 4 and 8 tokens per request) against the two-kernel path.
TEST(IndexerGpu, SinglePassSelectionSmall) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4, 8}) {
    Inputs in = make_inputs({{5000, tokens}, {3000, tokens}, {7990 - tokens, tokens}}, 4, rng,
                            /*integer=*/true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    in.hb.index_row(0, 7 * 128 + 9)[5] = 0x7f;  // request 0's block 7 scores NaN
    const Reference ref = reference(in);
    DeviceSet d;
    upload(in, d);
    const std::string label = std::to_string(tokens) + " tokens per request";
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const GpuResult g = run_gpu(d, two);
    compare(in, ref, g, /*exact_scores=*/true, label + " [two-kernel]");
    for (int w : {2, 4}) {  // select_short_kernel with 2 / 4 warps per row (above: automatic)
      IndexerCudaOptions tw = two;
      tw.short_select_warps = w;
      compare(in, ref, run_gpu(d, tw), /*exact_scores=*/true,
              label + " [two-kernel, " + std::to_string(w) + " warps]");
    }
    for (int ctas : {1, 2, 4}) {
      IndexerCudaOptions so;
      so.single_pass = true;
      so.single_pass_ctas = ctas;
      ASSERT_TRUE(indexer_cuda_plan(d.params, so).single);
      const GpuResult c = run_gpu(d, so);
      expect_same_ids(in, c, g, label + " [single pass, " + std::to_string(ctas) + " CTAs]");
    }
  }
}

TEST(IndexerGpu, GraphReplayWithNewInputsEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  IndexerCudaOptions single;
  single.single_pass = true;
  IndexerCudaOptions cluster = single;
  cluster.single_pass_ctas = 3;
  for (const IndexerCudaOptions& go : {IndexerCudaOptions{}, single, cluster}) {
    // The default plan at 17K (fused + selection kernel); the single pass at <= 64 blocks.
    const std::vector<RequestSpec> reqs =
        go.single_pass
            ? std::vector<RequestSpec>{{8000, 4}, {2100, 4}, {100, 4}, {2600, 300}}
            : std::vector<RequestSpec>{{9000, 4}, {2100, 4}, {100, 4}, {17000, 4}, {2600, 300}};
    const Inputs first = make_inputs(reqs, 4, rng);
    const Inputs second = make_inputs(reqs, 4, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_EQ(first.max_pages(), second.max_pages());
    ASSERT_EQ(first.hb.num_pages(), second.hb.num_pages());
    const std::string what =
        go.single_pass ? (go.single_pass_ctas > 1 ? " (single pass, cluster 3)" : " (single pass)")
                       : "";
    DeviceSet d;
    upload(first, d);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_TRUE(indexer_cuda_uses_fused_decode(d.params, go));
    ASSERT_EQ(indexer_cuda_plan(d.params, go).single, go.single_pass);
    const Status st = run_indexer_cuda(d.params, d.workspace, stream, go);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

    for (const Inputs* in : {&first, &second}) {
      reupload(*in, d);
      poison_outputs(d);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const GpuResult replay = download(d);
      const GpuResult eager = run_gpu(d, go);
      EXPECT_TRUE(replay.ids == eager.ids) << "graph replay and eager ids differ" << what;
      // The default (fused) path against the two-kernel path, checked against the twin.
      IndexerCudaOptions two;
      two.unfused_decode = true;
      const GpuResult unfused = run_gpu(d, two);
      expect_same_ids(*in, replay, unfused, "graph replay (fused) vs two-kernel" + what);
      compare(*in, reference(*in), unfused, false, "two-kernel after graph replay" + what);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST(IndexerGpu, InvalidCallsAreRejectedAndTouchNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Inputs in = make_inputs({{3000, 4}, {500, 2}}, 4, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet d;
  upload(in, d);
  const auto expect_rejected = [&](const IndexerParams& p, const TensorView& ws,
                                   const IndexerCudaOptions& o, const char* what) {
    poison_outputs(d);
    const Status st = run_indexer_cuda(p, ws, nullptr, o);
    EXPECT_FALSE(st.ok()) << what << " was accepted";
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> ids = d.ids.download_all();
    for (size_t i = 0; i < ids.size(); ++i) {
      const uint8_t want = (i >= kGuard && i < kGuard + d.ids_bytes) ? kIdsPoison : kGuardByte;
      if (ids[i] != want) {
        ADD_FAILURE() << what << ": output byte " << i << " changed";
        break;
      }
    }
    std::printf("[ indexer  ] rejected (%s): %s\n", what, st.to_string().c_str());
  };
  const IndexerCudaOptions none;
  {  // host views
    Tensor ids;
    const IndexerParams hp = host_params(in, ids);
    expect_rejected(hp, d.workspace, none, "host tensors");
  }
  {
    IndexerParams p = d.params;
    p.top_k = 8;
    expect_rejected(p, d.workspace, none, "top_k 8");
  }
  {
    IndexerParams p = d.params;
    p.block_ids.dtype = DType::kF32;
    expect_rejected(p, d.workspace, none, "f32 block_ids");
  }
  {
    TensorView ws = d.workspace;
    ws.shape[0] -= 1;
    expect_rejected(d.params, ws, none, "workspace one float short");
  }
  {
    TensorView ws = d.workspace;
    ws.data = static_cast<uint8_t*>(ws.data) + 4;
    expect_rejected(d.params, ws, none, "workspace not 16-byte aligned");
  }
  {
    TensorView ws = d.workspace;
    ws.device = Device::cpu();
    expect_rejected(d.params, ws, none, "workspace on the host");
  }
  {
    TensorView ws = d.workspace;
    ws.data = d.params.block_ids.data;
    expect_rejected(d.params, ws, none, "workspace overlapping block_ids");
  }
  {
    IndexerCudaOptions o;
    o.k_splits = -1;
    expect_rejected(d.params, d.workspace, o, "k_splits -1");
  }
  {
    IndexerCudaOptions o;
    o.single_pass_ctas = 9;
    expect_rejected(d.params, d.workspace, o, "single_pass_ctas 9");
  }
  for (int blocks : {-2, 9}) {
    IndexerCudaOptions o;
    o.programmatic_launch = true;
    o.pdl_prefetch_blocks = blocks;
    const std::string what = "pdl_prefetch_blocks " + std::to_string(blocks);
    expect_rejected(d.params, d.workspace, o, what.c_str());
  }
  {
    IndexerParams p = d.params;
    p.batch.num_requests = 0;
    p.batch.query_start.shape[0] = 1;
    p.batch.seq_lens.shape[0] = 0;
    p.batch.page_table.shape[0] = 0;
    expect_rejected(p, d.workspace, none, "tokens without requests");
  }
  {  // n_kv 9: a valid shape the kernels do not support
    mt::DeviceBuffer iq9(static_cast<size_t>(in.T() * 9 * kHeadDim));
    mt::DeviceBuffer ids9(static_cast<size_t>(in.T() * 9 * kTopK * 4));
    IndexerParams p = d.params;
    p.n_kv = 9;
    p.index_q =
        TensorView::contiguous(iq9.data(), DType::kE4M3, {in.T(), 9, kHeadDim}, Device::cuda(0));
    p.block_ids =
        TensorView::contiguous(ids9.data(), DType::kI32, {in.T(), 9, kTopK}, Device::cuda(0));
    mt::DeviceBuffer ws9(indexer_workspace_bytes(in.T(), 9, in.max_pages()) + 16);
    const TensorView ws = TensorView::contiguous(
        ws9.data(), DType::kF32, {static_cast<int64_t>(ws9.bytes() / 4)}, Device::cuda(0));
    const Status st = run_indexer_cuda(p, ws, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
  }
  {  // an empty batch is a no-op
    IndexerParams p = d.params;
    p.batch.num_tokens = 0;
    p.batch.num_requests = 0;
    p.batch.query_start.shape[0] = 1;
    p.batch.positions.shape[0] = 0;
    p.batch.seq_lens.shape[0] = 0;
    p.batch.page_table.shape[0] = 0;
    p.index_q.shape[0] = 0;
    p.block_ids.shape[0] = 0;
    const Status st = run_indexer_cuda(p, TensorView{}, nullptr);
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
