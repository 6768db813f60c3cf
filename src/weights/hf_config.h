// config.json of a MiniMax-M3 checkpoint (SPEC section 1).
//
// Two spellings are accepted, alone or together (when both give a setting they must agree):
//  - checkpoint: "sparse_attention_config" {sparse_num_index_heads, sparse_index_dim,
//    sparse_block_size, sparse_topk_blocks, sparse_init_block, sparse_local_block,
//    sparse_attention_freq [per layer 0/1]} plus "rotary_dim", "rope_theta", "rms_norm_eps",
//    "use_gemma_norm";
//  - HF transformers (flat): index_n_heads, index_head_dim, index_block_size, index_topk_blocks,
//    index_local_blocks, layer_types ["minimax_m3_sparse" | "full_attention"], "rope_parameters"
//    {rope_theta, partial_rotary_factor}.
// A vision-language checkpoint nests the text model under "text_config"; that object is used.
//
// The rotary width: HF rotates head_dim * partial_rotary_factor channels (all of head_dim when the
// factor is absent) and ignores rotary_dim; the checkpoint's own code rotates rotary_dim channels.
// The width is read from rotary_dim or the factor; a config where the two sources disagree is
// rejected, and so is any width other than 64. Every other setting m3attn does not implement
// (block size != 128, top-k != 16, init blocks != 0, local blocks != 1, head dim != 128, ...) is
// rejected with a message naming the key and the value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3attn/config.h"
#include "m3attn/status.h"

namespace m3attn {

struct M3Config {
  int hidden = 0;                  // hidden_size
  int num_layers = 0;              // num_hidden_layers
  int n_q = 0;                     // num_attention_heads
  int n_kv = 0;                    // num_key_value_heads
  int head_dim = 0;                // head_dim (hidden / n_q when absent, as HF does)
  int n_idx = 0;                   // index-Q heads (== n_kv)
  int index_dim = 0;               // index head dim (128)
  int rotary_dim = 0;              // rotated channels (64)
  double rope_theta = 0;           // rope base
  float eps = 0;                   // rms_norm_eps
  std::vector<bool> sparse_layer;  // [num_layers]: true for MSA layers, false for dense
  int64_t vocab = 0;               // vocab_size (0 when absent)

  // Sparse-attention settings as read (validated to the single supported values).
  int block_size = 0;    // 128
  int topk_blocks = 0;   // 16
  int init_blocks = 0;   // 0
  int local_blocks = 0;  // 1

  int num_sparse_layers() const;
  // TP1 geometry of one attention layer.
  MsaGeometry geometry() const;
  std::string to_string() const;  // one line summary
};

// Parses config.json text; `source` names it in error messages. Errors: kDataLoss for text that is
// not JSON, kInvalidArgument for missing or mistyped keys and inconsistent settings, kUnsupported
// for valid settings m3attn does not implement.
Result<M3Config> parse_m3_config(const std::string& json_text,
                                 const std::string& source = "config.json");
// Reads `path`, or `path`/config.json when `path` is a directory.
Result<M3Config> load_m3_config(const std::string& path);

}  // namespace m3attn
