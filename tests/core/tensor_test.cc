#include "m3attn/tensor.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>

#include "support/rejection.h"

namespace m3attn {
namespace {

using testing::rejects;

void* fake_ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2);
  EXPECT_EQ(dtype_size(DType::kE4M3), 1);
  EXPECT_EQ(dtype_size(DType::kE8M0), 1);
  EXPECT_EQ(dtype_size(DType::kF32), 4);
  EXPECT_EQ(dtype_size(DType::kI32), 4);
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_STREQ(dtype_name(DType::kE4M3), "e4m3");
  EXPECT_STREQ(dtype_name(DType::kE8M0), "e8m0");
  EXPECT_STREQ(dtype_name(DType::kF32), "f32");
  EXPECT_STREQ(dtype_name(DType::kI32), "i32");
}

TEST(Device, EqualityAndNames) {
  EXPECT_EQ(Device::cpu(), Device());
  EXPECT_EQ(Device::cuda(1), Device::cuda(1));
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
  EXPECT_NE(Device::cpu(), Device::cuda(0));
  EXPECT_EQ(Device::cpu().to_string(), "cpu");
  EXPECT_EQ(Device::cuda(3).to_string(), "cuda:3");
}

TEST(TensorView, ContiguousStridesAndNumel) {
  const TensorView v = TensorView::contiguous(fake_ptr(0x1000), DType::kBF16, {3, 5, 7});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.stride[0], 35);
  EXPECT_EQ(v.stride[1], 7);
  EXPECT_EQ(v.stride[2], 1);
  EXPECT_EQ(v.numel(), 105);
  EXPECT_EQ(v.size(0), 3);
  EXPECT_EQ(v.size(-1), 7);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_TRUE(v.defined());
  EXPECT_EQ(v.shape_string(), "[3, 5, 7]");
  EXPECT_EQ(v.device, Device::cpu());
  const TensorView w = TensorView::contiguous(fake_ptr(0x1000), DType::kF32,
                                              std::vector<int64_t>{2, 4}, Device::cuda(1));
  EXPECT_EQ(w.stride[0], 4);
  EXPECT_EQ(w.device, Device::cuda(1));
  EXPECT_FALSE(TensorView().defined());
  EXPECT_EQ(TensorView().numel(), 1);  // a 0-d view holds one element
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::kF32, {4, 0, 3}).numel(), 0);
}

TEST(TensorView, StridedAndContiguity) {
  // A transposed [4, 6] view of a [6, 4] buffer.
  const TensorView t = TensorView::strided(fake_ptr(0x1000), DType::kF32, {4, 6}, {1, 4});
  EXPECT_EQ(t.stride[0], 1);
  EXPECT_EQ(t.stride[1], 4);
  EXPECT_FALSE(t.is_contiguous());
  // Padded rows are not contiguous.
  EXPECT_FALSE(TensorView::strided(fake_ptr(0x1000), DType::kF32, {4, 6}, {8, 1}).is_contiguous());
  // Size-1 dimensions may carry any stride.
  EXPECT_TRUE(TensorView::strided(fake_ptr(0x1000), DType::kF32, {1, 6}, {999, 1}).is_contiguous());
  EXPECT_TRUE(
      TensorView::strided(fake_ptr(0x1000), DType::kF32, {4, 1, 6}, {6, 12345, 1}).is_contiguous());
  // Row-major strides given explicitly are contiguous.
  EXPECT_TRUE(TensorView::strided(fake_ptr(0x1000), DType::kF32, {4, 6}, {6, 1}).is_contiguous());
}

TEST(TensorView, OffsetOfIs64BitAndInBytes) {
  // A page pool view with a page stride far beyond 2^31 elements in total.
  const int64_t page_stride = int64_t{60} * 2 * 4 * 128 * 128;  // 60 interleaved layers
  const TensorView kv = TensorView::strided(fake_ptr(0x1000), DType::kE4M3, {70000, 2, 4, 128, 128},
                                            {page_stride, 4 * 128 * 128, 128 * 128, 128, 1});
  const int64_t want = int64_t{65536} * page_stride + 1 * 65536 + 3 * 16384 + 127 * 128 + 5;
  EXPECT_GT(want, int64_t{1} << 31);
  EXPECT_EQ(kv.offset_of({65536, 1, 3, 127, 5}), want);
  // Element size multiplies.
  const TensorView b = TensorView::strided(fake_ptr(0x1000), DType::kBF16, {int64_t{1} << 32, 2},
                                           {int64_t{1} << 20, 1});
  EXPECT_EQ(b.offset_of({(int64_t{1} << 31) + 1, 1}),
            (((int64_t{1} << 31) + 1) * (int64_t{1} << 20) + 1) * 2);
  const TensorView f = TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {3, 5});
  EXPECT_EQ(f.offset_of({2, 4}), (2 * 5 + 4) * 4);
  EXPECT_EQ(f.offset_of({0, 0}), 0);
  // Negative strides (reversed views) are plain arithmetic.
  const TensorView r = TensorView::strided(fake_ptr(0x1000), DType::kI32, {5}, {-1});
  EXPECT_EQ(r.offset_of({3}), -12);
}

TEST(CheckHelpers, Dtype) {
  const TensorView v = TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {2});
  EXPECT_TRUE(check_dtype(v, DType::kF32, "x").ok());
  EXPECT_TRUE(rejects(check_dtype(v, DType::kBF16, "packed"), "packed must be bf16, got f32"));
}

TEST(CheckHelpers, NdimAndShape) {
  const TensorView v = TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {2, 3});
  EXPECT_TRUE(check_ndim(v, 2, "x").ok());
  EXPECT_TRUE(rejects(check_ndim(v, 3, "slots"), "slots must have 3 dimensions, got 2 [2, 3]"));
  EXPECT_TRUE(check_shape(v, {2, 3}, "x").ok());
  EXPECT_TRUE(rejects(check_shape(v, {2, 4}, "q"), "q must have shape [2, 4], got [2, 3]"));
  EXPECT_TRUE(rejects(check_shape(v, {2, 3, 1}, "q"), "q must have shape [2, 3, 1], got [2, 3]"));
  EXPECT_TRUE(rejects(check_shape(v, {2}, "q"), "q must have shape [2], got [2, 3]"));
  const TensorView e = TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {0});
  EXPECT_TRUE(check_shape(e, {0}, "empty").ok());
}

TEST(CheckHelpers, Contiguous) {
  EXPECT_TRUE(
      check_contiguous(TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {2, 3}), "x").ok());
  EXPECT_TRUE(rejects(
      check_contiguous(TensorView::strided(fake_ptr(0x1000), DType::kF32, {2, 3}, {1, 2}), "pos"),
      "pos must be contiguous (shape [2, 3])"));
}

TEST(CheckHelpers, Alignment) {
  EXPECT_TRUE(
      check_alignment(TensorView::contiguous(fake_ptr(0x1010), DType::kE4M3, {4}), 16, "a").ok());
  EXPECT_TRUE(rejects(
      check_alignment(TensorView::contiguous(fake_ptr(0x1012), DType::kE4M3, {4}), 16, "packed"),
      "packed base address must be 16-byte aligned (it is off by 2 bytes)"));
  EXPECT_TRUE(rejects(
      check_alignment(TensorView::contiguous(fake_ptr(0x1001), DType::kE4M3, {4}), 4, "cache"),
      "off by 1 bytes"));
}

TEST(CheckHelpers, SameDevice) {
  const TensorView a = TensorView::contiguous(fake_ptr(0x1000), DType::kF32, {2});
  const TensorView b = TensorView::contiguous(fake_ptr(0x2000), DType::kF32, {2});
  const TensorView g0 = TensorView::contiguous(fake_ptr(0x3000), DType::kF32, {2}, Device::cuda(0));
  const TensorView g1 = TensorView::contiguous(fake_ptr(0x4000), DType::kF32, {2}, Device::cuda(1));
  const TensorView undefined;
  EXPECT_TRUE(check_same_device({&a, &b}, "stage").ok());
  EXPECT_TRUE(check_same_device({}, "stage").ok());
  // Undefined (optional) views are skipped, whatever their device field says.
  TensorView undefined_gpu;
  undefined_gpu.device = Device::cuda(0);
  EXPECT_TRUE(check_same_device({&a, &undefined, &undefined_gpu, &b}, "stage").ok());
  EXPECT_TRUE(rejects(check_same_device({&a, &g0}, "producer"),
                      "producer: all tensors must be on one device, found cpu and cuda:0"));
  EXPECT_TRUE(rejects(check_same_device({&g0, &g1}, "indexer"), "found cuda:0 and cuda:1"));
  EXPECT_TRUE(rejects(check_same_device({&undefined, &g0, &a}, "x"), "found cuda:0 and cpu"));
}

TEST(Tensor, OwningBuffer) {
  Tensor t(DType::kBF16, {3, 5});
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(t.nbytes(), 30);
  ASSERT_NE(t.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  t.fill_bytes(0xab);
  for (int64_t i = 0; i < t.nbytes(); ++i) ASSERT_EQ(static_cast<uint8_t*>(t.data())[i], 0xab);
  const TensorView v = t.view();
  EXPECT_EQ(v.data, t.data());
  EXPECT_EQ(v.dtype, DType::kBF16);
  EXPECT_EQ(v.shape_string(), "[3, 5]");
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.device, Device::cpu());

  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
  EXPECT_EQ(std::memcmp(c.data(), t.data(), 30), 0);
  c.fill_bytes(0);
  EXPECT_EQ(static_cast<uint8_t*>(t.data())[0], 0xab);  // independent storage

  void* p = t.data();
  Tensor m = std::move(t);
  EXPECT_EQ(m.data(), p);  // moves keep the buffer
  EXPECT_EQ(m.shape(), (std::vector<int64_t>{3, 5}));

  Tensor empty(DType::kF32, {0, 7});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.nbytes(), 0);
  empty.fill_bytes(1);  // no-op on an empty buffer
  Tensor empty_copy = empty.clone();
  EXPECT_EQ(empty_copy.numel(), 0);
}

}  // namespace
}  // namespace m3attn
