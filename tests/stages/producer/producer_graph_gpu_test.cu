// GPU tests of the producer kernels (SPEC sections 3-4, 8) beyond the twin comparisons of
// producer_gpu_test.cu: CUDA-graph capture and replay with new inputs, the kernel variants
// (per-batch, persistent, bulk-copy pipeline) against each other byte for byte, rejected options
// and calls, and T = 0. Helpers and tolerances: producer_gpu_test_util.h.
#include "producer_gpu_test_util.h"

namespace m3attn::producer_gpu_test {
namespace {

// Capture once (fused, and the unfused pair as two nodes), replay with new packed rows, new
// positions and new slots (a -1 among them) written into the same buffers: byte-identical to
// an eager run from the same state, and within tolerance of the twin.
void graph_replay_case(int64_t t, const ProducerCudaOptions& opt = {}) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "T " << t << " kernel " << choice_name(opt)
                                    << " persistent_blocks " << opt.persistent_blocks);
  mt::Rng rng(seed);
  const int64_t pages = pages_for(t) + 4;
  Inputs in = make_inputs(64, 4, t, pages, rng);
  const Layout lay = separate_layout(4, pages, 3, 0, 0);
  Packed fused = packed_for(in, ProducerMode::kFused, rng);
  Packed main = packed_for(in, ProducerMode::kMain, rng);
  Packed index = packed_for(in, ProducerMode::kIndex, rng);
  const Outputs init = make_outputs(in, lay, rng);
  Outputs state = init.clone();  // the host side of the device outputs

  Mirror m;
  mirror_inputs(m, in);
  m.add_all({&fused.data, &main.data, &index.data});
  mirror_outputs(m, state);
  const ProducerParams p_fused =
      m.device_params(make_params(ProducerMode::kFused, in, fused, state, lay));
  const ProducerParams p_main =
      m.device_params(make_params(ProducerMode::kMain, in, main, state, lay));
  const ProducerParams p_index =
      m.device_params(make_params(ProducerMode::kIndex, in, index, state, lay));

  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Variant {
    const char* name;
    std::vector<const ProducerParams*> runs;
    cudaGraphExec_t exec = nullptr;
  };
  Variant variants[] = {{"fused", {&p_fused}}, {"main + index", {&p_main, &p_index}}};
  for (Variant& v : variants) {
    cudaGraph_t graph;
    M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (const ProducerParams* p : v.runs) {
      const Status s = run_producer_cuda(*p, stream, opt);
      EXPECT_TRUE(s.ok()) << s.to_string();
    }
    M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
    size_t nodes = 0;
    M3_CUDA_TEST_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    EXPECT_EQ(nodes, v.runs.size()) << v.name << ": one kernel node per call";
    M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&v.exec, graph, 0));
    M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
  }

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "replay round " << round);
    fill_token_data(in, pages, rng);
    int32_t* slot = in.slots.ptr<int32_t>();
    slot[round] = -1;  // a padding row
    if (round == 2) {  // padded tail
      // (through a vector: GCC 12 otherwise believes the tensor is one 64-byte chunk)
      std::vector<int32_t> all(slot, slot + t + 3);
      std::fill(all.end() - 11, all.end(), -1);
      std::memcpy(in.slots.data(), all.data(), all.size() * sizeof(int32_t));
    }
    refill_packed(fused, in, ProducerMode::kFused, rng);
    refill_packed(main, in, ProducerMode::kMain, rng);
    refill_packed(index, in, ProducerMode::kIndex, rng);
    for (const Tensor* h : {&in.positions, &in.slots, &fused.data, &main.data, &index.data})
      m.upload(*h);

    Outputs cpu = init.clone();
    ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, fused, cpu, lay)).ok());

    for (Variant& v : variants) {
      SCOPED_TRACE(v.name);
      Outputs results[2];  // replay, eager
      for (int eager = 0; eager < 2; ++eager) {
        std::memcpy(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes()));
        std::memcpy(state.iq.data(), init.iq.data(), static_cast<size_t>(init.iq.nbytes()));
        std::memcpy(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes));
        m.upload(state.q);
        m.upload(state.iq);
        m.upload(state.pool);
        // Uploads run on the legacy stream; `stream` is non-blocking: order them explicitly.
        M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
        if (eager) {
          for (const ProducerParams* p : v.runs) {
            const Status s = run_producer_cuda(*p, stream, opt);
            ASSERT_TRUE(s.ok()) << s.to_string();
          }
        } else {
          M3_CUDA_TEST_CHECK(cudaGraphLaunch(v.exec, stream));
        }
        wait_or_exit("stream", stream);
        download_outputs(m, state);
        results[eager] = state.clone();
      }
      EXPECT_EQ(std::memcmp(results[0].q.data(), results[1].q.data(),
                            static_cast<size_t>(init.q.nbytes())),
                0);
      EXPECT_EQ(std::memcmp(results[0].iq.data(), results[1].iq.data(),
                            static_cast<size_t>(init.iq.nbytes())),
                0);
      EXPECT_EQ(std::memcmp(results[0].pool.data(), results[1].pool.data(),
                            static_cast<size_t>(lay.bytes)),
                0);
      expect_match(in, true, true, lay, init, cpu, results[0], false, "replay vs CPU twin");
    }
  }
  for (Variant& v : variants) cudaGraphExecDestroy(v.exec);
  cudaStreamDestroy(stream);
}

// T = 37 runs the 1-task-per-group kernel, T = 300 (23,100 tasks) the 3-task one; then the
// persistent kernel on 5 blocks (241 batches of 96 tasks: ~48 loop iterations per block) and the
// bulk-copy pipeline on its default grid, on 5 blocks with 2 stages (181 tiles: ~36 tiles and
// every stage reused ~18 times per block), with 3 stages on 4 blocks, with task plans (interleaved
// tile order, 5 blocks, with 128- and 64-task tiles; 4 stages, 3 blocks) and with tail blocks (5
// persistent blocks, 2 rounds and the rest in blocks of one 16-task tile).
TEST(ProducerGpu, GraphReplayWithNewInputsMatchesEager) {
  M3_REQUIRE_GPU();
  for (const int64_t t : {37, 300}) graph_replay_case(t);
  ProducerCudaOptions persistent;
  persistent.kernel = ProducerCudaKernel::kPersistent;
  persistent.persistent_blocks = 5;
  graph_replay_case(300, persistent);
  graph_replay_case(37, tma_options());
  graph_replay_case(300, tma_options(2, 5));
  graph_replay_case(300, tma_options(3, 4));
  graph_replay_case(300, tma_options(2, 5, true, true));
  graph_replay_case(300, tma_options(4, 5, true, true, 64));
  graph_replay_case(300, tma_options(4, 3, true));
  graph_replay_case(300, tail_options(2, 1, 16, 5));
}

// For every mode: fresh inputs of `geo` and `t` (a fresh seed), a pool with padded planes and
// 4-byte aligned rows, the mode's packed rows and fresh outputs; fn(mode, in, lay, packed, init).
template <typename Fn>
void for_each_mode_case(const Geometry& geo, int64_t t, Fn&& fn) {
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int64_t pages = pages_for(t);
  const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages, rng);
  const Layout lay = separate_layout(geo.n_kv, pages, 3, 260, 4);
  for (const ProducerMode mode : kModes) {
    SCOPED_TRACE(::testing::Message() << producer_mode_name(mode) << " n_q " << geo.n_q << " n_kv "
                                      << geo.n_kv << " T " << t);
    const Packed packed = packed_for(in, mode, rng);
    const Outputs init = make_outputs(in, lay, rng);
    fn(mode, in, lay, packed, init);
  }
}

// The persistent kernel (grid-stride loop over batches, next batch's loads, RoPE rows and
// positions in flight while the current one is computed) against the per-batch kernel: byte for
// byte (same per-task code), and against the CPU twin. Grids of 1, 3 and 7 blocks run many loop
// iterations per block (every pipeline stage reused many times), with a partial last batch
// (T 129 x 77 heads = 9933 tasks = 103 full batches + 45 tasks; index mode with n_kv 1 has 2
// heads per row: 49 tokens per batch, the staging maximum); the default grid (SMs x 2) at T 4099
// with the M3 geometry runs ~12 iterations per block; T 1 is a single partial batch.
TEST(ProducerGpu, PersistentMatchesPerBatchByteForByte) {
  M3_REQUIRE_GPU();
  struct Case {
    Geometry geo;
    int64_t t;
    int blocks;
  };
  const Case cases[] = {{{64, 4}, 1, 0},  {{64, 4}, 129, 1}, {{64, 4}, 129, 3}, {{64, 4}, 4099, 0},
                        {{8, 1}, 129, 1}, {{8, 1}, 1001, 7}, {{32, 2}, 517, 3}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "persistent_blocks " << c.blocks);
    for_each_mode_case(
        c.geo, c.t,
        [&](ProducerMode mode, const Inputs& in, const Layout& lay, const Packed& packed,
            const Outputs& init) {
          ProducerCudaOptions per_batch, persistent;
          per_batch.kernel = ProducerCudaKernel::kPerBatch;
          persistent.kernel = ProducerCudaKernel::kPersistent;
          persistent.persistent_blocks = c.blocks;
          Outputs a = init.clone(), b = init.clone(), cpu = init.clone();
          run_on_gpu({make_params(mode, in, packed, a, lay)}, in, {&packed}, a, per_batch);
          run_on_gpu({make_params(mode, in, packed, b, lay)}, in, {&packed}, b, persistent);
          expect_match(in, uses_main(mode), uses_index(mode), lay, init, a, b, /*exact=*/true,
                       "persistent vs per-batch (exact)");
          const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
          ASSERT_TRUE(s.ok()) << s.to_string();
          expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, b, /*exact=*/false,
                       "persistent vs CPU twin");
        });
  }
}

// The bulk-copy pipeline (copy warp + shared-memory ring, mbarrier phases; each block an equal
// share of the tasks in tiles of 128, or interleaved rounds of tiles first) against the per-batch
// kernel, byte for byte: with and without task plans, 128- and 64-task tiles, tail blocks (the
// default ones and others), 4 blocks per SM; the per-batch kernel
// against the CPU twin. Grids of
// 1-7 blocks run many tiles per block, so every stage and both barrier parities are reused many
// times (T 129 x 77 heads = 9933 tasks); index mode with n_kv 1 has 2 heads per row, up to 65
// tokens per tile (more than the 32 copy lanes: three passes); rows only 4-byte aligned in the
// pool; packed row strides padded; 2, 3 and 4 stages.
TEST(ProducerGpu, TmaPipelineMatchesPerBatchAndTwin) {
  M3_REQUIRE_GPU();
  struct Case {
    Geometry geo;
    int64_t t;
    int blocks;
    int stages;
  };
  const Case cases[] = {{{64, 4}, 1, 0, 0},    {{64, 4}, 129, 1, 2},  {{64, 4}, 129, 3, 3},
                        {{64, 4}, 4099, 0, 0}, {{64, 4}, 4099, 0, 4}, {{8, 1}, 129, 1, 2},
                        {{8, 1}, 1001, 7, 3},  {{32, 2}, 517, 3, 4},  {{16, 1}, 2050, 0, 2}};
  struct Variant {
    const char* name;
    bool plan, interleave;
    int tile;
    // Tail blocks: tail_rounds > 0 on with these parameters, -1 the default (on with 128-task
    // tiles), 0 off.
    int tail_rounds = 0, tail_tiles = 0, tail_tile = 0;
    int blocks_per_sm = 0;  // 4: 2 stages where the case has 2, else 3
  };
  const Variant variants[] = {
      {"no plans", false, false, 128},
      {"plans", true, false, 128},
      {"plans, interleaved", true, true, 128},
      {"64-task tiles", false, false, 64},
      {"plans, interleaved, 64-task tiles", true, true, 64},
      {"plans, interleaved, default tail", true, true, 128, -1},
      {"plans, tail 1 x 2 x 64", true, true, 128, 1, 2, 64},
      {"plans, tail 2 x 3 x 48", true, true, 64, 2, 3, 48},
      {"tail 1 x 1 x 128", false, false, 128, 1, 1, 0},
      {"plans, interleaved, 64-task tiles, 4 blocks per SM", true, true, 64, 0, 0, 0, 4},
      {"plans, tail 1 x 4 x 32", true, true, 128, 1, 4, 32}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "blocks " << c.blocks << " stages " << c.stages);
    for_each_mode_case(
        c.geo, c.t,
        [&](ProducerMode mode, const Inputs& in, const Layout& lay, const Packed& packed,
            const Outputs& init) {
          const Outputs ref = per_batch_reference(mode, in, lay, packed, init);
          for (const Variant& v : variants) {
            Outputs out = init.clone();
            ProducerCudaOptions o = tma_options(c.stages, c.blocks, v.plan, v.interleave, v.tile);
            o.tma_tail = v.tail_rounds > 0 ? 1 : v.tail_rounds < 0 ? 0 : -1;
            if (v.tail_rounds > 0) {
              o.tma_tail_rounds = v.tail_rounds;
              o.tma_tail_tiles = v.tail_tiles;
              o.tma_tail_tile_tasks = v.tail_tile;
            }
            if (v.blocks_per_sm == 4) {
              o.tma_blocks_per_sm = 4;
              o.tma_stages = c.stages == 2 ? 2 : 3;
            }
            run_on_gpu({make_params(mode, in, packed, out, lay)}, in, {&packed}, out, o);
            expect_match(in, uses_main(mode), uses_index(mode), lay, init, ref, out, /*exact=*/true,
                         std::string("bulk-copy pipeline (") + v.name + ") vs per-batch (exact)");
          }
        });
  }
}

// A small fused call (n_q 8, n_kv 1, T 16) with its device mirror, for the tests whose calls are
// rejected: after them every output must still hold its initial bytes.
struct SmallFusedCall {
  mt::Rng rng;
  Inputs in;
  Layout lay;
  Packed packed;
  Outputs init, state;
  Mirror m;
  ProducerParams host, good;  // views into the host tensors / their device mirrors

  explicit SmallFusedCall(uint64_t seed)
      : rng(seed),
        in(make_inputs(8, 1, 16, pages_for(16), rng)),
        lay(separate_layout(1, pages_for(16), 1, 0, 0)),
        packed(packed_for(in, ProducerMode::kFused, rng)),
        init(make_outputs(in, lay, rng)),
        state(init.clone()) {
    mirror_inputs(m, in);
    m.add(packed.data);
    mirror_outputs(m, state);
    host = make_params(ProducerMode::kFused, in, packed, state, lay);
    good = m.device_params(host);
  }
  SmallFusedCall(const SmallFusedCall&) = delete;
  SmallFusedCall& operator=(const SmallFusedCall&) = delete;

  void expect_untouched() {
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    download_outputs(m, state);
    EXPECT_EQ(std::memcmp(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes())), 0);
    EXPECT_EQ(std::memcmp(state.iq.data(), init.iq.data(), static_cast<size_t>(init.iq.nbytes())),
              0);
    EXPECT_EQ(std::memcmp(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0);
  }
};

// The bulk-copy kernel with tma_task_plan / tma_interleave set to raw values.
ProducerCudaOptions bad_flag(int plan, int interleave) {
  ProducerCudaOptions o = tma_options();
  o.tma_task_plan = plan;
  o.tma_interleave = interleave;
  return o;
}

// The bulk-copy kernel's defaults with the tail switch, rounds, tiles and tail tile set to raw
// values.
ProducerCudaOptions bad_tail(int tail, int rounds, int tiles, int tile_tasks) {
  ProducerCudaOptions o = tail_options(rounds, tiles, tile_tasks);
  o.tma_tail = tail;
  return o;
}

// The bulk-copy kernel with tma_blocks_per_sm and tma_stages set to raw values.
ProducerCudaOptions bad_blocks(int blocks_per_sm, int stages) {
  ProducerCudaOptions o = tma_options(stages);
  o.tma_blocks_per_sm = blocks_per_sm;
  return o;
}

void expect_rejected(const Status& s) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_FALSE(s.message().empty());
}

// A negative grid, a stage count outside [2, 4], a task-plan or
// tile-order switch outside {-1, 0, 1}, a tile size other than 64 or 128, a tail switch outside
// {-1, 0, 1}, tail rounds or tiles outside [0, 8], a tail tile outside [16, 64] (the default tile
// size is 64 at small T), blocks per SM other than 0,
// 3 or 4 (4 only with 2 or 3 stages), or an unknown kernel choice is rejected before any launch.
TEST(ProducerGpu, BadKernelOptionsRejected) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  SmallFusedCall call(seed);
  ProducerCudaOptions neg;
  neg.kernel = ProducerCudaKernel::kPersistent;
  neg.persistent_blocks = -1;
  ProducerCudaOptions unknown;
  unknown.kernel = static_cast<ProducerCudaKernel>(7);
  for (const ProducerCudaOptions& o : {neg,
                                       unknown,
                                       tma_options(1),
                                       tma_options(5),
                                       tma_options(-1),
                                       tma_options(0, -3),
                                       tma_options(1, 0, true),
                                       bad_flag(2, 0),
                                       bad_flag(0, -2),
                                       tma_options(0, 0, true, true, 32),
                                       tma_options(0, 0, false, false, 96),
                                       tma_options(0, 0, true, false, -64),
                                       bad_tail(2, 0, 0, 0),
                                       bad_tail(-2, 0, 0, 0),
                                       bad_tail(1, 9, 0, 0),
                                       bad_tail(1, -1, 0, 0),
                                       bad_tail(1, 0, 9, 0),
                                       bad_tail(1, 0, 0, 8),
                                       bad_tail(1, 0, 0, 65),
                                       bad_tail(1, 0, 0, -16),
                                       bad_blocks(5, 3),
                                       bad_blocks(4, 0),
                                       bad_blocks(4, 4),
                                       bad_blocks(2, 2)})
    expect_rejected(run_producer_cuda(call.good, nullptr, o));
  call.expect_untouched();
}

// A few rejected calls (the CPU suite covers every rule): a Status, no launch, no byte written.
TEST(ProducerGpu, RejectedCallsTouchNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  SmallFusedCall call(seed);
  const ProducerParams& good = call.good;
  struct Bad {
    const char* name;
    ProducerParams p;
  };
  std::vector<Bad> bad;
  bad.push_back({"CPU tensors", call.host});
  bad.push_back({"one view on the CPU", good});
  bad.back().p.rope = call.host.rope;
  bad.push_back({"packed base 2 bytes off", good});
  bad.back().p.packed.data = static_cast<char*>(good.packed.data) + 2;
  bad.push_back({"slots shorter than T", good});
  bad.back().p.slots.shape[0] = good.num_tokens - 1;
  bad.push_back({"index cache page count differs", good});
  bad.back().p.index_cache.shape[0] = call.lay.num_pages - 1;
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    expect_rejected(run_producer_cuda(b.p, nullptr));
  }
  call.expect_untouched();

  // The good call then runs (so the rejections above were not the environment failing).
  ASSERT_TRUE(run_producer_cuda(good, nullptr).ok());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
}

// T == 0 launches nothing: the captured graph is empty and every output keeps its bytes.
TEST(ProducerGpu, ZeroTokensLaunchesNothing) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const Inputs in = make_inputs(16, 1, 0, 2, rng);
  const Layout lay = separate_layout(1, 2, 1, 0, 0);
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for_each_choice_and_mode(
      in, lay, rng,
      [&](const ProducerCudaOptions& opt, ProducerMode mode, const Packed& packed,
          const Outputs& init) {
        Outputs state = init.clone();
        Mirror m;
        mirror_inputs(m, in);
        mirror_outputs(m, state);
        const ProducerParams p = m.device_params(make_params(mode, in, packed, state, lay));
        M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());  // uploads (legacy stream) before `stream`
        cudaGraph_t graph;
        M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        const Status s = run_producer_cuda(p, stream, opt);
        M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
        EXPECT_TRUE(s.ok()) << s.to_string();
        size_t nodes = 1;
        M3_CUDA_TEST_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
        EXPECT_EQ(nodes, 0u);
        M3_CUDA_TEST_CHECK(cudaGraphDestroy(graph));
        ASSERT_TRUE(run_producer_cuda(p, stream, opt).ok());
        wait_or_exit("stream", stream);
        download_outputs(m, state);
        EXPECT_EQ(std::memcmp(state.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)),
                  0);
        EXPECT_EQ(std::memcmp(state.q.data(), init.q.data(), static_cast<size_t>(init.q.nbytes())),
                  0);
      });
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace m3attn::producer_gpu_test
