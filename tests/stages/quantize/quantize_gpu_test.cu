// GPU activation quantization (run_quantize_cuda) against the CPU twin: E4M3 codes and fp32 scales
// byte-identical (NaN codes: both NaN, sign free), padding rows q = 0 / scale = 1, every scale
// layout, guard bytes untouched, rejected calls write nothing, CUDA-graph replay equals eager, a
// programmatic launch waits for the kernel before it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "core/pdl.cuh"
#include "stages/quantize/quantize.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::DeviceBuffer;
using testing::fresh_seed;
using testing::Rng;

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 256;  // bytes before and after every output region

enum class ScaleLayout { kTokenMajor, kRowMajor, kGappedTokenMajor };

const char* layout_name(ScaleLayout l) {
  switch (l) {
    case ScaleLayout::kTokenMajor:
      return "token-major (1, M_pad)";
    case ScaleLayout::kRowMajor:
      return "row-major (K/128, 1)";
    case ScaleLayout::kGappedTokenMajor:
      return "gapped (1, M_pad + 4)";
  }
  return "?";
}

struct ScaleGeometry {
  int64_t s0 = 0, s1 = 0, span = 0;  // span: elements from the first to one past the last
};

ScaleGeometry scale_geometry(ScaleLayout l, int64_t m_pad, int64_t kb) {
  ScaleGeometry g;
  switch (l) {
    case ScaleLayout::kTokenMajor:
      g.s0 = 1;
      g.s1 = m_pad > 0 ? m_pad : 1;  // strides stay positive for an empty call
      break;
    case ScaleLayout::kRowMajor:
      g.s0 = kb > 0 ? kb : 1;
      g.s1 = 1;
      break;
    case ScaleLayout::kGappedTokenMajor:
      g.s0 = 1;
      g.s1 = m_pad + 4;
      break;
  }
  g.span = (m_pad == 0 || kb == 0) ? 0 : (m_pad - 1) * g.s0 + (kb - 1) * g.s1 + 1;
  return g;
}

// One quantize problem: host input, host twin outputs and guarded device buffers.
struct Problem {
  int64_t rows, m_pad, k, in_stride;
  ScaleGeometry sg;
  std::vector<uint16_t> in;  // bf16 [rows, in_stride]
  DeviceBuffer d_in, d_out, d_scales;

  Problem(int64_t rows_, int64_t m_pad_, int64_t k_, int64_t stride_pad, ScaleLayout layout)
      : rows(rows_),
        m_pad(m_pad_),
        k(k_),
        in_stride(k_ + stride_pad),
        sg(scale_geometry(layout, m_pad_, k_ / 128)),
        in(static_cast<size_t>(rows_ * (k_ + stride_pad)), 0),
        d_in(static_cast<size_t>(rows_ * (k_ + stride_pad)) * 2 + 16),
        d_out(static_cast<size_t>(m_pad_ * k_) + 2 * kGuard, kPoison),
        d_scales(static_cast<size_t>(sg.span) * 4 + 2 * kGuard, kPoison) {}

  QuantizeParams host_params(std::vector<uint8_t>& out, std::vector<float>& scales) {
    out.assign(static_cast<size_t>(m_pad * k), kPoison);
    scales.resize(static_cast<size_t>(sg.span));
    if (!scales.empty()) std::memset(scales.data(), kPoison, scales.size() * 4);
    QuantizeParams p;
    p.rows = rows;
    p.in = TensorView::strided(in.data(), DType::kBF16, {rows, k}, {in_stride, 1});
    p.out = TensorView::contiguous(out.data(), DType::kE4M3, {m_pad, k});
    p.scales = TensorView::strided(scales.data(), DType::kF32, {m_pad, k / 128}, {sg.s0, sg.s1});
    return p;
  }

  QuantizeParams device_params() {
    QuantizeParams p;
    p.rows = rows;
    p.in =
        TensorView::strided(d_in.data(), DType::kBF16, {rows, k}, {in_stride, 1}, Device::cuda(0));
    p.out = TensorView::contiguous(static_cast<uint8_t*>(d_out.data()) + kGuard, DType::kE4M3,
                                   {m_pad, k}, Device::cuda(0));
    p.scales = TensorView::strided(static_cast<uint8_t*>(d_scales.data()) + kGuard, DType::kF32,
                                   {m_pad, k / 128}, {sg.s0, sg.s1}, Device::cuda(0));
    return p;
  }

  void upload() { d_in.upload(in.data(), in.size() * 2); }
};

// Random bf16 rows whose magnitudes span many binades, with zero rows, zero blocks and the
// occasional lone large value (so that most of a block lands in the E4M3 subnormal range).
void fill_input(Problem& pb, Rng& rng) {
  for (int64_t r = 0; r < pb.rows; ++r) {
    uint16_t* row = pb.in.data() + r * pb.in_stride;
    for (int64_t c = pb.k; c < pb.in_stride; ++c) row[c] = 0x7fc1;  // NaN in the stride gap
    if (r % 7 == 3) continue;                                       // an all-zero row
    const float stddev = std::pow(10.0f, rng.uniform(-6.0f, 6.0f));
    for (int64_t c = 0; c < pb.k; ++c) row[c] = float_to_bf16(rng.normal(0.0f, stddev));
    const int64_t kb = rng.integer(0, pb.k / 128 - 1);
    if (r % 3 == 1) {  // one zero block
      for (int64_t c = kb * 128; c < (kb + 1) * 128; ++c) row[c] = 0;
    } else if (r % 5 == 2) {  // one spike dominating its block
      row[kb * 128 + rng.integer(0, 127)] = float_to_bf16(stddev * 1000.0f);
    }
  }
}

struct Mismatch {
  int64_t codes = 0, scales = 0, guards = 0;
  std::string report;
};

// Device outputs against the twin: codes byte-equal (NaN codes only need to be NaN on both sides),
// scales bit-equal, gaps between scales and the guards still poisoned.
Mismatch compare(const Problem& pb, const std::vector<uint8_t>& out,
                 const std::vector<float>& scales) {
  Mismatch mm;
  std::string report;
  const std::vector<uint8_t> d_out = pb.d_out.download_all();
  const std::vector<uint8_t> d_sc = pb.d_scales.download_all();
  for (size_t i = 0; i < kGuard; ++i) {
    mm.guards += d_out[i] != kPoison;
    mm.guards += d_out[d_out.size() - 1 - i] != kPoison;
    mm.guards += d_sc[i] != kPoison;
    mm.guards += d_sc[d_sc.size() - 1 - i] != kPoison;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t g = d_out[kGuard + i], c = out[i];
    const bool same = g == c || (e4m3_is_nan(g) && e4m3_is_nan(c));
    if (!same) {
      if (mm.codes < 6)
        report += "  code[row " + std::to_string(i / pb.k) + ", col " + std::to_string(i % pb.k) +
                  "] gpu " + std::to_string(g) + " cpu " + std::to_string(c) + "\n";
      ++mm.codes;
    }
  }
  // Scales compared as raw bytes over the whole span (gaps must stay poisoned on both sides).
  const uint8_t* c_bytes = reinterpret_cast<const uint8_t*>(scales.data());
  for (size_t i = 0; i < scales.size() * 4; ++i) {
    if (d_sc[kGuard + i] != c_bytes[i]) {
      if (mm.scales < 6) {
        float gs, cs;
        std::memcpy(&gs, &d_sc[kGuard + i / 4 * 4], 4);
        std::memcpy(&cs, &c_bytes[i / 4 * 4], 4);
        report += "  scale slot " + std::to_string(i / 4) + " gpu " + std::to_string(gs) + " cpu " +
                  std::to_string(cs) + "\n";
      }
      ++mm.scales;
    }
  }
  mm.report = report;
  return mm;
}

struct Case {
  int64_t rows, m_pad, k, stride_pad;
  ScaleLayout layout;
};

class QuantizeGpu : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizeGpu, MatchesCpuTwinByteForByte) {
  M3_REQUIRE_GPU();
  const Case c = GetParam();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " m_pad " << c.m_pad << " K " << c.k
                                    << " scales " << layout_name(c.layout));
  Rng rng(seed);
  Problem pb(c.rows, c.m_pad, c.k, c.stride_pad, c.layout);
  fill_input(pb, rng);
  pb.upload();

  std::vector<uint8_t> out;
  std::vector<float> scales;
  ASSERT_TRUE(run_quantize_cpu(pb.host_params(out, scales)).ok());
  const Status st = run_quantize_cuda(pb.device_params(), nullptr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());

  const Mismatch mm = compare(pb, out, scales);
  EXPECT_EQ(mm.codes, 0) << mm.report;
  EXPECT_EQ(mm.scales, 0) << mm.report;
  EXPECT_EQ(mm.guards, 0) << "bytes outside the outputs were written";

  // Padding rows: q = 0, scale = 1 (checked on the device result directly as well).
  const std::vector<uint8_t> d_out = pb.d_out.download_all();
  const std::vector<uint8_t> d_sc = pb.d_scales.download_all();
  for (int64_t m = c.rows; m < c.m_pad; ++m) {
    for (int64_t i = 0; i < c.k; ++i) ASSERT_EQ(d_out[kGuard + m * c.k + i], 0) << "row " << m;
    for (int64_t kb = 0; kb < c.k / 128; ++kb) {
      float s;
      std::memcpy(&s, &d_sc[kGuard + 4 * (m * pb.sg.s0 + kb * pb.sg.s1)], 4);
      ASSERT_EQ(s, 1.0f) << "row " << m << " block " << kb;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantizeGpu,
    ::testing::Values(Case{1, 4, 6144, 0, ScaleLayout::kTokenMajor},  // decode: M = 1 padded
                      Case{3, 4, 6144, 8, ScaleLayout::kTokenMajor},
                      Case{5, 8, 6144, 0, ScaleLayout::kRowMajor},
                      Case{13, 16, 384, 24, ScaleLayout::kGappedTokenMajor},
                      Case{130, 132, 6144, 0, ScaleLayout::kTokenMajor},
                      Case{127, 127, 128, 0, ScaleLayout::kRowMajor},  // no padding rows
                      Case{0, 4, 512, 0, ScaleLayout::kTokenMajor},    // padding only
                      Case{1029, 1032, 8192, 64, ScaleLayout::kTokenMajor},
                      Case{70, 76, 1152, 0, ScaleLayout::kGappedTokenMajor}));

// Infinities, NaNs, bf16 subnormals, the largest bf16 and E4M3 rounding ties.
TEST(QuantizeGpuSpecial, SpecialValuesMatchTwin) {
  M3_REQUIRE_GPU();
  const int64_t k = 256;
  Problem pb(8, 8, k, 0, ScaleLayout::kTokenMajor);
  auto row = [&](int64_t r) { return pb.in.data() + r * pb.in_stride; };
  for (int64_t i = 0; i < k; ++i) {
    row(0)[i] = float_to_bf16(static_cast<float>(i) - 100.0f);
    row(1)[i] = static_cast<uint16_t>(1 + (i % 127));             // positive bf16 subnormals
    row(2)[i] = static_cast<uint16_t>(0x8000 | (1 + (i % 127)));  // negative subnormals
    row(3)[i] = float_to_bf16(std::ldexp(1.0f, static_cast<int>(i % 40) - 20));
    row(4)[i] = 0;
    row(5)[i] = float_to_bf16(static_cast<float>(i % 9) * 0.0625f);
    row(6)[i] = float_to_bf16(1.0f);
    row(7)[i] = float_to_bf16(static_cast<float>(i));
  }
  row(0)[5] = 0x7f80;    // +inf: block 0 gets scale inf, its finite values NaN-free zeros
  row(0)[200] = 0xff80;  // -inf in block 1
  row(3)[17] = 0x7fc0;   // NaN: never the amax, becomes a NaN code
  row(4)[130] = 0xffc0;  // NaN in an otherwise zero block: scale 1
  row(5)[3] = 0x7f7f;    // the largest finite bf16
  row(6)[250] = 0x0001;  // a subnormal next to ones
  row(7)[0] = float_to_bf16(448.0f * 3.0f);
  pb.upload();

  std::vector<uint8_t> out;
  std::vector<float> scales;
  ASSERT_TRUE(run_quantize_cpu(pb.host_params(out, scales)).ok());
  const Status st = run_quantize_cuda(pb.device_params(), nullptr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  const Mismatch mm = compare(pb, out, scales);
  EXPECT_EQ(mm.codes, 0) << mm.report;
  EXPECT_EQ(mm.scales, 0) << mm.report;
  EXPECT_EQ(mm.guards, 0);
  // The NaN input of row 3 must be a NaN code on the device too (compare() accepts NaN == NaN).
  const std::vector<uint8_t> d_out = pb.d_out.download_all();
  EXPECT_TRUE(e4m3_is_nan(d_out[kGuard + 3 * k + 17]));
  EXPECT_TRUE(e4m3_is_nan(d_out[kGuard + 4 * k + 130]));
}

TEST(QuantizeGpuSpecial, EmptyCallLaunchesNothing) {
  M3_REQUIRE_GPU();
  Problem pb(0, 0, 256, 0, ScaleLayout::kTokenMajor);
  const Status st = run_quantize_cuda(pb.device_params(), nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> d_out = pb.d_out.download_all();
  for (uint8_t b : d_out) ASSERT_EQ(b, kPoison);
}

// A rejected call must leave every byte as it was.
TEST(QuantizeGpuSpecial, RejectedCallsWriteNothing) {
  M3_REQUIRE_GPU();
  Problem pb(4, 4, 256, 0, ScaleLayout::kTokenMajor);
  {
    QuantizeParams p = pb.device_params();
    p.in.device = Device::cpu();  // mixed devices
    EXPECT_FALSE(run_quantize_cuda(p, nullptr).ok());
  }
  {
    QuantizeParams p = pb.device_params();
    p.in.device = Device::cpu();
    p.out.device = Device::cpu();
    p.scales.device = Device::cpu();  // all on the CPU: the CUDA launcher must refuse
    const Status st = run_quantize_cuda(p, nullptr);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("CUDA"), std::string::npos) << st.message();
  }
  {
    QuantizeParams p = pb.device_params();
    p.out.shape[0] = 3;  // fewer output rows than input rows
    EXPECT_FALSE(run_quantize_cuda(p, nullptr).ok());
  }
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  for (uint8_t b : pb.d_out.download_all()) ASSERT_EQ(b, kPoison);
  for (uint8_t b : pb.d_scales.download_all()) ASSERT_EQ(b, kPoison);
}

// Capture once, replay with new input written into the same buffer: equals an eager run.
TEST(QuantizeGpuSpecial, GraphReplayWithNewInputEqualsEager) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Problem pb(3, 4, 6144, 0, ScaleLayout::kTokenMajor);
  fill_input(pb, rng);
  pb.upload();

  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Eager warm-up outside the capture (the kernel's module may be loaded lazily).
  ASSERT_TRUE(run_quantize_cuda(pb.device_params(), stream).ok());
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  pb.d_out.poison(kPoison);
  pb.d_scales.poison(kPoison);
  // The uploads and poisons run on the legacy stream, which a non-blocking stream does not wait
  // for (and a pageable upload may return before its copy lands): finish them first.
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status cap = run_quantize_cuda(pb.device_params(), stream);
  M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(cap.ok()) << cap.to_string();
  M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> first = pb.d_out.download_all();

  fill_input(pb, rng);  // new values, same buffer
  pb.upload();
  pb.d_out.poison(kPoison);
  pb.d_scales.poison(kPoison);
  // The uploads and poisons run on the legacy stream, which a non-blocking stream does not wait
  // for (and a pageable upload may return before its copy lands): finish them first.
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> replay_out = pb.d_out.download_all();
  const std::vector<uint8_t> replay_sc = pb.d_scales.download_all();
  EXPECT_NE(first, replay_out) << "the replay did not see the new input";

  pb.d_out.poison(kPoison);
  pb.d_scales.poison(kPoison);
  // The uploads and poisons run on the legacy stream, which a non-blocking stream does not wait
  // for (and a pageable upload may return before its copy lands): finish them first.
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  ASSERT_TRUE(run_quantize_cuda(pb.device_params(), stream).ok());
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(replay_out, pb.d_out.download_all());
  EXPECT_EQ(replay_sc, pb.d_scales.download_all());

  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Writes `in` into `out` after spinning ~spin_cycles, having let its programmatic dependents
// launch at once: a dependent that read before its griddepcontrol.wait would see stale input.
__global__ void delayed_copy_kernel(const uint8_t* in, uint8_t* out, int64_t n,
                                    long long spin_cycles) {
  pdl_launch_dependents();
  const long long t0 = clock64();
  while (clock64() - t0 < spin_cycles) {
  }
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = in[i];
}

// A programmatic launch behind a kernel that writes the input late: still the twin's bytes.
TEST(QuantizeGpuSpecial, ProgrammaticLaunchWaitsForThePrecedingKernel) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Problem pb(130, 132, 6144, 8, ScaleLayout::kTokenMajor);
  fill_input(pb, rng);
  DeviceBuffer staging(pb.d_in.bytes());
  staging.upload(pb.in.data(), pb.in.size() * 2);
  pb.d_in.poison(0x7f);  // bf16 0x7f7f: large finite values, wrong codes if read early
  std::vector<uint8_t> out;
  std::vector<float> scales;
  ASSERT_TRUE(run_quantize_cpu(pb.host_params(out, scales)).ok());
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());  // uploads / poisons (legacy stream) first
  for (int graph = 0; graph < 2; ++graph) {
    SCOPED_TRACE(graph ? "graph replay" : "eager");
    pb.d_in.poison(0x7f);
    pb.d_out.poison(kPoison);
    pb.d_scales.poison(kPoison);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    auto launch = [&](cudaStream_t s) {
      delayed_copy_kernel<<<64, 256, 0, s>>>(static_cast<const uint8_t*>(staging.data()),
                                             static_cast<uint8_t*>(pb.d_in.data()),
                                             static_cast<int64_t>(pb.in.size() * 2), 2000000);
      return run_quantize_cuda(pb.device_params(), s, /*programmatic=*/true);
    };
    if (graph) {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      const Status st = launch(stream);
      M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &g));
      ASSERT_TRUE(st.ok()) << st.to_string();
      M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, g, 0));
      M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(g);
    } else {
      const Status st = launch(stream);
      ASSERT_TRUE(st.ok()) << st.to_string();
      M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    }
    const Mismatch mm = compare(pb, out, scales);
    EXPECT_EQ(mm.codes, 0) << mm.report;
    EXPECT_EQ(mm.scales, 0) << mm.report;
    EXPECT_EQ(mm.guards, 0);
  }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace m3attn
