// Geometry of one MiniMax-M3 attention layer (SPEC section 1), per tensor-parallel rank.
#pragma once

#include <cstdint>
#include <string>

#include "m3attn/status.h"

namespace m3attn {

constexpr int kHeadDim = 128;     // Q/K/V and index head dim
constexpr int kRotaryDim = 64;    // channels [0, 64) rotate, NeoX half-split pairing
constexpr int kRotaryHalf = 32;   // pairs (i, i + 32)
constexpr int kPageSize = 128;    // tokens per KV page == sparse block
constexpr int kTopK = 16;         // selected blocks per (token, KV head)
constexpr int kQuantBlock = 128;  // FP8 scale granularity along K (and 128x128 weight blocks)

struct MsaGeometry {
  int hidden = 6144;
  int n_q = 64;  // query heads (this rank)
  int n_kv = 4;  // KV heads == index-Q heads (this rank)
  float rope_theta = 5e6f;
  float eps = 1e-6f;

  int n_idx() const { return n_kv; }
  // Packed projection row [Q | K | V | index-Q | index-K], in heads and in columns.
  int packed_heads() const { return n_q + 2 * n_kv + n_kv + 1; }
  int64_t packed_width() const { return int64_t{packed_heads()} * kHeadDim; }
  // Column offsets of each segment inside the packed row.
  int64_t q_col() const { return 0; }
  int64_t k_col() const { return int64_t{n_q} * kHeadDim; }
  int64_t v_col() const { return int64_t{n_q + n_kv} * kHeadDim; }
  int64_t iq_col() const { return int64_t{n_q + 2 * n_kv} * kHeadDim; }
  int64_t ik_col() const { return int64_t{n_q + 3 * n_kv} * kHeadDim; }
  int group_size() const { return n_q / n_kv; }

  Status validate() const;
  std::string to_string() const;  // "hidden 6144, q 64, kv 4"
  static MsaGeometry m3() { return MsaGeometry{}; }
  // Per-rank geometry of the M3 layer under attention tensor parallelism P (SPEC section 2).
  static Result<MsaGeometry> m3_tp(int tp_size);
};

}  // namespace m3attn
