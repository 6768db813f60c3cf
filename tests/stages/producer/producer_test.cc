// CPU twin of the producer (SPEC section 3): numerics against an fp64 reference, fused == unfused,
// slot and position edge cases.
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <string>

#include "producer_test_fixture.h"

namespace m3attn {
namespace {

using namespace producer_test;  // NOLINT(build/namespaces)
using testing::count_e4m3_mismatches;
using testing::fresh_seed;

struct HeadConfig {
  int n_q, n_kv;
};
constexpr HeadConfig kConfigs[] = {{8, 2}, {16, 1}, {64, 4}};

int64_t mismatches(const uint8_t* got, const uint8_t* want, int64_t n, const char* what) {
  std::string report;
  const int64_t bad = count_e4m3_mismatches(got, want, n, &report);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n
                    << " elements not within one E4M3 step (got vs reference):\n"
                    << report;
  return bad;
}

bool position_valid(const Inputs& in, int64_t t) {
  const int32_t pos = in.positions.ptr<int32_t>()[t];
  return pos >= 0 && pos < in.max_pos;
}

// Checks Q / index-Q of every token and the K, V, index-K rows of every token whose slot writes,
// against the fp64 reference; tokens with a position outside the table must have all-NaN Q /
// index-Q rows and write nothing. `main` / `index`: which outputs the call produced.
void check_against_reference(const Inputs& in, const Reference& ref, const Outputs& out,
                             const CachePool& pool, bool main, bool index) {
  const int64_t pages = pool.layout.num_pages;
  const int64_t q_row = in.n_q * kHeadDim, iq_row = in.n_kv * kHeadDim;
  for (int64_t t = 0; t < in.tokens; ++t) {
    SCOPED_TRACE(::testing::Message()
                 << "token " << t << " position " << in.positions.ptr<int32_t>()[t] << " slot "
                 << in.slots.ptr<int32_t>()[t]);
    const uint8_t* q = out.q.ptr<uint8_t>() + t * q_row;
    const uint8_t* iq = out.iq.ptr<uint8_t>() + t * iq_row;
    if (!position_valid(in, t)) {
      for (int64_t i = 0; main && i < q_row; ++i) ASSERT_EQ(q[i], 0x7f) << "Q element " << i;
      for (int64_t i = 0; index && i < iq_row; ++i) ASSERT_EQ(iq[i], 0x7f) << "iQ element " << i;
      continue;
    }
    if (main) mismatches(q, &ref.q[t * q_row], q_row, "Q");
    if (index) mismatches(iq, &ref.iq[t * iq_row], iq_row, "index-Q");
    const int32_t s = in.slots.ptr<int32_t>()[t];
    if (!slot_writes(s, pages)) continue;
    const int64_t page = s / kPageSize;
    const int row = s % kPageSize;
    for (int h = 0; h < in.n_kv && main; ++h) {
      const int64_t o = (t * in.n_kv + h) * kHeadDim;
      mismatches(pool.kv_row(page, 0, h, row), &ref.k[o], kHeadDim, "K");
      EXPECT_EQ(std::memcmp(pool.kv_row(page, 1, h, row), &ref.v[o], kHeadDim), 0)
          << "V head " << h << " is not e4m3(bf16)";
    }
    if (index) mismatches(pool.index_row(page, row), &ref.ik[t * kHeadDim], kHeadDim, "index-K");
  }
  expect_only_slot_rows_written(pool, in, main, index);
}

// A mix of slots: distinct valid ones, then -1, one just past the last page, the last row past
// the end, INT32_MAX and INT32_MIN on tokens 0, 3, 6, 9, 12.
void assign_mixed_slots(Inputs& in, Rng& rng, int64_t num_pages) {
  assign_distinct_slots(in, rng, num_pages);
  const int32_t past_end = static_cast<int32_t>(num_pages * kPageSize);
  const int32_t specials[] = {-1, past_end, past_end + 127, INT32_MAX, INT32_MIN};
  for (int i = 0; i < 5 && 3 * i < in.tokens; ++i) in.slot()[3 * i] = specials[i];
}

// Positions outside [0, max_pos) on tokens 4 and 5 (with valid slots), the table ends on 1 and 2.
void assign_edge_positions(Inputs& in) {
  in.pos()[1] = 0;
  in.pos()[2] = static_cast<int32_t>(in.max_pos - 1);
  in.pos()[4] = -1;
  in.pos()[5] = static_cast<int32_t>(in.max_pos);
}

TEST(ProducerCpu, FusedMatchesFp64Reference) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (const HeadConfig cfg : {HeadConfig{8, 2}, HeadConfig{16, 1}}) {
    SCOPED_TRACE(::testing::Message() << "n_q " << cfg.n_q << " n_kv " << cfg.n_kv);
    Inputs in = make_inputs(rng, cfg.n_q, cfg.n_kv, /*tokens=*/37, /*max_pos=*/4099);
    const int64_t pages = 5;
    assign_mixed_slots(in, rng, pages);
    assign_edge_positions(in);
    CachePool pool(CacheLayout::separate(pages, cfg.n_kv));
    Outputs out(in);
    ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, out, pool, pool)).ok());
    check_against_reference(in, compute_reference(in), out, pool, true, true);
  }
}

TEST(ProducerCpu, FusedEqualsUnfusedByteForByte) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (const HeadConfig cfg : kConfigs) {
    SCOPED_TRACE(::testing::Message() << "n_q " << cfg.n_q << " n_kv " << cfg.n_kv);
    Inputs in = make_inputs(rng, cfg.n_q, cfg.n_kv, /*tokens=*/29, /*max_pos=*/3000);
    const int64_t pages = 4;
    assign_mixed_slots(in, rng, pages);
    assign_edge_positions(in);
    const CacheLayout layout = CacheLayout::separate(pages, cfg.n_kv, 3);
    CachePool fused_pool(layout), unfused_pool(layout);
    Outputs fused_out(in), unfused_out(in);
    ASSERT_TRUE(
        run_producer_cpu(make_params(ProducerMode::kFused, in, fused_out, fused_pool, fused_pool))
            .ok());
    ASSERT_TRUE(run_producer_cpu(
                    make_params(ProducerMode::kMain, in, unfused_out, unfused_pool, unfused_pool))
                    .ok());
    ASSERT_TRUE(run_producer_cpu(
                    make_params(ProducerMode::kIndex, in, unfused_out, unfused_pool, unfused_pool))
                    .ok());
    EXPECT_EQ(std::memcmp(fused_out.q.data(), unfused_out.q.data(), fused_out.q.nbytes()), 0);
    EXPECT_EQ(std::memcmp(fused_out.iq.data(), unfused_out.iq.data(), fused_out.iq.nbytes()), 0);
    EXPECT_EQ(
        std::memcmp(fused_pool.bytes.data(), unfused_pool.bytes.data(), fused_pool.bytes.nbytes()),
        0);
    // Identical and right.
    check_against_reference(in, compute_reference(in), fused_out, fused_pool, true, true);
  }
}

TEST(ProducerCpu, UnfusedModesWriteOnlyTheirOwnOutputs) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs(rng, 8, 2, 11, 700);
  assign_distinct_slots(in, rng, 3);
  const Reference ref = compute_reference(in);
  {
    CachePool pool(CacheLayout::separate(3, 2));
    Outputs out(in);
    ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kMain, in, out, pool, pool)).ok());
    check_against_reference(in, ref, out, pool, /*main=*/true, /*index=*/false);
    for (int64_t i = 0; i < out.iq.nbytes(); ++i) ASSERT_EQ(out.iq.ptr<uint8_t>()[i], 0xc9);
  }
  {
    CachePool pool(CacheLayout::separate(3, 2));
    Outputs out(in);
    ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kIndex, in, out, pool, pool)).ok());
    check_against_reference(in, ref, out, pool, /*main=*/false, /*index=*/true);
    for (int64_t i = 0; i < out.q.nbytes(); ++i) ASSERT_EQ(out.q.ptr<uint8_t>()[i], 0xc9);
  }
}

TEST(ProducerCpu, RopeAtPositionZeroIsIdentity) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs(rng, 4, 1, 6, 16);
  assign_distinct_slots(in, rng, 1);
  for (int64_t t = 0; t < in.tokens; ++t) in.pos()[t] = 0;
  CachePool pool(CacheLayout::separate(1, 1));
  Outputs out(in);
  ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, out, pool, pool)).ok());
  // At position 0 the twin's output is its own RMSNorm alone, computed here in the documented
  // fp32 order: the rotation must not move a single channel.
  const float eps = kEps;
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int h = 0; h < in.n_q; ++h) {
      const uint16_t* x = in.head(t, in.q_col(), h);
      float ss = 0.0f;
      for (int i = 0; i < kHeadDim; ++i) ss += bf16_to_float(x[i]) * bf16_to_float(x[i]);
      const float r = 1.0f / std::sqrt(ss / 128.0f + eps);
      for (int i = 0; i < kHeadDim; ++i) {
        const float w = bf16_to_float(in.q_norm.ptr<uint16_t>()[i]);
        const uint8_t want = float_to_e4m3((bf16_to_float(x[i]) * r) * (1.0f + w));
        const uint8_t got = out.q.ptr<uint8_t>()[(t * in.n_q + h) * kHeadDim + i];
        // Same value; the sign of a zero may differ (y - 0 * s turns -0 into +0).
        ASSERT_FALSE(e4m3_is_nan(got));
        ASSERT_EQ(e4m3_ordinal(got), e4m3_ordinal(want))
            << "token " << t << " head " << h << " channel " << i;
      }
    }
    // The fp64 reference without any rotation agrees too.
    uint8_t no_rope[kHeadDim];
    reference_head(in.head(t, in.ik_col(), 0), in.ik_norm.ptr<uint16_t>(), kEps, -1, no_rope);
    const int32_t s = in.slots.ptr<int32_t>()[t];
    mismatches(pool.index_row(s / kPageSize, s % kPageSize), no_rope, kHeadDim, "index-K");
  }
}

TEST(ProducerCpu, SlotsOutsideThePoolWriteNothing) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs(rng, 8, 2, 9, 512);
  const int64_t pages = 2;
  const int32_t slots[] = {-1, -128, -129, INT32_MIN, 256, 383, 384, 100000, INT32_MAX};
  for (int64_t t = 0; t < in.tokens; ++t) in.slot()[t] = slots[t];
  CachePool pool(CacheLayout::separate(pages, 2, 1, 4096));
  Outputs out(in);
  ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, out, pool, pool)).ok());
  EXPECT_EQ(std::memcmp(pool.bytes.data(), pool.snapshot.data(), pool.bytes.nbytes()), 0)
      << "a slot outside the pool wrote to a cache";
  check_against_reference(in, compute_reference(in), out, pool, true, true);  // Q still produced
}

TEST(ProducerCpu, ZeroTokensDoNothing) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs(rng, 8, 2, 3, 64);
  assign_distinct_slots(in, rng, 1);
  CachePool pool(CacheLayout::separate(1, 2));
  Outputs out(in);
  for (ProducerMode mode : {ProducerMode::kFused, ProducerMode::kMain, ProducerMode::kIndex}) {
    ProducerParams p = make_params(mode, in, out, pool, pool);
    p.num_tokens = 0;  // real buffers behind every view, but T = 0
    p.packed.shape[0] = 0;
    p.positions.shape[0] = 0;
    if (mode != ProducerMode::kIndex) p.q_out.shape[0] = 0;
    if (mode != ProducerMode::kMain) p.iq_out.shape[0] = 0;
    ASSERT_TRUE(run_producer_cpu(p).ok()) << producer_mode_name(mode);
  }
  EXPECT_EQ(std::memcmp(pool.bytes.data(), pool.snapshot.data(), pool.bytes.nbytes()), 0);
  for (int64_t i = 0; i < out.q.nbytes(); ++i) ASSERT_EQ(out.q.ptr<uint8_t>()[i], 0xc9);
  for (int64_t i = 0; i < out.iq.nbytes(); ++i) ASSERT_EQ(out.iq.ptr<uint8_t>()[i], 0xc9);

  // And with empty tensors (null data) everywhere T-shaped.
  Inputs none = make_inputs(rng, 8, 2, 0, 64);
  Outputs none_out(none);
  ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, none, none_out, pool, pool)).ok());
  EXPECT_EQ(std::memcmp(pool.bytes.data(), pool.snapshot.data(), pool.bytes.nbytes()), 0);
}

TEST(ProducerCpu, M3GeometrySmoke) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const MsaGeometry g = MsaGeometry::m3();
  Inputs in = make_inputs(rng, g.n_q, g.n_kv, /*tokens=*/5, /*max_pos=*/int64_t{1} << 17);
  ASSERT_EQ(in.fused_width(), g.packed_width());
  assign_distinct_slots(in, rng, 3);
  in.pos()[0] = static_cast<int32_t>(in.max_pos - 1);
  CachePool pool(CacheLayout::separate(3, g.n_kv));
  Outputs out(in);
  ProducerParams p = make_params(ProducerMode::kFused, in, out, pool, pool);
  p.eps = g.eps;
  ASSERT_TRUE(run_producer_cpu(p).ok());
  check_against_reference(in, compute_reference(in), out, pool, true, true);
}

}  // namespace
}  // namespace m3attn
