// GPU tests of the producer kernels against the CPU twin (SPEC sections 3-4, 8), each on the
// default kernel choice and on bulk-copy pipeline variants (kKernelChoices); the byte classes
// and tolerances are in producer_gpu_test_util.h. Graph replays, the kernel variants against each
// other and rejected calls are in producer_graph_gpu_test.cu.
#include "producer_gpu_test_util.h"

namespace m3attn::producer_gpu_test {
namespace {

// ---------------------------------------------------------------------------------------------

TEST(ProducerGpu, MatchesCpuTwinEveryModeGeometryAndLength) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : kGeometries) {
    for (const int64_t t : {0, 1, 16, 129, 4099}) {
      const uint64_t seed = mt::fresh_seed();
      M3_SEED_TRACE(seed);
      mt::Rng rng(seed);
      const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
      const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
      for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
    }
  }
}

// The default choice from 2^19 tasks on (M3 TP1 fused, T 6900: 531,300 tasks) runs the bulk-copy
// kernel with 128-task tiles, 2 stages and tail blocks, which the sizes above do not reach: byte
// for byte against the per-batch kernel (itself checked against the CPU twin).
TEST(ProducerGpu, DefaultChoiceWithTailBlocks) {
  M3_REQUIRE_GPU();
  const int64_t t = 6900;
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const Inputs in = make_inputs(64, 4, t, pages_for(t), rng);
  const Layout lay = separate_layout(4, pages_for(t), 1, 0, 0);
  const Packed packed = packed_for(in, ProducerMode::kFused, rng);
  const Outputs init = make_outputs(in, lay, rng);
  const Outputs ref = per_batch_reference(ProducerMode::kFused, in, lay, packed, init);
  Outputs gpu = init.clone();
  run_on_gpu({make_params(ProducerMode::kFused, in, packed, gpu, lay)}, in, {&packed}, gpu);
  expect_match(in, true, true, lay, init, ref, gpu, /*exact=*/true, "default vs per-batch (exact)");
}

TEST(ProducerGpu, StridedPoolsKeepGuardsAndOtherLayers) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : {Geometry{64, 4}, Geometry{8, 1}}) {
    const int64_t t = 300;
    const int64_t pages = pages_for(t);
    const uint64_t seed = mt::fresh_seed();
    M3_SEED_TRACE(seed);
    mt::Rng rng(seed);
    const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages, rng);
    const Layout layouts[] = {
        separate_layout(geo.n_kv, pages, 3, 0, 0),
        // Plane stride padded by 260 bytes and bases 4 bytes off: rows only 4-byte aligned.
        separate_layout(geo.n_kv, pages, 5, 260, 4),
        interleaved_layout(geo.n_kv, pages, 57, 31, 64),
        interleaved_layout(geo.n_kv, pages, 57, 56, 4),
    };
    for (const Layout& lay : layouts)
      for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
  }
}

TEST(ProducerGpu, FusedMatchesUnfusedPair) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : kGeometries) {
    for (const int64_t t : {1, 129, 4099}) {
      const uint64_t seed = mt::fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "n_q " << geo.n_q << " n_kv " << geo.n_kv << " T " << t);
      mt::Rng rng(seed);
      const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
      const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
      const Packed fused = packed_for(in, ProducerMode::kFused, rng);
      const Packed main = packed_for(in, ProducerMode::kMain, rng);  // the two GEMM outputs
      const Packed index = packed_for(in, ProducerMode::kIndex, rng);
      const Outputs init = make_outputs(in, lay, rng);

      for (const ProducerCudaOptions& opt : kKernelChoices) {
        SCOPED_TRACE(choice_name(opt));
        Outputs one = init.clone();
        run_on_gpu({make_params(ProducerMode::kFused, in, fused, one, lay)}, in, {&fused}, one,
                   opt);
        Outputs two = init.clone();
        run_on_gpu({make_params(ProducerMode::kMain, in, main, two, lay),
                    make_params(ProducerMode::kIndex, in, index, two, lay)},
                   in, {&main, &index}, two, opt);
        expect_match(in, true, true, lay, init, one, two, /*exact=*/false, "fused vs main + index");
      }
    }
  }
}

// Few heads per row and many tokens: the most tokens per batch and tile (index mode with n_kv = 1
// has H = 2: 65 tokens per tile of the bulk-copy kernel), which the sizes above do not reach. The
// default choice runs the bulk-copy kernel for fused n_q 32 (351,039 tasks) and the per-batch
// kernel for the others.
TEST(ProducerGpu, LargeBatchFewHeadsPerRow) {
  M3_REQUIRE_GPU();
  for (const Geometry& geo : {Geometry{8, 1}, Geometry{32, 2}}) {
    const int64_t t = 9001;
    const uint64_t seed = mt::fresh_seed();
    M3_SEED_TRACE(seed);
    mt::Rng rng(seed);
    const Inputs in = make_inputs(geo.n_q, geo.n_kv, t, pages_for(t), rng);
    const Layout lay = separate_layout(geo.n_kv, pages_for(t), 1, 0, 0);
    for (const ProducerMode mode : kModes) check_against_twin(mode, in, lay, rng);
  }
}

TEST(ProducerGpu, SkippedSlotsAndBadPositionsWriteNoCache) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int64_t pages = 3;
  Inputs in = make_inputs(8, 1, 7, pages, rng);
  const int32_t cap = static_cast<int32_t>(pages * kPageSize);
  const int32_t slots[] = {-1, cap, cap + 127, INT32_MAX, 5, 6, -2};
  const int32_t positions[] = {0, 1, 2, 3, -1, static_cast<int32_t>(in.max_pos), 4};
  std::memcpy(in.slots.ptr<int32_t>(), slots, sizeof(slots));
  std::memcpy(in.positions.ptr<int32_t>(), positions, sizeof(positions));
  const Layout lay = separate_layout(1, pages, 1, 0, 0);
  for_each_choice_and_mode(
      in, lay, rng,
      [&](const ProducerCudaOptions& opt, ProducerMode mode, const Packed& packed,
          const Outputs& init) {
        Outputs gpu = init.clone();
        run_on_gpu({make_params(mode, in, packed, gpu, lay)}, in, {&packed}, gpu, opt);
        EXPECT_EQ(std::memcmp(gpu.pool.data(), init.pool.data(), static_cast<size_t>(lay.bytes)), 0)
            << "no token of this batch may write a cache";
        // Tokens 4 and 5 (bad positions) have NaN Q / index-Q rows; the others are real values.
        const Tensor& out = uses_main(mode) ? gpu.q : gpu.iq;
        const int heads = uses_main(mode) ? in.n_q : in.n_kv;
        for (int64_t i = 0; i < in.t; ++i) {
          const uint8_t* row = out.ptr<uint8_t>() + kOutGuard + i * heads * kHeadDim;
          const int64_t nan = std::count(row, row + heads * kHeadDim, uint8_t{0x7f});
          if (i == 4 || i == 5)
            EXPECT_EQ(nan, heads * kHeadDim) << "token " << i;
          else
            EXPECT_LT(nan, heads * kHeadDim) << "token " << i;
        }
        Outputs cpu = init.clone();
        const Status s = run_producer_cpu(make_params(mode, in, packed, cpu, lay));
        ASSERT_TRUE(s.ok()) << s.to_string();
        expect_match(in, uses_main(mode), uses_index(mode), lay, init, cpu, gpu, false, "vs twin");
      });
}

__global__ void count_bytes_not_equal(const uint4* p, int64_t n16, uint8_t value,
                                      unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n16;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    for (const uint32_t w : {v.x, v.y, v.z, v.w})
      for (int k = 0; k < 4; ++k) local += ((w >> (8 * k)) & 0xffu) != value;
  }
  if (local) atomicAdd(count, local);
}

// Page 65536 of a pool whose page stride is 98,304 bytes (two layers interleaved) sits past
// 2^32 bytes: 32-bit address arithmetic would write elsewhere. About 6.4 GB of device memory.
TEST(ProducerGpu, Page65536AddressedIn64Bits) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  mt::Rng rng(seed);
  const int n_q = 8, n_kv = 1;
  const int64_t pages = 65540;
  const Layout big = interleaved_layout(n_kv, pages, 2, 1, 0);
  ASSERT_GT(65536 * big.kv_page, int64_t{1} << 32);
  constexpr uint8_t kPoison = 0x5A;

  Inputs in = make_inputs(n_q, n_kv, 8, 1, rng);
  const int32_t slots[] = {65536 * 128 + 0,
                           65536 * 128 + 5,
                           65536 * 128 + 127,
                           65535 * 128 + 7,
                           65539 * 128 + 127,
                           1,
                           -1,
                           65540 * 128};
  std::memcpy(in.slots.ptr<int32_t>(), slots, sizeof(slots));
  for (int64_t i = 8; i < 11; ++i) in.slots.ptr<int32_t>()[i] = 65537 * 128 + int32_t(i);  // unread
  for (int64_t i = 0; i < 8; ++i)
    in.positions.ptr<int32_t>()[i] = static_cast<int32_t>(rng.integer(0, in.max_pos - 1));
  const Packed packed = packed_for(in, ProducerMode::kFused, rng);

  // CPU twin on a small pool of the same layout: pages 65536, 65535, 65539, 0 -> 0, 1, 2, 3.
  Inputs small_in = make_inputs(n_q, n_kv, 8, 1, rng);
  small_in.fused = in.fused.clone();
  small_in.fused_stride = in.fused_stride;
  small_in.positions = in.positions.clone();
  small_in.rope = in.rope.clone();
  for (int w = 0; w < 4; ++w) small_in.norms[w] = in.norms[w].clone();
  const int32_t small_slots[] = {
      0 * 128 + 0, 0 * 128 + 5, 0 * 128 + 127, 1 * 128 + 7, 2 * 128 + 127, 3 * 128 + 1, -1, -1, -1,
      -1,          -1};
  std::memcpy(small_in.slots.ptr<int32_t>(), small_slots, sizeof(small_slots));
  const Layout small = interleaved_layout(n_kv, 4, 2, 1, 0);
  Outputs cpu = make_outputs(small_in, small, rng);
  std::memset(cpu.pool.data(), kPoison, static_cast<size_t>(small.bytes));
  ASSERT_TRUE(
      run_producer_cpu(make_params(ProducerMode::kFused, small_in, packed, cpu, small)).ok());

  // GPU on the big pool.
  mt::DeviceBuffer pool(static_cast<size_t>(big.bytes), kPoison);
  Mirror m;
  mirror_inputs(m, in);
  m.add(packed.data);
  Outputs gpu = make_outputs(in, small, rng);  // q / iq only; the pool view is replaced below
  mirror_outputs(m, gpu);
  ProducerParams dp = m.device_params(make_params(ProducerMode::kFused, in, packed, gpu, small));
  auto* base = static_cast<uint8_t*>(pool.data());
  dp.kv_cache = make_kv_cache_view(base + big.kv_base, pages, n_kv, big.kv_page, big.kv_plane,
                                   Device::cuda(0));
  dp.index_cache = make_index_cache_view(base + big.ic_base, pages, big.ic_page, Device::cuda(0));
  for (const ProducerCudaOptions& opt : kKernelChoices) {
    SCOPED_TRACE(choice_name(opt));
    pool.poison(kPoison);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    const Status s = run_producer_cuda(dp, nullptr, opt);
    ASSERT_TRUE(s.ok()) << s.to_string();
    wait_or_exit("page 65536");
    m.download(gpu.q);
    m.download(gpu.iq);

    // Q / index-Q, and every written row against the twin's row on the mapped page.
    Mismatches mm;
    compare_compact("q_out", in, n_q, cpu.q, cpu.q, gpu.q, true, false, mm);
    compare_compact("iq_out", in, n_kv, cpu.iq, cpu.iq, gpu.iq, true, false, mm);
    const int64_t big_pages[] = {65536, 65535, 65539, 0};
    int64_t differing = 0;  // bytes of the written rows that differ from the poison
    for (int64_t i = 0; i < 6; ++i) {
      const int64_t page = slots[i] / 128, row = slots[i] % 128;
      const int64_t small_page = small_slots[i] / 128;
      ASSERT_EQ(page, big_pages[small_page]);
      struct RowAt {
        const char* name;
        int64_t big_off, small_off;
        bool exact;
      };
      const RowAt rows[] = {{"K", big.kv_base + page * big.kv_page,
                             small.kv_base + small_page * small.kv_page, false},
                            {"V", big.kv_base + page * big.kv_page + big.kv_plane,
                             small.kv_base + small_page * small.kv_page + small.kv_plane, true},
                            {"index-K", big.ic_base + page * big.ic_page,
                             small.ic_base + small_page * small.ic_page, false}};
      for (const RowAt& r : rows) {
        uint8_t got[kHeadDim];
        pool.download(got, kHeadDim, static_cast<size_t>(r.big_off + row * kHeadDim));
        const uint8_t* want = cpu.pool.ptr<uint8_t>() + r.small_off + row * kHeadDim;
        for (int d = 0; d < kHeadDim; ++d) {
          differing += got[d] != kPoison;
          if (r.exact ? got[d] != want[d] : !e4m3_within_one_step(want[d], got[d]))
            mm.add(describe(r.name, page * 1000 + row, want[d], got[d]));
        }
      }
    }
    EXPECT_EQ(mm.count, 0) << mm.report;
    EXPECT_GT(differing, 0);
    // Nothing else in the 6.4 GB changed: the poison count equals the written rows' count.
    unsigned long long* count = nullptr;
    M3_CUDA_TEST_CHECK(cudaMalloc(&count, sizeof(*count)));
    M3_CUDA_TEST_CHECK(cudaMemset(count, 0, sizeof(*count)));
    count_bytes_not_equal<<<1024, 256>>>(static_cast<const uint4*>(pool.data()), big.bytes / 16,
                                         kPoison, count);
    M3_CUDA_TEST_CHECK(cudaGetLastError());
    unsigned long long total = 0;
    M3_CUDA_TEST_CHECK(cudaMemcpy(&total, count, sizeof(total), cudaMemcpyDeviceToHost));
    cudaFree(count);
    ASSERT_EQ(big.bytes % 16, 0);
    EXPECT_EQ(static_cast<int64_t>(total), differing)
        << "bytes outside the six written token rows changed";
  }
}

}  // namespace
}  // namespace m3attn::producer_gpu_test
