// BatchBuilder: a host batch for the downstream stages (indexer, attention) built from a list of
// requests {cached_len, new_tokens}: the BatchView tensors (query_start, positions, seq_lens, page
// table), a main KV pool and an index-K pool with every visible token filled, plus accessors that
// address one token's K / V / index-K row through the page table.
//
// Pool layout (what tests lean on):
//   - Pages are drawn from a pool of (pages needed + spare_pages) ids in a random order, so a
//     request's pages are neither contiguous nor ascending; page-table columns past a request's
//     last page hold -1.
//   - Every byte of the pools that no visible token owns (rows past seq_len in a last page, spare
//     pages, the gaps of strided layouts) holds the E4M3 NaN 0x7F (unowned_byte): a stage that
//     reads outside the contract produces NaN, and NaN never passes a comparison.
//   - Values are drawn in logical order (request, position, plane, head, dim), independent of the
//     layout, so two builds with the same seed, requests and fill but different strides hold the
//     same logical content and must give bit-identical results.
// GPU tests upload the pools and the batch tensors as they are and rebuild views over the device
// copies with kv_view_at / index_view_at / batch_view_at.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/batch.h"
#include "m3attn/tensor.h"
#include "support/test_util.h"

namespace m3attn::testing {

struct RequestSpec {
  int cached_len = 0;  // tokens already in the cache before this step (positions 0 .. cached-1)
  int new_tokens = 0;  // query tokens of this step (positions cached .. cached + new - 1)
};

// How cache values are drawn for every visible token.
enum class CacheFill {
  kNormal,    // E4M3 of N(0, stddev)
  kIntegers,  // integers in [int_lo, int_hi] (exact dot products)
  kZero,      // all zero (tests then write what they need through the accessors)
};

struct BatchOptions {
  int n_kv = 1;
  // Strides in elements; 0 selects the dense default (kv page 2 * n_kv * 128 * 128, kv plane
  // n_kv * 128 * 128, index page 128 * 128). Non-default strides must be multiples of 4 and large
  // enough not to overlap (the builder checks and fails the test otherwise).
  int64_t kv_page_stride = 0;
  int64_t kv_plane_stride = 0;
  int64_t index_page_stride = 0;
  int spare_pages = 3;       // pool pages no request owns (filled with unowned_byte)
  int extra_table_cols = 1;  // page-table columns beyond the longest request (hold -1)
  CacheFill fill = CacheFill::kNormal;
  // Every pool byte no visible token owns. The E4M3 NaN by default: a kernel that loads whole
  // 128-row tiles must mask rows past pos_t so that they cannot reach the result (note that a
  // masked score alone is not enough when V is NaN: 0 * NaN = NaN). Change it only to tell such a
  // failure apart from others while debugging.
  uint8_t unowned_byte = 0x7f;
  float stddev = 1.0f;
  int int_lo = -4;
  int int_hi = 4;
};

class HostBatch {
 public:
  // Views over the host tensors.
  BatchView batch_view() const;
  TensorView kv_cache() const;     // e4m3 [num_pages, 2, n_kv, 128, 128] strided
  TensorView index_cache() const;  // e4m3 [num_pages, 1, 128, 128] strided

  // The same views over device (or other) copies of the host tensors, which must be uploaded
  // byte for byte (same sizes, same layout).
  TensorView kv_view_at(void* base, Device device) const;
  TensorView index_view_at(void* base, Device device) const;
  BatchView batch_view_at(void* query_start, void* positions, void* seq_lens, void* page_table,
                          Device device) const;

  // Geometry.
  int n_kv() const { return n_kv_; }
  int num_requests() const { return static_cast<int>(requests_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_pages() const { return num_pages_; }
  int max_pages() const { return max_pages_; }
  int64_t kv_page_stride() const { return kv_page_stride_; }
  int64_t kv_plane_stride() const { return kv_plane_stride_; }
  int64_t index_page_stride() const { return index_page_stride_; }
  const RequestSpec& request(int r) const { return requests_[r]; }

  // Per query token t: its request, absolute position, and the request's sequence length.
  int request_of(int64_t t) const { return token_request_[t]; }
  int position_of(int64_t t) const { return positions.ptr<int32_t>()[t]; }
  int seq_len(int r) const { return seq_lens.ptr<int32_t>()[r]; }
  int32_t page_of(int r, int pos) const;  // physical page of token `pos` of request r

  // Row (128 E4M3 values) of token `pos` of request r, 0 <= pos < seq_len(r). plane 0 = K, 1 = V.
  uint8_t* kv_row(int r, int pos, int plane, int head);
  const uint8_t* kv_row(int r, int pos, int plane, int head) const;
  uint8_t* index_row(int r, int pos);
  const uint8_t* index_row(int r, int pos) const;

  // The batch tensors (contiguous i32) and the pools (flat e4m3 buffers).
  Tensor query_start;  // [R + 1]
  Tensor positions;    // [T]
  Tensor seq_lens;     // [R]
  Tensor page_table;   // [R, max_pages]
  Tensor kv_pool;      // e4m3 [kv_pool_elems]
  Tensor index_pool;   // e4m3 [index_pool_elems]

 private:
  friend HostBatch build_batch(const std::vector<RequestSpec>&, const BatchOptions&, Rng&);
  int n_kv_ = 0;
  int64_t num_tokens_ = 0;
  int64_t num_pages_ = 0;
  int max_pages_ = 0;
  int64_t kv_page_stride_ = 0;
  int64_t kv_plane_stride_ = 0;
  int64_t index_page_stride_ = 0;
  std::vector<RequestSpec> requests_;
  std::vector<int> token_request_;
};

// Builds the batch. Fails the calling test (ADD_FAILURE) and returns an empty batch on options
// that cannot describe a valid pool; callers should ASSERT_FALSE(::testing::Test::HasFailure()).
HostBatch build_batch(const std::vector<RequestSpec>& requests, const BatchOptions& options,
                      Rng& rng);

// The usual mixed step of SPEC section 7: `contexts` context chunks {cached, new} first, then
// `num_gen` generation requests of 1 + draft_len tokens each with cached lengths drawn from
// [1, max_gen_cached].
std::vector<RequestSpec> mixed_requests(const std::vector<RequestSpec>& contexts, int num_gen,
                                        int draft_len, int max_gen_cached, Rng& rng);

// "[{cached 100, new 3}, ...]" for failure messages.
std::string describe_requests(const std::vector<RequestSpec>& requests);

}  // namespace m3attn::testing
