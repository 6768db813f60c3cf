#include "support/batch_builder.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <sstream>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"

namespace m3attn::testing {

namespace {

constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (page, plane, head) tile

uint8_t draw(const BatchOptions& o, Rng& rng) {
  switch (o.fill) {
    case CacheFill::kNormal:
      return float_to_e4m3(rng.normal(0.0f, o.stddev));
    case CacheFill::kIntegers:
      return float_to_e4m3(static_cast<float>(rng.integer(o.int_lo, o.int_hi)));
    case CacheFill::kZero:
      return 0;
  }
  return 0;
}

}  // namespace

BatchView HostBatch::batch_view() const {
  return batch_view_at(const_cast<void*>(query_start.data()), const_cast<void*>(positions.data()),
                       const_cast<void*>(seq_lens.data()), const_cast<void*>(page_table.data()),
                       Device::cpu());
}

TensorView HostBatch::kv_cache() const {
  return kv_view_at(const_cast<void*>(kv_pool.data()), Device::cpu());
}

TensorView HostBatch::index_cache() const {
  return index_view_at(const_cast<void*>(index_pool.data()), Device::cpu());
}

TensorView HostBatch::kv_view_at(void* base, Device device) const {
  return make_kv_cache_view(base, num_pages_, n_kv_, kv_page_stride_, kv_plane_stride_, device);
}

TensorView HostBatch::index_view_at(void* base, Device device) const {
  return make_index_cache_view(base, num_pages_, index_page_stride_, device);
}

BatchView HostBatch::batch_view_at(void* qs, void* pos, void* lens, void* table,
                                   Device device) const {
  BatchView b;
  b.num_tokens = num_tokens_;
  b.num_requests = num_requests();
  b.max_pages = max_pages_;
  b.query_start = TensorView::contiguous(qs, DType::kI32, {int64_t{b.num_requests} + 1}, device);
  b.positions = TensorView::contiguous(pos, DType::kI32, {num_tokens_}, device);
  b.seq_lens = TensorView::contiguous(lens, DType::kI32, {int64_t{b.num_requests}}, device);
  b.page_table = TensorView::contiguous(table, DType::kI32,
                                        {int64_t{b.num_requests}, int64_t{max_pages_}}, device);
  return b;
}

int32_t HostBatch::page_of(int r, int pos) const {
  return page_table.ptr<int32_t>()[int64_t{r} * max_pages_ + pos / kPageSize];
}

uint8_t* HostBatch::kv_row(int r, int pos, int plane, int head) {
  return kv_pool.ptr<uint8_t>() + int64_t{page_of(r, pos)} * kv_page_stride_ +
         plane * kv_plane_stride_ + head * kTile + int64_t{pos % kPageSize} * kHeadDim;
}
const uint8_t* HostBatch::kv_row(int r, int pos, int plane, int head) const {
  return const_cast<HostBatch*>(this)->kv_row(r, pos, plane, head);
}

uint8_t* HostBatch::index_row(int r, int pos) {
  return index_pool.ptr<uint8_t>() + int64_t{page_of(r, pos)} * index_page_stride_ +
         int64_t{pos % kPageSize} * kHeadDim;
}
const uint8_t* HostBatch::index_row(int r, int pos) const {
  return const_cast<HostBatch*>(this)->index_row(r, pos);
}

HostBatch build_batch(const std::vector<RequestSpec>& requests, const BatchOptions& o, Rng& rng) {
  HostBatch h;
  const int64_t kv_plane = o.kv_plane_stride ? o.kv_plane_stride : int64_t{o.n_kv} * kTile;
  const int64_t kv_page = o.kv_page_stride ? o.kv_page_stride : kv_plane + int64_t{o.n_kv} * kTile;
  const int64_t ix_page = o.index_page_stride ? o.index_page_stride : kTile;
  if (o.n_kv <= 0 || kv_plane % 4 || kv_page % 4 || ix_page % 4 ||
      kv_plane < int64_t{o.n_kv} * kTile || kv_page < kv_plane + int64_t{o.n_kv} * kTile ||
      ix_page < kTile || o.spare_pages < 0 || o.extra_table_cols < 0) {
    ADD_FAILURE() << "build_batch: invalid options (n_kv " << o.n_kv << ", kv page stride "
                  << kv_page << ", plane stride " << kv_plane << ", index page stride " << ix_page
                  << ")";
    return h;
  }
  for (const RequestSpec& rq : requests) {
    if (rq.cached_len < 0 || rq.new_tokens < 0) {
      ADD_FAILURE() << "build_batch: negative request " << describe_requests(requests);
      return h;
    }
  }
  h.n_kv_ = o.n_kv;
  h.kv_page_stride_ = kv_page;
  h.kv_plane_stride_ = kv_plane;
  h.index_page_stride_ = ix_page;
  h.requests_ = requests;
  const int R = static_cast<int>(requests.size());

  // Pages: every request's pages drawn from one shuffled pool.
  int64_t pages_needed = 0;
  int max_req_pages = 0;
  std::vector<int> req_pages(R);
  for (int r = 0; r < R; ++r) {
    const int len = requests[r].cached_len + requests[r].new_tokens;
    req_pages[r] = (len + kPageSize - 1) / kPageSize;
    pages_needed += req_pages[r];
    max_req_pages = std::max(max_req_pages, req_pages[r]);
  }
  h.num_pages_ = std::max<int64_t>(1, pages_needed + o.spare_pages);
  h.max_pages_ = max_req_pages + o.extra_table_cols;
  std::vector<int32_t> perm(static_cast<size_t>(h.num_pages_));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.engine());

  h.query_start = Tensor(DType::kI32, {R + 1});
  h.seq_lens = Tensor(DType::kI32, {R});
  h.page_table = Tensor(DType::kI32, {R, h.max_pages_});
  int32_t* qs = h.query_start.ptr<int32_t>();
  int32_t* lens = h.seq_lens.ptr<int32_t>();
  int32_t* table = h.page_table.ptr<int32_t>();
  std::fill(table, table + int64_t{R} * h.max_pages_, -1);
  int64_t next_page = 0;
  qs[0] = 0;
  for (int r = 0; r < R; ++r) {
    qs[r + 1] = qs[r] + requests[r].new_tokens;
    lens[r] = requests[r].cached_len + requests[r].new_tokens;
    for (int j = 0; j < req_pages[r]; ++j) table[int64_t{r} * h.max_pages_ + j] = perm[next_page++];
  }
  h.num_tokens_ = qs[R];
  h.positions = Tensor(DType::kI32, {h.num_tokens_});
  h.token_request_.resize(static_cast<size_t>(h.num_tokens_));
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < requests[r].new_tokens; ++i) {
      h.positions.ptr<int32_t>()[qs[r] + i] = requests[r].cached_len + i;
      h.token_request_[qs[r] + i] = r;
    }
  }

  // Pools: unowned_byte everywhere, then every visible token's rows in logical order.
  const int64_t kv_elems = (h.num_pages_ - 1) * kv_page + kv_plane + int64_t{o.n_kv} * kTile;
  const int64_t ix_elems = (h.num_pages_ - 1) * ix_page + kTile;
  h.kv_pool = Tensor(DType::kE4M3, {kv_elems});
  h.index_pool = Tensor(DType::kE4M3, {ix_elems});
  h.kv_pool.fill_bytes(o.unowned_byte);
  h.index_pool.fill_bytes(o.unowned_byte);
  for (int r = 0; r < R; ++r) {
    for (int pos = 0; pos < lens[r]; ++pos) {
      for (int plane = 0; plane < 2; ++plane)
        for (int head = 0; head < o.n_kv; ++head) {
          uint8_t* row = h.kv_row(r, pos, plane, head);
          for (int d = 0; d < kHeadDim; ++d) row[d] = draw(o, rng);
        }
      uint8_t* irow = h.index_row(r, pos);
      for (int d = 0; d < kHeadDim; ++d) irow[d] = draw(o, rng);
    }
  }
  return h;
}

std::vector<RequestSpec> mixed_requests(const std::vector<RequestSpec>& contexts, int num_gen,
                                        int draft_len, int max_gen_cached, Rng& rng) {
  std::vector<RequestSpec> out = contexts;
  for (int i = 0; i < num_gen; ++i)
    out.push_back({static_cast<int>(rng.integer(1, std::max(1, max_gen_cached))), 1 + draft_len});
  return out;
}

std::string describe_requests(const std::vector<RequestSpec>& requests) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < requests.size(); ++i)
    os << (i ? ", " : "") << "{cached " << requests[i].cached_len << ", new "
       << requests[i].new_tokens << "}";
  os << "]";
  return os.str();
}

}  // namespace m3attn::testing
