// GPU tests of the CUDA indexer (see indexer_gpu_test_util.h): guards against bad device data,
// CUDA-graph replay, rejected calls.
#include <gtest/gtest.h>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

TEST(IndexerGpu, GuardsAgainstBadDeviceData) {
  M3_REQUIRE_GPU();
  check_guards({0, 1, 2, 3, 4, 5, 6, 7});
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
  IndexerCudaOptions ticket;
  ticket.flat_decode = 1;
  ticket.ticket_select = true;
  for (const IndexerCudaOptions& go : {IndexerCudaOptions{}, single, cluster, ticket}) {
    // The default plan at 17K (fused + selection kernel); the single pass and the ticket
    // selection at <= 64 blocks.
    const std::vector<RequestSpec> reqs =
        go.single_pass || go.ticket_select
            ? std::vector<RequestSpec>{{8000, 4}, {2100, 4}, {100, 4}, {2600, 300}}
            : std::vector<RequestSpec>{{9000, 4}, {2100, 4}, {100, 4}, {17000, 4}, {2600, 300}};
    const Inputs first = make_inputs(reqs, 4, rng);
    const Inputs second = make_inputs(reqs, 4, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_EQ(first.max_pages(), second.max_pages());
    ASSERT_EQ(first.hb.num_pages(), second.hb.num_pages());
    const std::string what =
        go.ticket_select
            ? " (flat ticket)"
            : (go.single_pass
                   ? (go.single_pass_ctas > 1 ? " (single pass, cluster 3)" : " (single pass)")
                   : "");
    DeviceSet d;
    upload(first, d);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(indexer_cuda_uses_fused_decode(d.params, go), !go.ticket_select);
    ASSERT_EQ(indexer_cuda_plan(d.params, go).single, go.single_pass);
    ASSERT_EQ(indexer_cuda_plan(d.params, go).ticket, go.ticket_select);
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

// The ticket selection (flat decode, IndexerCudaOptions::ticket_select) keeps per-request tickets
// in the workspace's control area, zero before and after every call. Three calls of two shapes
// (4 tokens per request, then 1, then 4 again: other T, other R, the same workspace) captured in
// one graph and replayed twice: the last call's ids equal an eager call's, the second shape's ids
// equal its eager call's, and the tickets are zero after every replay (download checks them).
// About two requests per flat CTA (R ~ 2 SMs), so CTAs hold warps of several requests.
TEST(IndexerGpu, TicketSelectionLeavesTicketsZeroAcrossShapesAndReplays) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int sms = mt::current_device_sms();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto requests = [&](int R, int tokens) {
    std::vector<RequestSpec> reqs;
    for (int i = 0; i < R; ++i)
      reqs.push_back({static_cast<int>(rng.integer(2100, 2600 - tokens)), tokens});
    reqs[0] = {8192 - tokens, tokens};  // max_pages 64; the others 17-21 blocks (a quick twin)
    return reqs;
  };
  const Inputs a = make_inputs(requests(2 * sms + 3, 4), 4, rng, false, 0, 0);
  const Inputs b = make_inputs(requests(2 * sms - 5, 1), 4, rng, false, 0, 0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  DeviceSet da, db;
  upload(a, da);
  upload(b, db);
  IndexerCudaOptions o;
  o.flat_decode = 1;
  o.ticket_select = true;
  ASSERT_TRUE(indexer_cuda_plan(da.params, o).ticket);
  ASSERT_TRUE(indexer_cuda_plan(db.params, o).ticket);
  const GpuResult ea = run_gpu(da, o);
  const GpuResult eb = run_gpu(db, o);
  compare(a, reference(a), ea, false, "ticket selection, 4 tokens per request");
  compare(b, reference(b), eb, false, "ticket selection, 1 token per request");
  // b's call on a's workspace (larger: 4 times the tokens).
  ASSERT_GE(da.ws_bytes, db.ws_bytes);
  IndexerParams pb = db.params;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const Status st1 = run_indexer_cuda(da.params, da.workspace, stream, o);
  const Status st2 = run_indexer_cuda(pb, da.workspace, stream, o);
  const Status st3 = run_indexer_cuda(da.params, da.workspace, stream, o);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st1.ok()) << st1.to_string();
  ASSERT_TRUE(st2.ok()) << st2.to_string();
  ASSERT_TRUE(st3.ok()) << st3.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    poison_outputs(da);
    poison_outputs(db);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const GpuResult ra = download(da), rb = download(db);
    EXPECT_TRUE(ra.ids == ea.ids) << "replay " << replay << ": ids of the third call differ";
    EXPECT_TRUE(rb.ids == eb.ids) << "replay " << replay << ": ids of the second call differ";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
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
