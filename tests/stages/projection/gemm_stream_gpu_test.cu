// The streaming decode GEMM (run_gemm_stream_cuda) against the CPU twin. Numerics and bounds: see
// gemm_gpu_test_util.h. The kernel accumulates each 128-wide K block in the tensor core
// (mma.sync, reduced-precision FP8 accumulator, exact for the integer inputs), folds it into fp32
// with sa * sb, sums its warps in warp order and split groups' partials in CTA order. So:
// integer-valued inputs must be bit-identical to the twin, random inputs within
// |gpu - cpu| <= 2^-7 |cpu| + 2^-10 S. Every case also checks that nothing outside the output was
// written, that a second launch on the same workspace gives the same bytes (the kernel resets its
// arrival counters) and that the counters are zero afterwards. Small grids and short chunks make
// groups span several CTAs (the fixup path); N = 9856, K = 6144 is the fused projection's shape.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_gpu_test_util.h"
#include "stages/projection/gemm_stream.h"
#include "stages/projection/projection.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace gemm_test;  // NOLINT(build/namespaces)
using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::Rng;

#define M3_REQUIRE_STREAM_GEMM()                                                       \
  do {                                                                                 \
    M3_REQUIRE_GPU();                                                                  \
    if (!gemm_stream_device_supported())                                               \
      GTEST_SKIP() << "the streaming GEMM needs an sm_90 device (this is not a pass)"; \
  } while (0)

// A zeroed workspace for run_gemm_stream_cuda, for grids up to max_grid (0: one CTA per SM).
DeviceBuffer make_workspace(int64_t n, int max_grid = 0) {
  Result<size_t> bytes = gemm_stream_workspace_bytes(n, max_grid);
  EXPECT_TRUE(bytes.ok()) << bytes.status().to_string();
  return DeviceBuffer(bytes.ok() ? bytes.value() : 256, 0);
}

int64_t nonzero_counters(const DeviceBuffer& ws, int64_t n) {
  std::vector<unsigned> c(static_cast<size_t>(n / 8));
  ws.download(c.data(), c.size() * sizeof(unsigned));
  int64_t bad = 0;
  for (unsigned v : c) bad += v != 0;
  return bad;
}

struct Case {
  int64_t m, n, k, ld_pad;
  size_t shift;          // 16: operands only 16-byte aligned
  bool sa_row_major;     // activation scales [M, K / 128] row-major instead of token-major
  int chunk_blocks = 0;  // 0: automatic (8)
  int grid = 0;          // 0: one CTA per SM
  int max_stages = 0;
  bool evict_first = true;
  bool pdl = false;    // programmatic_launch and trigger_dependents
  int ctas = 1;        // ctas_per_sm
  bool async = false;  // async_copies
  bool pair = true;    // pair_units
};

std::string describe(const Case& c) {
  return "M " + std::to_string(c.m) + " N " + std::to_string(c.n) + " K " + std::to_string(c.k) +
         " ld pad " + std::to_string(c.ld_pad) + " shift " + std::to_string(c.shift) +
         " sa row-major " + std::to_string(c.sa_row_major) + " chunk " +
         std::to_string(c.chunk_blocks) + " grid " + std::to_string(c.grid) + " stages " +
         std::to_string(c.max_stages) + " evict-first " + std::to_string(c.evict_first) + " PDL " +
         std::to_string(c.pdl);
}

void PrintTo(const Case& c, std::ostream* os) { *os << describe(c); }

GemmStreamOptions options_of(const Case& c) {
  GemmStreamOptions o;
  o.chunk_blocks = c.chunk_blocks;
  o.grid = c.grid;
  o.max_stages = c.max_stages;
  o.weight_evict_first = c.evict_first;
  o.programmatic_launch = c.pdl;
  o.trigger_dependents = c.pdl;
  o.ctas_per_sm = c.ctas;
  o.async_copies = c.async;
  o.pair_units = c.pair;
  return o;
}

// Runs the kernel twice on the same workspace (output re-poisoned in between): both results must
// be identical, nothing outside [M, N] written, the counters zero afterwards.
std::vector<uint16_t> run_twice(DeviceGemm& dev, const Case& c) {
  DeviceBuffer ws = make_workspace(c.n, c.grid);
  const GemmStreamOptions o = options_of(c);
  const Status st = run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), nullptr, o);
  EXPECT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t touched = 0;
  const std::vector<uint16_t> first = dev.result(&touched);
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
  EXPECT_EQ(nonzero_counters(ws, c.n), 0) << "arrival counters not reset by the kernel";
  dev.out.poison(kPoison);
  const Status st2 = run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), nullptr, o);
  EXPECT_TRUE(st2.ok()) << st2.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> second = dev.result(&touched);
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(first, second) << "a second launch on the same workspace differs";
  return first;
}

void expect_exact(const Case& c, Rng& rng) {
  GemmData d = make_integer_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, c.n + c.ld_pad, c.shift, c.sa_row_major);
  const std::vector<uint16_t> got = run_twice(dev, c);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, c.n, &report), 0) << report;
}

class GemmStreamExact : public ::testing::TestWithParam<Case> {};

TEST_P(GemmStreamExact, IntegerInputsBitIdenticalToTwin) {
  M3_REQUIRE_STREAM_GEMM();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(describe(c));
  Rng rng(seed);
  expect_exact(c, rng);
}

// Small shapes for compute-sanitizer (memcheck, racecheck): both kernels (M <= 8, M <= 16), whole
// groups and the fixup (groups over several CTAs), a short last chunk, a two-stage ring that
// wraps many times, programmatic launch with the trigger.
TEST(GemmStreamSanitizer, SmallShapesExact) {
  M3_REQUIRE_STREAM_GEMM();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const Case cases[] = {Case{3, 256, 1152, 8, 16, true, 8, 0},
                        Case{16, 128, 2048, 0, 0, false, 8, 40},
                        Case{9, 384, 640, 0, 16, false, 8, 5, 2},
                        Case{1, 1280, 6144, 0, 0, false, 16, 0, 0, true, true},
                        Case{6, 256, 2304, 0, 0, false, 16, 7, 2},
                        Case{12, 640, 1024, 0, 0, true, 0, 0, 2, false, true},
                        Case{4, 384, 1152, 0, 16, false, 0, 5, 2, true, false, 2, true},
                        Case{13, 256, 2048, 0, 0, true, 0, 3, 0, true, true, 1, true},
                        Case{7, 384, 1152, 0, 0, false, 0, 5, 3, true, false, 1, false, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    expect_exact(c, rng);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmStreamExact,
    ::testing::Values(Case{1, 9856, 6144, 0, 0, false},         // decode, fused width (N_wgmma 16)
                      Case{4, 9856, 6144, 0, 0, false},         // N_wgmma 32
                      Case{16, 9856, 6144, 0, 0, false},        // N_wgmma 128
                      Case{3, 640, 6144, 8, 16, true},          // odd M, unaligned, row-major sa
                      Case{9, 6144, 8192, 0, 0, false},         // o_proj shape
                      Case{16, 256, 8192, 24, 16, true},        // largest K at M 16: 5-stage ring
                      Case{13, 384, 1152, 0, 0, false},         // 9 K blocks: runs of 8 and 1
                      Case{8, 128, 128, 0, 0, false},           // one K block
                      Case{5, 256, 384, 0, 0, false, 8, 7},     // 7 CTAs: split groups
                      Case{16, 640, 6144, 0, 16, false, 8, 5},  // 5 CTAs
                      Case{16, 128, 4096, 0, 16, false, 8, 100},  // each group over 4 CTAs
                      // Runs of 16 K blocks (M <= 8).
                      Case{1, 9856, 6144, 0, 0, false, 16},      // N_wgmma 16
                      Case{2, 1280, 2048, 16, 0, true, 16, 3},   // N_wgmma 32, 3 CTAs
                      Case{4, 2048, 6144, 0, 0, false, 16},      // N_wgmma 64
                      Case{7, 1280, 6144, 0, 0, true, 16},       // N_wgmma 128
                      Case{3, 256, 2304, 0, 0, false, 16, 5},    // 18 K blocks: 16 and 2
                      Case{11, 2048, 6144, 0, 0, false},         //
                      Case{1, 640, 2048, 0, 0, false, 0, 0, 2},  // two-stage ring
                      Case{12, 1280, 6144, 8, 0, false, 0, 0, 3},
                      Case{1, 9856, 6144, 0, 0, false, 0, 0, 0, false},  // no evict-first hint
                      Case{14, 640, 1024, 0, 16, true, 0, 0, 0, false},
                      // Programmatic launch (weights of the first ring before the wait).
                      Case{1, 9856, 6144, 0, 0, false, 0, 0, 0, true, true},
                      Case{16, 640, 1024, 0, 16, true, 8, 9, 3, true, true},
                      Case{6, 128, 128, 0, 0, false, 16, 0, 0, true, true},
                      // Several CTAs per SM (smaller rings; M > 8 falls back to one).
                      Case{1, 9856, 6144, 0, 0, false, 0, 0, 0, true, false, 2},
                      Case{4, 640, 6144, 8, 16, true, 0, 0, 0, true, false, 3},
                      Case{8, 1280, 2048, 0, 0, false, 0, 0, 0, true, true, 2},
                      Case{2, 9856, 6144, 0, 0, false, 16, 0, 0, true, false, 2},
                      Case{16, 640, 1024, 0, 0, false, 0, 0, 0, true, false, 2},
                      // Weights by cp.async (16 bytes per lane) instead of bulk copies.
                      Case{1, 9856, 6144, 0, 0, false, 0, 0, 0, true, false, 1, true},
                      Case{16, 9856, 6144, 0, 0, false, 0, 0, 0, true, false, 1, true},
                      Case{5, 640, 1152, 8, 16, true, 0, 7, 3, false, false, 1, true},
                      Case{3, 256, 2304, 0, 0, false, 16, 5, 0, true, true, 2, true},
                      Case{8, 1280, 6144, 0, 0, false, 0, 0, 0, true, true, 2, true},
                      // One unit per wgmma wait (the pairs are the default where they fit).
                      Case{1, 9856, 6144, 0, 0, false, 0, 0, 0, true, false, 1, false, false},
                      Case{6, 640, 1152, 8, 16, true, 16, 7, 3, true, true, 2, false, false}));

struct RandomCase {
  int64_t m, n, k;
};

class GemmStreamRandom : public ::testing::TestWithParam<RandomCase> {};

TEST_P(GemmStreamRandom, WithinAccumulationBoundOfTwin) {
  M3_REQUIRE_STREAM_GEMM();
  const RandomCase c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "M " << c.m << " N " << c.n << " K " << c.k);
  Rng rng(seed);
  GemmData d = make_random_data(c.m, c.n, c.k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  const std::vector<double> s = abs_sums(d);
  DeviceGemm dev(d, c.n);
  Case cc{c.m, c.n, c.k, 0, 0, false};
  const std::vector<uint16_t> got = run_twice(dev, cc);
  expect_within_bound("streaming kernel vs twin", got, ref, s, d, std::ldexp(1.0, -10), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmStreamRandom,
                         ::testing::Values(RandomCase{1, 9856, 6144}, RandomCase{16, 2048, 6144},
                                           RandomCase{5, 640, 6144}, RandomCase{12, 256, 8192}));

// Captured once, replayed with new activations and scales written into the same buffers: equals
// an eager run on the new inputs byte for byte (and the twin: integer inputs).
TEST(GemmStreamGraph, ReplayWithNewInputEqualsEager) {
  M3_REQUIRE_STREAM_GEMM();
  for (int64_t rows : {1, 16}) {
    for (bool pdl : {false, true}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " pdl " << pdl);
      Rng rng(seed);
      const int64_t n = 1280, k = 6144;
      GemmData d1 = make_integer_data(rows, n, k, rng);
      GemmData d2 = make_integer_data(rows, n, k, rng);
      d2.b = d1.b;
      d2.sb = d1.sb;
      const std::vector<uint16_t> ref2 = cpu_gemm(d2);
      DeviceGemm dev(d1, n);
      DeviceBuffer ws = make_workspace(n);
      GemmStreamOptions o;
      o.programmatic_launch = pdl;
      cudaStream_t stream;
      M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status st = run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), stream, o);
      M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
      ASSERT_TRUE(st.ok()) << st.to_string();
      M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      // New inputs into the captured buffers (same layout as DeviceGemm's constructor).
      dev.a.upload(d2.a.data(), d2.a.size(), dev.shift);
      dev.sa.upload(d2.sa.data(), d2.sa.size() * 4);
      M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      int64_t touched = 0;
      const std::vector<uint16_t> replay = dev.result(&touched);
      EXPECT_EQ(touched, 0);
      dev.out.poison(kPoison);
      ASSERT_TRUE(run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), stream, o).ok());
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> eager = dev.result(&touched);
      EXPECT_EQ(replay, eager) << "graph replay differs from the eager run";
      std::string report;
      EXPECT_EQ(count_bit_mismatches(replay, ref2, n, &report), 0) << report;
      EXPECT_EQ(nonzero_counters(ws, n), 0);
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

// Two GEMMs back to back, both with programmatic launch and trigger_dependents, writing the same
// output from different activations on one workspace: the second may start while the first
// finishes but writes only after it, so the output is the second's, bit for bit (eager and as a
// graph replay), and the shared arrival counters end at zero. Small grids force fixups.
TEST(GemmStreamGraph, TriggeredChainWritesTheLastGemm) {
  M3_REQUIRE_STREAM_GEMM();
  for (int64_t rows : {1, 16}) {
    for (int grid : {0, 37}) {
      const uint64_t seed = fresh_seed();
      M3_SEED_TRACE(seed);
      SCOPED_TRACE(::testing::Message() << "rows " << rows << " grid " << grid);
      Rng rng(seed);
      const int64_t n = 1280, k = 2048;
      GemmData d1 = make_integer_data(rows, n, k, rng);
      GemmData d2 = make_integer_data(rows, n, k, rng);
      GemmData mixed = d1;  // the second call: d2's activations, d1's weights
      mixed.a = d2.a;
      mixed.sa = d2.sa;
      const std::vector<uint16_t> ref = cpu_gemm(mixed);
      DeviceGemm g1(d1, n), g2(d2, n);
      GemmParams p1 = g1.params(), p2 = g1.params();
      p2.a = g2.params().a;
      p2.a_scales = g2.params().a_scales;
      GemmStreamOptions o;
      o.programmatic_launch = true;
      o.trigger_dependents = true;
      o.chunk_blocks = 8;
      o.grid = grid;
      DeviceBuffer ws = make_workspace(n, grid);
      cudaStream_t stream;
      M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      auto chain = [&] {
        EXPECT_TRUE(run_gemm_stream_cuda(p1, ws.data(), ws.bytes(), stream, o).ok());
        EXPECT_TRUE(run_gemm_stream_cuda(p2, ws.data(), ws.bytes(), stream, o).ok());
      };
      for (int pass = 0; pass < 2; ++pass) {
        g1.out.poison(kPoison);
        if (pass == 0) {
          chain();
        } else {
          cudaGraph_t graph;
          cudaGraphExec_t exec;
          M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          chain();
          M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
          M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
          M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
          M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
        }
        M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
        int64_t touched = 0;
        const std::vector<uint16_t> got = g1.result(&touched);
        std::string report;
        EXPECT_EQ(count_bit_mismatches(got, ref, n, &report), 0) << "pass " << pass << report;
        EXPECT_EQ(touched, 0);
        EXPECT_EQ(nonzero_counters(ws, n), 0);
      }
      cudaStreamDestroy(stream);
    }
  }
}

Fp8BlockGemmOptions stream_options() {
  Fp8BlockGemmOptions o;
  o.stream_max_m = 16;
  o.wgmma_max_m = 0;
  o.autotune = false;
  return o;
}

// Through Fp8BlockGemm (stream_max_m = 16): quantize + GEMM captured once and replayed with a new
// x equals eager runs byte for byte, with and without programmatic launch (the PDL object must
// also equal a plain launch after a full synchronization).
TEST(GemmStreamGraph, Fp8BlockGemmReplayEqualsEager) {
  M3_REQUIRE_STREAM_GEMM();
  for (int64_t rows : {1, 16}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    SCOPED_TRACE(::testing::Message() << "rows " << rows);
    Rng rng(seed);
    expect_graph_replay_equals_eager(rows, 16, stream_options(), rng);
    Fp8BlockGemmOptions pdl = stream_options();
    pdl.stream.programmatic_launch = true;
    const Fp8BlockGemmOptions plain = stream_options();
    expect_graph_replay_equals_eager(rows, 16, pdl, rng, &plain);
  }
}

// The fused projection equals the unfused pair bit for bit on integer inputs (N = 9856 and the
// pair 9216 + 640 split their units differently over the CTAs), and the streaming kernel agrees
// with cuBLASLt on random inputs within two device accumulations' bound.
TEST(GemmStreamFused, IntegerInputsFusedEqualsUnfusedBitForBit) {
  M3_REQUIRE_STREAM_GEMM();
  for (int64_t m : {4, 16}) {
    const uint64_t seed = fresh_seed();
    M3_SEED_TRACE(seed);
    Rng rng(seed);
    const GemmData d = make_integer_data(m, kNF, kHidden, rng);
    const FusedRun r = run_fused_and_unfused(d, stream_options());
    ASSERT_EQ(r.fused.size(), static_cast<size_t>(m * kNF));
    std::string report;
    EXPECT_EQ(count_bit_mismatches(r.fused, r.unfused, kNF, &report), 0) << report;
    EXPECT_EQ(r.touched, 0);
  }
}

TEST(GemmStreamFused, AgreesWithCublasLt) {
  M3_REQUIRE_STREAM_GEMM();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  expect_agrees_with_cublaslt("streaming kernel", 8, 16, stream_options(), rng);
  expect_agrees_with_cublaslt("streaming kernel", 16, 16, stream_options(), rng);
}

// One call of `gemm` on fresh integer operands [m, n, k]: bit-identical to the twin, nothing
// outside the output written.
void expect_object_exact(Fp8BlockGemm& gemm, int64_t m, int64_t n, int64_t k, Rng& rng) {
  GemmData d = make_integer_data(m, n, k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  DeviceGemm dev(d, n);
  const Status st = gemm.run(dev.params(), nullptr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> got = dev.result(&touched);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, n, &report), 0) << report;
  EXPECT_EQ(touched, 0);
}

// An object whose K leaves no room for the activations at M = 16 still serves every M: the calls
// the streaming kernel refuses (kUnsupported) run on cuBLASLt, the others on the kernel; both
// exact on integer inputs.
TEST(GemmStreamFused, UnsupportedCallsFallBackToCublasLt) {
  M3_REQUIRE_STREAM_GEMM();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t n = 256, k = 16384;
  auto gemm = make_gemm(16, n, k, stream_options());
  ASSERT_NE(gemm, nullptr);
  EXPECT_NE(gemm->algorithm_for(4).find("streaming"), std::string::npos);
  for (int64_t m : {4, 16}) {
    SCOPED_TRACE(::testing::Message() << "M " << m);
    expect_object_exact(*gemm, m, n, k, rng);
  }
  Fp8BlockGemmOptions bad = stream_options();
  bad.stream_max_m = 17;
  EXPECT_EQ(Fp8BlockGemm::create(16, n, k, bad).status().code(), StatusCode::kInvalidArgument);
}

// Auto mode (autotuning on, stream_auto_max_m = 16): the autotuner times the streaming kernel for
// the buckets up to 16 (describe() names it) and whatever it chooses per bucket is exact on
// integer inputs at every M up to 20 (the bucket above the auto range stays on cuBLASLt).
TEST(GemmStreamFused, AutotunedChoiceIsExact) {
  M3_REQUIRE_STREAM_GEMM();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int64_t n = 1280, k = 6144;
  const char* old = std::getenv("M3ATTN_GEMM_PATH");  // the auto mode needs it unset
  const std::string saved = old ? old : "";
  unsetenv("M3ATTN_GEMM_PATH");
  Fp8BlockGemmOptions o;
  o.stream_auto_max_m = 16;
  o.autotune_budget_ms = 500;
  auto gemm = make_gemm(20, n, k, o);
  if (old) setenv("M3ATTN_GEMM_PATH", saved.c_str(), 1);
  ASSERT_NE(gemm, nullptr);
  const std::string d = gemm->describe();
  EXPECT_NE(d.find("stream chunk"), std::string::npos) << d;
  std::printf("%s", d.c_str());
  for (int64_t m : {4, 8, 12, 16, 20}) {
    SCOPED_TRACE(::testing::Message() << "M " << m << ": " << gemm->algorithm_for(m));
    expect_object_exact(*gemm, m, n, k, rng);
  }
  EXPECT_EQ(gemm->algorithm_for(20).find("streaming"), std::string::npos);
}

TEST(GemmStreamRules, RejectedCallsWriteNothing) {
  M3_REQUIRE_STREAM_GEMM();
  Rng rng(fresh_seed());
  GemmData d = make_integer_data(17, 256, 512, rng);  // one row too many
  DeviceGemm dev(d, 256);
  DeviceBuffer ws = make_workspace(256);
  EXPECT_EQ(run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kUnsupported);
  GemmParams p = dev.params();
  p.a.shape[0] = p.a_scales.shape[0] = p.out.shape[0] = 16;  // a valid 16-row call from here on
  EXPECT_TRUE(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr).ok());
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  dev.out.poison(kPoison);
  GemmParams cpu = p;
  cpu.a.device = cpu.a_scales.device = cpu.b.device = cpu.b_scales.device = cpu.out.device =
      Device::cpu();
  EXPECT_EQ(run_gemm_stream_cuda(cpu, ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  GemmParams bad_shape = p;
  bad_shape.a_scales.shape[0] = 15;
  EXPECT_EQ(run_gemm_stream_cuda(bad_shape, ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  // Workspace too small, null, or misaligned.
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), 64, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(run_gemm_stream_cuda(p, nullptr, ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(run_gemm_stream_cuda(p, static_cast<uint8_t*>(ws.data()) + 16, ws.bytes() - 16, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  // A grid larger than the workspace was sized for.
  DeviceBuffer one_cta_ws = make_workspace(256, 1);
  GemmStreamOptions two;
  two.grid = 2;
  EXPECT_EQ(run_gemm_stream_cuda(p, one_cta_ws.data(), one_cta_ws.bytes(), nullptr, two).code(),
            StatusCode::kInvalidArgument);
  // Bad options.
  GemmStreamOptions o;
  o.chunk_blocks = 4;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kInvalidArgument);
  o.chunk_blocks = 32;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kInvalidArgument);
  o.chunk_blocks = 16;  // runs of 16 K blocks serve M <= 8
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kUnsupported);
  o = GemmStreamOptions{};
  o.ctas_per_sm = 5;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kInvalidArgument);
  o.ctas_per_sm = 0;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kInvalidArgument);
  o = GemmStreamOptions{};
  o.chunk_blocks = 16;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kUnsupported);
  o = GemmStreamOptions{};
  o.grid = -1;
  EXPECT_EQ(run_gemm_stream_cuda(p, ws.data(), ws.bytes(), nullptr, o).code(),
            StatusCode::kInvalidArgument);
  // A rows only 8-byte aligned (validate_gemm wants 16, as the bulk copies do).
  GemmParams odd = p;
  odd.a.data = static_cast<uint8_t*>(odd.a.data) + 8;
  odd.a.shape[1] = odd.b.shape[1] = 384;  // stays inside the allocation
  odd.a_scales.shape[1] = odd.b_scales.shape[1] = 3;
  EXPECT_EQ(run_gemm_stream_cuda(odd, ws.data(), ws.bytes(), nullptr).code(),
            StatusCode::kInvalidArgument);
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> out = dev.result(&touched);
  for (size_t i = 0; i < static_cast<size_t>(16 * 256); ++i) ASSERT_EQ(out[i], 0xA5A5) << i;
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(gemm_stream_workspace_bytes(100, 1).status().code(), StatusCode::kInvalidArgument);
}

// K too large for the activations in shared memory at M = 16 (16 x 16384 bytes): unsupported, the
// output untouched; at M = 8 the same K fits (half the rows) and runs exactly.
TEST(GemmStreamRules, ActivationsMustFitInSharedMemory) {
  M3_REQUIRE_STREAM_GEMM();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  {
    GemmData d = make_integer_data(16, 128, 16384, rng);
    DeviceGemm dev(d, 128);
    DeviceBuffer ws = make_workspace(128);
    EXPECT_EQ(run_gemm_stream_cuda(dev.params(), ws.data(), ws.bytes(), nullptr).code(),
              StatusCode::kUnsupported);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    int64_t touched = 0;
    for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5);
    EXPECT_EQ(touched, 0);
  }
  {
    GemmData d = make_integer_data(8, 256, 16384, rng);
    const std::vector<uint16_t> ref = cpu_gemm(d);
    DeviceGemm dev(d, 256);
    Case c{8, 256, 16384, 0, 0, false};
    const std::vector<uint16_t> got = run_twice(dev, c);
    std::string report;
    EXPECT_EQ(count_bit_mismatches(got, ref, 256, &report), 0) << report;
  }
}

}  // namespace
}  // namespace m3attn
