#include "support/cuda_test_util.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cstdio>
#include <cstdlib>
#include <utility>

namespace m3attn::testing {
namespace {
void die_on(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}
}  // namespace

bool cuda_device_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

int current_device_sms() {
  int device = 0, sms = 0;
  die_on(cudaGetDevice(&device), "cudaGetDevice");
  die_on(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
         "cudaDeviceGetAttribute(MultiProcessorCount)");
  return sms;
}

DeviceBuffer::DeviceBuffer(size_t bytes, uint8_t poison_value) : bytes_(bytes) {
  if (bytes == 0) return;
  die_on(cudaMalloc(&ptr_, bytes), "cudaMalloc");
  poison(poison_value);
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

// poison and upload are complete when they return. cudaMemset and a pageable cudaMemcpy H2D run
// on the legacy default stream, which does not order work on the non-blocking streams the tests
// launch on, and a pageable H2D copy may return before its DMA has landed: without the device
// synchronisation a kernel launched right after could read the old input or have its output
// overwritten by a late poison.
void DeviceBuffer::poison(uint8_t value) {
  if (!bytes_) return;
  die_on(cudaMemset(ptr_, value, bytes_), "cudaMemset");
  die_on(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemset");
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  if (!bytes) return;
  die_on(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice),
         "cudaMemcpy H2D");
  die_on(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemcpy H2D");
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  if (bytes)
    die_on(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
           "cudaMemcpy D2H");
}

std::vector<uint8_t> DeviceBuffer::download_all() const {
  std::vector<uint8_t> out(bytes_);
  download(out.data(), bytes_);
  return out;
}

DeviceTensor to_device(const Tensor& host) {
  DeviceTensor d;
  d.buffer = DeviceBuffer(static_cast<size_t>(host.nbytes()));
  d.buffer.upload(host.data(), static_cast<size_t>(host.nbytes()));
  d.view = device_view_like(host.view(), d.buffer.data());
  return d;
}

TensorView device_view_like(const TensorView& like, void* data) {
  TensorView v = like;
  v.data = data;
  v.device = Device::cuda(0);
  return v;
}

}  // namespace m3attn::testing
#endif  // M3ATTN_WITH_CUDA
