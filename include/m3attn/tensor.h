// TensorView: a non-owning view of a strided tensor (pointer, dtype, shape, int64 strides in
// elements, device). Stage params structs carry TensorViews so that one validation routine serves
// the CPU twin and the CUDA launcher alike. Tensor: an owning host buffer for tests, tools and the
// CPU backend.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "m3attn/status.h"

namespace m3attn {

enum class DType : uint8_t { kBF16, kE4M3, kE8M0, kF32, kI32 };

int dtype_size(DType dtype);          // bytes per element
const char* dtype_name(DType dtype);  // "bf16", "e4m3", ...

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string to_string() const;  // "cpu", "cuda:0"
};

constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};  // in elements
  Device device;

  // Contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());
  // Explicit strides (same length as shape).
  static TensorView strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                            std::initializer_list<int64_t> strides, Device device = Device::cpu());

  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  int64_t size(int d) const { return shape[d < 0 ? d + ndim : d]; }
  bool is_contiguous() const;
  // Byte offset of the element with the given index (no bounds checks; 64-bit throughout).
  int64_t offset_of(std::initializer_list<int64_t> index) const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string shape_string() const;  // "[4, 128]"
};

// The [lo, hi) bytes a view can touch (validated views have positive strides); empty for a view
// with no elements or no data. Used to reject outputs that alias inputs or each other.
struct ByteRange {
  uintptr_t lo = 0;
  uintptr_t hi = 0;
  bool empty() const { return hi <= lo; }
};
ByteRange byte_range(const TensorView& t);
bool ranges_overlap(const ByteRange& a, const ByteRange& b);

// Validation helpers: each returns invalid_argument naming `what` and the values.
Status check_dtype(const TensorView& t, DType dtype, const char* what);
Status check_ndim(const TensorView& t, int ndim, const char* what);
Status check_shape(const TensorView& t, std::initializer_list<int64_t> shape, const char* what);
Status check_contiguous(const TensorView& t, const char* what);
Status check_alignment(const TensorView& t, int bytes, const char* what);
// dtype, shape, contiguity and base alignment, in that order (the usual checks on a packed tensor).
Status check_packed(const TensorView& t, DType dtype, std::initializer_list<int64_t> shape,
                    int alignment, const char* what);
Status check_same_device(std::initializer_list<const TensorView*> tensors, const char* stage);

// Owning, contiguous host tensor (64-byte aligned). Cheap to move, explicit to copy.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, std::vector<int64_t> shape);
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor clone() const;

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype_); }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  template <typename T>
  T* ptr() {
    return reinterpret_cast<T*>(storage_.data());
  }
  template <typename T>
  const T* ptr() const {
    return reinterpret_cast<const T*>(storage_.data());
  }
  TensorView view() const;
  void fill_bytes(uint8_t value);

 private:
  struct alignas(64) Chunk {
    uint8_t bytes[64];
  };
  struct Storage {
    std::vector<Chunk> chunks;
    // Through the vector's pointer, not chunks[0].bytes: the latter makes GCC treat every access
    // as bounded by one 64-byte chunk (false -Wstringop-overflow on constant offsets).
    uint8_t* data() { return chunks.empty() ? nullptr : reinterpret_cast<uint8_t*>(chunks.data()); }
    const uint8_t* data() const {
      return chunks.empty() ? nullptr : reinterpret_cast<const uint8_t*>(chunks.data());
    }
  };
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  Storage storage_;
};

}  // namespace m3attn
