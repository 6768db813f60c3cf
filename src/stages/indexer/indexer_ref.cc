// CPU twin of the indexer (SPEC section 5), written for clarity; the semantics are spelled out in
// indexer.h. Scores are exact dot products rounded once to fp32, so they do not depend on the order
// of accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"

namespace m3attn {

namespace {

// Every E4M3 code as a double (NaN codes give NaN).
struct E4M3Table {
  double value[256];
  E4M3Table() {
    for (int c = 0; c < 256; ++c) value[c] = e4m3_to_float(static_cast<uint8_t>(c));
  }
};
const E4M3Table& e4m3_table() {
  static const E4M3Table table;
  return table;
}

Status check_host_views(const IndexerParams& p) {
  for (const TensorView* t : {&p.index_q, &p.index_cache, &p.block_ids, &p.batch.query_start})
    M3_CHECK_ARG(t->device.type == DeviceType::kCPU,
                 "indexer: the CPU twin needs host views, got a tensor on ", t->device.to_string());
  return Status::Ok();
}

Status validate_for_cpu(const IndexerParams& p) {
  M3_RETURN_IF_ERROR(validate_indexer(p));
  M3_RETURN_IF_ERROR(check_host_views(p));
  return validate_batch_contents(p.batch, p.index_cache.shape[0], "indexer");
}

// Block scores B(t, h, b) for b in [0, n_valid) of token `pos` of the request whose page-table row
// is `table`. The dot product is exact in double (multiples of 2^-18 below 2^25) and rounded once.
void token_block_scores(const IndexerParams& p, const int32_t* table, int pos, const uint8_t* iq,
                        float* out) {
  const E4M3Table& lut = e4m3_table();
  double q[kHeadDim];
  for (int d = 0; d < kHeadDim; ++d) q[d] = lut.value[iq[d]];
  const uint8_t* base = static_cast<const uint8_t*>(p.index_cache.data);
  const int n_valid = pos / kPageSize + 1;
  for (int b = 0; b < n_valid; ++b) {
    const uint8_t* page = base + index_cache_offset(p.index_cache, table[b], 0);
    const int rows = b + 1 < n_valid ? kPageSize : pos % kPageSize + 1;  // p <= pos only
    float best = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int row = 0; row < rows; ++row) {
      const uint8_t* k = page + int64_t{row} * kHeadDim;
      // Four partial sums: every partial sum is exact, so the order cannot change the result.
      double acc[4] = {0.0, 0.0, 0.0, 0.0};
      for (int d = 0; d < kHeadDim; d += 4)
        for (int i = 0; i < 4; ++i) acc[i] += q[d + i] * lut.value[k[d + i]];
      const float s = static_cast<float>((acc[0] + acc[1]) + (acc[2] + acc[3]));
      if (std::isnan(s))
        nan = true;
      else
        best = std::max(best, s);
    }
    out[b] = nan ? std::numeric_limits<float>::quiet_NaN() : best;
  }
}

// Calls fn(t, h, scores, n_valid) for every query token and index head.
template <typename Fn>
void for_each_token_head(const IndexerParams& p, Fn fn) {
  const BatchView& b = p.batch;
  const int32_t* qs = b.query_start.ptr<int32_t>();
  const int32_t* positions = b.positions.ptr<int32_t>();
  const uint8_t* iq = static_cast<const uint8_t*>(p.index_q.data);
  std::vector<float> scores;
  for (int r = 0; r < b.num_requests; ++r) {
    const int32_t* table = b.page_table.ptr<int32_t>() + int64_t{r} * b.page_table.stride[0];
    for (int64_t t = qs[r]; t < qs[r + 1]; ++t) {
      const int pos = positions[t];
      const int n_valid = pos / kPageSize + 1;
      scores.resize(static_cast<size_t>(n_valid));
      for (int h = 0; h < p.n_kv; ++h) {
        token_block_scores(p, table, pos, iq + (t * p.n_kv + h) * kHeadDim, scores.data());
        fn(t, h, scores.data(), n_valid);
      }
    }
  }
}

}  // namespace

void select_blocks_ref(const float* block_scores, int n_valid, int32_t* out) {
  int n = 0;
  if (n_valid <= kTopK) {
    for (int b = 0; b < n_valid; ++b) out[n++] = b;
  } else {
    const int local = n_valid - 1;
    std::vector<int32_t> cand;
    cand.reserve(static_cast<size_t>(local));
    for (int b = 0; b < local; ++b)
      if (!std::isnan(block_scores[b])) cand.push_back(b);
    const size_t take = std::min<size_t>(kTopK - 1, cand.size());
    // Higher score first, exact ties to the smaller id (-0 == +0 compare equal).
    std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(take), cand.end(),
                      [&](int32_t a, int32_t c) {
                        const float sa = block_scores[a], sc = block_scores[c];
                        return sa > sc || (sa == sc && a < c);
                      });
    for (size_t i = 0; i < take; ++i) out[n++] = cand[i];
    out[n++] = local;
    std::sort(out, out + n);
  }
  for (int i = n; i < kTopK; ++i) out[i] = -1;
}

Status run_indexer_cpu(const IndexerParams& p) {
  M3_RETURN_IF_ERROR(validate_for_cpu(p));
  int32_t* ids = p.block_ids.ptr<int32_t>();
  for_each_token_head(p, [&](int64_t t, int h, const float* scores, int n_valid) {
    select_blocks_ref(scores, n_valid, ids + (t * p.n_kv + h) * kTopK);
  });
  return Status::Ok();
}

Status indexer_block_scores_cpu(const IndexerParams& p, const TensorView& scores) {
  M3_RETURN_IF_ERROR(validate_for_cpu(p));
  const int64_t T = p.batch.num_tokens;
  M3_RETURN_IF_ERROR(check_dtype(scores, DType::kF32, "indexer block scores"));
  M3_RETURN_IF_ERROR(check_ndim(scores, 3, "indexer block scores"));
  M3_RETURN_IF_ERROR(check_contiguous(scores, "indexer block scores"));
  M3_CHECK_ARG(scores.device.type == DeviceType::kCPU, "indexer block scores must be on the host");
  const int64_t max_blocks = scores.shape[2];
  M3_RETURN_IF_ERROR(check_shape(scores, {T, p.n_kv, max_blocks}, "indexer block scores"));
  const int32_t* positions = p.batch.positions.ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    M3_CHECK_ARG(positions[t] / kPageSize + 1 <= max_blocks, "indexer block scores: token ", t,
                 " at position ", positions[t], " has ", positions[t] / kPageSize + 1,
                 " visible blocks but the scores hold ", max_blocks);
  float* out = scores.ptr<float>();
  for_each_token_head(p, [&](int64_t t, int h, const float* s, int n_valid) {
    float* row = out + (t * p.n_kv + h) * max_blocks;
    std::copy(s, s + n_valid, row);
    std::fill(row + n_valid, row + max_blocks, -std::numeric_limits<float>::infinity());
  });
  return Status::Ok();
}

Status verify_block_selection(const float* block_scores, int n_valid, const int32_t* ids,
                              float tolerance) {
  M3_CHECK_ARG(n_valid >= 1, "block selection: n_valid ", n_valid, " must be >= 1");
  const int local = n_valid - 1;
  int count = 0;
  while (count < kTopK && ids[count] != -1) ++count;
  for (int i = count; i < kTopK; ++i)
    M3_CHECK_ARG(ids[i] == -1, "block selection: entry ", i, " = ", ids[i],
                 " follows -1 padding (valid ids must come first)");
  std::vector<char> chosen(static_cast<size_t>(n_valid), 0);
  for (int i = 0; i < count; ++i) {
    M3_CHECK_ARG(ids[i] >= 0 && ids[i] < n_valid, "block selection: entry ", i, " = ", ids[i],
                 " is outside [0, ", n_valid, ")");
    M3_CHECK_ARG(i == 0 || ids[i] > ids[i - 1], "block selection: entry ", i, " = ", ids[i],
                 " is not above entry ", i - 1, " = ", ids[i - 1], " (ids must ascend, unique)");
    chosen[ids[i]] = 1;
  }
  M3_CHECK_ARG(chosen[local], "block selection: the local block ", local, " is missing");
  if (n_valid <= kTopK) {
    M3_CHECK_ARG(count == n_valid, "block selection: ", count, " ids for ", n_valid,
                 " visible blocks (all must be selected)");
    return Status::Ok();
  }
  int others = 0;
  for (int b = 0; b < local; ++b) others += std::isnan(block_scores[b]) ? 0 : 1;
  const int want = 1 + std::min(kTopK - 1, others);
  M3_CHECK_ARG(count == want, "block selection: ", count, " ids, expected ", want, " (", others,
               " non-NaN blocks besides the local one)");
  for (int i = 0; i < count; ++i)
    M3_CHECK_ARG(ids[i] == local || !std::isnan(block_scores[ids[i]]), "block selection: block ",
                 ids[i], " with a NaN score was chosen");
  for (int i = 0; i < count; ++i) {
    const int c = ids[i];
    if (c == local) continue;
    for (int u = 0; u < local; ++u) {
      if (chosen[u] || std::isnan(block_scores[u])) continue;
      const float sc = block_scores[c], su = block_scores[u];
      M3_CHECK_ARG(sc >= su - tolerance, "block selection: chose block ", c, " (score ", sc,
                   ") over block ", u, " (score ", su, "), tolerance ", tolerance);
      M3_CHECK_ARG(tolerance > 0.0f || sc != su || c < u, "block selection: tie at score ", sc,
                   " went to block ", c, " instead of the smaller id ", u);
    }
  }
  return Status::Ok();
}

}  // namespace m3attn
