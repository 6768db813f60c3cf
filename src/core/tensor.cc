#include "m3attn/tensor.h"

#include <cstring>
#include <sstream>

namespace m3attn {

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kE4M3:
      return 1;
    case DType::kE8M0:
      return 1;
    case DType::kF32:
      return 4;
    case DType::kI32:
      return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kE4M3:
      return "e4m3";
    case DType::kE8M0:
      return "e8m0";
    case DType::kF32:
      return "f32";
    case DType::kI32:
      return "i32";
  }
  return "?";
}

std::string Device::to_string() const {
  return type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(index);
}

namespace {
TensorView make_contiguous(void* data, DType dtype, const int64_t* shape, int ndim, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = ndim;
  v.device = device;
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = s;
    s *= shape[d];
  }
  return v;
}
}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape.begin(), static_cast<int>(shape.size()), device);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  return make_contiguous(data, dtype, shape.data(), static_cast<int>(shape.size()), device);
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides, Device device) {
  TensorView v =
      make_contiguous(data, dtype, shape.begin(), static_cast<int>(shape.size()), device);
  int d = 0;
  for (int64_t s : strides) {
    if (d < kMaxDims) v.stride[d] = s;
    ++d;
  }
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

int64_t TensorView::offset_of(std::initializer_list<int64_t> index) const {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) off += i * stride[d++];
  return off * dtype_size(dtype);
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "]";
  return os.str();
}

ByteRange byte_range(const TensorView& t) {
  if (t.data == nullptr || t.numel() == 0) return {};
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride[d];
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  return {base, base + static_cast<uintptr_t>((last + 1) * dtype_size(t.dtype))};
}

bool ranges_overlap(const ByteRange& a, const ByteRange& b) {
  return !a.empty() && !b.empty() && a.lo < b.hi && b.lo < a.hi;
}

Status check_dtype(const TensorView& t, DType dtype, const char* what) {
  M3_CHECK_ARG(t.dtype == dtype, what, " must be ", dtype_name(dtype), ", got ",
               dtype_name(t.dtype));
  return Status::Ok();
}

Status check_ndim(const TensorView& t, int ndim, const char* what) {
  M3_CHECK_ARG(t.ndim == ndim, what, " must have ", ndim, " dimensions, got ", t.ndim, " ",
               t.shape_string());
  return Status::Ok();
}

Status check_shape(const TensorView& t, std::initializer_list<int64_t> shape, const char* what) {
  bool same = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  std::ostringstream want;
  want << "[";
  for (int64_t s : shape) {
    if (same && t.shape[d] != s) same = false;
    want << (d ? ", " : "") << s;
    ++d;
  }
  want << "]";
  M3_CHECK_ARG(same, what, " must have shape ", want.str(), ", got ", t.shape_string());
  return Status::Ok();
}

Status check_contiguous(const TensorView& t, const char* what) {
  M3_CHECK_ARG(t.is_contiguous(), what, " must be contiguous (shape ", t.shape_string(), ")");
  return Status::Ok();
}

Status check_alignment(const TensorView& t, int bytes, const char* what) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data);
  M3_CHECK_ARG(addr % bytes == 0, what, " base address must be ", bytes,
               "-byte aligned (it is off by ", addr % bytes, " bytes)");
  return Status::Ok();
}

Status check_packed(const TensorView& t, DType dtype, std::initializer_list<int64_t> shape,
                    int alignment, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(t, dtype, what));
  M3_RETURN_IF_ERROR(check_shape(t, shape, what));
  M3_RETURN_IF_ERROR(check_contiguous(t, what));
  return check_alignment(t, alignment, what);
}

Status check_same_device(std::initializer_list<const TensorView*> tensors, const char* stage) {
  const TensorView* first = nullptr;
  for (const TensorView* t : tensors) {
    if (!t->defined()) continue;
    if (!first) {
      first = t;
      continue;
    }
    M3_CHECK_ARG(t->device == first->device, stage, ": all tensors must be on one device, found ",
                 first->device.to_string(), " and ", t->device.to_string());
  }
  return Status::Ok();
}

Tensor::Tensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  const int64_t bytes = nbytes();
  storage_.chunks.resize(static_cast<size_t>((bytes + 63) / 64));
}

Tensor Tensor::clone() const {
  Tensor t(dtype_, shape_);
  if (nbytes() > 0) std::memcpy(t.data(), data(), static_cast<size_t>(nbytes()));
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

TensorView Tensor::view() const {
  return TensorView::contiguous(const_cast<void*>(data()), dtype_, shape_, Device::cpu());
}

void Tensor::fill_bytes(uint8_t value) {
  if (nbytes() > 0) std::memset(data(), value, static_cast<size_t>(nbytes()));
}

}  // namespace m3attn
