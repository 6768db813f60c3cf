// The NCCL communicator of one rank, and the small host-side collectives of the attention-DP
// lock-step.
//
// NCCL is the collective library of the CUDA toolkit. m3attn opens libnccl with dlopen the first
// time it is needed (M3ATTN_NCCL_LIBRARY if set, then libnccl.so.2 on the loader's path, then the
// library CMake found), so binaries built with NCCL support start on machines without it and only
// the multi-GPU paths report that it is missing. A build without NCCL (no CUDA, or M3ATTN_NCCL=OFF)
// has the same API: every call returns unsupported.
//
// Every process that uses NCCL keeps NVLink multicast off (NCCL_NVLS_ENABLE=0 is forced in the
// environment before the library is opened).
//
// Streams are passed as `void*` holding a cudaStream_t (nullptr: the legacy default stream), so
// that this header needs no CUDA include. Collectives are enqueued, never synchronized: they are
// CUDA-graph capturable (NCCL supports stream capture), and every rank must issue the same
// collectives in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/launcher.h"
#include "m3attn/status.h"

namespace m3attn {

// This build carries NCCL support (the library itself is opened at run time).
bool nccl_built_in();
// Opens libnccl once; Ok with its version ("2.28.3") in *version, or unsupported naming the build
// or what the loader tried.
Status nccl_available(std::string* version = nullptr);
// A new unique id (ncclGetUniqueId). The calling process hosts NCCL's bootstrap root: it must
// stay alive until every rank has joined.
Result<UniqueIdBytes> nccl_new_unique_id();

enum class CollectiveDType { kBF16, kF32, kF64, kI32 };
enum class CollectiveOp { kSum, kMax, kMin };
int collective_dtype_bytes(CollectiveDType dtype);

class Communicator {
 public:
  // Joins the communicator of `size` ranks as `rank`, on CUDA device `device` (made current).
  // Blocks until every rank has joined (a peer that never comes is the launcher's to stop).
  static Result<std::unique_ptr<Communicator>> create(const UniqueIdBytes& id, int size, int rank,
                                                      int device);
  // One communicator per device, all in this process (ncclCommInitAll): rank i on devices[i].
  // Drive them from one thread per rank (or within one group); tests use this.
  static Result<std::vector<std::unique_ptr<Communicator>>> create_all(
      const std::vector<int>& devices);
  ~Communicator();  // destroys the communicator (aborts it when an error was seen)
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }

  // In place: `data` (device memory of this rank's device) holds `count` elements. Enqueued on
  // `stream`. count 0 launches nothing.
  Status all_reduce(void* data, int64_t count, CollectiveDType dtype, CollectiveOp op,
                    void* stream);
  // The o_proj row-parallel reduction: bf16 partial sums, summed in place.
  Status all_reduce_bf16_sum(void* data, int64_t count, void* stream) {
    return all_reduce(data, count, CollectiveDType::kBF16, CollectiveOp::kSum, stream);
  }
  // `recv` holds size() * bytes; rank r's `send` (bytes) lands at recv + r * bytes.
  Status all_gather(const void* send, void* recv, int64_t bytes, void* stream);
  // Every rank waits for the others (a one-element all-reduce on a private stream, synchronized):
  // after it, no rank has collectives of this communicator in flight.
  Status barrier();
  // A pending asynchronous NCCL error (e.g. a failed peer), as a Status.
  Status check_async_error();
  // Cancels this rank's pending operations; the communicator is unusable afterwards.
  void abort();

 private:
  Communicator() = default;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t of barrier()
  void* flag_ = nullptr;    // device int32 of barrier()
  int rank_ = 0, size_ = 1, device_ = 0;
  bool failed_ = false;
  Status check(int result, const char* what);
  Status init_barrier();
};

// Small collectives of host values (synchronous): the per-step lock-step of attention-DP (who has
// work, the slowest rank's step time) and the final totals.
class HostCollective {
 public:
  virtual ~HostCollective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over every rank's `values` (same length on every rank).
  virtual Status all_reduce(std::vector<double>* values, CollectiveOp op) = 0;
};

// Over a Communicator: a device buffer, a private stream, a synchronize per call. `comm` must
// outlive the object and its device must be current when all_reduce is called.
Result<std::unique_ptr<HostCollective>> make_nccl_host_collective(Communicator* comm);

// `size` ranks in one process, one thread each (tests, CPU simulation): all_reduce blocks until
// every rank of the group has called it.
std::vector<std::unique_ptr<HostCollective>> make_thread_host_collectives(int size);

}  // namespace m3attn
