#include "dist/communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

#if defined(M3ATTN_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include "core/cuda_check.h"
#endif

namespace m3attn {

int collective_dtype_bytes(CollectiveDType dtype) {
  switch (dtype) {
    case CollectiveDType::kBF16:
      return 2;
    case CollectiveDType::kF32:
    case CollectiveDType::kI32:
      return 4;
    case CollectiveDType::kF64:
      return 8;
  }
  return 0;
}

bool nccl_built_in() {
#if defined(M3ATTN_WITH_NCCL)
  return true;
#else
  return false;
#endif
}

#if defined(M3ATTN_WITH_NCCL)

static_assert(NCCL_UNIQUE_ID_BYTES == kUniqueIdBytes, "unique id size differs from nccl.h");

namespace {

// The NCCL entry points m3attn uses, resolved from the shared library.
struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommInitAll) init_all = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  int version = 0;
};

struct Loaded {
  NcclApi api;
  Status status = Status::Ok();
};

template <typename F>
bool resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

Loaded load_nccl() {
  Loaded l;
  // NVLink multicast stays off in every process that uses NCCL (read when NCCL initializes).
  force_nvls_off();
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("M3ATTN_NCCL_LIBRARY"); env && *env) candidates.push_back(env);
  candidates.push_back("libnccl.so.2");
  candidates.push_back("libnccl.so");
  candidates.push_back(M3ATTN_NCCL_LIBRARY_PATH);
  void* lib = nullptr;
  std::string tried;
  for (const std::string& c : candidates) {
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    const char* why = dlerror();
    tried += "\n  " + c + ": " + (why ? why : "not found");
  }
  if (!lib) {
    l.status = unsupported("NCCL is built in but libnccl could not be opened (set ",
                           "M3ATTN_NCCL_LIBRARY to its path):", tried);
    return l;
  }
  NcclApi& a = l.api;
  const bool ok =
      resolve(lib, "ncclGetVersion", &a.get_version) &&
      resolve(lib, "ncclGetUniqueId", &a.get_unique_id) &&
      resolve(lib, "ncclCommInitRank", &a.init_rank) &&
      resolve(lib, "ncclCommInitAll", &a.init_all) && resolve(lib, "ncclCommDestroy", &a.destroy) &&
      resolve(lib, "ncclCommAbort", &a.abort) &&
      resolve(lib, "ncclCommGetAsyncError", &a.async_error) &&
      resolve(lib, "ncclGetErrorString", &a.error_string) &&
      resolve(lib, "ncclGetLastError", &a.last_error) &&
      resolve(lib, "ncclAllReduce", &a.all_reduce) && resolve(lib, "ncclAllGather", &a.all_gather);
  if (!ok) {
    l.status = unsupported("libnccl lacks an entry point m3attn needs: ", dlerror());
    return l;
  }
  if (a.get_version(&a.version) != ncclSuccess) {
    l.status = unsupported("ncclGetVersion failed");
    return l;
  }
  return l;
}

const Loaded& nccl() {
  static const Loaded loaded = load_nccl();  // thread-safe, once
  return loaded;
}

Result<const NcclApi*> api() {
  const Loaded& l = nccl();
  M3_RETURN_IF_ERROR(l.status);
  return &l.api;
}

ncclDataType_t to_nccl(CollectiveDType d) {
  switch (d) {
    case CollectiveDType::kBF16:
      return ncclBfloat16;
    case CollectiveDType::kF32:
      return ncclFloat32;
    case CollectiveDType::kF64:
      return ncclFloat64;
    case CollectiveDType::kI32:
      return ncclInt32;
  }
  return ncclFloat32;
}

ncclRedOp_t to_nccl(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kSum:
      return ncclSum;
    case CollectiveOp::kMax:
      return ncclMax;
    case CollectiveOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

Status nccl_error(const NcclApi& a, ncclResult_t r, const char* what, ncclComm_t comm) {
  const char* last = comm ? a.last_error(comm) : nullptr;
  return make_status(StatusCode::kCudaError, what, " failed: NCCL error ", static_cast<int>(r),
                     " (", a.error_string(r), ")", last && *last ? ": " : "", last ? last : "");
}

}  // namespace

Status nccl_available(std::string* version) {
  const Loaded& l = nccl();
  M3_RETURN_IF_ERROR(l.status);
  if (version) {
    const int v = l.api.version;  // 2.19+: major * 10000 + minor * 100 + patch
    *version = std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
               std::to_string(v % 100);
  }
  return Status::Ok();
}

Result<UniqueIdBytes> nccl_new_unique_id() {
  Result<const NcclApi*> a = api();
  M3_RETURN_IF_ERROR(a.status());
  ncclUniqueId id;
  const ncclResult_t r = a.value()->get_unique_id(&id);
  if (r != ncclSuccess) return nccl_error(*a.value(), r, "ncclGetUniqueId", nullptr);
  UniqueIdBytes out{};
  std::copy(id.internal, id.internal + kUniqueIdBytes, reinterpret_cast<char*>(out.data()));
  return out;
}

Status Communicator::check(int result, const char* what) {
  if (result == ncclSuccess) return Status::Ok();
  failed_ = true;
  return nccl_error(*api().value(), static_cast<ncclResult_t>(result), what,
                    static_cast<ncclComm_t>(comm_));
}

Result<std::unique_ptr<Communicator>> Communicator::create(const UniqueIdBytes& id, int size,
                                                           int rank, int device) {
  M3_CHECK_ARG(size >= 1 && size <= kMaxRanks, "communicator size must be in [1, ", kMaxRanks,
               "], got ", size);
  M3_CHECK_ARG(rank >= 0 && rank < size, "communicator rank must be in [0, ", size, "), got ",
               rank);
  Result<const NcclApi*> a = api();
  M3_RETURN_IF_ERROR(a.status());
  int count = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  M3_CHECK_ARG(device >= 0 && device < count, "rank ", rank, " wants CUDA device ", device,
               " but this process sees ", count, " devices");
  M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  ncclUniqueId uid;
  std::copy(id.begin(), id.end(), reinterpret_cast<uint8_t*>(uid.internal));
  std::unique_ptr<Communicator> c(new Communicator());
  c->rank_ = rank;
  c->size_ = size;
  c->device_ = device;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = a.value()->init_rank(&comm, size, uid, rank);
  if (r != ncclSuccess) return nccl_error(*a.value(), r, "ncclCommInitRank", nullptr);
  c->comm_ = comm;
  M3_RETURN_IF_ERROR(c->init_barrier());
  return c;
}

Result<std::vector<std::unique_ptr<Communicator>>> Communicator::create_all(
    const std::vector<int>& devices) {
  const int n = static_cast<int>(devices.size());
  M3_CHECK_ARG(n >= 1 && n <= kMaxRanks, "create_all needs 1 to ", kMaxRanks, " devices, got ", n);
  Result<const NcclApi*> a = api();
  M3_RETURN_IF_ERROR(a.status());
  int count = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  for (int d : devices)
    M3_CHECK_ARG(d >= 0 && d < count, "create_all: device ", d, " is not one of the ", count,
                 " devices of this process");
  std::vector<ncclComm_t> comms(static_cast<size_t>(n), nullptr);
  const ncclResult_t r = a.value()->init_all(comms.data(), n, devices.data());
  if (r != ncclSuccess) return nccl_error(*a.value(), r, "ncclCommInitAll", nullptr);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) {
    std::unique_ptr<Communicator> c(new Communicator());
    c->comm_ = comms[static_cast<size_t>(i)];
    c->rank_ = i;
    c->size_ = n;
    c->device_ = devices[static_cast<size_t>(i)];
    out.push_back(std::move(c));
  }
  int prev = 0;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&prev));
  for (auto& c : out) {
    M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(c->device_));
    M3_RETURN_IF_ERROR(c->init_barrier());
  }
  M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(prev));
  return out;
}

Status Communicator::init_barrier() {
  cudaStream_t s = nullptr;
  M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = s;
  M3_CUDA_RETURN_IF_ERROR(cudaMalloc(&flag_, sizeof(int32_t)));
  return Status::Ok();
}

Status Communicator::barrier() {
  M3_CHECK_ARG(comm_ != nullptr && !failed_, "barrier on a communicator that failed or aborted");
  M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  M3_RETURN_IF_ERROR(all_reduce(flag_, 1, CollectiveDType::kI32, CollectiveOp::kSum, stream_));
  M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
  return check_async_error();
}

Communicator::~Communicator() {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device_);
  if (comm_) {
    const NcclApi& a = *api().value();
    if (failed_) {
      a.abort(static_cast<ncclComm_t>(comm_));
    } else {
      a.destroy(static_cast<ncclComm_t>(comm_));
    }
  }
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  if (flag_) cudaFree(flag_);
  cudaSetDevice(prev);
}

Status Communicator::all_reduce(void* data, int64_t count, CollectiveDType dtype, CollectiveOp op,
                                void* stream) {
  M3_CHECK_ARG(comm_ != nullptr && !failed_, "all_reduce on a communicator that failed or aborted");
  M3_CHECK_ARG(count >= 0, "all_reduce count must be >= 0, got ", count);
  if (count == 0) return Status::Ok();
  M3_CHECK_ARG(data != nullptr, "all_reduce of ", count, " elements from a null pointer");
  return check(
      api().value()->all_reduce(data, data, static_cast<size_t>(count), to_nccl(dtype), to_nccl(op),
                                static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(stream)),
      "ncclAllReduce");
}

Status Communicator::all_gather(const void* send, void* recv, int64_t bytes, void* stream) {
  M3_CHECK_ARG(comm_ != nullptr && !failed_, "all_gather on a communicator that failed or aborted");
  M3_CHECK_ARG(bytes >= 0, "all_gather size must be >= 0, got ", bytes);
  if (bytes == 0) return Status::Ok();
  M3_CHECK_ARG(send != nullptr && recv != nullptr, "all_gather with a null buffer");
  return check(
      api().value()->all_gather(send, recv, static_cast<size_t>(bytes), ncclUint8,
                                static_cast<ncclComm_t>(comm_), static_cast<cudaStream_t>(stream)),
      "ncclAllGather");
}

Status Communicator::check_async_error() {
  M3_CHECK_ARG(comm_ != nullptr, "check_async_error on an aborted communicator");
  ncclResult_t async = ncclSuccess;
  M3_RETURN_IF_ERROR(check(api().value()->async_error(static_cast<ncclComm_t>(comm_), &async),
                           "ncclCommGetAsyncError"));
  if (async != ncclSuccess && async != ncclInProgress)
    return check(async, "an asynchronous NCCL operation");
  return Status::Ok();
}

void Communicator::abort() {
  if (!comm_) return;
  api().value()->abort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
  failed_ = true;
}

namespace {

class NcclHostCollective final : public HostCollective {
 public:
  static constexpr int64_t kMaxValues = 256;
  ~NcclHostCollective() override {
    if (buf_) cudaFree(buf_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  static Result<std::unique_ptr<HostCollective>> create(Communicator* comm) {
    M3_CHECK_ARG(comm != nullptr, "host collective without a communicator");
    std::unique_ptr<NcclHostCollective> h(new NcclHostCollective());
    h->comm_ = comm;
    M3_CUDA_RETURN_IF_ERROR(cudaSetDevice(comm->device()));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&h->stream_, cudaStreamNonBlocking));
    M3_CUDA_RETURN_IF_ERROR(cudaMalloc(&h->buf_, kMaxValues * sizeof(double)));
    return std::unique_ptr<HostCollective>(std::move(h));
  }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  Status all_reduce(std::vector<double>* values, CollectiveOp op) override {
    const int64_t n = static_cast<int64_t>(values->size());
    M3_CHECK_ARG(n <= kMaxValues, "host all_reduce of ", n, " values, at most ", kMaxValues);
    if (n == 0) return Status::Ok();
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    M3_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(buf_, values->data(), bytes, cudaMemcpyHostToDevice, stream_));
    M3_RETURN_IF_ERROR(comm_->all_reduce(buf_, n, CollectiveDType::kF64, op, stream_));
    M3_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(values->data(), buf_, bytes, cudaMemcpyDeviceToHost, stream_));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

 private:
  NcclHostCollective() = default;
  Communicator* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* buf_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<HostCollective>> make_nccl_host_collective(Communicator* comm) {
  return NcclHostCollective::create(comm);
}

#else  // no NCCL in this build

namespace {
Status not_built() {
  return unsupported(
      "this m3attn was built without NCCL (it needs the CUDA backend and nccl.h / libnccl at "
      "configure time; M3ATTN_NCCL=ON makes it required)");
}
}  // namespace

Status nccl_available(std::string*) { return not_built(); }
Result<UniqueIdBytes> nccl_new_unique_id() { return not_built(); }
Result<std::unique_ptr<Communicator>> Communicator::create(const UniqueIdBytes&, int, int, int) {
  return not_built();
}
Result<std::vector<std::unique_ptr<Communicator>>> Communicator::create_all(
    const std::vector<int>&) {
  return not_built();
}
Communicator::~Communicator() = default;
Status Communicator::all_reduce(void*, int64_t, CollectiveDType, CollectiveOp, void*) {
  return not_built();
}
Status Communicator::all_gather(const void*, void*, int64_t, void*) { return not_built(); }
Status Communicator::barrier() { return not_built(); }
Status Communicator::init_barrier() { return not_built(); }
Status Communicator::check_async_error() { return not_built(); }
void Communicator::abort() {}
Status Communicator::check(int, const char*) { return not_built(); }
Result<std::unique_ptr<HostCollective>> make_nccl_host_collective(Communicator*) {
  return not_built();
}

#endif  // M3ATTN_WITH_NCCL

// ---------------------------------------------------------------------------------------------
// In-process host collectives (threads).

namespace {

struct ThreadGroup {
  explicit ThreadGroup(int n) : size(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<double> acc, result;
  bool mismatch = false, mismatch_result = false;
  size_t length = 0;
};

class ThreadHostCollective final : public HostCollective {
 public:
  ThreadHostCollective(std::shared_ptr<ThreadGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  Status all_reduce(std::vector<double>* values, CollectiveOp op) override {
    ThreadGroup& g = *g_;
    std::unique_lock<std::mutex> lock(g.mu);
    const uint64_t gen = g.generation;
    if (g.arrived == 0) {
      g.acc = *values;
      g.length = values->size();
      g.mismatch = false;
    } else if (values->size() != g.length) {
      g.mismatch = true;
    } else {
      for (size_t i = 0; i < values->size(); ++i) {
        const double v = (*values)[i];
        double& a = g.acc[i];
        a = op == CollectiveOp::kSum   ? a + v
            : op == CollectiveOp::kMax ? std::max(a, v)
                                       : std::min(a, v);
      }
    }
    if (++g.arrived == g.size) {
      g.result = g.acc;
      g.mismatch_result = g.mismatch;
      g.arrived = 0;
      ++g.generation;
      g.cv.notify_all();
    } else {
      g.cv.wait(lock, [&]() { return g.generation != gen; });
    }
    M3_CHECK_ARG(!g.mismatch_result, "host all_reduce: ranks passed different lengths");
    *values = g.result;
    return Status::Ok();
  }

 private:
  std::shared_ptr<ThreadGroup> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<HostCollective>> make_thread_host_collectives(int size) {
  std::vector<std::unique_ptr<HostCollective>> out;
  if (size < 1) return out;
  auto g = std::make_shared<ThreadGroup>(size);
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<ThreadHostCollective>(g, r));
  return out;
}

}  // namespace m3attn
