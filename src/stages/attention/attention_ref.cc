// CPU twin of the attention stage (SPEC section 6), written for clarity; the semantics are spelled
// out in attention.h. Everything between the E4M3 loads and the final BF16 rounding is double, and
// keys are visited in ascending position order whatever the selection's order, so sparse and
// dense agree bit for bit whenever their key sets agree.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cache/cache_view.h"
#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/attention/attention.h"

namespace m3attn {

namespace {

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

// Round to nearest even straight from double. Going through float first could round twice: when
// the float lands exactly on a BF16 midpoint, the side of x decides.
uint16_t double_to_bf16(double x) {
  const float f = static_cast<float>(x);
  const uint32_t u = float_bits(f);
  if (!std::isnan(x) && (u & 0xffffu) == 0x8000u && static_cast<double>(f) != x) {
    const uint16_t toward_zero = static_cast<uint16_t>(u >> 16);
    return std::fabs(x) > std::fabs(static_cast<double>(f)) ? static_cast<uint16_t>(toward_zero + 1)
                                                            : toward_zero;
  }
  return float_to_bf16(f);
}

Status check_host_views(const AttentionParams& p) {
  for (const TensorView* t : {&p.q, &p.kv_cache, &p.out, &p.batch.query_start})
    M3_CHECK_ARG(t->device.type == DeviceType::kCPU,
                 "attention: the CPU twin needs host views, got a tensor on ",
                 t->device.to_string());
  if (attention_quantizes_out(p))
    M3_CHECK_ARG(p.out_q.device.type == DeviceType::kCPU,
                 "attention: the CPU twin needs host views, got out_q on ",
                 p.out_q.device.to_string());
  if (p.sparse)
    M3_CHECK_ARG(p.block_ids.device.type == DeviceType::kCPU,
                 "attention: the CPU twin needs host views, got block_ids on ",
                 p.block_ids.device.to_string());
  return Status::Ok();
}

// Visible key positions of token `pos` for one KV head, ascending.
void collect_keys(const AttentionParams& p, int64_t t, int g, int pos, std::vector<char>& blocks,
                  std::vector<int>& keys) {
  const int n_valid = pos / kPageSize + 1;
  keys.clear();
  blocks.assign(static_cast<size_t>(n_valid), p.sparse ? 0 : 1);
  if (p.sparse) {
    const int32_t* row = p.block_ids.ptr<int32_t>() + (t * p.n_kv + g) * kTopK;
    for (int i = 0; i < kTopK; ++i)
      if (row[i] >= 0 && row[i] < n_valid) blocks[row[i]] = 1;
  }
  for (int b = 0; b < n_valid; ++b) {
    if (!blocks[b]) continue;
    const int last = std::min(pos, b * kPageSize + kPageSize - 1);
    for (int k = b * kPageSize; k <= last; ++k) keys.push_back(k);
  }
}

}  // namespace

Status run_attention_cpu(const AttentionParams& p) {
  M3_RETURN_IF_ERROR(validate_attention(p));
  M3_RETURN_IF_ERROR(check_host_views(p));
  M3_RETURN_IF_ERROR(validate_batch_contents(p.batch, p.kv_cache.shape[0], "attention"));

  const E4M3Table& lut = e4m3_table();
  const double scale =
      p.softmax_scale > 0.0f ? double{p.softmax_scale} : 1.0 / std::sqrt(double{kHeadDim});
  const int group = p.n_q / p.n_kv;
  const BatchView& b = p.batch;
  const int32_t* qs = b.query_start.ptr<int32_t>();
  const int32_t* positions = b.positions.ptr<int32_t>();
  const uint8_t* q_base = static_cast<const uint8_t*>(p.q.data);
  const uint8_t* kv_base = static_cast<const uint8_t*>(p.kv_cache.data);
  uint16_t* out_base = p.out.ptr<uint16_t>();

  std::vector<char> blocks;
  std::vector<int> keys;
  std::vector<double> logits;  // [group][keys]
  std::vector<double> q(static_cast<size_t>(group) * kHeadDim);
  std::vector<double> acc(static_cast<size_t>(group) * kHeadDim);
  double row[kHeadDim];

  for (int r = 0; r < b.num_requests; ++r) {
    const int32_t* table = b.page_table.ptr<int32_t>() + int64_t{r} * b.page_table.stride[0];
    auto kv_row = [&](int pos, int plane, int g) {
      return kv_base +
             kv_cache_offset(p.kv_cache, table[pos / kPageSize], plane, g, pos % kPageSize);
    };
    for (int64_t t = qs[r]; t < qs[r + 1]; ++t) {
      const int pos = positions[t];
      uint16_t* out_row = out_base + t * p.out.stride[0];
      for (int g = 0; g < p.n_kv; ++g) {
        collect_keys(p, t, g, pos, blocks, keys);
        const size_t nk = keys.size();
        for (int j = 0; j < group; ++j) {
          const uint8_t* qr = q_base + (t * p.n_q + g * group + j) * kHeadDim;
          for (int d = 0; d < kHeadDim; ++d) q[j * kHeadDim + d] = lut.value[qr[d]];
        }
        // Logits: q . k exact in double, then scaled.
        logits.assign(static_cast<size_t>(group) * nk, 0.0);
        for (size_t i = 0; i < nk; ++i) {
          const uint8_t* k = kv_row(keys[i], 0, g);
          for (int d = 0; d < kHeadDim; ++d) row[d] = lut.value[k[d]];
          for (int j = 0; j < group; ++j) {
            // Four partial sums: every partial sum is exact, so the order cannot matter.
            const double* qj = q.data() + j * kHeadDim;
            double dot[4] = {0.0, 0.0, 0.0, 0.0};
            for (int d = 0; d < kHeadDim; d += 4)
              for (int u = 0; u < 4; ++u) dot[u] += qj[d + u] * row[d + u];
            logits[j * nk + i] = ((dot[0] + dot[1]) + (dot[2] + dot[3])) * scale;
          }
        }
        // Softmax with max subtraction (NaN-propagating max), then the weighted sum of v.
        std::vector<double> denom(static_cast<size_t>(group), 0.0);
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < group; ++j) {
          double m = -std::numeric_limits<double>::infinity();
          for (size_t i = 0; i < nk; ++i) {
            const double l = logits[j * nk + i];
            m = (std::isnan(l) || std::isnan(m)) ? std::numeric_limits<double>::quiet_NaN()
                                                 : std::max(m, l);
          }
          for (size_t i = 0; i < nk; ++i) {
            const double w = std::exp(logits[j * nk + i] - m);
            logits[j * nk + i] = w;
            denom[j] += w;
          }
        }
        for (size_t i = 0; i < nk; ++i) {
          const uint8_t* v = kv_row(keys[i], 1, g);
          for (int d = 0; d < kHeadDim; ++d) row[d] = lut.value[v[d]];
          for (int j = 0; j < group; ++j) {
            const double w = logits[j * nk + i];
            for (int d = 0; d < kHeadDim; ++d) acc[j * kHeadDim + d] += w * row[d];
          }
        }
        for (int j = 0; j < group; ++j) {
          uint16_t* o = out_row + int64_t{g * group + j} * kHeadDim;
          for (int d = 0; d < kHeadDim; ++d)
            o[d] = nk == 0 ? uint16_t{0} : double_to_bf16(acc[j * kHeadDim + d] / denom[j]);
        }
      }
    }
  }
  // o_proj's input, by definition the quantize stage on `out`.
  if (attention_quantizes_out(p)) return run_quantize_cpu(attention_out_quantize_params(p));
  return Status::Ok();
}

}  // namespace m3attn
