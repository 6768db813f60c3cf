#include "cache/page_pool.h"

#include <limits>
#include <sstream>

#include "cache/cache_view.h"
#include "m3attn/config.h"

namespace m3attn {

namespace {
constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (plane, head) page: 16384 B
// Slots are int32 (page * 128 + row), so page ids stay below 2^31 / 128.
constexpr int64_t kMaxPages = (int64_t{1} << 31) / kPageSize;
}  // namespace

Status PagePoolConfig::validate() const {
  M3_CHECK_ARG(num_pages > 0 && num_pages <= kMaxPages, "page pool needs 1 .. ", kMaxPages,
               " pages (slots are int32 page * 128 + row), got ", num_pages);
  M3_CHECK_ARG(num_layers > 0, "page pool needs at least one layer, got ", num_layers);
  M3_CHECK_ARG(n_kv > 0, "page pool KV head count must be > 0, got ", n_kv);
  const int64_t plane = int64_t{n_kv} * kTile;
  M3_CHECK_ARG(plane_stride == 0 || plane_stride >= plane, "page pool plane stride ", plane_stride,
               " is smaller than one plane of ", n_kv, " heads (", plane, " elements)");
  M3_CHECK_ARG(plane_stride % 4 == 0, "page pool plane stride ", plane_stride,
               " is not a multiple of 4");
  return Status::Ok();
}

Result<PoolLayout> PoolLayout::create(const PagePoolConfig& config) {
  M3_RETURN_IF_ERROR(config.validate());
  PoolLayout l;
  l.config_ = config;
  const int64_t plane = int64_t{config.n_kv} * kTile;
  l.plane_stride_ = config.plane_stride == 0 ? plane : config.plane_stride;
  l.index_offset_ = l.plane_stride_ + plane;
  l.layer_bytes_ = l.index_offset_ + (config.with_index ? kTile : 0);
  // Overflow guard: the whole pool must be addressable with int64 (and fit a size_t).
  const int64_t max_bytes = std::numeric_limits<int64_t>::max() / 4;
  M3_CHECK_ARG(l.layer_bytes_ <= max_bytes / config.num_layers, "page pool layer page of ",
               l.layer_bytes_, " bytes x ", config.num_layers, " layers overflows");
  l.page_stride_ = l.layer_bytes_ * config.num_layers;
  M3_CHECK_ARG(l.page_stride_ <= max_bytes / config.num_pages, "page pool of ", config.num_pages,
               " pages x ", l.page_stride_, " bytes overflows");
  return l;
}

TensorView PoolLayout::kv_cache_view(void* base, int layer, Device device) const {
  auto* p = static_cast<uint8_t*>(base) + int64_t{layer} * layer_bytes_;
  return make_kv_cache_view(p, config_.num_pages, config_.n_kv, page_stride_, plane_stride_,
                            device);
}

TensorView PoolLayout::index_cache_view(void* base, int layer, Device device) const {
  auto* p = static_cast<uint8_t*>(base) + int64_t{layer} * layer_bytes_ + index_offset_;
  return make_index_cache_view(p, config_.num_pages, page_stride_, device);
}

Status PoolLayout::check_layer(int layer, bool need_index) const {
  M3_CHECK_ARG(layer >= 0 && layer < config_.num_layers, "layer ", layer,
               " is outside the page pool's ", config_.num_layers, " layers");
  M3_CHECK_ARG(!need_index || config_.with_index,
               "the page pool was built without index-K pages (with_index = false)");
  return Status::Ok();
}

std::string PoolLayout::to_string() const {
  std::ostringstream os;
  os << config_.num_pages << " pages x " << config_.num_layers << " layers, kv heads "
     << config_.n_kv << (config_.with_index ? " + index-K" : "") << ", page stride " << page_stride_
     << " B, pool " << total_bytes() << " B";
  return os.str();
}

Result<PagePool> PagePool::create(const PagePoolConfig& config) {
  Result<PoolLayout> layout = PoolLayout::create(config);
  M3_RETURN_IF_ERROR(layout.status());
  PagePool pool;
  pool.layout_ = layout.value();
  pool.storage_ = Tensor(DType::kE4M3, {pool.layout_.total_bytes()});
  pool.storage_.fill_bytes(0);
  return pool;
}

PagePool PagePool::clone() const {
  PagePool p;
  p.layout_ = layout_;
  p.storage_ = storage_.clone();
  return p;
}

Result<TensorView> PagePool::kv_cache(int layer) const {
  M3_RETURN_IF_ERROR(layout_.check_layer(layer, false));
  return layout_.kv_cache_view(const_cast<uint8_t*>(data()), layer);
}

Result<TensorView> PagePool::index_cache(int layer) const {
  M3_RETURN_IF_ERROR(layout_.check_layer(layer, true));
  return layout_.index_cache_view(const_cast<uint8_t*>(data()), layer);
}

}  // namespace m3attn
