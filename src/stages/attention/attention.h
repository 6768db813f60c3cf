// Attention over the paged E4M3 cache (SPEC section 6). Sparse (MSA layers): for token t and KV
// head g, keys are the tokens p <= pos_t of the blocks in block_ids[t, g, :] (-1 entries skipped).
// Dense (layers 0-2): all p <= pos_t. o_j = softmax(q_j . k_p * scale) v_p with raw E4M3 operands,
// fp32 accumulation, BF16 out [T, n_q * 128]; query head j reads KV head j / (n_q / n_kv).
#pragma once

#include <cstdint>

#include "cache/batch.h"
#include "m3attn/tensor.h"
#include "stages/quantize/quantize.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct AttentionParams {
  int n_q = 0;
  int n_kv = 0;
  bool sparse = true;          // false: dense causal (block_ids unused)
  float softmax_scale = 0.0f;  // 0 means 1 / sqrt(128)
  TensorView q;                // e4m3 [T, n_q, 128] contiguous
  TensorView kv_cache;         // e4m3 [pages, 2, n_kv, 128, 128] strided
  TensorView block_ids;        // i32 [T, n_kv, 16] (sparse)
  BatchView batch;
  TensorView out;  // bf16 [T, n_q * 128], last stride 1
  // Optional (both null: off): o_proj's E4M3 input written by the attention itself, byte-identical
  // to run_quantize_cpu / run_quantize_cuda(QuantizeParams{T, out, out_q, out_scales}) on `out`
  // (stages/quantize/quantize.h: one (token, head) output row = one 1x128 block): out_q e4m3
  // [M_pad, n_q * 128] contiguous with M_pad >= T, out_scales f32 [M_pad, n_q] (any strides); rows
  // [T, M_pad) get q = 0 and scale 1 on every call. `out` is written as well. Rows of tokens that
  // no request owns (out untouched) are unspecified.
  TensorView out_q;
  TensorView out_scales;
};

// Every SPEC section 8 rule that applies: n_q, n_kv > 0 and n_q % n_kv == 0; softmax_scale finite
// and >= 0; dtypes and shapes; q contiguous and 16-byte aligned; the KV cache layout; block_ids
// (sparse only) i32 [T, n_kv, 16] contiguous, 16-byte aligned; out bf16 [T, n_q * 128] with last
// stride 1, row stride >= n_q * 128 and a multiple of 8, base 16-byte aligned (16-byte stores);
// out_q / out_scales both or neither, then validate_quantize's rules for {T, out, out_q,
// out_scales}; the batch views; one device. Reads no tensor data, touches nothing.
Status validate_attention(const AttentionParams& p);

// Whether p asks for the quantized output (out_q set), and the quantize stage's view of it:
// QuantizeParams{T, out, out_q, out_scales}.
inline bool attention_quantizes_out(const AttentionParams& p) { return p.out_q.data != nullptr; }
QuantizeParams attention_out_quantize_params(const AttentionParams& p);

// CPU twin (the oracle); requires CPU views and also checks the batch contents (positions, page ids
// inside the pool). Exact semantics, which the CUDA kernels must match up to fp32 rounding:
//   - Keys of (t, g): sparse: {p : p / 128 in block_ids[t, g, :], p <= pos_t}, a SET: entries < 0
//     (the -1 padding) and ids >= n_valid(t) = pos_t / 128 + 1 select nothing, a repeated id counts
//     once, the order of the row does not matter. Dense: all p <= pos_t.
//   - Query head j reads KV head j / (n_q / n_kv).
//   - logit_p = (q_j . k_p) * scale with scale = softmax_scale, or 1 / sqrt(128) when it is 0. The
//     dot product of raw E4M3 values is exact in double; logits, the max-subtracted softmax and
//     the weighted sum of v are computed in double in ascending p order; the result is rounded
//     once (double -> BF16, round to nearest even). NaN in a visible q, k or v row gives NaN out.
//     So sparse with a key set equal to dense's is bit-identical to dense.
//   - A (token, head) with no keys (only possible when block_ids omits the forced local block)
//     gets +0 outputs.
// Tokens are independent: the output row of t depends only on q[t], pos_t and its request's
// pages, so padding and batching never change a row.
Status run_attention_cpu(const AttentionParams& p);

#if defined(M3ATTN_WITH_CUDA)
// CUDA launch shape. A zero field is chosen from host-known shapes (T, R, n_kv, max_pages and the
// SM count), never from device data, so the same params always give the same launch.
struct AttentionCudaConfig {
  int tokens_per_tile = 0;  // query tokens of one request sharing each loaded block: 1 on the
                            // mma.sync decode kernel, 4 on the wgmma verify kernel, 8 on the
                            // wgmma prefill kernels (each kernel's only tile size; 2 and 4 on
                            // mma.sync were removed in session 14)
  int splits = 0;           // 1 .. 128 CTAs sharing one (tile, KV head)'s blocks (> 1: workspace)
  int v_convert = 0;        // V E4M3 -> f16 on the mma.sync decode kernel: 1 in registers (the
                            // only path since session 13; 2, the shared f16 tile, was removed)
  int kernel = 0;  // 0 automatic, 1 the mma.sync decode kernel (attention_decode_kernel.cuh:
                   // 1-token tiles, 8 warps; any batch; automatic for decode),
                   // 4 the Hopper wgmma prefill kernel (attention_prefill_wgmma.cuh:
                   // 8-token tiles, 2 warpgroups, cp.async loads); 5 the Hopper wgmma
                   // decode / verify kernel (attention_verify_wgmma.cuh: 4-token
                   // tiles x 16 heads = 64 rows, one warpgroup, 2 CTAs per SM); 15 the
                   // warp-specialised persistent prefill kernel (attention_prefill_ws.cuh:
                   // TMA, 2 consumer warpgroups, 64 / 216 registers; automatic for
                   // prefill; kernel 4 runs instead where TMA cannot address the pool:
                   // base or strides not multiples of 16 bytes). 2, 3, 6-10, 12-18
                   // were removed in session 13, 11 in session 14 (unsupported)
  int persistent_ctas = 0;  // kernel 15: CTAs of the persistent grid (0: one per SM;
                            // fewer make each CTA walk more work items, e.g. in tests)
  int verify_variant = 0;   // kernel 5 (attention_verify_wgmma.cuh): 0 automatic (70 when the
                            // likely grid is one wave of 2 CTAs per SM without splits, else 69), 8
                            // cp.async loads of K and V (the NaN test in every block), 69 TMA
                            // loads (where TMA can address the pool; else 8 runs), the V NaN
                            // test in a second pass that runs only when the first one's output
                            // holds a NaN, a lazy running max, conflict-free f16 V stores, a
                            // shorter epilogue (session 16's 17), the first two blocks
                            // requested as soon as their pages are known (session 17; one split,
                            // sparse), a token's output rows (and out_q's) written by one bulk
                            // copy per warp (sessions 20 / 21; one split) and the K / V copies L2
                            // evict-first (session 21); 27: 69's loop on cp.async loads, the early
                            // copies by TMA, the rows by plain stores, no cache hint; 70: 27 with
                            // only the first block requested early (session 18), Q loaded for the
                            // guessed tile (session 19) once its ids landed, that tile's
                            // page-table entries read from a shared-memory copy of the request's
                            // row before the tile scan, 69's bulk rows and evict-first copies
                            // (session 21) (9, 11-26, 28-68 were removed)
  int decode_kernel = 0;    // the 8-warp decode kernel: 0 automatic (11 when the likely grid is
                            // one wave of 2 CTAs per SM, else 10), 10 (session 17) with
                            // its first two blocks requested by TMA as soon as their pages are
                            // known (attention_decode_early_kernel; where TMA can address the
                            // pool, else 2 runs), 11 (session 18) the same with only the first
                            // block requested early, 2 without them (session 16's kernel); 1, the
                            // 4-warp tile kernel, and 3, two barriers per block, were removed in
                            // session 14; 4, TMA loads, in session 15; 5-7 in session 16; 8, 9 in
                            // session 17; other plans ignore it
  bool programmatic_launch = false;  // decode / verify kernels (mma.sync, 5) and the split merge
                                     // launched as programmatic dependents (PDL,
                                     // src/core/pdl.cuh): each waits (griddepcontrol.wait) before
                                     // reading ids, Q, the cache or the workspace; off: plain
                                     // stream-ordered launches (same kernels, same bytes)
  // Diagnostics for benchmarks (null: off; not validated): the decode and verify kernels write 16
  // uint64 words per CTA of their grid (CTA x + X (y + Y z)): %globaltimer ns at entry, tile found,
  // block list built, first block landed, last block attended, exit (words 0-5; a CTA without a
  // tile writes only 0 and 5), its block count (6) and SM id + 1 (7); the sparse verify kernel
  // also stamps its front in words 8-11 (ids arrived, union ranked, first page known, first copy
  // issued) and its bulk epilogue in 12-15 (attention_kernel.cuh timeline_mark). Size it for the
  // grid (at most T x n_kv x splits CTAs) and clear it before the call. The prefill kernels
  // ignore it.
  uint64_t* timeline = nullptr;
};

// Device workspace bytes that run_attention_cuda needs for these params and config (0 when the
// launch has no split). Size it once at capacity; a replay with the same params needs no more.
size_t attention_workspace_bytes(const AttentionParams& p, const AttentionCudaConfig& cfg = {});

// An upper bound of attention_workspace_bytes(p) (automatic config) over EVERY params on the
// current device: the automatic plan splits only when the grid is small, so a smaller batch can
// need more workspace than the capacity batch. Allocate this once (~70 MB on an H200) and any
// step shape fits.
size_t attention_workspace_bound();

// CUDA attention: validate_attention, then every view on the current CUDA device, group size
// n_q / n_kv <= 16, workspace large enough (16-byte aligned); then one kernel (plus a small merge
// kernel when splits > 1). No sync, no allocation, no host read of device data: graph-capturable.
// Same semantics as run_attention_cpu (set semantics for ids, no keys -> +0); ids or page-table
// entries that are out of range on the device are skipped, never dereferenced.
Status run_attention_cuda(const AttentionParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream, const AttentionCudaConfig& cfg = {});
#endif

}  // namespace m3attn
