// GPU tests of IndexerCudaOptions::programmatic_launch (programmatic dependent launch): the
// indexer launched programmatically behind a kernel that lets it start at once
// (pdl_launch_dependents) and only later writes index_q and the step's new index-K rows (what the
// layer's producer does) must select exactly the ids of a normal launch on the final data. The
// writer starts from poisoned copies (NaN), so an indexer that read index_q or a new row before
// its pdl_wait would see NaN scores; a control run shows that the poison changes the ids (by
// construction: plant_visible_row).
#include <gtest/gtest.h>

#include <vector>

#include "core/pdl.cuh"
#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

constexpr uint8_t kNaNByte = 0x7f;  // E4M3 NaN

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Lets the next kernel in the stream start (pdl_launch_dependents), waits delay_ns, then copies
// iq_bytes bytes iq_src -> iq_dst and the 128-byte rows rows_src[i] -> pool + row_off[i].
__global__ void delayed_writer(uint8_t* iq_dst, const uint8_t* iq_src, int64_t iq_bytes,
                               uint8_t* pool, const int64_t* row_off, const uint8_t* rows_src,
                               int n_rows, uint64_t delay_ns) {
  pdl_launch_dependents();
  const uint64_t t0 = global_ns();
  while (global_ns() - t0 < delay_ns) __nanosleep(500);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  const int64_t tid = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < iq_bytes; i += stride) iq_dst[i] = iq_src[i];
  for (int64_t i = tid; i < int64_t{n_rows} * kHeadDim; i += stride)
    pool[row_off[i / kHeadDim] + i % kHeadDim] = rows_src[i];
}

// The clean copies of what the writer writes, and where.
struct WriterSet {
  mt::DeviceBuffer iq_src, rows_src, row_off;
  int n_rows = 0;
  std::vector<uint8_t> rows_host;
  std::vector<int64_t> off_host;
};

// The index-K rows of every token of the step (its position in its request), as the producer
// writes them.
WriterSet make_writer_set(const Inputs& in, const DeviceSet& d) {
  WriterSet w;
  const HostBatch& hb = in.hb;
  const uint8_t* pool0 = hb.index_pool.ptr<uint8_t>();
  for (int64_t t = 0; t < in.T(); ++t) {
    const uint8_t* row = hb.index_row(hb.request_of(t), hb.position_of(t));
    w.off_host.push_back(static_cast<int64_t>(row - pool0) + d.pool_offset);
    w.rows_host.insert(w.rows_host.end(), row, row + kHeadDim);
  }
  w.n_rows = static_cast<int>(in.T());
  w.iq_src = mt::DeviceBuffer(d.iq.bytes());
  w.iq_src.upload(in.iq.data(), static_cast<size_t>(in.iq.nbytes()));
  w.rows_src = mt::DeviceBuffer(std::max<size_t>(16, w.rows_host.size()));
  w.rows_src.upload(w.rows_host.data(), w.rows_host.size());
  w.row_off = mt::DeviceBuffer(std::max<size_t>(16, w.off_host.size() * 8));
  w.row_off.upload(w.off_host.data(), w.off_host.size() * 8);
  return w;
}

// Overwrites index_q (when `iq`) and the step's index-K rows (when `rows`) on the device with NaN.
void poison_inputs(const Inputs& in, DeviceSet& d, const WriterSet& w, bool iq, bool rows) {
  if (iq) {
    const std::vector<uint8_t> nan(static_cast<size_t>(in.iq.nbytes()), kNaNByte);
    d.iq.upload(nan.data(), nan.size());
  }
  if (rows) {
    const std::vector<uint8_t> nan(kHeadDim, kNaNByte);
    for (int64_t off : w.off_host) d.pool.upload(nan.data(), nan.size(), static_cast<size_t>(off));
  }
}

void launch_writer(const Inputs& in, DeviceSet& d, const WriterSet& w, cudaStream_t s) {
  delayed_writer<<<4, 256, 0, s>>>(
      static_cast<uint8_t*>(d.iq.data()), static_cast<const uint8_t*>(w.iq_src.data()),
      in.iq.nbytes(), static_cast<uint8_t*>(d.pool.data()),
      static_cast<const int64_t*>(w.row_off.data()), static_cast<const uint8_t*>(w.rows_src.data()),
      w.n_rows, uint64_t{40000});
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// Makes the control's "new rows" case deterministic: request r's first token of the step (position
// p, block b = p / 128) gets an index-K row of +-448 with the signs of the head-0 query of the
// request's first token past block b (t2), so block b is t2's best non-local block by far (scored:
// t2's local block is >= 16); NaN in that row (the step's row, which the writer restores) then
// drops block b from t2's ids whatever the rest of the data. Same data for the twin and every run.
void plant_visible_row(Inputs& in, int r) {
  HostBatch& hb = in.hb;
  int64_t t0 = -1, t2 = -1;
  for (int64_t t = 0; t < in.T(); ++t) {
    if (hb.request_of(t) != r) continue;
    if (t0 < 0) t0 = t;
    if (t2 < 0 && hb.position_of(t) / kPageSize > hb.position_of(t0) / kPageSize) t2 = t;
  }
  ASSERT_GE(t0, 0);
  ASSERT_GE(t2, 0) << "request " << r << " does not straddle a block boundary";
  ASSERT_GE(hb.position_of(t2) / kPageSize, kTopK) << "t2's row must be scored";
  uint8_t* row = hb.index_row(r, hb.position_of(t0));
  const uint8_t* q = in.iq.ptr<uint8_t>() + t2 * in.n_kv * kHeadDim;  // head 0
  for (int d = 0; d < kHeadDim; ++d) {
    const float v = e4m3_to_float(q[d]);
    row[d] = float_to_e4m3(v > 0 ? 448.0f : (v < 0 ? -448.0f : 0.0f));
  }
}

// Poisoned inputs, the delayed writer, then the indexer launched programmatically (eagerly, or
// both captured in one CUDA graph and replayed); returns the ids.
GpuResult run_behind_writer(const Inputs& in, DeviceSet& d, const WriterSet& w,
                            IndexerCudaOptions o, cudaStream_t s, bool graph) {
  o.programmatic_launch = true;
  poison_inputs(in, d, w, true, true);
  poison_outputs(d);
  if (!graph) {
    launch_writer(in, d, w, s);
    const Status st = run_indexer_cuda(d.params, d.workspace, s, o);
    EXPECT_TRUE(st.ok()) << st.to_string();
  } else {
    cudaGraph_t g;
    cudaGraphExec_t exec;
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    launch_writer(in, d, w, s);
    const Status st = run_indexer_cuda(d.params, d.workspace, s, o);
    EXPECT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
    EXPECT_TRUE(st.ok()) << st.to_string();
    EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
  }
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  return download(d);
}

int differing_rows(const GpuResult& a, const GpuResult& b) {
  int n = 0;
  for (size_t i = 0; i < a.ids.size(); i += kTopK)
    n += std::equal(a.ids.begin() + i, a.ids.begin() + i + kTopK, b.ids.begin() + i) ? 0 : 1;
  return n;
}

struct Variant {
  const char* name;
  IndexerCudaOptions o;
};

void check_programmatic(const Inputs& in, const std::vector<Variant>& variants,
                        const std::string& label, bool control) {
  const Reference ref = reference(in);
  DeviceSet d;
  upload(in, d);
  const std::vector<uint8_t> pool_clean = d.pool.download_all();
  const WriterSet w = make_writer_set(in, d);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  if (control) {
    // The poison is visible: index_q alone, and the new rows alone (the tokens of a request whose
    // step straddles a block boundary see the earlier tokens' block as a candidate).
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const GpuResult clean = run_gpu(d, two);
    compare(in, ref, clean, in.integer, label + " [two-kernel, clean inputs]");
    for (int which : {0, 1}) {
      poison_inputs(in, d, w, which == 0, which == 1);
      const GpuResult bad = run_gpu(d, two);
      EXPECT_GT(differing_rows(bad, clean), 0)
          << label << ": NaN " << (which == 0 ? "index_q" : "new index-K rows")
          << " did not change any ids: the test cannot see an early read";
      upload(in, d);  // clean again (same addresses: new buffers, so re-derive the views)
    }
  }
  for (const Variant& v : variants) {
    upload(in, d);
    const GpuResult normal = run_gpu(d, v.o);
    if (::testing::Test::HasFailure()) break;
    for (bool graph : {false, true}) {
      const GpuResult pdl = run_behind_writer(in, d, w, v.o, s, graph);
      expect_same_ids(in, pdl, normal,
                      label + " [" + v.name + (graph ? ", graph" : "") +
                          ": programmatic behind the writer vs normal launch]");
      EXPECT_TRUE(d.pool.download_all() == pool_clean) << "the writer did not restore the pool";
    }
  }
  cudaStreamDestroy(s);
}

std::vector<Variant> all_variants(bool short_context) {
  std::vector<Variant> v = {{"auto", {}}};
  IndexerCudaOptions o;
  o.unfused_decode = true;
  v.push_back({"two-kernel", o});
  o.k_splits = 1000;  // 4-block splits: every block is some warp's first (the early copies)
  v.push_back({"two-kernel, k_splits 1000", o});
  o = {};
  o.fused_decode_always = true;
  v.push_back({"fused", o});
  o = {};
  o.force_cuda_cores = true;
  v.push_back({"cuda cores", o});
  o = {};
  o.early_query_loads = false;
  o.fast_select = false;
  v.push_back({"late loads, sorted lists", o});
  o = {};
  o.guess_request_bounds = false;
  v.push_back({"no guess: early loads", o});
  o = {};
  o.unfused_decode = true;
  o.short_select = false;
  v.push_back({"two-kernel, one warp per short row", o});
  o = {};
  o.pdl_prefetch_blocks = -1;
  v.push_back({"no L2 prefetch", o});
  o = {};
  o.pdl_prefetch_blocks = 8;
  v.push_back({"L2 prefetch 8", o});
  if (short_context) {
    for (int ctas : {1, 2, 8}) {
      o = {};
      o.single_pass = true;
      o.single_pass_ctas = ctas;
      v.push_back({ctas == 1 ? "single pass" : ctas == 2 ? "cluster 2" : "cluster 8", o});
    }
  }
  return v;
}

TEST(IndexerGpuPdl, ProgrammaticLaunchBehindAWriterEqualsNormalLaunch) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (bool integer : {true, false}) {
    // <= 64 blocks (the single pass applies): a prefill chunk (overflow tiles), then generation
    // requests of 4 tokens whose step straddles a block boundary (5118..5121, 2558..2561,
    // 4094..4097), a draft-0 request and one at the full 64 blocks.
    const std::vector<RequestSpec> reqs = {{2000, 150}, {5118, 4}, {2558, 4},
                                           {7000, 1},   {4094, 4}, {8188, 4}};
    Inputs in = make_inputs(reqs, 4, rng, integer, 0, 0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_EQ(in.max_pages(), 64);
    plant_visible_row(in, 1);  // 5118..5121: block 39 is a candidate of 5120 / 5121
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_programmatic(in, all_variants(true),
                       std::string("pdl 8K ") + (integer ? "integer" : "normal"), true);
  }
  {
    // Above 128 blocks: the automatic fused path with its selection kernel.
    const std::vector<RequestSpec> reqs = {{140 * 128 - 2, 4}, {9000, 1}, {100 * 128 - 1, 2}};
    Inputs in = make_inputs(reqs, 4, rng, true);
    ASSERT_FALSE(::testing::Test::HasFailure());
    plant_visible_row(in, 0);  // 17918..17921: block 139 is a candidate of 17920 / 17921
    ASSERT_FALSE(::testing::Test::HasFailure());
    check_programmatic(in, all_variants(false), "pdl 18K", true);
  }
  {
    // <= 16 blocks: no scorer, the selection kernel is the first (programmatic) kernel.
    const Inputs in = make_inputs({{2040, 8}, {100, 1}, {1000, 3}}, 4, rng, false, 0, 0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    ASSERT_EQ(in.max_pages(), 16);
    check_programmatic(in, {{"auto", {}}}, "pdl max_pages 16", false);
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
