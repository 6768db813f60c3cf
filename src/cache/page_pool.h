// The paged KV pool (SPEC section 4): host memory for num_pages page slots, each slot holding the
// pages of num_layers layers side by side, plus the layout arithmetic that turns a pool base
// pointer into each layer's main-cache and index-cache TensorViews.
//
// One page slot (page stride = num_layers * layer_bytes, all in E4M3 elements == bytes):
//
//   | layer 0 | layer 1 | ... | layer L-1 |
//   layer l = | K plane: n_kv heads x 128 x 128 | gap | V plane: n_kv x 128 x 128 | index-K 128 x
//   128 |
//             ^ 0                                      ^ plane_stride                ^ index_offset
//
// The plane stride is configurable (>= one plane, a multiple of 4), so tests can leave gaps between
// planes; the index page is present when the pool is built with_index (sparse layers; dense layers
// simply do not use it). Every page id names the same slot in every layer: one page table serves
// all layers of a model. All offsets are 64-bit.
#pragma once

#include <cstdint>
#include <string>

#include "m3attn/tensor.h"

namespace m3attn {

struct PagePoolConfig {
  int64_t num_pages = 0;     // page slots; page ids are int32 and slots page * 128 + row must fit
  int num_layers = 1;        // layers interleaved in one page slot
  int n_kv = 0;              // KV heads per layer (this rank)
  bool with_index = true;    // each layer page also holds one index-K page
  int64_t plane_stride = 0;  // elements from the K plane to the V plane; 0 = n_kv * 128 * 128

  Status validate() const;
};

// Where everything lives inside a pool; usable with any base pointer (host or device).
class PoolLayout {
 public:
  static Result<PoolLayout> create(const PagePoolConfig& config);

  const PagePoolConfig& config() const { return config_; }
  int64_t num_pages() const { return config_.num_pages; }
  int num_layers() const { return config_.num_layers; }
  int n_kv() const { return config_.n_kv; }
  bool with_index() const { return config_.with_index; }
  int64_t plane_stride() const { return plane_stride_; }
  int64_t layer_bytes() const { return layer_bytes_; }    // one layer's share of a page slot
  int64_t index_offset() const { return index_offset_; }  // index page inside a layer page
  int64_t page_stride() const { return page_stride_; }    // elements between page slots
  int64_t total_bytes() const { return page_stride_ * config_.num_pages; }

  // Views for one layer over a pool whose first byte is `base` (layer in [0, num_layers); the
  // index view requires with_index). No checks here: call check_layer first where the layer index
  // comes from outside.
  TensorView kv_cache_view(void* base, int layer, Device device = Device::cpu()) const;
  TensorView index_cache_view(void* base, int layer, Device device = Device::cpu()) const;
  Status check_layer(int layer, bool need_index) const;

  std::string to_string() const;  // "64 pages x 2 layers, kv heads 2, page stride 163840 B"

 private:
  PagePoolConfig config_;
  int64_t plane_stride_ = 0;
  int64_t layer_bytes_ = 0;
  int64_t index_offset_ = 0;
  int64_t page_stride_ = 0;
};

// A pool in host memory (64-byte aligned, zero-filled), the CPU backend's cache.
class PagePool {
 public:
  PagePool() = default;
  static Result<PagePool> create(const PagePoolConfig& config);

  PagePool(PagePool&&) noexcept = default;
  PagePool& operator=(PagePool&&) noexcept = default;
  PagePool clone() const;  // a byte-for-byte copy (tests: run two variants from one state)

  const PoolLayout& layout() const { return layout_; }
  int64_t num_pages() const { return layout_.num_pages(); }
  uint8_t* data() { return storage_.ptr<uint8_t>(); }
  const uint8_t* data() const { return storage_.ptr<uint8_t>(); }
  int64_t bytes() const { return storage_.nbytes(); }
  void fill(uint8_t value) { storage_.fill_bytes(value); }

  // e4m3 [num_pages, 2, n_kv, 128, 128] and [num_pages, 1, 128, 128] views of one layer.
  Result<TensorView> kv_cache(int layer) const;
  Result<TensorView> index_cache(int layer) const;

 private:
  PoolLayout layout_;
  Tensor storage_;
};

}  // namespace m3attn
