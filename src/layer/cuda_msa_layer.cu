// CudaMsaLayer and its metadata / workspace objects (see cuda_msa_layer.h). Host code only, plus
// one small gather kernel used by download_trace (tests and tools).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cache/cache_view.h"
#include "core/cuda_check.h"
#include "core/rope.h"
#include "layer/cuda_msa_layer.h"

namespace m3attn {

// ---------------------------------------------------------------------------------------------
// CudaBuffer

Result<CudaBuffer> CudaBuffer::create(size_t bytes) {
  CudaBuffer b;
  if (bytes == 0) return Result<CudaBuffer>(std::move(b));
  M3_CUDA_RETURN_IF_ERROR(cudaMalloc(&b.ptr_, bytes));
  b.bytes_ = bytes;
  return Result<CudaBuffer>(std::move(b));
}

CudaBuffer::~CudaBuffer() {
  if (ptr_) cudaFree(ptr_);
}

CudaBuffer::CudaBuffer(CudaBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
  o.ptr_ = nullptr;
  o.bytes_ = 0;
}

CudaBuffer& CudaBuffer::operator=(CudaBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

namespace {

Status alloc(size_t bytes, CudaBuffer* out) {
  Result<CudaBuffer> b = CudaBuffer::create(bytes);
  M3_RETURN_IF_ERROR(b.status());
  *out = std::move(b.value());
  return Status::Ok();
}

Result<Device> current_device() {
  int dev = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  return Device::cuda(dev);
}

constexpr int64_t kMetaAlign = 64;  // int32s: every metadata section starts 256-byte aligned
int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// CudaLayerCapacity

Status CudaLayerCapacity::validate() const {
  M3_CHECK_ARG(max_tokens >= 1 && max_tokens < (int64_t{1} << 31) - 4,
               "layer capacity: max_tokens must be in [1, 2^31 - 4), got ", max_tokens);
  M3_CHECK_ARG(max_requests >= 1, "layer capacity: max_requests must be >= 1, got ", max_requests);
  M3_CHECK_ARG(max_pages >= 1, "layer capacity: max_pages must be >= 1, got ", max_pages);
  M3_CHECK_ARG(int64_t{max_requests} * max_pages < (int64_t{1} << 31),
               "layer capacity: page table of ", max_requests, " x ", max_pages,
               " entries is too large");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// CudaStepMetadata

Result<std::unique_ptr<CudaStepMetadata>> CudaStepMetadata::create(const CudaLayerCapacity& cap) {
  M3_RETURN_IF_ERROR(cap.validate());
  std::unique_ptr<CudaStepMetadata> m(new CudaStepMetadata());
  m->capacity_ = cap;
  int64_t at = 0;
  m->off_pos_ = at;
  at = align_up(at + cap.max_tokens, kMetaAlign);
  m->off_slots_ = at;
  at = align_up(at + cap.max_tokens, kMetaAlign);
  m->off_qs_ = at;
  at = align_up(at + cap.max_requests + 1, kMetaAlign);
  m->off_lens_ = at;
  at = align_up(at + cap.max_requests, kMetaAlign);
  m->off_table_ = at;
  at = align_up(at + int64_t{cap.max_requests} * cap.max_pages, kMetaAlign);
  const size_t bytes = static_cast<size_t>(at) * sizeof(int32_t);
  M3_RETURN_IF_ERROR(alloc(bytes, &m->device_));
  void* staging = nullptr;
  M3_CUDA_RETURN_IF_ERROR(cudaMallocHost(&staging, bytes));
  m->staging_ = static_cast<int32_t*>(staging);
  // A never-uploaded metadata block describes an empty step: no slot, no request.
  std::fill(m->staging_, m->staging_ + at, -1);
  std::fill(m->staging_ + m->off_pos_, m->staging_ + m->off_pos_ + cap.max_tokens, 0);
  std::fill(m->staging_ + m->off_qs_, m->staging_ + m->off_qs_ + cap.max_requests + 1, 0);
  std::fill(m->staging_ + m->off_lens_, m->staging_ + m->off_lens_ + cap.max_requests, 0);
  M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(m->device_.data(), staging, bytes, cudaMemcpyHostToDevice));
  M3_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&m->copied_, cudaEventDisableTiming));
  return Result<std::unique_ptr<CudaStepMetadata>>(std::move(m));
}

CudaStepMetadata::~CudaStepMetadata() {
  if (copied_) {
    cudaEventSynchronize(copied_);  // the staging may still be read by an enqueued copy
    cudaEventDestroy(copied_);
  }
  if (staging_) cudaFreeHost(staging_);
}

Status CudaStepMetadata::upload(const StepPlan& step, int64_t num_pages, int64_t max_position,
                                const CudaStepShape& shape, cudaStream_t stream) {
  const int64_t T = step.num_tokens();
  const int R = step.num_requests();
  const int64_t Tp = shape.tokens > 0 ? shape.tokens : T;
  const int Rp = shape.requests > 0 ? shape.requests : R;
  const CudaLayerCapacity& cap = capacity_;
  // ---- host checks (nothing written on failure) ----
  M3_CHECK_ARG(T <= Tp && Tp <= cap.max_tokens, "step metadata: ", T, " tokens padded to ", Tp,
               " do not fit the capacity of ", cap.max_tokens,
               " tokens (need T <= padded <= capacity)");
  M3_CHECK_ARG(R <= Rp && Rp <= cap.max_requests, "step metadata: ", R, " requests padded to ", Rp,
               " do not fit the capacity of ", cap.max_requests,
               " requests (need R <= padded <= capacity)");
  M3_CHECK_ARG(step.max_pages <= cap.max_pages, "step metadata: the plan's page table has ",
               step.max_pages, " columns, more than the capacity of ", cap.max_pages);
  M3_CHECK_ARG(static_cast<int64_t>(step.slots.size()) == T, "step metadata: plan has ",
               step.slots.size(), " slots for ", T, " tokens");
  M3_CHECK_ARG(num_pages >= 1, "step metadata: pool of ", num_pages, " pages");
  M3_RETURN_IF_ERROR(validate_batch_contents(step.batch(), num_pages, "step metadata"));
  for (int r = 0; r < R; ++r) {
    for (int32_t t = step.query_start[static_cast<size_t>(r)];
         t < step.query_start[static_cast<size_t>(r) + 1]; ++t) {
      const int32_t pos = step.positions[static_cast<size_t>(t)];
      M3_CHECK_ARG(pos < max_position, "step metadata: token ", t, " position ", pos,
                   " is outside the RoPE table of ", max_position, " positions");
      const int32_t page =
          step.page_table[static_cast<size_t>(r) * static_cast<size_t>(step.max_pages) +
                          static_cast<size_t>(pos / kPageSize)];
      const int64_t want = int64_t{page} * kPageSize + pos % kPageSize;
      M3_CHECK_ARG(step.slots[static_cast<size_t>(t)] == want, "step metadata: token ", t, " slot ",
                   step.slots[static_cast<size_t>(t)], " disagrees with the page table (page ",
                   page, " row ", pos % kPageSize, " = slot ", want, ")");
    }
  }

  // ---- staging (wait until the previous upload's copies have read it) ----
  if (pending_) {
    M3_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(copied_));
    pending_ = false;
  }
  int32_t* pos = staging_ + off_pos_;
  int32_t* slots = staging_ + off_slots_;
  int32_t* qs = staging_ + off_qs_;
  int32_t* lens = staging_ + off_lens_;
  int32_t* table = staging_ + off_table_;
  std::copy(step.positions.begin(), step.positions.end(), pos);
  std::copy(step.slots.begin(), step.slots.end(), slots);
  std::fill(pos + T, pos + Tp, 0);       // padding tokens: position 0 (valid for RoPE) ...
  std::fill(slots + T, slots + Tp, -1);  // ... and no cache write
  std::copy(step.query_start.begin(), step.query_start.end(), qs);
  if (R == 0) qs[0] = 0;
  std::fill(qs + R + 1, qs + Rp + 1, static_cast<int32_t>(T));  // padding requests are empty
  std::copy(step.seq_lens.begin(), step.seq_lens.end(), lens);
  std::fill(lens + R, lens + Rp, 0);
  for (int r = 0; r < Rp; ++r) {
    int32_t* row = table + int64_t{r} * cap.max_pages;
    int w = 0;
    if (r < R) {
      w = step.max_pages;
      std::copy(step.page_table.begin() + int64_t{r} * step.max_pages,
                step.page_table.begin() + int64_t{r + 1} * step.max_pages, row);
    }
    std::fill(row + w, row + cap.max_pages, -1);
  }

  // ---- copies ----
  auto copy = [&](int64_t off, int64_t count) -> Status {
    if (count <= 0) return Status::Ok();
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device_.ptr<int32_t>() + off, staging_ + off,
                                            static_cast<size_t>(count) * sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
    return Status::Ok();
  };
  M3_RETURN_IF_ERROR(copy(off_pos_, Tp));
  M3_RETURN_IF_ERROR(copy(off_slots_, Tp));
  M3_RETURN_IF_ERROR(copy(off_qs_, Rp + 1));
  M3_RETURN_IF_ERROR(copy(off_lens_, Rp));
  M3_RETURN_IF_ERROR(copy(off_table_, int64_t{Rp} * cap.max_pages));
  M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(copied_, stream));
  pending_ = true;
  tokens_ = Tp;
  real_tokens_ = T;
  requests_ = Rp;
  real_requests_ = R;
  num_pages_ = num_pages;
  return Status::Ok();
}

BatchView CudaStepMetadata::batch() const {
  int dev = 0;
  cudaGetDevice(&dev);
  const Device d = Device::cuda(dev);
  int32_t* base = device_.ptr<int32_t>();
  BatchView b;
  b.num_tokens = tokens_;
  b.num_requests = requests_;
  b.max_pages = capacity_.max_pages;
  b.query_start = TensorView::contiguous(base + off_qs_, DType::kI32, {int64_t{requests_} + 1}, d);
  b.positions = TensorView::contiguous(base + off_pos_, DType::kI32, {tokens_}, d);
  b.seq_lens = TensorView::contiguous(base + off_lens_, DType::kI32, {int64_t{requests_}}, d);
  b.page_table = TensorView::contiguous(base + off_table_, DType::kI32,
                                        {int64_t{requests_}, int64_t{capacity_.max_pages}}, d);
  return b;
}

TensorView CudaStepMetadata::positions() const { return batch().positions; }

TensorView CudaStepMetadata::slots() const {
  int dev = 0;
  cudaGetDevice(&dev);
  return TensorView::contiguous(device_.ptr<int32_t>() + off_slots_, DType::kI32, {tokens_},
                                Device::cuda(dev));
}

// ---------------------------------------------------------------------------------------------
// CudaLayerWorkspace

Result<std::shared_ptr<CudaLayerWorkspace>> CudaLayerWorkspace::create(
    const MsaGeometry& g, const CudaLayerCapacity& cap, const CudaLayerWorkspaceOptions& options) {
  M3_RETURN_IF_ERROR(g.validate());
  M3_RETURN_IF_ERROR(cap.validate());
  std::shared_ptr<CudaLayerWorkspace> w(new CudaLayerWorkspace());
  w->geometry_ = g;
  w->capacity_ = cap;
  const size_t M = static_cast<size_t>(cap.padded_rows());
  const size_t hidden = static_cast<size_t>(g.hidden);
  const size_t q_width = static_cast<size_t>(g.n_q) * kHeadDim;
  const size_t kv_width = static_cast<size_t>(g.n_kv) * kHeadDim;
  const size_t packed = static_cast<size_t>(g.packed_width());
  const size_t index_width = static_cast<size_t>(g.n_kv + 1) * kHeadDim;
  M3_RETURN_IF_ERROR(alloc(M * hidden, &w->x_q_));
  M3_RETURN_IF_ERROR(alloc(M * (hidden / kQuantBlock) * 4, &w->x_s_));
  M3_RETURN_IF_ERROR(alloc(M * packed * 2, &w->packed_));
  M3_RETURN_IF_ERROR(alloc(M * index_width * 2, &w->packed_index_));
  M3_RETURN_IF_ERROR(alloc(M * q_width, &w->q_));
  M3_RETURN_IF_ERROR(alloc(M * kv_width, &w->index_q_));
  M3_RETURN_IF_ERROR(alloc(M * static_cast<size_t>(g.n_kv) * kTopK * 4, &w->block_ids_));
  M3_RETURN_IF_ERROR(alloc(M * q_width * 2, &w->core_));
  M3_RETURN_IF_ERROR(alloc(M * q_width, &w->core_q_));
  M3_RETURN_IF_ERROR(alloc(M * (q_width / kQuantBlock) * 4, &w->core_s_));
  M3_RETURN_IF_ERROR(alloc(M * hidden * 2, &w->out_));
  // Intermediates start as zeros: padding rows that no stage writes stay finite.
  for (CudaBuffer* b : {&w->x_q_, &w->x_s_, &w->packed_, &w->packed_index_, &w->q_, &w->index_q_,
                        &w->block_ids_, &w->core_, &w->core_q_, &w->core_s_, &w->out_})
    M3_CUDA_RETURN_IF_ERROR(cudaMemset(b->data(), 0, b->bytes()));
  w->indexer_ws_bytes_ =
      std::max<size_t>(16, indexer_workspace_bytes(static_cast<int64_t>(M), g.n_kv, cap.max_pages));
  M3_RETURN_IF_ERROR(alloc(w->indexer_ws_bytes_, &w->indexer_ws_));
  w->attention_ws_bytes_ = std::max<size_t>(16, attention_workspace_bound());
  M3_RETURN_IF_ERROR(alloc(w->attention_ws_bytes_, &w->attention_ws_));

  Fp8BlockGemmOptions go;
  go.small_m_max = options.gemm_small_m_max;
  const int64_t m = static_cast<int64_t>(M);
  auto make = [&](int64_t n, int64_t k, const Fp8BlockGemmOptions& o,
                  std::unique_ptr<Fp8BlockGemm>* out) -> Status {
    Result<std::unique_ptr<Fp8BlockGemm>> r = Fp8BlockGemm::create(m, n, k, o);
    M3_RETURN_IF_ERROR(r.status());
    *out = std::move(r.value());
    return Status::Ok();
  };
  // With the row split on (set_row_split), the fused projection runs it up to M 64 and o_proj up
  // to M 32 with one activation box per slot. Session 24 round G (fused N 9856 x K 6144 and o_proj
  // N 6144 x K 8192, b2b us, plain): the fused row split 17.68-20.24 at M 9-48 and 19.83-19.89 at
  // M 64 against the default object's 20.61-21.61; o_proj's row split 16.41-16.55 / 21.19-21.20 at
  // M 9 / 17 with one box (two: 16.62-16.65 / 22.73-22.76) against 19.57 / 21.14, but 23.69-25.4
  // at M 33-64 against 21.44-22.15.
  Fp8BlockGemmOptions go_fused = go, go_o = go;
  go_fused.row_split_max_m = 64;
  go_o.wgmma.row_one_box = true;
  M3_RETURN_IF_ERROR(make(g.packed_width(), g.hidden, go_fused, &w->gemm_fused_));
  M3_RETURN_IF_ERROR(make(int64_t{g.n_q + 2 * g.n_kv} * kHeadDim, g.hidden, go, &w->gemm_qkv_));
  M3_RETURN_IF_ERROR(make(static_cast<int64_t>(index_width), g.hidden, go, &w->gemm_index_));
  M3_RETURN_IF_ERROR(make(g.hidden, static_cast<int64_t>(q_width), go_o, &w->gemm_o_));
  return w;
}

std::string CudaLayerWorkspace::describe_gemms() const {
  std::string out;
  const std::pair<const char*, const Fp8BlockGemm*> gemms[] = {{"fused", gemm_fused_.get()},
                                                               {"qkv", gemm_qkv_.get()},
                                                               {"index", gemm_index_.get()},
                                                               {"o_proj", gemm_o_.get()}};
  for (const auto& [name, gm] : gemms)
    if (gm) out += std::string(name) + ": " + gm->describe() + "\n";
  return out;
}

size_t CudaLayerWorkspace::device_bytes() const {
  size_t b = 0;
  for (const CudaBuffer* x : {&x_q_, &x_s_, &packed_, &packed_index_, &q_, &index_q_, &block_ids_,
                              &core_, &core_q_, &core_s_, &out_, &indexer_ws_, &attention_ws_})
    b += x->bytes();
  for (const auto* gm : {&gemm_fused_, &gemm_qkv_, &gemm_index_, &gemm_o_})
    if (*gm) b += (*gm)->workspace_bytes();
  return b;
}

// ---------------------------------------------------------------------------------------------
// CudaMsaLayer

namespace {

// E4M3 [N, K] contiguous and f32 scales [N/128, K/128] with the row stride Fp8BlockGemm reads.
Status upload_matrix(const QuantizedMatrix& m, Device dev, CudaBuffer* w, CudaBuffer* s,
                     TensorView* wv, TensorView* sv) {
  const int64_t n = m.rows(), k = m.cols();
  const int64_t nb = n / kQuantBlock, kb = k / kQuantBlock;
  const int64_t rs = gemm_weight_scales_row_stride(k);
  M3_RETURN_IF_ERROR(alloc(static_cast<size_t>(n * k), w));
  M3_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(w->data(), m.w.data(), static_cast<size_t>(n * k), cudaMemcpyHostToDevice));
  M3_RETURN_IF_ERROR(alloc(static_cast<size_t>(nb * rs) * sizeof(float), s));
  M3_CUDA_RETURN_IF_ERROR(cudaMemset(s->data(), 0, s->bytes()));
  M3_CUDA_RETURN_IF_ERROR(cudaMemcpy2D(s->data(), static_cast<size_t>(rs) * sizeof(float),
                                       m.scales.data(), static_cast<size_t>(kb) * sizeof(float),
                                       static_cast<size_t>(kb) * sizeof(float),
                                       static_cast<size_t>(nb), cudaMemcpyHostToDevice));
  *wv = TensorView::contiguous(w->data(), DType::kE4M3, {n, k}, dev);
  *sv = TensorView::strided(s->data(), DType::kF32, {nb, kb}, {rs, 1}, dev);
  return Status::Ok();
}

Status check_device_view(const TensorView& t, Device dev, const char* what) {
  M3_CHECK_ARG(t.device == dev, "the CUDA layer needs ", what, " on ", dev.to_string(), ", got ",
               t.device.to_string());
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<CudaMsaLayer>> CudaMsaLayer::create(
    const PackedRankWeights& weights, const TensorView& rope, const CudaLayerCapacity& capacity,
    const MsaLayerOptions& options, std::shared_ptr<CudaLayerWorkspace> workspace) {
  M3_RETURN_IF_ERROR(weights.validate());
  M3_RETURN_IF_ERROR(validate_rope_table(rope));
  const MsaGeometry& g = weights.geometry;
  if (workspace) {
    const MsaGeometry& wg = workspace->geometry();
    M3_CHECK_ARG(wg.hidden == g.hidden && wg.n_q == g.n_q && wg.n_kv == g.n_kv, "layer geometry ",
                 g.to_string(), " differs from the workspace's ", wg.to_string());
  } else {
    Result<std::shared_ptr<CudaLayerWorkspace>> w = CudaLayerWorkspace::create(g, capacity);
    M3_RETURN_IF_ERROR(w.status());
    workspace = std::move(w.value());
  }
  Result<Device> dev_r = current_device();
  M3_RETURN_IF_ERROR(dev_r.status());
  const Device dev = dev_r.value();

  std::unique_ptr<CudaMsaLayer> l(new CudaMsaLayer());
  l->geometry_ = g;
  l->sparse_ = weights.sparse;
  l->options_ = options;
  l->max_position_ = rope.shape[0];
  l->workspace_ = std::move(workspace);
  M3_RETURN_IF_ERROR(
      upload_matrix(weights.qkv, dev, &l->w_qkv_, &l->s_qkv_, &l->wv_qkv_, &l->sv_qkv_));
  M3_RETURN_IF_ERROR(upload_matrix(weights.o, dev, &l->w_o_, &l->s_o_, &l->wv_o_, &l->sv_o_));
  if (l->sparse_) {
    M3_RETURN_IF_ERROR(upload_matrix(weights.fused, dev, &l->w_fused_, &l->s_fused_, &l->wv_fused_,
                                     &l->sv_fused_));
    M3_RETURN_IF_ERROR(upload_matrix(weights.index, dev, &l->w_index_, &l->s_index_, &l->wv_index_,
                                     &l->sv_index_));
  }
  M3_RETURN_IF_ERROR(alloc(4 * kHeadDim * 2, &l->norms_));
  M3_CUDA_RETURN_IF_ERROR(cudaMemset(l->norms_.data(), 0, l->norms_.bytes()));
  const Tensor* norms[4] = {&weights.q_norm, &weights.k_norm, &weights.index_q_norm,
                            &weights.index_k_norm};
  for (int i = 0; i < (l->sparse_ ? 4 : 2); ++i)
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(l->norms_.ptr<uint8_t>() + i * kHeadDim * 2,
                                       norms[i]->data(), kHeadDim * 2, cudaMemcpyHostToDevice));
  const size_t rope_bytes = static_cast<size_t>(rope.numel()) * sizeof(float);
  M3_RETURN_IF_ERROR(alloc(rope_bytes, &l->rope_));
  M3_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(l->rope_.data(), rope.data, rope_bytes, cudaMemcpyHostToDevice));
  l->rope_view_ = TensorView::contiguous(l->rope_.data(), DType::kF32,
                                         {rope.shape[0], 2, int64_t{kRotaryHalf}}, dev);
  return Result<std::unique_ptr<CudaMsaLayer>>(std::move(l));
}

CudaMsaLayer::~CudaMsaLayer() = default;

Status CudaMsaLayer::set_row_split(bool on) {
  if (on && row_o_.data() == nullptr) {
    // Pack both images (or neither): the weights' row-split images for this device's grid.
    auto pack = [](const TensorView& wv, CudaBuffer* image, int* ctas) -> Status {
      const int64_t n = wv.shape[0], k = wv.shape[1];
      M3_RETURN_IF_ERROR(gemm_wgmma_rows_supported(n, k));
      Result<int> c = gemm_wgmma_rows_ctas(n);
      M3_RETURN_IF_ERROR(c.status());
      Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(n, k);
      M3_RETURN_IF_ERROR(bytes.status());
      M3_RETURN_IF_ERROR(alloc(bytes.value(), image));
      M3_RETURN_IF_ERROR(
          gemm_wgmma_pack_weights_rows(wv, c.value(), image->data(), image->bytes(), nullptr, 1));
      *ctas = c.value();
      return Status::Ok();
    };
    CudaBuffer fused, o;
    int ctas_fused = 0, ctas_o = 0;
    if (sparse_) M3_RETURN_IF_ERROR(pack(wv_fused_, &fused, &ctas_fused));
    M3_RETURN_IF_ERROR(pack(wv_o_, &o, &ctas_o));
    M3_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    row_fused_ = std::move(fused);
    row_o_ = std::move(o);
    row_ctas_fused_ = ctas_fused;
    row_ctas_o_ = ctas_o;
  }
  row_split_ = on;
  return Status::Ok();
}

Status CudaMsaLayer::plan(const CudaStepMetadata& meta, const TensorView& hidden,
                          const CudaLayerCaches& caches) {
  planned_ = false;
  CudaLayerWorkspace& w = *workspace_;
  const MsaGeometry& g = geometry_;
  Result<Device> dev_r = current_device();
  M3_RETURN_IF_ERROR(dev_r.status());
  const Device dev = dev_r.value();
  const int64_t Tp = meta.tokens();
  const CudaLayerCapacity& cap = w.capacity();
  const CudaLayerCapacity& mcap = meta.capacity();
  M3_CHECK_ARG(mcap.max_tokens <= cap.max_tokens && mcap.max_pages == cap.max_pages,
               "layer: metadata capacity (", mcap.max_tokens, " tokens, ", mcap.max_pages,
               " pages) does not fit the workspace (", cap.max_tokens, " tokens, ", cap.max_pages,
               " pages)");
  const int64_t M = gemm_padded_rows(Tp);
  const int64_t hid = g.hidden;
  const int64_t q_width = int64_t{g.n_q} * kHeadDim;
  const int64_t qkv_width = int64_t{g.n_q + 2 * g.n_kv} * kHeadDim;
  const int64_t index_width = int64_t{g.n_kv + 1} * kHeadDim;

  M3_RETURN_IF_ERROR(check_device_view(hidden, dev, "hidden"));
  M3_RETURN_IF_ERROR(check_dtype(hidden, DType::kBF16, "layer hidden"));
  M3_RETURN_IF_ERROR(check_shape(hidden, {Tp, hid}, "layer hidden"));
  M3_CHECK_ARG(hidden.stride[1] == 1, "layer hidden last stride must be 1, got ", hidden.stride[1]);
  M3_RETURN_IF_ERROR(check_device_view(caches.kv_cache, dev, "the KV cache"));
  M3_RETURN_IF_ERROR(validate_kv_cache(caches.kv_cache, g.n_kv, "layer KV cache"));
  M3_CHECK_ARG(caches.kv_cache.shape[0] == meta.num_pages(), "layer KV cache has ",
               caches.kv_cache.shape[0], " pages but the metadata was checked against ",
               meta.num_pages());
  if (sparse_) {
    M3_RETURN_IF_ERROR(check_device_view(caches.index_cache, dev, "the index cache"));
    M3_RETURN_IF_ERROR(validate_index_cache(caches.index_cache, "layer index cache"));
    M3_CHECK_ARG(caches.index_cache.shape[0] == meta.num_pages(), "layer index cache has ",
                 caches.index_cache.shape[0], " pages but the KV cache has ", meta.num_pages());
  }

  tokens_ = Tp;
  real_tokens_ = meta.real_tokens();
  slots_ = meta.slots();
  caches_ = caches;
  out_view_ = TensorView::contiguous(w.out_.data(), DType::kBF16, {Tp, hid}, dev);
  quantize_in_ = QuantizeParams{};
  if (Tp == 0) {
    planned_ = true;
    return Status::Ok();
  }
  const BatchView batch = meta.batch();
  const TensorView x_q = TensorView::contiguous(w.x_q_.data(), DType::kE4M3, {M, hid}, dev);
  const TensorView x_s = gemm_activation_scales_view(w.x_s_.ptr<float>(), M, hid, dev);
  const TensorView q = TensorView::contiguous(w.q_.data(), DType::kE4M3,
                                              {Tp, int64_t{g.n_q}, int64_t{kHeadDim}}, dev);
  const TensorView iq = TensorView::contiguous(w.index_q_.data(), DType::kE4M3,
                                               {Tp, int64_t{g.n_kv}, int64_t{kHeadDim}}, dev);
  const TensorView ids = TensorView::contiguous(w.block_ids_.data(), DType::kI32,
                                                {Tp, int64_t{g.n_kv}, int64_t{kTopK}}, dev);
  const TensorView core = TensorView::contiguous(w.core_.data(), DType::kBF16, {Tp, q_width}, dev);
  const TensorView core_q =
      TensorView::contiguous(w.core_q_.data(), DType::kE4M3, {M, q_width}, dev);
  const TensorView core_s = gemm_activation_scales_view(w.core_s_.ptr<float>(), M, q_width, dev);
  const TensorView out_pad = TensorView::contiguous(w.out_.data(), DType::kBF16, {M, hid}, dev);
  auto packed_view = [&](const CudaBuffer& b, int64_t rows, int64_t width) {
    return TensorView::contiguous(b.data(), DType::kBF16, {rows, width}, dev);
  };
  auto norm_view = [&](int i) {
    return TensorView::contiguous(norms_.ptr<uint8_t>() + i * kHeadDim * 2, DType::kBF16,
                                  {int64_t{kHeadDim}}, dev);
  };

  quantize_in_ = {Tp, hidden, x_q, x_s};
  M3_RETURN_IF_ERROR(validate_quantize(quantize_in_));

  gemm_qkv_ = {x_q, x_s, wv_qkv_, sv_qkv_, packed_view(w.packed_, M, qkv_width)};
  M3_RETURN_IF_ERROR(w.gemm_qkv_->check(gemm_qkv_));
  if (sparse_) {
    gemm_fused_ = {x_q, x_s, wv_fused_, sv_fused_, packed_view(w.packed_, M, g.packed_width())};
    M3_RETURN_IF_ERROR(w.gemm_fused_->check(gemm_fused_));
    gemm_index_ = {x_q, x_s, wv_index_, sv_index_, packed_view(w.packed_index_, M, index_width)};
    M3_RETURN_IF_ERROR(w.gemm_index_->check(gemm_index_));
  }

  ProducerParams common;
  common.n_q = g.n_q;
  common.n_kv = g.n_kv;
  common.eps = g.eps;
  common.num_tokens = Tp;
  common.positions = meta.positions();
  common.slots = slots_;
  common.rope = rope_view_;
  producer_main_ = common;
  producer_main_.mode = ProducerMode::kMain;
  producer_main_.packed = packed_view(w.packed_, Tp, qkv_width);
  producer_main_.q_norm = norm_view(0);
  producer_main_.k_norm = norm_view(1);
  producer_main_.q_out = q;
  producer_main_.kv_cache = caches.kv_cache;
  M3_RETURN_IF_ERROR(validate_producer(producer_main_));
  if (sparse_) {
    producer_index_ = common;
    producer_index_.mode = ProducerMode::kIndex;
    producer_index_.packed = packed_view(w.packed_index_, Tp, index_width);
    producer_index_.iq_norm = norm_view(2);
    producer_index_.ik_norm = norm_view(3);
    producer_index_.iq_out = iq;
    producer_index_.index_cache = caches.index_cache;
    M3_RETURN_IF_ERROR(validate_producer(producer_index_));
    producer_fused_ = common;
    producer_fused_.mode = ProducerMode::kFused;
    producer_fused_.packed = packed_view(w.packed_, Tp, g.packed_width());
    producer_fused_.q_norm = norm_view(0);
    producer_fused_.k_norm = norm_view(1);
    producer_fused_.iq_norm = norm_view(2);
    producer_fused_.ik_norm = norm_view(3);
    producer_fused_.q_out = q;
    producer_fused_.iq_out = iq;
    producer_fused_.kv_cache = caches.kv_cache;
    producer_fused_.index_cache = caches.index_cache;
    M3_RETURN_IF_ERROR(validate_producer(producer_fused_));

    indexer_ = IndexerParams{};
    indexer_.n_kv = g.n_kv;
    indexer_.top_k = kTopK;
    indexer_.index_q = iq;
    indexer_.index_cache = caches.index_cache;
    indexer_.batch = batch;
    indexer_.block_ids = ids;
    M3_RETURN_IF_ERROR(validate_indexer(indexer_));
    const size_t need = indexer_workspace_bytes(Tp, g.n_kv, batch.max_pages);
    M3_CHECK_ARG(need <= w.indexer_ws_bytes_, "layer: indexer needs ", need,
                 " workspace bytes, the workspace holds ", w.indexer_ws_bytes_);
    indexer_ws_ = TensorView::contiguous(w.indexer_ws_.data(), DType::kF32,
                                         {static_cast<int64_t>(w.indexer_ws_bytes_ / 4)}, dev);
  }

  attention_ = AttentionParams{};
  attention_.n_q = g.n_q;
  attention_.n_kv = g.n_kv;
  attention_.sparse = sparse_;
  attention_.q = q;
  attention_.kv_cache = caches.kv_cache;
  if (sparse_) attention_.block_ids = ids;
  attention_.batch = batch;
  attention_.out = core;
  M3_RETURN_IF_ERROR(validate_attention(attention_));
  const size_t att_need = attention_workspace_bytes(attention_);
  M3_CHECK_ARG(att_need <= w.attention_ws_bytes_, "layer: attention needs ", att_need,
               " workspace bytes, the workspace holds ", w.attention_ws_bytes_);

  quantize_core_ = {Tp, core, core_q, core_s};
  M3_RETURN_IF_ERROR(validate_quantize(quantize_core_));
  attention_quantized_ = attention_;
  attention_quantized_.out_q = core_q;
  attention_quantized_.out_scales = core_s;
  M3_RETURN_IF_ERROR(validate_attention(attention_quantized_));
  M3_CHECK_ARG(attention_workspace_bytes(attention_quantized_) <= w.attention_ws_bytes_,
               "layer: attention (quantized output) needs ",
               attention_workspace_bytes(attention_quantized_),
               " workspace bytes, the workspace holds ", w.attention_ws_bytes_);
  gemm_o_ = {core_q, core_s, wv_o_, sv_o_, out_pad};
  M3_RETURN_IF_ERROR(w.gemm_o_->check(gemm_o_));
  planned_ = true;
  return Status::Ok();
}

Status CudaMsaLayer::launch_stage(LayerStage stage, cudaStream_t stream) {
  CudaLayerWorkspace& w = *workspace_;
  const bool fuse = fused();
  const bool pdl = (programmatic_stages_ & stage_bit(stage)) != 0;
  ProducerCudaOptions producer_options;
  producer_options.programmatic_launch = pdl;
  switch (stage) {
    case LayerStage::kQuantize:
      return external_input_quantize_ ? Status::Ok() : run_quantize_cuda(quantize_in_, stream, pdl);
    case LayerStage::kProjection:
      if (fuse && row_split_)
        return w.gemm_fused_->run_row_split(gemm_fused_, {row_fused_.data(), row_ctas_fused_}, pdl,
                                            stream);
      if (fuse) return w.gemm_fused_->run(gemm_fused_, stream);
      M3_RETURN_IF_ERROR(w.gemm_qkv_->run(gemm_qkv_, stream));
      return sparse_ ? w.gemm_index_->run(gemm_index_, stream) : Status::Ok();
    case LayerStage::kProducer:
      if (fuse) return run_producer_cuda(producer_fused_, stream, producer_options);
      M3_RETURN_IF_ERROR(run_producer_cuda(producer_main_, stream, producer_options));
      return sparse_ ? run_producer_cuda(producer_index_, stream, producer_options) : Status::Ok();
    case LayerStage::kIndexer: {
      if (!sparse_) return Status::Ok();
      IndexerCudaOptions options;
      options.programmatic_launch = pdl;
      options.pdl_prefetch_blocks = indexer_pdl_prefetch_;
      return run_indexer_cuda(indexer_, indexer_ws_, stream, options);
    }
    case LayerStage::kAttention: {
      AttentionCudaConfig config;
      config.programmatic_launch = pdl;
      return run_attention_cuda(attention_quantize_ ? attention_quantized_ : attention_,
                                w.attention_ws_.data(), w.attention_ws_bytes_, stream, config);
    }
    case LayerStage::kOutQuantize:
      return attention_quantize_ ? Status::Ok() : run_quantize_cuda(quantize_core_, stream, pdl);
    case LayerStage::kOutProjection:
      if (row_split_)
        return w.gemm_o_->run_row_split(gemm_o_, {row_o_.data(), row_ctas_o_}, pdl, stream);
      return w.gemm_o_->run(gemm_o_, stream);
    case LayerStage::kCount:
      break;
  }
  return unsupported("layer: no stage ", static_cast<int>(stage));
}

Status CudaMsaLayer::launch(LayerStage first, LayerStage last, cudaStream_t stream,
                            cudaEvent_t* marks) {
  M3_CHECK_ARG(planned_, "layer: run without a successful plan");
  M3_CHECK_ARG(static_cast<int>(first) <= static_cast<int>(last) &&
                   static_cast<int>(last) <= kNumLayerStages,
               "layer: stage range [", static_cast<int>(first), ", ", static_cast<int>(last),
               ") is not within [0, ", kNumLayerStages, "]");
  if (tokens_ == 0) return Status::Ok();
  for (int s = static_cast<int>(first); s < static_cast<int>(last); ++s) {
    if (marks) M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(marks[s], stream));
    M3_RETURN_IF_ERROR(launch_stage(static_cast<LayerStage>(s), stream));
  }
  if (marks) M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(marks[static_cast<int>(last)], stream));
  return Status::Ok();
}

Status CudaMsaLayer::run(cudaStream_t stream) {
  return launch(LayerStage::kQuantize, LayerStage::kCount, stream, nullptr);
}
Status CudaMsaLayer::run_front(cudaStream_t stream) {
  return launch(LayerStage::kQuantize, LayerStage::kIndexer, stream, nullptr);
}
Status CudaMsaLayer::run_back(cudaStream_t stream) {
  return launch(LayerStage::kIndexer, LayerStage::kCount, stream, nullptr);
}
Status CudaMsaLayer::run_stages(LayerStage first, LayerStage last, cudaStream_t stream) {
  return launch(first, last, stream, nullptr);
}

Status CudaMsaLayer::run_timed(cudaStream_t stream, LayerTimes* times) {
  cudaEvent_t marks[kNumLayerStages + 1] = {};
  auto body = [&]() -> Status {
    for (cudaEvent_t& e : marks) M3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
    M3_RETURN_IF_ERROR(
        launch(LayerStage::kQuantize, LayerStage::kCount, stream, tokens_ > 0 ? marks : nullptr));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    if (times) {
      *times = LayerTimes{};
      for (int s = 0; s < kNumLayerStages && tokens_ > 0; ++s) {
        float ms = 0;
        M3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, marks[s], marks[s + 1]));
        times->seconds[static_cast<size_t>(s)] = ms * 1e-3;
      }
    }
    return Status::Ok();
  };
  Status st = body();
  for (cudaEvent_t e : marks)
    if (e) cudaEventDestroy(e);
  return st;
}

TensorView CudaMsaLayer::attn_out() const { return out_view_; }
TensorView CudaMsaLayer::q() const { return attention_.q; }
TensorView CudaMsaLayer::index_q() const { return indexer_.index_q; }
TensorView CudaMsaLayer::block_ids() const { return indexer_.block_ids; }
TensorView CudaMsaLayer::attn_core() const { return attention_.out; }

namespace {

// One CTA per token: copies its K / V rows (every KV head) and index-K row from the caches at its
// slot; a slot < 0 or past the pool leaves zeros.
__global__ void gather_cache_rows_kernel(const int32_t* slots, int64_t T, int n_kv,
                                         int64_t num_pages, const uint8_t* kv, int64_t kv_page,
                                         int64_t kv_plane, int64_t kv_head, const uint8_t* ic,
                                         int64_t ic_page, uint8_t* k_out, uint8_t* v_out,
                                         uint8_t* ik_out) {
  const int64_t t = blockIdx.x;
  if (t >= T) return;
  const int32_t slot = slots[t];
  const bool ok = slot >= 0 && slot / kPageSize < num_pages;
  const int64_t page = ok ? slot / kPageSize : 0;
  const int64_t row = ok ? slot % kPageSize : 0;
  for (int i = threadIdx.x; i < n_kv * kHeadDim; i += blockDim.x) {
    const int h = i / kHeadDim, d = i % kHeadDim;
    const int64_t off = page * kv_page + h * kv_head + row * kHeadDim + d;
    k_out[t * n_kv * kHeadDim + i] = ok ? kv[off] : 0;
    v_out[t * n_kv * kHeadDim + i] = ok ? kv[off + kv_plane] : 0;
  }
  if (ic != nullptr) {
    for (int d = threadIdx.x; d < kHeadDim; d += blockDim.x)
      ik_out[t * kHeadDim + d] = ok ? ic[page * ic_page + row * kHeadDim + d] : 0;
  }
}

Status download(const TensorView& v, int64_t rows, Tensor* out) {
  std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
  shape[0] = rows;
  *out = Tensor(v.dtype, shape);
  if (out->nbytes() > 0)
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(out->data(), v.data, static_cast<size_t>(out->nbytes()),
                                       cudaMemcpyDeviceToHost));
  return Status::Ok();
}

}  // namespace

Status CudaMsaLayer::download_trace(LayerTrace* trace, Tensor* attn_out,
                                    cudaStream_t stream) const {
  M3_CHECK_ARG(planned_, "layer: download_trace without a plan");
  M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  const int64_t T = real_tokens_;
  const int n_kv = geometry_.n_kv;
  if (attn_out) M3_RETURN_IF_ERROR(download(out_view_, T, attn_out));
  if (!trace) return Status::Ok();
  const int64_t q_width = int64_t{geometry_.n_q} * kHeadDim;
  if (tokens_ == 0) {
    trace->q = Tensor(DType::kE4M3, {0, geometry_.n_q, kHeadDim});
    trace->attn_core = Tensor(DType::kBF16, {0, q_width});
  } else {
    M3_RETURN_IF_ERROR(download(attention_.q, T, &trace->q));
    M3_RETURN_IF_ERROR(download(attention_.out, T, &trace->attn_core));
  }
  trace->index_q = Tensor();
  trace->block_ids = Tensor();
  trace->index_k = Tensor();
  if (sparse_) {
    if (tokens_ == 0) {
      trace->index_q = Tensor(DType::kE4M3, {0, n_kv, kHeadDim});
      trace->block_ids = Tensor(DType::kI32, {0, n_kv, kTopK});
    } else {
      M3_RETURN_IF_ERROR(download(indexer_.index_q, T, &trace->index_q));
      M3_RETURN_IF_ERROR(download(indexer_.block_ids, T, &trace->block_ids));
    }
  }
  trace->k = Tensor(DType::kE4M3, {T, n_kv, kHeadDim});
  trace->v = Tensor(DType::kE4M3, {T, n_kv, kHeadDim});
  if (sparse_) trace->index_k = Tensor(DType::kE4M3, {T, kHeadDim});
  if (T == 0) return Status::Ok();
  const size_t kv_bytes = static_cast<size_t>(T) * n_kv * kHeadDim;
  Result<CudaBuffer> tmp = CudaBuffer::create(2 * kv_bytes + static_cast<size_t>(T) * kHeadDim);
  M3_RETURN_IF_ERROR(tmp.status());
  uint8_t* k_d = tmp.value().ptr<uint8_t>();
  const TensorView& kv = caches_.kv_cache;
  const TensorView& ic = caches_.index_cache;
  gather_cache_rows_kernel<<<static_cast<unsigned>(T), 128, 0, stream>>>(
      slots_.ptr<const int32_t>(), T, n_kv, kv.shape[0], kv.ptr<const uint8_t>(), kv.stride[0],
      kv.stride[1], kv.stride[2], sparse_ ? ic.ptr<const uint8_t>() : nullptr,
      sparse_ ? ic.stride[0] : 0, k_d, k_d + kv_bytes, k_d + 2 * kv_bytes);
  M3_CUDA_CHECK_LAUNCH();
  M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(trace->k.data(), k_d, kv_bytes, cudaMemcpyDeviceToHost));
  M3_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(trace->v.data(), k_d + kv_bytes, kv_bytes, cudaMemcpyDeviceToHost));
  if (sparse_)
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpy(trace->index_k.data(), k_d + 2 * kv_bytes,
                                       static_cast<size_t>(T) * kHeadDim, cudaMemcpyDeviceToHost));
  return Status::Ok();
}

}  // namespace m3attn
