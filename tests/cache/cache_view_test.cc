#include "cache/cache_view.h"

#include <gtest/gtest.h>

#include <string>

#include "m3attn/config.h"
#include "support/rejection.h"

namespace m3attn {
namespace {

// Validation never touches cache memory, so a fake (aligned) base address is enough.
void* base_at(uintptr_t addr) { return reinterpret_cast<void*>(addr); }
constexpr uintptr_t kBase = 0x100000;
constexpr int64_t kTile = 128 * 128;

using testing::rejects;

TEST(KvCacheView, LayoutOfACompactPool) {
  const int n_kv = 4;
  const TensorView kv =
      make_kv_cache_view(base_at(kBase), 10, n_kv, 2 * n_kv * kTile, n_kv * kTile);
  EXPECT_EQ(kv.dtype, DType::kE4M3);
  EXPECT_EQ(kv.ndim, 5);
  EXPECT_EQ(kv.shape_string(), "[10, 2, 4, 128, 128]");
  EXPECT_EQ(kv.stride[0], 2 * n_kv * kTile);
  EXPECT_EQ(kv.stride[1], n_kv * kTile);
  EXPECT_EQ(kv.stride[2], kTile);
  EXPECT_EQ(kv.stride[3], 128);
  EXPECT_EQ(kv.stride[4], 1);
  EXPECT_TRUE(kv.is_contiguous());
  EXPECT_TRUE(validate_kv_cache(kv, n_kv, "kv").ok());
  // One plane, page, head and row step each move by their stride.
  EXPECT_EQ(kv_cache_offset(kv, 3, 1, 2, 5), 3 * kv.stride[0] + kv.stride[1] + 2 * kTile + 5 * 128);
  EXPECT_EQ(kv_cache_offset(kv, 3, 1, 2, 5), kv.offset_of({3, 1, 2, 5, 0}));
}

TEST(KvCacheView, InterleavedPoolWith64BitOffsets) {
  // 60 layers of (K, V, index-K) pages per slot and page ids past 65536: offsets pass 2^31.
  const int n_kv = 4;
  const int64_t layer = (2 * n_kv + 1) * kTile;
  const int64_t page_stride = 60 * layer;
  const int64_t pages = 70000;
  const TensorView kv =
      make_kv_cache_view(base_at(kBase), pages, n_kv, page_stride, n_kv * kTile, Device::cuda(0));
  ASSERT_TRUE(validate_kv_cache(kv, n_kv, "kv").ok())
      << validate_kv_cache(kv, n_kv, "kv").to_string();
  EXPECT_EQ(kv.device, Device::cuda(0));
  const int64_t off = kv_cache_offset(kv, 65536, 1, 3, 127);
  EXPECT_EQ(off, int64_t{65536} * page_stride + n_kv * kTile + 3 * kTile + 127 * 128);
  EXPECT_GT(off, int64_t{1} << 31);
  EXPECT_EQ(off, kv.offset_of({65536, 1, 3, 127, 0}));

  const TensorView ic =
      make_index_cache_view(base_at(kBase + 2 * n_kv * kTile), pages, page_stride);
  ASSERT_TRUE(validate_index_cache(ic, "index").ok());
  EXPECT_EQ(index_cache_offset(ic, 65536, 9), int64_t{65536} * page_stride + 9 * 128);
  EXPECT_EQ(index_cache_offset(ic, 65536, 9), ic.offset_of({65536, 0, 9, 0}));
}

TEST(KvCacheView, PlaneGapAndSinglePage) {
  const int n_kv = 2;
  // A gap between the K and V planes (plane stride > one plane) is fine when pages do not overlap.
  const int64_t plane = n_kv * kTile + 64;
  EXPECT_TRUE(
      validate_kv_cache(
          make_kv_cache_view(base_at(kBase), 4, n_kv, 2 * plane + n_kv * kTile, plane), n_kv, "kv")
          .ok());
  // A single page only needs its two planes apart.
  EXPECT_TRUE(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 1, n_kv, 4, n_kv * kTile), n_kv, "kv")
          .ok());
}

TEST(KvCacheView, RejectsEveryRule) {
  const int n_kv = 2;
  const int64_t plane = n_kv * kTile, page = 2 * plane;
  const TensorView good = make_kv_cache_view(base_at(kBase), 8, n_kv, page, plane);
  ASSERT_TRUE(validate_kv_cache(good, n_kv, "kv").ok());

  TensorView v = good;
  v.dtype = DType::kBF16;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "kv must be e4m3, got bf16"));
  v = good;
  v.ndim = 4;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "kv must have 5 dimensions"));
  v = good;
  v.shape[0] = 0;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "kv must hold at least one page"));
  // Page size must be 128 (a 64-token page is a different cache).
  v = make_kv_cache_view(base_at(kBase), 8, n_kv, page, plane);
  v.shape[3] = 64;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "page size must be 128"));
  EXPECT_TRUE(rejects(validate_kv_cache(good, 4, "kv"),
                      "kv must have shape [pages, 2, 4, 128, 128], got [8, 2, 2, 128, 128]"));
  v = good;
  v.shape[1] = 1;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "must have shape [pages, 2,"));
  v = good;
  v.shape[4] = 64;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "must have shape"));
  // Fixed inner strides.
  v = good;
  v.stride[4] = 2;
  EXPECT_TRUE(
      rejects(validate_kv_cache(v, n_kv, "kv"),
              "kv inner strides must be (head 16384, token 128, dim 1), got (16384, 128, 2)"));
  v = good;
  v.stride[3] = 256;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "inner strides"));
  v = good;
  v.stride[2] = kTile + 128;
  EXPECT_TRUE(rejects(validate_kv_cache(v, n_kv, "kv"), "inner strides"));
  // Page and plane strides: positive multiples of 4.
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, page + 2, plane), n_kv, "kv"),
      "kv page stride 65538 is not a positive multiple of 4"));
  EXPECT_TRUE(
      rejects(validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, 0, plane), n_kv, "kv"),
              "page stride 0 is not a positive multiple of 4"));
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, -page, plane), n_kv, "kv"),
      "is not a positive multiple of 4"));
  EXPECT_TRUE(
      rejects(validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, page + 4, plane + 2),
                                n_kv, "kv"),
              "plane stride 32770 is not a positive multiple of 4"));
  EXPECT_TRUE(
      rejects(validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, page, 0), n_kv, "kv"),
              "plane stride 0"));
  // Overlaps: V plane inside the K plane; a page running into the next one.
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, page, plane - 4), n_kv, "kv"),
      "plane stride 32764 is smaller than one plane of 2 heads (32768 elements)"));
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, page - 4, plane), n_kv, "kv"),
      "page stride 65532 overlaps the next page (needs >= 65536)"));
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 2, n_kv, plane, plane), n_kv, "kv"),
      "overlaps the next page"));
  // Plane-major (all K pages, then all V pages) keeps every span disjoint and is accepted.
  EXPECT_TRUE(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, plane, 8 * plane), n_kv, "kv")
          .ok());
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase), 8, n_kv, plane, 7 * plane), n_kv, "kv"),
      "plane-major layout would need plane stride >= 262144"));
  // Base alignment: 4 bytes.
  EXPECT_TRUE(rejects(
      validate_kv_cache(make_kv_cache_view(base_at(kBase + 2), 8, n_kv, page, plane), n_kv, "kv"),
      "kv base address must be 4-byte aligned (it is off by 2 bytes)"));
  EXPECT_TRUE(
      validate_kv_cache(make_kv_cache_view(base_at(kBase + 4), 8, n_kv, page, plane), n_kv, "kv")
          .ok());
}

TEST(IndexCacheView, LayoutAndRules) {
  const TensorView good = make_index_cache_view(base_at(kBase), 6, kTile);
  EXPECT_EQ(good.shape_string(), "[6, 1, 128, 128]");
  EXPECT_EQ(good.stride[0], kTile);
  EXPECT_EQ(good.stride[2], 128);
  EXPECT_EQ(good.stride[3], 1);
  ASSERT_TRUE(validate_index_cache(good, "ic").ok());
  EXPECT_TRUE(validate_index_cache(make_index_cache_view(base_at(kBase), 1, 4), "ic").ok());

  TensorView v = good;
  v.dtype = DType::kF32;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"), "ic must be e4m3, got f32"));
  v = good;
  v.ndim = 5;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"), "ic must have 4 dimensions"));
  v = good;
  v.shape[0] = 0;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"), "at least one page"));
  v = good;
  v.shape[2] = 64;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"), "page size must be 128"));
  v = good;
  v.shape[1] = 2;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"),
                      "ic must have shape [pages, 1, 128, 128], got [6, 2, 128, 128]"));
  v = good;
  v.stride[3] = 2;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"),
                      "ic inner strides must be (token 128, dim 1), got (128, 2)"));
  v = good;
  v.stride[2] = 256;
  EXPECT_TRUE(rejects(validate_index_cache(v, "ic"), "inner strides"));
  EXPECT_TRUE(
      rejects(validate_index_cache(make_index_cache_view(base_at(kBase), 6, kTile + 2), "ic"),
              "ic page stride 16386 is not a positive multiple of 4"));
  EXPECT_TRUE(rejects(validate_index_cache(make_index_cache_view(base_at(kBase), 6, -kTile), "ic"),
                      "is not a positive multiple of 4"));
  EXPECT_TRUE(
      rejects(validate_index_cache(make_index_cache_view(base_at(kBase), 6, kTile - 4), "ic"),
              "ic page stride 16380 makes index pages overlap (needs >= 16384)"));
  EXPECT_TRUE(
      rejects(validate_index_cache(make_index_cache_view(base_at(kBase + 1), 6, kTile), "ic"),
              "ic base address must be 4-byte aligned (it is off by 1 bytes)"));
}

}  // namespace
}  // namespace m3attn
