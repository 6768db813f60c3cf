// The golden-file interface of `m3attn layer` (safetensors files), so that a layer can be checked
// against an outside implementation (e.g. HF transformers) tensor by tensor:
//
//   inputs  (--inputs): input.hidden_states  bf16 or f32 [T, hidden]  (f32 is rounded to bf16)
//                       input.positions      i32 [T], exactly 0 .. T-1 (one sequence prefilled
//                                            from position 0)
//   dump    (--dump):   output.attn_out      bf16 [T, hidden]           (after o_proj)
//                       output.attn_core     bf16 [T, n_q * 128]        (before o_proj)
//                       output.block_ids     i32  [T, n_kv, 16]         (sparse layers; ascending
//                                                                        ids then -1)
//                       inter.q              F8_E4M3 [T, n_q, 128]      (after norm + RoPE)
//                       inter.k, inter.v     F8_E4M3 [T, n_kv, 128]     (as stored in the cache)
//                       inter.index_q        F8_E4M3 [T, n_kv, 128]     (sparse)
//                       inter.index_k        F8_E4M3 [T, 128]           (sparse, as stored)
// Weights (--weights) are read by load_attention_weights (weights/packing.h): one layer's tensors
// under HF names, BF16 / F32 (quantized at load) or FP8 block / MXFP8.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "layer/msa_layer.h"
#include "m3attn/tensor.h"
#include "weights/safetensors.h"

namespace m3attn {

struct GoldenInputs {
  Tensor hidden;     // bf16 [T, hidden]
  Tensor positions;  // i32 [T] = 0 .. T-1
  int64_t num_tokens() const { return hidden.shape().empty() ? 0 : hidden.shape()[0]; }
};

// Reads and checks an inputs file. hidden_size > 0 requires that width (the weights'); 0 accepts
// any positive multiple of 128. Errors: kIoError (cannot open), kDataLoss (not safetensors),
// kInvalidArgument (missing tensors, dtypes, shapes, positions).
Result<GoldenInputs> read_golden_inputs(const std::string& path, int64_t hidden_size = 0);
Result<GoldenInputs> golden_inputs_from_file(const SafetensorsFile& file, int64_t hidden_size = 0);
Status write_golden_inputs(const std::string& path, const TensorView& hidden,
                           const TensorView& positions);

// The dump tensors (views into attn_out and the trace, in the order listed above).
std::vector<NamedTensor> golden_dump_tensors(const TensorView& attn_out, const LayerTrace& trace);
Status write_golden_dump(const std::string& path, const TensorView& attn_out,
                         const LayerTrace& trace,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace m3attn
