// Host validation of the producer (SPEC section 8): every rule rejects with a message naming it,
// and a rejected call writes nothing (outputs and the whole cache pool stay byte-identical).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "producer_test_fixture.h"
#include "support/rejection.h"

namespace m3attn {
namespace {

using namespace producer_test;  // NOLINT(build/namespaces)
using testing::fresh_seed;

struct Rule {
  const char* name;
  ProducerMode mode;
  std::vector<std::string> keywords;
  void (*apply)(ProducerParams&);
};

uint8_t* bytes_of(const TensorView& v) { return static_cast<uint8_t*>(v.data); }

const Rule kRules[] = {
    // Scalars.
    {"mode out of range",
     ProducerMode::kFused,
     {"mode 7"},
     [](ProducerParams& p) { p.mode = static_cast<ProducerMode>(7); }},
    {"n_kv zero",
     ProducerMode::kFused,
     {"n_kv", "> 0", "0"},
     [](ProducerParams& p) { p.n_kv = 0; }},
    {"n_kv negative", ProducerMode::kIndex, {"n_kv", "-2"}, [](ProducerParams& p) { p.n_kv = -2; }},
    {"n_q zero (fused)",
     ProducerMode::kFused,
     {"n_q", "> 0"},
     [](ProducerParams& p) { p.n_q = 0; }},
    {"n_q zero (main)", ProducerMode::kMain, {"n_q", "> 0"}, [](ProducerParams& p) { p.n_q = 0; }},
    {"n_q not a multiple of n_kv",
     ProducerMode::kFused,
     {"n_q 6", "multiple of n_kv 4"},
     [](ProducerParams& p) {
       p.n_q = 6;
       p.n_kv = 4;
     }},
    {"eps zero",
     ProducerMode::kFused,
     {"eps", "finite and > 0"},
     [](ProducerParams& p) { p.eps = 0.0f; }},
    {"eps negative", ProducerMode::kIndex, {"eps"}, [](ProducerParams& p) { p.eps = -1e-6f; }},
    {"eps NaN",
     ProducerMode::kMain,
     {"eps", "nan"},
     [](ProducerParams& p) { p.eps = std::numeric_limits<float>::quiet_NaN(); }},
    {"eps infinite",
     ProducerMode::kFused,
     {"eps", "inf"},
     [](ProducerParams& p) { p.eps = std::numeric_limits<float>::infinity(); }},
    {"T negative",
     ProducerMode::kFused,
     {"num_tokens", "-1"},
     [](ProducerParams& p) { p.num_tokens = -1; }},
    {"T 2^31",
     ProducerMode::kFused,
     {"num_tokens", "2^31", "2147483648"},
     [](ProducerParams& p) { p.num_tokens = int64_t{1} << 31; }},
    // Packed rows.
    {"packed dtype",
     ProducerMode::kFused,
     {"packed", "bf16", "f32"},
     [](ProducerParams& p) { p.packed.dtype = DType::kF32; }},
    {"packed rank",
     ProducerMode::kFused,
     {"packed", "2 dimensions"},
     [](ProducerParams& p) { p.packed.ndim = 3; }},
    {"packed rows != T",
     ProducerMode::kFused,
     {"packed", "rows", "T = 9"},
     [](ProducerParams& p) { p.packed.shape[0] = 8; }},
    {"packed width of another mode",
     ProducerMode::kMain,
     {"packed width", "main width"},
     [](ProducerParams& p) { p.packed.shape[1] = (p.n_q + 3 * p.n_kv + 1) * 128; }},
    {"packed width (index)",
     ProducerMode::kIndex,
     {"packed width 256", "index width 384"},
     [](ProducerParams& p) { p.packed.shape[1] = 256; }},
    {"packed last stride",
     ProducerMode::kFused,
     {"packed", "last stride", "2"},
     [](ProducerParams& p) { p.packed.stride[1] = 2; }},
    {"packed row stride < W",
     ProducerMode::kFused,
     {"packed row stride", ">= the width"},
     [](ProducerParams& p) { p.packed.stride[0] = p.packed.shape[1] - 8; }},
    {"packed row stride not 16 B",
     ProducerMode::kFused,
     {"packed row stride", "multiple of 8"},
     [](ProducerParams& p) { p.packed.stride[0] += 4; }},
    {"packed base not 16 B",
     ProducerMode::kIndex,
     {"packed", "16-byte aligned"},
     [](ProducerParams& p) { p.packed.data = bytes_of(p.packed) + 8; }},
    {"packed null",
     ProducerMode::kFused,
     {"packed", "null"},
     [](ProducerParams& p) { p.packed.data = nullptr; }},
    // Token metadata and the RoPE table.
    {"positions dtype",
     ProducerMode::kFused,
     {"positions", "i32"},
     [](ProducerParams& p) { p.positions.dtype = DType::kF32; }},
    {"positions length",
     ProducerMode::kFused,
     {"positions length 8", "T = 9"},
     [](ProducerParams& p) { p.positions.shape[0] = 8; }},
    {"positions longer than T",
     ProducerMode::kFused,
     {"positions length 10"},
     [](ProducerParams& p) { p.positions.shape[0] = 10; }},
    {"positions strided",
     ProducerMode::kFused,
     {"positions", "contiguous"},
     [](ProducerParams& p) {
       p.positions.shape[0] = 4;
       p.positions.stride[0] = 2;
       p.num_tokens = 4;
       p.packed.shape[0] = 4;
     }},
    {"slots dtype",
     ProducerMode::kMain,
     {"slots", "i32"},
     [](ProducerParams& p) { p.slots.dtype = DType::kBF16; }},
    {"slots shorter than T",
     ProducerMode::kIndex,
     {"slots length 8", "shorter than T = 9"},
     [](ProducerParams& p) { p.slots.shape[0] = 8; }},
    {"slots null",
     ProducerMode::kFused,
     {"slots", "null"},
     [](ProducerParams& p) { p.slots.data = nullptr; }},
    {"rope dtype",
     ProducerMode::kFused,
     {"rope", "f32"},
     [](ProducerParams& p) { p.rope.dtype = DType::kBF16; }},
    {"rope half width",
     ProducerMode::kFused,
     {"rope", "[max_pos > 0, 2, 32]", "rotary dim must be 64"},
     [](ProducerParams& p) { p.rope.shape[2] = 16; }},
    {"rope planes",
     ProducerMode::kIndex,
     {"rope", "shape"},
     [](ProducerParams& p) { p.rope.shape[1] = 1; }},
    {"rope empty",
     ProducerMode::kMain,
     {"rope", "max_pos > 0"},
     [](ProducerParams& p) { p.rope.shape[0] = 0; }},
    {"rope strided",
     ProducerMode::kFused,
     {"rope", "contiguous"},
     [](ProducerParams& p) { p.rope.stride[0] = 128; }},
    // Norm weights.
    {"q_norm shape",
     ProducerMode::kFused,
     {"q_norm", "shape [128]"},
     [](ProducerParams& p) { p.q_norm.shape[0] = 64; }},
    {"k_norm dtype",
     ProducerMode::kMain,
     {"k_norm", "bf16"},
     [](ProducerParams& p) { p.k_norm.dtype = DType::kF32; }},
    {"iq_norm missing",
     ProducerMode::kIndex,
     {"iq_norm"},
     [](ProducerParams& p) { p.iq_norm = TensorView(); }},
    {"ik_norm null",
     ProducerMode::kFused,
     {"ik_norm", "null"},
     [](ProducerParams& p) { p.ik_norm.data = nullptr; }},
    {"q_norm strided",
     ProducerMode::kFused,
     {"q_norm", "contiguous"},
     [](ProducerParams& p) { p.q_norm.stride[0] = 2; }},
    // Outputs.
    {"q_out shape",
     ProducerMode::kFused,
     {"q_out", "shape [9, 8, 128]"},
     [](ProducerParams& p) { p.q_out.shape[1] = 4; }},
    {"q_out dtype",
     ProducerMode::kMain,
     {"q_out", "e4m3"},
     [](ProducerParams& p) { p.q_out.dtype = DType::kBF16; }},
    {"q_out missing",
     ProducerMode::kMain,
     {"q_out"},
     [](ProducerParams& p) { p.q_out = TensorView(); }},
    {"iq_out shape",
     ProducerMode::kIndex,
     {"iq_out", "shape [9, 2, 128]"},
     [](ProducerParams& p) { p.iq_out.shape[0] = 10; }},
    {"iq_out strided",
     ProducerMode::kFused,
     {"iq_out", "contiguous"},
     [](ProducerParams& p) { p.iq_out.stride[0] = 512; }},
    {"iq_out misaligned",
     ProducerMode::kFused,
     {"iq_out", "16-byte aligned"},
     [](ProducerParams& p) { p.iq_out.data = bytes_of(p.iq_out) + 4; }},
    // Caches.
    {"main cache dtype",
     ProducerMode::kFused,
     {"main cache", "e4m3"},
     [](ProducerParams& p) { p.kv_cache.dtype = DType::kBF16; }},
    {"main cache heads != n_kv",
     ProducerMode::kMain,
     {"main cache", "[pages, 2, 2, 128, 128]"},
     [](ProducerParams& p) { p.kv_cache.shape[2] = 3; }},
    {"main cache page size 64",
     ProducerMode::kFused,
     {"main cache", "page size must be 128"},
     [](ProducerParams& p) { p.kv_cache.shape[3] = 64; }},
    {"main cache page stride not multiple of 4",
     ProducerMode::kFused,
     {"main cache page stride", "multiple of 4"},
     [](ProducerParams& p) { p.kv_cache.stride[0] += 2; }},
    {"main cache plane stride not multiple of 4",
     ProducerMode::kMain,
     {"main cache plane stride", "multiple of 4"},
     [](ProducerParams& p) { p.kv_cache.stride[1] += 1; }},
    {"main cache planes overlap",
     ProducerMode::kFused,
     {"main cache plane stride", "smaller"},
     [](ProducerParams& p) { p.kv_cache.stride[1] = 128 * 128; }},
    {"main cache pages overlap",
     ProducerMode::kMain,
     {"main cache page stride", "overlaps"},
     [](ProducerParams& p) { p.kv_cache.stride[0] = p.kv_cache.stride[1]; }},
    {"main cache base 2 B",
     ProducerMode::kFused,
     {"main cache", "4-byte aligned"},
     [](ProducerParams& p) { p.kv_cache.data = bytes_of(p.kv_cache) + 2; }},
    {"main cache inner stride",
     ProducerMode::kFused,
     {"main cache inner strides"},
     [](ProducerParams& p) { p.kv_cache.stride[3] = 256; }},
    {"main cache null",
     ProducerMode::kMain,
     {"main cache", "null"},
     [](ProducerParams& p) { p.kv_cache.data = nullptr; }},
    {"index cache shape",
     ProducerMode::kIndex,
     {"index cache", "shape"},
     [](ProducerParams& p) { p.index_cache.shape[1] = 2; }},
    {"index cache pages overlap",
     ProducerMode::kIndex,
     {"index cache page stride", "overlap"},
     [](ProducerParams& p) { p.index_cache.stride[0] = 128 * 64; }},
    {"index cache page stride not multiple of 4",
     ProducerMode::kFused,
     {"index cache page stride", "multiple of 4"},
     [](ProducerParams& p) { p.index_cache.stride[0] += 6; }},
    {"index cache rank",
     ProducerMode::kFused,
     {"index cache", "4 dimensions"},
     [](ProducerParams& p) { p.index_cache.ndim = 5; }},
    {"fused page counts differ",
     ProducerMode::kFused,
     {"main cache has 3 pages", "index cache has 2"},
     [](ProducerParams& p) { p.index_cache.shape[0] = 2; }},
    // One device.
    {"q_out on a GPU",
     ProducerMode::kFused,
     {"one device", "cpu", "cuda:0"},
     [](ProducerParams& p) { p.q_out.device = Device::cuda(0); }},
    {"index cache on another GPU",
     ProducerMode::kIndex,
     {"one device", "cuda:1"},
     [](ProducerParams& p) {
       for (TensorView* v :
            {&p.packed, &p.positions, &p.slots, &p.rope, &p.iq_norm, &p.ik_norm, &p.iq_out})
         v->device = Device::cuda(0);
       p.index_cache.device = Device::cuda(1);
     }},
    // Overlaps.
    {"q_out over iq_out",
     ProducerMode::kFused,
     {"q_out overlaps iq_out"},
     [](ProducerParams& p) { p.q_out.data = p.iq_out.data; }},
    {"q_out over packed",
     ProducerMode::kMain,
     {"q_out overlaps the input packed"},
     [](ProducerParams& p) { p.q_out.data = p.packed.data; }},
    {"iq_out inside the main cache",
     ProducerMode::kFused,
     {"iq_out overlaps main cache"},
     [](ProducerParams& p) { p.iq_out.data = bytes_of(p.kv_cache) + 4096; }},
    {"index cache on the V plane",
     ProducerMode::kFused,
     {"index cache pages overlap main cache pages"},
     [](ProducerParams& p) { p.index_cache.data = bytes_of(p.kv_cache) + p.kv_cache.stride[1]; }},
    {"index cache one page later, shifted into the K plane",
     ProducerMode::kFused,
     {"index cache pages overlap main cache pages"},
     [](ProducerParams& p) {
       p.index_cache.stride[0] = p.kv_cache.stride[0];
       p.index_cache.data = bytes_of(p.kv_cache) + p.kv_cache.stride[0] - 128 * 64;
     }},
    {"index cache overlapping with a different page stride",
     ProducerMode::kFused,
     {"index cache pages overlap main cache pages"},
     [](ProducerParams& p) { p.index_cache.data = bytes_of(p.kv_cache) + 7 * 128 * 128; }},
    {"rope table inside the index cache",
     ProducerMode::kIndex,
     {"index cache overlaps the input rope table"},
     [](ProducerParams& p) { p.rope.data = p.index_cache.data; }},
};

// A valid setup: T = 9, n_q 8, n_kv 2, 3 pages, main cache page stride x3 and an index cache that
// lives in the same pool.
struct ValidSetup {
  Inputs in;
  CachePool pool;
  Outputs out;
  explicit ValidSetup(Rng& rng)
      : in(make_inputs(rng, 8, 2, 9, 300)), pool(CacheLayout::separate(3, 2, 3)), out(in) {
    assign_distinct_slots(in, rng, 3);
  }
  ProducerParams params(ProducerMode mode) const { return make_params(mode, in, out, pool, pool); }
};

TEST(ProducerValidate, EveryRuleRejectsAndWritesNothing) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  ValidSetup s(rng);
  for (ProducerMode mode : {ProducerMode::kFused, ProducerMode::kMain, ProducerMode::kIndex})
    ASSERT_TRUE(validate_producer(s.params(mode)).ok())
        << producer_mode_name(mode) << ": " << validate_producer(s.params(mode)).to_string();
  const Tensor q_before = s.out.q.clone(), iq_before = s.out.iq.clone();
  for (const Rule& rule : kRules) {
    SCOPED_TRACE(rule.name);
    ProducerParams p = s.params(rule.mode);
    rule.apply(p);
    for (const Status& st : {validate_producer(p), run_producer_cpu(p)})
      ASSERT_NO_FATAL_FAILURE(testing::expect_invalid_naming(st, rule.keywords));
    ASSERT_EQ(std::memcmp(s.pool.bytes.data(), s.pool.snapshot.data(), s.pool.bytes.nbytes()), 0);
    ASSERT_EQ(std::memcmp(s.out.q.data(), q_before.data(), q_before.nbytes()), 0);
    ASSERT_EQ(std::memcmp(s.out.iq.data(), iq_before.data(), iq_before.nbytes()), 0);
  }
}

TEST(ProducerValidate, ModesIgnoreTheTensorsTheyDoNotUse) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  ValidSetup s(rng);
  // kMain reads no index tensor: invalid ones there are not its business.
  ProducerParams main = s.params(ProducerMode::kMain);
  main.iq_norm = s.in.iq_norm.view();
  main.iq_norm.dtype = DType::kF32;
  main.index_cache = s.pool.kv();  // a 5-D view
  main.iq_out.device = Device::cuda(2);
  EXPECT_TRUE(validate_producer(main).ok()) << validate_producer(main).to_string();
  // kIndex has no Q heads and no main cache.
  ProducerParams index = s.params(ProducerMode::kIndex);
  index.n_q = 0;
  index.kv_cache = s.pool.kv();
  index.kv_cache.device = Device::cuda(3);
  index.q_out = s.out.iq.view();  // would overlap iq_out
  EXPECT_TRUE(validate_producer(index).ok()) << validate_producer(index).to_string();
}

TEST(ProducerValidate, InterleavedAndSeparateCachesAreAccepted) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  Inputs in = make_inputs(rng, 8, 2, 3, 64);
  Outputs out(in);
  for (const CacheLayout& l :
       {CacheLayout::interleaved(3, 2, 57, 0), CacheLayout::interleaved(3, 2, 57, 56, 4),
        CacheLayout::interleaved(1, 2, 1, 0), CacheLayout::separate(3, 2, 5, 4096)}) {
    CachePool pool(l);
    const Status st = validate_producer(make_params(ProducerMode::kFused, in, out, pool, pool));
    EXPECT_TRUE(st.ok()) << st.to_string();
  }
  // Main cache of one layer and index cache of the next layer, interleaved: disjoint tiles.
  CachePool pool(CacheLayout::interleaved(3, 2, 4, 1));
  ProducerParams p = make_params(ProducerMode::kFused, in, out, pool, pool);
  p.index_cache.data = bytes_of(p.index_cache) + (5 * kTile + 64);
  EXPECT_TRUE(validate_producer(p).ok()) << validate_producer(p).to_string();
  // ... and of the previous layer (a negative offset).
  p.index_cache.data = bytes_of(p.index_cache) - 2 * (5 * kTile + 64);
  EXPECT_TRUE(validate_producer(p).ok()) << validate_producer(p).to_string();
}

}  // namespace
}  // namespace m3attn
