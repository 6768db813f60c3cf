// Shared helpers of the block-scaled GEMM GPU tests (gemm_gpu_test.cu, gemm_small_m_gpu_test.cu):
// host operands, the CPU twin, the accumulation bound and guarded device copies.
// Numerics and tolerances:
//  - Integer-valued E4M3 inputs in [-3, 3] with power-of-two scales in {1/2, 1, 2}: every 128-wide
//    partial dot product is an integer of magnitude <= 128 * 9 = 1152 < 2^11, exact even in the
//    Hopper tensor core's reduced-precision accumulator (~14 significant bits); every scaled term
//    is a multiple of 1/4 and the whole sum stays below K / 128 * 1152 * 4 < 2^19 (K <= 8192), so
//    the fp32 accumulation is exact in any order and both sides round the same exact value to bf16:
//    the outputs must be bit-identical.
//  - Random inputs: the twin forms exact per-block dot products and accumulates in fp32; the
//    device accumulates each 128-wide block in the tensor core (about 14 significant bits kept per
//    addition, so per block at most ~4 * 2^-13 of the block's sum of |products| across its four
//    k = 32 steps) and then in fp32. With S(m, n) = sum_k |a b| sa sb:
//      |G_acc - E| <= 2^-11 S,  |C_acc - E| <= K 2^-24 S <= 2^-11.4 S (K <= 6144),
//    and each side then rounds to bf16 (relative error <= 2^-8). Test bound:
//      |gpu - cpu| <= 2^-7 |cpu| + 2^-10 S,
//    which a wrong scale layout, a transposed operand or a missing block violates by orders of
//    magnitude (with random data S / |E| is ~ sqrt(K) ~ 80, so the bound is ~1-2 % of |E|).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/projection.h"
#include "stages/quantize/quantize.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn::gemm_test {

using testing::DeviceBuffer;
using testing::Rng;

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 256;

// Host operands of one GEMM: A [m, k] with token-major scales (m, kb) at m + kb * m, B [n, k] with
// row-major scales [n / 128, kb].
struct GemmData {
  int64_t m = 0, n = 0, k = 0, kb = 0;
  std::vector<uint8_t> a, b;
  std::vector<float> sa, sb;
};

inline GemmData make_integer_data(int64_t m, int64_t n, int64_t k, Rng& rng) {
  GemmData d;
  d.m = m, d.n = n, d.k = k, d.kb = k / 128;
  d.a.resize(static_cast<size_t>(m * k));
  d.b.resize(static_cast<size_t>(n * k));
  d.sa.resize(static_cast<size_t>(m * d.kb));
  d.sb.resize(static_cast<size_t>(n / 128 * d.kb));
  for (auto& v : d.a) v = float_to_e4m3(static_cast<float>(rng.integer(-3, 3)));
  for (auto& v : d.b) v = float_to_e4m3(static_cast<float>(rng.integer(-3, 3)));
  // Distinct per-block scales, so a transposed or shifted scale layout cannot pass.
  for (auto& v : d.sa) v = std::ldexp(1.0f, static_cast<int>(rng.integer(-1, 1)));
  for (auto& v : d.sb) v = std::ldexp(1.0f, static_cast<int>(rng.integer(-1, 1)));
  return d;
}

inline GemmData make_random_data(int64_t m, int64_t n, int64_t k, Rng& rng) {
  GemmData d;
  d.m = m, d.n = n, d.k = k, d.kb = k / 128;
  d.a.resize(static_cast<size_t>(m * k));
  d.b.resize(static_cast<size_t>(n * k));
  d.sa.resize(static_cast<size_t>(m * d.kb));
  d.sb.resize(static_cast<size_t>(n / 128 * d.kb));
  // Quantizer-like codes spanning the whole E4M3 range (saturating at 448).
  for (auto& v : d.a) v = float_to_e4m3(rng.normal(0.0f, 120.0f));
  for (auto& v : d.b) v = float_to_e4m3(rng.normal(0.0f, 120.0f));
  for (auto& v : d.sa) v = std::pow(10.0f, rng.uniform(-4.0f, -1.0f));
  for (auto& v : d.sb) v = std::pow(10.0f, rng.uniform(-4.0f, -2.0f));
  return d;
}

inline GemmParams host_params(GemmData& d, std::vector<uint16_t>& out) {
  out.assign(static_cast<size_t>(d.m * d.n), 0xffff);
  GemmParams p;
  p.a = TensorView::contiguous(d.a.data(), DType::kE4M3, {d.m, d.k});
  p.a_scales = TensorView::strided(d.sa.data(), DType::kF32, {d.m, d.kb}, {1, d.m});
  p.b = TensorView::contiguous(d.b.data(), DType::kE4M3, {d.n, d.k});
  p.b_scales = TensorView::contiguous(d.sb.data(), DType::kF32, {d.n / 128, d.kb});
  p.out = TensorView::contiguous(out.data(), DType::kBF16, {d.m, d.n});
  return p;
}

inline std::vector<uint16_t> cpu_gemm(GemmData& d) {
  std::vector<uint16_t> out;
  const Status st = run_gemm_cpu(host_params(d, out));
  EXPECT_TRUE(st.ok()) << st.to_string();
  return out;
}

// S(m, n) = sum_k |a b| sa sb, in double.
inline std::vector<double> abs_sums(const GemmData& d) {
  std::vector<double> dec(256);
  for (int c = 0; c < 256; ++c) dec[c] = std::fabs(e4m3_to_float(static_cast<uint8_t>(c)));
  std::vector<double> s(static_cast<size_t>(d.m * d.n), 0.0);
  std::vector<double> arow(static_cast<size_t>(d.k));
  for (int64_t m = 0; m < d.m; ++m) {
    for (int64_t i = 0; i < d.k; ++i) arow[i] = dec[d.a[m * d.k + i]];
    for (int64_t n = 0; n < d.n; ++n) {
      const uint8_t* brow = &d.b[n * d.k];
      double total = 0.0;
      for (int64_t kb = 0; kb < d.kb; ++kb) {
        double part = 0.0;
        for (int64_t i = kb * 128; i < (kb + 1) * 128; ++i) part += arow[i] * dec[brow[i]];
        total += part * d.sa[m + kb * d.m] * d.sb[(n / 128) * d.kb + kb];
      }
      s[m * d.n + n] = total;
    }
  }
  return s;
}

// Device copies, with guards around the output and optional misalignment of every operand. The
// weight scales are stored with rows round_up(K / 128, 4) apart, padding slots poisoned.
struct DeviceGemm {
  int64_t m, n, k, kb, kb_row, ld_out;
  size_t shift;       // bytes added to the 256-byte aligned base of A, B and out
  bool sa_row_major;  // activation scales [m, kb] row-major instead of token-major
  DeviceBuffer a, sa, b, sb, out;

  DeviceGemm(const GemmData& d, int64_t ld_out_, size_t shift_ = 0, bool sa_row_major_ = false)
      : m(d.m),
        n(d.n),
        k(d.k),
        kb(d.kb),
        kb_row(gemm_weight_scales_row_stride(d.k)),
        ld_out(ld_out_),
        shift(shift_),
        sa_row_major(sa_row_major_),
        a(d.a.size() + 256),
        sa(d.sa.size() * 4 + 16),
        b(d.b.size() + 256),
        sb(static_cast<size_t>(d.n / 128 * gemm_weight_scales_row_stride(d.k)) * 4 + 16),
        out(2 * kGuard + shift_ + static_cast<size_t>(d.m * ld_out_) * 2, kPoison) {
    a.upload(d.a.data(), d.a.size(), shift);
    if (sa_row_major) {
      std::vector<float> t(d.sa.size());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < kb; ++j) t[i * kb + j] = d.sa[i + j * m];
      sa.upload(t.data(), t.size() * 4);
    } else {
      sa.upload(d.sa.data(), d.sa.size() * 4);
    }
    b.upload(d.b.data(), d.b.size(), shift);
    for (int64_t r = 0; r < n / 128; ++r) sb.upload(&d.sb[r * kb], kb * 4, r * kb_row * 4);
  }

  GemmParams params() const {
    const Device dev = Device::cuda(0);
    GemmParams p;
    p.a =
        TensorView::contiguous(static_cast<uint8_t*>(a.data()) + shift, DType::kE4M3, {m, k}, dev);
    p.a_scales = sa_row_major
                     ? TensorView::contiguous(sa.data(), DType::kF32, {m, kb}, dev)
                     : gemm_activation_scales_view(static_cast<float*>(sa.data()), m, k, dev);
    p.b =
        TensorView::contiguous(static_cast<uint8_t*>(b.data()) + shift, DType::kE4M3, {n, k}, dev);
    p.b_scales = TensorView::strided(sb.data(), DType::kF32, {n / 128, kb}, {kb_row, 1}, dev);
    p.out = TensorView::strided(static_cast<uint8_t*>(out.data()) + kGuard + shift, DType::kBF16,
                                {m, n}, {ld_out, 1}, dev);
    return p;
  }

  // The [m, n] result; counts bytes outside it that are no longer poisoned.
  std::vector<uint16_t> result(int64_t* touched_outside) const {
    const std::vector<uint8_t> raw = out.download_all();
    std::vector<uint8_t> inside(raw.size(), 0);
    std::vector<uint16_t> r(static_cast<size_t>(m * n));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const size_t off = kGuard + shift + static_cast<size_t>(i * ld_out + j) * 2;
        std::memcpy(&r[i * n + j], &raw[off], 2);
        inside[off] = inside[off + 1] = 1;
      }
    }
    int64_t touched = 0;
    for (size_t i = 0; i < raw.size(); ++i) touched += !inside[i] && raw[i] != kPoison;
    *touched_outside = touched;
    return r;
  }
};

// Tests run without autotuning (speed) unless they ask for it.
inline Fp8BlockGemmOptions untuned_options() {
  Fp8BlockGemmOptions o;
  o.autotune = false;
  return o;
}

inline std::unique_ptr<Fp8BlockGemm> make_gemm(int64_t max_m, int64_t n, int64_t k,
                                               const Fp8BlockGemmOptions& opt = untuned_options()) {
  auto r = Fp8BlockGemm::create(max_m, n, k, opt);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (!r.ok()) return nullptr;
  return std::move(r).value();
}

inline int64_t count_bit_mismatches(const std::vector<uint16_t>& x, const std::vector<uint16_t>& y,
                                    int64_t n, std::string* report) {
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == y[i]) continue;
    if (bad < 6 && report)
      *report += "  [" + std::to_string(i / n) + ", " + std::to_string(i % n) + "] " +
                 std::to_string(bf16_to_float(x[i])) + " vs " +
                 std::to_string(bf16_to_float(y[i])) + "\n";
    ++bad;
  }
  return bad;
}

struct BoundReport {
  int64_t violations = 0;
  int64_t non_finite = 0;
  double worst_ratio = 0;  // max |g - c| / bound
  double worst_rel_s = 0;  // max |g - c| / S
  std::string text;
};

// |g - c| <= 2^-7 |c| + s_factor * S; g must be finite.
inline BoundReport check_bound(const std::vector<uint16_t>& g, const std::vector<uint16_t>& c,
                               const std::vector<double>& s, int64_t n, double s_factor) {
  BoundReport r;
  for (size_t i = 0; i < g.size(); ++i) {
    const double gv = bf16_to_float(g[i]), cv = bf16_to_float(c[i]);
    if (!std::isfinite(gv) || !std::isfinite(cv)) {
      ++r.non_finite;
      continue;
    }
    const double err = std::fabs(gv - cv);
    const double bound = std::ldexp(std::fabs(cv), -7) + s_factor * s[i];
    r.worst_ratio = std::max(r.worst_ratio, bound > 0 ? err / bound : (err > 0 ? 1e30 : 0.0));
    if (s[i] > 0) r.worst_rel_s = std::max(r.worst_rel_s, err / s[i]);
    if (err > bound || (bound == 0 && err != 0)) {
      if (r.violations < 6)
        r.text += "  [" + std::to_string(i / n) + ", " + std::to_string(i % n) + "] gpu " +
                  std::to_string(gv) + " cpu " + std::to_string(cv) + " S " + std::to_string(s[i]) +
                  "\n";
      ++r.violations;
    }
  }
  return r;
}

// `got` within |got - ref| <= 2^-7 |ref| + s_factor S of `ref` (finite), nothing outside the
// output written (`touched`); prints how many outputs are bit-identical under `label`.
inline void expect_within_bound(const std::string& label, const std::vector<uint16_t>& got,
                                const std::vector<uint16_t>& ref, const std::vector<double>& s,
                                const GemmData& d, double s_factor, int64_t touched) {
  const BoundReport r = check_bound(got, ref, s, d.n, s_factor);
  int64_t identical = 0;
  for (size_t i = 0; i < got.size(); ++i) identical += got[i] == ref[i];
  std::printf(
      "[ INFO     ] %s, M %lld N %lld K %lld: %lld of %zu outputs bit-identical, worst |diff| / "
      "bound %.3g, worst |diff| / S %.3g\n",
      label.c_str(), static_cast<long long>(d.m), static_cast<long long>(d.n),
      static_cast<long long>(d.k), static_cast<long long>(identical), got.size(), r.worst_ratio,
      r.worst_rel_s);
  EXPECT_EQ(r.non_finite, 0);
  EXPECT_EQ(r.violations, 0) << r.text;
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
}

// After a launch into `dev` that returned `st`: it succeeded, and once the device is synchronized
// the output is bit-identical to `ref` (integer inputs) with nothing outside [M, N] written.
inline void expect_launch_exact(const Status& st, const DeviceGemm& dev,
                                const std::vector<uint16_t>& ref) {
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> got = dev.result(&touched);
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, dev.n, &report), 0) << report;
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
}

// After a launch into `dev` that returned `st`: it succeeded, and once the device is synchronized
// the output is within the accumulation bound of `ref` (expect_within_bound under `label`).
inline void expect_launch_within_bound(const std::string& label, const Status& st,
                                       const DeviceGemm& dev, const std::vector<uint16_t>& ref,
                                       const GemmData& d, double s_factor) {
  ASSERT_TRUE(st.ok()) << st.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t touched = 0;
  const std::vector<uint16_t> got = dev.result(&touched);
  expect_within_bound(label, got, ref, abs_sums(d), d, s_factor, touched);
}

// A rejected call wrote nothing: every output of `dev` still holds the poison, and so does every
// byte around it.
inline void expect_output_unwritten(const DeviceGemm& dev) {
  int64_t touched = 0;
  for (uint16_t v : dev.result(&touched)) ASSERT_EQ(v, 0xA5A5) << "the output was written";
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
}

// Runs `gemm` on `d` (output rows n apart) and returns the [m, n] result; `touched` counts bytes
// written outside it. A failed run fails the test and returns an empty result.
inline std::vector<uint16_t> run_object(Fp8BlockGemm& gemm, const GemmData& d, int64_t* touched) {
  DeviceGemm dev(d, d.n);
  const Status st = gemm.run(dev.params(), nullptr);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const cudaError_t e = cudaDeviceSynchronize();
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  if (!st.ok() || e != cudaSuccess) return {};
  return dev.result(touched);
}

// Integer-valued [m, n, k] operands from a fresh seed (exact in any summation order): `gemm`
// matches the CPU twin bit for bit and writes nothing outside its output.
inline void expect_object_exact(Fp8BlockGemm& gemm, int64_t m, int64_t n, int64_t k) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  GemmData d = make_integer_data(m, n, k, rng);
  const std::vector<uint16_t> ref = cpu_gemm(d);
  int64_t touched = 0;
  const std::vector<uint16_t> got = run_object(gemm, d, &touched);
  ASSERT_EQ(got.size(), ref.size());
  std::string report;
  EXPECT_EQ(count_bit_mismatches(got, ref, n, &report), 0) << report;
  EXPECT_EQ(touched, 0) << "bytes outside the [M, N] output were written";
}

// The reference object: cuBLASLt's heuristic algorithm only (no tuning, so neither the wgmma nor
// the prefill kernel is ever chosen).
inline Fp8BlockGemmOptions cublaslt_only() {
  Fp8BlockGemmOptions o;
  o.autotune = false;
  o.wgmma_max_m = 0;
  o.prefill_min_m = 0;
  return o;
}

// cuBLASLt (no autotuning) and an object with `opt` on the same random [m, 640, 6144] operands:
// within the accumulation bound of each other (two device accumulations: 2^-9 S).
inline void expect_agrees_with_cublaslt(const std::string& label, int64_t m, int64_t max_m,
                                        const Fp8BlockGemmOptions& opt, Rng& rng) {
  const int64_t n = 640, k = 6144;
  GemmData d = make_random_data(m, n, k, rng);
  const std::vector<double> s = abs_sums(d);
  auto lt = make_gemm(max_m, n, k, cublaslt_only());
  auto other = make_gemm(max_m, n, k, opt);
  ASSERT_NE(lt, nullptr);
  ASSERT_NE(other, nullptr);
  DeviceGemm x(d, n), y(d, n);
  const Status s1 = lt->run(x.params(), nullptr);
  const Status s2 = other->run(y.params(), nullptr);
  ASSERT_TRUE(s1.ok()) << s1.to_string();
  ASSERT_TRUE(s2.ok()) << s2.to_string();
  M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
  int64_t t1 = 0, t2 = 0;
  const std::vector<uint16_t> a = x.result(&t1), b = y.result(&t2);
  expect_within_bound(label + " vs cuBLASLt", b, a, s, d, std::ldexp(1.0, -9), t1 + t2);
}

// Fused [Q|K|V|iQ|iK] (N = 9856) against the unfused pair [Q|K|V] (9216) + [iQ|iK] (640) from the
// same packed weights and scales: the halves are sub-views of the packed buffers, and the pair
// writes into the column ranges of one packed output (row stride 9856).
constexpr int64_t kN1 = 9216, kN2 = 640, kNF = kN1 + kN2, kHidden = 6144;

struct FusedRun {
  std::vector<uint16_t> fused, unfused;
  int64_t touched = 0;
};

inline FusedRun run_fused_and_unfused(const GemmData& d,
                                      const Fp8BlockGemmOptions& opt = untuned_options()) {
  FusedRun r;
  auto fused = make_gemm(d.m, kNF, kHidden, opt);
  auto first = make_gemm(d.m, kN1, kHidden, opt);
  auto second = make_gemm(d.m, kN2, kHidden, opt);
  if (!fused || !first || !second) return r;
  DeviceGemm f(d, kNF);
  DeviceGemm u(d, kNF);  // same operands; its output buffer receives the pair
  EXPECT_TRUE(fused->run(f.params(), nullptr).ok());

  GemmParams p1 = u.params(), p2 = u.params();
  p1.b.shape[0] = kN1;
  p1.b_scales.shape[0] = kN1 / 128;
  p1.out.shape[1] = kN1;
  p2.b.data = static_cast<uint8_t*>(p2.b.data) + kN1 * kHidden;
  p2.b.shape[0] = kN2;
  p2.b_scales.data =
      static_cast<float*>(p2.b_scales.data) + kN1 / 128 * gemm_weight_scales_row_stride(kHidden);
  p2.b_scales.shape[0] = kN2 / 128;
  p2.out.data = static_cast<uint16_t*>(p2.out.data) + kN1;
  p2.out.shape[1] = kN2;
  const Status s1 = first->run(p1, nullptr);
  const Status s2 = second->run(p2, nullptr);
  EXPECT_TRUE(s1.ok()) << s1.to_string();
  EXPECT_TRUE(s2.ok()) << s2.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int64_t t1 = 0, t2 = 0;
  r.fused = f.result(&t1);
  r.unfused = u.result(&t2);
  r.touched = t1 + t2;
  return r;
}

// Quantize `rows` bf16 rows (padded to a multiple of 4) + the GEMM of a `max_m` object with
// `opt`, on random fused-width operands: captured once in a CUDA graph, replayed with a new x
// written into the same buffer. The replay must see the new input and equal two eager runs byte
// for byte (deterministic paths); with `reference`, also an object with those options run alone
// after a device synchronization on the same quantized input.
inline void expect_graph_replay_equals_eager(int64_t rows, int64_t max_m,
                                             const Fp8BlockGemmOptions& opt, Rng& rng,
                                             const Fp8BlockGemmOptions* reference = nullptr) {
  const int64_t m_pad = gemm_padded_rows(rows), n = kNF, k = kHidden;
  GemmData d = make_random_data(m_pad, n, k, rng);
  DeviceGemm dev(d, n);
  DeviceBuffer d_x(static_cast<size_t>(rows * k) * 2);
  std::vector<uint16_t> x(static_cast<size_t>(rows * k));
  auto new_x = [&] {
    for (auto& v : x) v = float_to_bf16(rng.normal(0.0f, 1.0f));
    d_x.upload(x.data(), x.size() * 2);
  };
  new_x();
  const GemmParams gp = dev.params();
  QuantizeParams qd;
  qd.rows = rows;
  qd.in = TensorView::contiguous(d_x.data(), DType::kBF16, {rows, k}, Device::cuda(0));
  qd.out = gp.a;
  qd.scales = gp.a_scales;
  auto gemm = make_gemm(max_m, n, k, opt);
  ASSERT_NE(gemm, nullptr);
  cudaStream_t stream;
  M3_CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto launch = [&]() -> Status {
    M3_RETURN_IF_ERROR(run_quantize_cuda(qd, stream));
    return gemm->run(gp, stream);
  };
  // Warm-up eager call (cuBLASLt may load its kernels lazily), outside the capture.
  ASSERT_TRUE(launch().ok());
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  M3_CUDA_TEST_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status cap = launch();
  M3_CUDA_TEST_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(cap.ok()) << cap.to_string();
  M3_CUDA_TEST_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  int64_t touched = 0;
  const std::vector<uint16_t> first = dev.result(&touched);
  EXPECT_EQ(touched, 0);

  new_x();
  dev.out.poison(kPoison);
  M3_CUDA_TEST_CHECK(cudaGraphLaunch(exec, stream));
  M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  const std::vector<uint8_t> replay = dev.out.download_all();
  EXPECT_NE(first, dev.result(&touched)) << "the replay did not see the new input";
  for (int rep = 0; rep < 2; ++rep) {
    dev.out.poison(kPoison);
    ASSERT_TRUE(launch().ok());
    M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(replay, dev.out.download_all()) << "eager run " << rep << " differs from the replay";
  }
  if (reference) {
    auto ref = make_gemm(max_m, n, k, *reference);
    ASSERT_NE(ref, nullptr);
    M3_CUDA_TEST_CHECK(cudaDeviceSynchronize());
    dev.out.poison(kPoison);
    const Status st = ref->run(gp, stream);
    ASSERT_TRUE(st.ok()) << st.to_string();
    M3_CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(replay, dev.out.download_all()) << "the reference object differs from the replay";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace m3attn::gemm_test
