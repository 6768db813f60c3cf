// GPU test helpers (only in CUDA builds): an owning device buffer, host<->device copies and the
// skip that every GPU test starts with. Without a device a test skips with a message; it never
// passes.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "m3attn/tensor.h"

namespace m3attn::testing {

bool cuda_device_available();
// Multiprocessors of the current device (aborts with a message if the query fails).
int current_device_sms();

// Owning device allocation; poisoned with `poison` bytes on creation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes, uint8_t poison = 0xA5);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void poison(uint8_t value);  // poison / upload: complete on the device when they return
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;
  std::vector<uint8_t> download_all() const;

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A device copy of a host tensor, and a view of it with the host tensor's shape.
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};
DeviceTensor to_device(const Tensor& host);
// Device view with the same shape/strides/dtype as `like`, pointing at `data`.
TensorView device_view_like(const TensorView& like, void* data);

}  // namespace m3attn::testing

#define M3_REQUIRE_GPU()                                                       \
  do {                                                                         \
    if (!::m3attn::testing::cuda_device_available())                           \
      GTEST_SKIP() << "no CUDA device: GPU test not run (this is not a pass)"; \
  } while (0)

#define M3_CUDA_TEST_CHECK(expr)                                           \
  do {                                                                     \
    cudaError_t e_ = (expr);                                               \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

#endif  // M3ATTN_WITH_CUDA
