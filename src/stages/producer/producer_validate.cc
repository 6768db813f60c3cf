// Host validation of the producer (SPEC section 8), shared by the CPU twin and the CUDA launcher.
// Every rule returns invalid_argument naming the rule and the values; nothing is written.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cache/cache_view.h"
#include "m3attn/config.h"
#include "stages/producer/producer.h"

namespace m3attn {

const char* producer_mode_name(ProducerMode mode) {
  switch (mode) {
    case ProducerMode::kFused:
      return "fused";
    case ProducerMode::kMain:
      return "main";
    case ProducerMode::kIndex:
      return "index";
  }
  return "?";
}

int64_t producer_packed_width(ProducerMode mode, int n_q, int n_kv) {
  switch (mode) {
    case ProducerMode::kFused:
      return (int64_t{n_q} + 3 * int64_t{n_kv} + 1) * kHeadDim;
    case ProducerMode::kMain:
      return (int64_t{n_q} + 2 * int64_t{n_kv}) * kHeadDim;
    case ProducerMode::kIndex:
      return (int64_t{n_kv} + 1) * kHeadDim;
  }
  return -1;
}

namespace {

constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;  // one (page, plane, head) tile, bytes

int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// Whether a tile of the index cache shares a byte with a K or V plane of the main cache. Both are
// lattices of pages; a pool that interleaves layers (and the index cache) in one page slot has
// overlapping overall extents but disjoint tiles, so with equal page strides the check is exact:
// index page b and main page a overlap iff k = b - a satisfies
//   c - kTile < k * P + d < c + n_kv * kTile   for a plane offset c in {0, plane stride},
// with d = index base - main base. With different page strides the whole extents are compared
// (conservative).
bool caches_overlap(const TensorView& kv, const TensorView& ic) {
  const int64_t p = kv.stride[0];
  if (p != ic.stride[0]) return ranges_overlap(byte_range(kv), byte_range(ic));
  const int64_t d = static_cast<int64_t>(reinterpret_cast<intptr_t>(ic.data)) -
                    static_cast<int64_t>(reinterpret_cast<intptr_t>(kv.data));
  const int64_t k_lo = -(kv.shape[0] - 1), k_hi = ic.shape[0] - 1;
  const int64_t plane_span = int64_t{kv.shape[2]} * kTile;
  for (const int64_t c : {int64_t{0}, kv.stride[1]}) {
    const int64_t lo = c - kTile - d;       // k * P must be > lo ...
    const int64_t hi = c + plane_span - d;  // ... and < hi
    const int64_t k = std::max(floor_div(lo, p) + 1, k_lo);
    if (k <= k_hi && k * p < hi) return true;
  }
  return false;
}

Status check_vector(const TensorView& t, DType dtype, int64_t min_len, bool exact,
                    const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(t, dtype, what));
  M3_RETURN_IF_ERROR(check_ndim(t, 1, what));
  if (exact) {
    M3_CHECK_ARG(t.shape[0] == min_len, what, " length ", t.shape[0], " must equal T = ", min_len);
  } else {
    M3_CHECK_ARG(t.shape[0] >= min_len, what, " length ", t.shape[0],
                 " is shorter than T = ", min_len);
  }
  M3_CHECK_ARG(t.shape[0] <= 1 || t.stride[0] == 1, what, " must be contiguous (stride ",
               t.stride[0], ")");
  M3_CHECK_ARG(min_len == 0 || t.data != nullptr, what, " is null");
  return check_alignment(t, dtype_size(dtype), what);
}

Status check_norm_weight(const TensorView& w, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(w, DType::kBF16, what));
  M3_RETURN_IF_ERROR(check_shape(w, {kHeadDim}, what));
  M3_RETURN_IF_ERROR(check_contiguous(w, what));
  M3_CHECK_ARG(w.data != nullptr, what, " is null");
  return check_alignment(w, 16, what);
}

// Compact e4m3 [T, heads, 128] output.
Status check_head_output(const TensorView& t, int64_t tokens, int heads, const char* what) {
  M3_RETURN_IF_ERROR(check_dtype(t, DType::kE4M3, what));
  M3_RETURN_IF_ERROR(check_shape(t, {tokens, heads, kHeadDim}, what));
  M3_RETURN_IF_ERROR(check_contiguous(t, what));
  M3_CHECK_ARG(tokens == 0 || t.data != nullptr, what, " is null");
  return check_alignment(t, 16, what);
}

}  // namespace

Status validate_producer(const ProducerParams& p) {
  const int mode_value = static_cast<int>(p.mode);
  M3_CHECK_ARG(mode_value >= 0 && mode_value <= 2, "producer mode ", mode_value,
               " is not fused (0), main (1) or index (2)");
  const bool uses_main = p.mode != ProducerMode::kIndex;  // Q, K, V
  const bool uses_index = p.mode != ProducerMode::kMain;  // index-Q, index-K
  const char* mode = producer_mode_name(p.mode);

  // Scalars.
  M3_CHECK_ARG(p.n_kv > 0, "producer (", mode, "): n_kv must be > 0, got ", p.n_kv);
  if (uses_main) {
    M3_CHECK_ARG(p.n_q > 0, "producer (", mode, "): n_q must be > 0, got ", p.n_q);
    M3_CHECK_ARG(p.n_q % p.n_kv == 0, "producer (", mode, "): n_q ", p.n_q,
                 " is not a multiple of n_kv ", p.n_kv);
  }
  M3_CHECK_ARG(std::isfinite(p.eps) && p.eps > 0.0f, "producer (", mode,
               "): eps must be finite and > 0, got ", p.eps);
  const int64_t t = p.num_tokens;
  M3_CHECK_ARG(t >= 0 && t < (int64_t{1} << 31), "producer (", mode,
               "): num_tokens T must be in [0, 2^31), got ", t);

  // Packed BF16 rows [T, W].
  const int64_t width = producer_packed_width(p.mode, p.n_q, p.n_kv);
  M3_RETURN_IF_ERROR(check_dtype(p.packed, DType::kBF16, "producer packed"));
  M3_RETURN_IF_ERROR(check_ndim(p.packed, 2, "producer packed"));
  M3_CHECK_ARG(p.packed.shape[0] == t, "producer packed has ", p.packed.shape[0],
               " rows but T = ", t);
  M3_CHECK_ARG(p.packed.shape[1] == width, "producer packed width ", p.packed.shape[1],
               " differs from the ", mode, " width ", width, " (n_q ", p.n_q, ", n_kv ", p.n_kv,
               ")");
  M3_CHECK_ARG(p.packed.stride[1] == 1, "producer packed last stride must be 1, got ",
               p.packed.stride[1]);
  M3_CHECK_ARG(p.packed.stride[0] >= width && p.packed.stride[0] % 8 == 0,
               "producer packed row stride ", p.packed.stride[0], " must be >= the width ", width,
               " and a multiple of 8 elements (16 bytes)");
  M3_CHECK_ARG(t == 0 || p.packed.data != nullptr, "producer packed is null");
  M3_RETURN_IF_ERROR(check_alignment(p.packed, 16, "producer packed"));

  // Token metadata and the RoPE table.
  M3_RETURN_IF_ERROR(check_vector(p.positions, DType::kI32, t, true, "producer positions"));
  M3_RETURN_IF_ERROR(check_vector(p.slots, DType::kI32, t, false, "producer slots"));
  M3_RETURN_IF_ERROR(check_dtype(p.rope, DType::kF32, "producer rope table"));
  M3_RETURN_IF_ERROR(check_ndim(p.rope, 3, "producer rope table"));
  M3_CHECK_ARG(p.rope.shape[0] > 0 && p.rope.shape[1] == 2 && p.rope.shape[2] == kRotaryHalf,
               "producer rope table must have shape [max_pos > 0, 2, ", kRotaryHalf, "], got ",
               p.rope.shape_string(), " (rotary dim must be ", kRotaryDim, ")");
  M3_RETURN_IF_ERROR(check_contiguous(p.rope, "producer rope table"));
  M3_CHECK_ARG(p.rope.data != nullptr, "producer rope table is null");
  M3_RETURN_IF_ERROR(check_alignment(p.rope, 16, "producer rope table"));

  // Mode-specific weights, outputs and caches.
  if (uses_main) {
    M3_RETURN_IF_ERROR(check_norm_weight(p.q_norm, "producer q_norm"));
    M3_RETURN_IF_ERROR(check_norm_weight(p.k_norm, "producer k_norm"));
    M3_RETURN_IF_ERROR(check_head_output(p.q_out, t, p.n_q, "producer q_out"));
    M3_RETURN_IF_ERROR(validate_kv_cache(p.kv_cache, p.n_kv, "producer main cache"));
    M3_CHECK_ARG(p.kv_cache.data != nullptr, "producer main cache is null");
  }
  if (uses_index) {
    M3_RETURN_IF_ERROR(check_norm_weight(p.iq_norm, "producer iq_norm"));
    M3_RETURN_IF_ERROR(check_norm_weight(p.ik_norm, "producer ik_norm"));
    M3_RETURN_IF_ERROR(check_head_output(p.iq_out, t, p.n_kv, "producer iq_out"));
    M3_RETURN_IF_ERROR(validate_index_cache(p.index_cache, "producer index cache"));
    M3_CHECK_ARG(p.index_cache.data != nullptr, "producer index cache is null");
  }
  if (uses_main && uses_index) {
    // One slot addresses both caches (same page ids), so they must agree on the page count.
    M3_CHECK_ARG(p.kv_cache.shape[0] == p.index_cache.shape[0], "producer (fused): main cache has ",
                 p.kv_cache.shape[0], " pages but the index cache has ", p.index_cache.shape[0]);
  }

  // One device for every tensor the mode uses.
  const TensorView none;
  const TensorView* used[] = {&p.packed,
                              &p.positions,
                              &p.slots,
                              &p.rope,
                              uses_main ? &p.q_norm : &none,
                              uses_main ? &p.k_norm : &none,
                              uses_main ? &p.q_out : &none,
                              uses_main ? &p.kv_cache : &none,
                              uses_index ? &p.iq_norm : &none,
                              uses_index ? &p.ik_norm : &none,
                              uses_index ? &p.iq_out : &none,
                              uses_index ? &p.index_cache : &none};
  const Device dev = p.packed.device;
  for (const TensorView* v : used) {
    if (v == &none) continue;
    M3_CHECK_ARG(v->device == dev, "producer (", mode,
                 "): all tensors must be on one device, found ", dev.to_string(), " and ",
                 v->device.to_string());
  }

  // Outputs must not overlap each other nor any input.
  struct Named {
    const TensorView* view;
    const char* name;
  };
  const Named outputs[] = {{uses_main ? &p.q_out : &none, "q_out"},
                           {uses_index ? &p.iq_out : &none, "iq_out"},
                           {uses_main ? &p.kv_cache : &none, "main cache"},
                           {uses_index ? &p.index_cache : &none, "index cache"}};
  const Named inputs[] = {{&p.packed, "packed"},
                          {&p.positions, "positions"},
                          {&p.slots, "slots"},
                          {&p.rope, "rope table"},
                          {uses_main ? &p.q_norm : &none, "q_norm"},
                          {uses_main ? &p.k_norm : &none, "k_norm"},
                          {uses_index ? &p.iq_norm : &none, "iq_norm"},
                          {uses_index ? &p.ik_norm : &none, "ik_norm"}};
  for (const Named& o : outputs) {
    const ByteRange ro = byte_range(*o.view);
    for (const Named& i : inputs)
      M3_CHECK_ARG(!ranges_overlap(ro, byte_range(*i.view)), "producer (", mode, "): ", o.name,
                   " overlaps the input ", i.name);
  }
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) {
      if (a == 2 && b == 3) continue;  // the two caches: tile-exact check below
      M3_CHECK_ARG(!ranges_overlap(byte_range(*outputs[a].view), byte_range(*outputs[b].view)),
                   "producer (", mode, "): ", outputs[a].name, " overlaps ", outputs[b].name);
    }
  }
  if (uses_main && uses_index) {
    M3_CHECK_ARG(!caches_overlap(p.kv_cache, p.index_cache), "producer (fused): index cache pages",
                 " overlap main cache pages (main base ", p.kv_cache.data, " page stride ",
                 p.kv_cache.stride[0], ", index base ", p.index_cache.data, " page stride ",
                 p.index_cache.stride[0], ")");
  }
  return Status::Ok();
}

}  // namespace m3attn
