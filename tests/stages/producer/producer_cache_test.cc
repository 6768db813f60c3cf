// The producer's cache addressing (SPEC section 4): strided and interleaved pools, unaligned bases,
// guard bytes between pages, and page 65536 (64-bit offsets) in a sparse multi-GB mapping.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <string>
#include <vector>

#include "producer_test_fixture.h"

namespace m3attn {
namespace {

using namespace producer_test;  // NOLINT(build/namespaces)
using testing::count_e4m3_mismatches;
using testing::fresh_seed;

// K within one step, V exact, index-K within one step, for every token of `in` (all positions
// valid); then every other byte of the pool unchanged.
void check_cache_rows(const Inputs& in, const Reference& ref, const CachePool& pool) {
  std::string report;
  for (int64_t t = 0; t < in.tokens; ++t) {
    const int32_t s = in.slots.ptr<int32_t>()[t];
    if (!slot_writes(s, pool.layout.num_pages)) continue;
    SCOPED_TRACE(::testing::Message() << "token " << t << " slot " << s);
    const int64_t page = s / kPageSize;
    const int row = s % kPageSize;
    for (int h = 0; h < in.n_kv; ++h) {
      const int64_t o = (t * in.n_kv + h) * kHeadDim;
      EXPECT_EQ(count_e4m3_mismatches(pool.kv_row(page, 0, h, row), &ref.k[o], kHeadDim, &report),
                0)
          << "K head " << h << "\n"
          << report;
      EXPECT_EQ(std::memcmp(pool.kv_row(page, 1, h, row), &ref.v[o], kHeadDim), 0)
          << "V head " << h;
    }
    EXPECT_EQ(
        count_e4m3_mismatches(pool.index_row(page, row), &ref.ik[t * kHeadDim], kHeadDim, &report),
        0)
        << "index-K\n"
        << report;
  }
  expect_only_slot_rows_written(pool, in, true, true);
}

struct LayoutCase {
  const char* name;
  CacheLayout layout;
};

TEST(ProducerCache, StridedAndInterleavedPools) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int n_kv = 2;
  const int64_t pages = 4;
  const LayoutCase cases[] = {
      {"minimal strides", CacheLayout::separate(pages, n_kv)},
      {"page stride x3", CacheLayout::separate(pages, n_kv, 3)},
      {"page stride x5, plane stride + 4096", CacheLayout::separate(pages, n_kv, 5, 4096)},
      {"57-layer interleave, layer 13", CacheLayout::interleaved(pages, n_kv, 57, 13)},
      {"57-layer interleave, layer 56, base 4 B off 16 B alignment",
       CacheLayout::interleaved(pages, n_kv, 57, 56, 4)},
  };
  Inputs in = make_inputs(rng, 8, n_kv, /*tokens=*/41, /*max_pos=*/1000);
  assign_distinct_slots(in, rng, pages);
  // Both ends of a page, and the first and last rows of the pool.
  in.slot()[0] = 0;
  in.slot()[1] = kPageSize - 1;
  in.slot()[2] = static_cast<int32_t>(pages * kPageSize - 1);
  in.slot()[3] = kPageSize;
  for (int64_t t = 4; t < in.tokens; ++t)
    for (int64_t u = 0; u < 4; ++u)
      if (in.slot()[t] == in.slot()[u]) in.slot()[t] = -1;  // keep slots distinct
  const Reference ref = compute_reference(in);
  for (const LayoutCase& c : cases) {
    SCOPED_TRACE(c.name);
    for (bool fused : {true, false}) {
      SCOPED_TRACE(fused ? "fused" : "unfused");
      CachePool pool(c.layout);
      Outputs out(in);
      if (fused) {
        ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kFused, in, out, pool, pool)).ok());
      } else {
        ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kMain, in, out, pool, pool)).ok());
        ASSERT_TRUE(run_producer_cpu(make_params(ProducerMode::kIndex, in, out, pool, pool)).ok());
      }
      check_cache_rows(in, ref, pool);
    }
  }
}

// A private anonymous mapping that reserves no memory: untouched pages cost nothing.
class SparseBuffer {
 public:
  explicit SparseBuffer(size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  ~SparseBuffer() {
    if (data_) munmap(data_, bytes_);
  }
  SparseBuffer(const SparseBuffer&) = delete;
  SparseBuffer& operator=(const SparseBuffer&) = delete;
  uint8_t* data() const { return data_; }

 private:
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

TEST(ProducerCache, Page65536Uses64BitOffsets) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // n_kv = 1, [K | V | iK | 64 guard bytes] per page slot: 49216 bytes per page, so page 65536
  // starts 3.2e9 bytes (> 2^31) into the pool.
  const int n_kv = 1;
  const int64_t pages = 65540;
  const int64_t page_stride = 3 * kTile + 64;
  const int64_t pool_bytes = pages * page_stride;
  SparseBuffer pool(static_cast<size_t>(pool_bytes));
  ASSERT_NE(pool.data(), nullptr) << "mmap of " << pool_bytes << " bytes failed";
  uint8_t* base = pool.data();

  Inputs in = make_inputs(rng, 2, n_kv, /*tokens=*/6, /*max_pos=*/300);
  const int32_t slots[] = {65536 * 128,     65536 * 128 + 127, 65535 * 128 + 77, 5,
                           65539 * 128 + 3, 65540 * 128};  // the last is past the end
  for (int64_t t = 0; t < in.tokens; ++t) in.slot()[t] = slots[t];
  const Reference ref = compute_reference(in);

  Outputs out(in);
  const CachePool unused(CacheLayout::separate(1, n_kv));  // replaced by the sparse views below
  ProducerParams p = make_params(ProducerMode::kFused, in, out, unused, unused);
  p.kv_cache = make_kv_cache_view(base, pages, n_kv, page_stride, kTile);
  p.index_cache = make_index_cache_view(base + 2 * kTile, pages, page_stride);
  ASSERT_TRUE(run_producer_cpu(p).ok());

  // Each touched page slot must hold exactly the written rows and zeros elsewhere; so must the
  // slots around them and the pages a 32-bit truncation of the offset of page 65536 would hit.
  const int64_t wrapped = (int64_t{65536} * page_stride) % (int64_t{1} << 31) / page_stride;
  for (int64_t page : {int64_t{0}, int64_t{1}, int64_t{65535}, int64_t{65536}, int64_t{65537},
                       int64_t{65539}, wrapped, wrapped + 1}) {
    SCOPED_TRACE(::testing::Message() << "page " << page);
    const uint8_t* slot_base = base + page * page_stride;
    std::vector<bool> written(static_cast<size_t>(page_stride), false);
    for (int64_t t = 0; t < in.tokens; ++t) {
      if (slots[t] / kPageSize != page) continue;
      const int64_t row = (slots[t] % kPageSize) * kHeadDim;
      std::string report;
      EXPECT_EQ(count_e4m3_mismatches(slot_base + row, &ref.k[t * kHeadDim], kHeadDim, &report), 0)
          << "K of token " << t << "\n"
          << report;
      EXPECT_EQ(std::memcmp(slot_base + kTile + row, &ref.v[t * kHeadDim], kHeadDim), 0)
          << "V of token " << t;
      EXPECT_EQ(count_e4m3_mismatches(slot_base + 2 * kTile + row, &ref.ik[t * kHeadDim], kHeadDim,
                                      &report),
                0)
          << "index-K of token " << t << "\n"
          << report;
      for (int64_t plane = 0; plane < 3; ++plane)
        for (int64_t i = 0; i < kHeadDim; ++i) written[plane * kTile + row + i] = true;
    }
    int64_t stray = 0;
    for (int64_t i = 0; i < page_stride; ++i)
      if (!written[i] && slot_base[i] != 0) ++stray;
    EXPECT_EQ(stray, 0) << "bytes written outside the slot rows";
  }
  for (int64_t t = 0; t < in.tokens; ++t)
    EXPECT_EQ(count_e4m3_mismatches(out.q.ptr<uint8_t>() + t * in.n_q * kHeadDim,
                                    &ref.q[t * in.n_q * kHeadDim], in.n_q * kHeadDim, nullptr),
              0)
        << "Q of token " << t;
}

}  // namespace
}  // namespace m3attn
