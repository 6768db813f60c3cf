#include "cache/cache_view.h"

#include <algorithm>

#include "m3attn/config.h"

namespace m3attn {

TensorView make_kv_cache_view(void* base, int64_t num_pages, int n_kv, int64_t page_stride,
                              int64_t plane_stride, Device device) {
  return TensorView::strided(
      base, DType::kE4M3, {num_pages, 2, n_kv, kPageSize, kHeadDim},
      {page_stride, plane_stride, int64_t{kPageSize} * kHeadDim, kHeadDim, 1}, device);
}

TensorView make_index_cache_view(void* base, int64_t num_pages, int64_t page_stride,
                                 Device device) {
  return TensorView::strided(base, DType::kE4M3, {num_pages, 1, kPageSize, kHeadDim},
                             {page_stride, int64_t{kPageSize} * kHeadDim, kHeadDim, 1}, device);
}

namespace {
constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (page, plane, head) tile
}

Status validate_kv_cache(const TensorView& kv, int n_kv, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(kv, DType::kE4M3, what));
  M3_RETURN_IF_ERROR(check_ndim(kv, 5, what));
  M3_CHECK_ARG(kv.shape[0] > 0, what, " must hold at least one page");
  M3_CHECK_ARG(kv.shape[1] == 2 && kv.shape[2] == n_kv && kv.shape[3] == kPageSize &&
                   kv.shape[4] == kHeadDim,
               what, " must have shape [pages, 2, ", n_kv, ", ", kPageSize, ", ", kHeadDim,
               "], got ", kv.shape_string(), " (page size must be ", kPageSize, ")");
  M3_CHECK_ARG(kv.stride[4] == 1 && kv.stride[3] == kHeadDim && kv.stride[2] == kTile, what,
               " inner strides must be (head ", kTile, ", token ", kHeadDim, ", dim 1), got (",
               kv.stride[2], ", ", kv.stride[3], ", ", kv.stride[4], ")");
  M3_CHECK_ARG(kv.stride[0] > 0 && kv.stride[0] % 4 == 0, what, " page stride ", kv.stride[0],
               " is not a positive multiple of 4");
  M3_CHECK_ARG(kv.stride[1] > 0 && kv.stride[1] % 4 == 0, what, " plane stride ", kv.stride[1],
               " is not a positive multiple of 4");
  M3_RETURN_IF_ERROR(check_alignment(kv, 4, what));
  // The K plane, the V plane and the next page must not overlap: each plane spans n_kv tiles.
  const int64_t plane_span = int64_t{n_kv} * kTile;
  M3_CHECK_ARG(kv.stride[1] >= plane_span, what, " plane stride ", kv.stride[1],
               " is smaller than one plane of ", n_kv, " heads (", plane_span, " elements)");
  // Two layouts keep every (page, plane) span disjoint: page-major (a page holds its K and V
  // planes: page stride >= plane stride + span) and plane-major (all K pages, then all V pages:
  // page stride
  // >= span and the V plane starts after the last K page).
  const int64_t pages = kv.shape[0];
  const bool page_major = pages == 1 || kv.stride[0] >= kv.stride[1] + plane_span;
  const bool plane_major =
      kv.stride[0] >= plane_span && kv.stride[1] >= (pages - 1) * kv.stride[0] + plane_span;
  M3_CHECK_ARG(page_major || plane_major, what, " page stride ", kv.stride[0],
               " overlaps the next page (needs >= ", kv.stride[1] + plane_span,
               "); a plane-major layout would need plane stride >= ",
               (pages - 1) * kv.stride[0] + plane_span);
  return Status::Ok();
}

Status validate_index_cache(const TensorView& ic, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(ic, DType::kE4M3, what));
  M3_RETURN_IF_ERROR(check_ndim(ic, 4, what));
  M3_CHECK_ARG(ic.shape[0] > 0, what, " must hold at least one page");
  M3_CHECK_ARG(ic.shape[1] == 1 && ic.shape[2] == kPageSize && ic.shape[3] == kHeadDim, what,
               " must have shape [pages, 1, ", kPageSize, ", ", kHeadDim, "], got ",
               ic.shape_string(), " (page size must be ", kPageSize, ")");
  M3_CHECK_ARG(ic.stride[3] == 1 && ic.stride[2] == kHeadDim, what,
               " inner strides must be (token ", kHeadDim, ", dim 1), got (", ic.stride[2], ", ",
               ic.stride[3], ")");
  M3_CHECK_ARG(ic.stride[0] > 0 && ic.stride[0] % 4 == 0, what, " page stride ", ic.stride[0],
               " is not a positive multiple of 4");
  M3_CHECK_ARG(ic.shape[0] == 1 || ic.stride[0] >= kTile, what, " page stride ", ic.stride[0],
               " makes index pages overlap (needs >= ", kTile, ")");
  M3_RETURN_IF_ERROR(check_alignment(ic, 4, what));
  return Status::Ok();
}

}  // namespace m3attn
