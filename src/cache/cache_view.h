// Views of the paged E4M3 caches (SPEC section 4).
//   main KV : [num_pages, 2 (K, V), n_kv, 128 tokens, 128 dims]; dim stride 1, token stride 128,
//             head stride 128*128; page and plane strides are run-time int64 (multiples of 4).
//   index-K : [num_pages, 1, 128, 128]; run-time page stride.
// A pool may interleave many layers in one page slot, so page strides can be far larger than one
// layer's page; every address is computed in 64 bits.
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

namespace m3attn {

TensorView make_kv_cache_view(void* base, int64_t num_pages, int n_kv, int64_t page_stride,
                              int64_t plane_stride, Device device = Device::cpu());
TensorView make_index_cache_view(void* base, int64_t num_pages, int64_t page_stride,
                                 Device device = Device::cpu());

// dtype, rank, fixed inner strides, stride multiples of 4, base alignment 4 B, and that no two
// (page, plane, head) tiles overlap.
Status validate_kv_cache(const TensorView& kv, int n_kv, const char* what);
Status validate_index_cache(const TensorView& index_cache, const char* what);

// Byte offset of (page, plane, head, row) in a main cache / (page, row) in an index cache.
inline int64_t kv_cache_offset(const TensorView& kv, int64_t page, int plane, int head, int row) {
  return page * kv.stride[0] + plane * kv.stride[1] + head * kv.stride[2] + row * kv.stride[3];
}
inline int64_t index_cache_offset(const TensorView& ic, int64_t page, int row) {
  return page * ic.stride[0] + row * ic.stride[2];
}

}  // namespace m3attn
