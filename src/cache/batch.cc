#include "cache/batch.h"

#include "m3attn/config.h"

namespace m3attn {

Status validate_batch_view(const BatchView& b, const char* stage) {
  M3_CHECK_ARG(b.num_tokens >= 0, stage, ": token count ", b.num_tokens, " is negative");
  M3_CHECK_ARG(b.num_requests >= 0, stage, ": request count ", b.num_requests, " is negative");
  M3_CHECK_ARG(b.max_pages >= 0, stage, ": max pages ", b.max_pages, " is negative");
  M3_RETURN_IF_ERROR(check_dtype(b.query_start, DType::kI32, "query_start"));
  M3_RETURN_IF_ERROR(check_shape(b.query_start, {b.num_requests + 1}, "query_start"));
  M3_RETURN_IF_ERROR(check_dtype(b.positions, DType::kI32, "positions"));
  M3_RETURN_IF_ERROR(check_shape(b.positions, {b.num_tokens}, "positions"));
  M3_RETURN_IF_ERROR(check_dtype(b.seq_lens, DType::kI32, "seq_lens"));
  M3_RETURN_IF_ERROR(check_shape(b.seq_lens, {b.num_requests}, "seq_lens"));
  M3_RETURN_IF_ERROR(check_dtype(b.page_table, DType::kI32, "page_table"));
  M3_RETURN_IF_ERROR(check_shape(b.page_table, {b.num_requests, b.max_pages}, "page_table"));
  M3_RETURN_IF_ERROR(check_contiguous(b.query_start, "query_start"));
  M3_RETURN_IF_ERROR(check_contiguous(b.positions, "positions"));
  M3_RETURN_IF_ERROR(check_contiguous(b.seq_lens, "seq_lens"));
  M3_CHECK_ARG(b.page_table.stride[1] == 1, "page_table rows must be contiguous");
  M3_RETURN_IF_ERROR(
      check_same_device({&b.query_start, &b.positions, &b.seq_lens, &b.page_table}, stage));
  return Status::Ok();
}

Status validate_batch_contents(const BatchView& b, int64_t num_pages, const char* stage) {
  M3_RETURN_IF_ERROR(validate_batch_view(b, stage));
  M3_CHECK_ARG(b.query_start.device.type == DeviceType::kCPU, stage,
               ": batch contents can only be checked on host views");
  const int32_t* qs = b.query_start.ptr<int32_t>();
  const int32_t* pos = b.positions.ptr<int32_t>();
  const int32_t* len = b.seq_lens.ptr<int32_t>();
  M3_CHECK_ARG(b.num_requests == 0 || qs[0] == 0, stage, ": query_start[0] must be 0, got ", qs[0]);
  M3_CHECK_ARG(b.num_requests > 0 || b.num_tokens == 0, stage, ": ", b.num_tokens,
               " tokens but no request owns them");
  M3_CHECK_ARG(qs[b.num_requests] == b.num_tokens, stage, ": query_start[R] = ", qs[b.num_requests],
               " must equal the token count ", b.num_tokens);
  for (int r = 0; r < b.num_requests; ++r) {
    M3_CHECK_ARG(qs[r] <= qs[r + 1], stage, ": query_start is not monotone at request ", r);
    const int n = qs[r + 1] - qs[r];
    M3_CHECK_ARG(len[r] >= n, stage, ": request ", r, " has ", n, " query tokens but seq_len ",
                 len[r]);
    M3_CHECK_ARG(int64_t{len[r]} <= int64_t{b.max_pages} * kPageSize, stage, ": request ", r,
                 " seq_len ", len[r], " exceeds its page table (", b.max_pages, " pages)");
    for (int i = 0; i < n; ++i) {
      const int32_t want = len[r] - n + i;
      M3_CHECK_ARG(pos[qs[r] + i] == want, stage, ": request ", r, " token ", i, " has position ",
                   pos[qs[r] + i], ", expected ", want, " (positions end at seq_len - 1)");
    }
    const int32_t* row = b.page_table.ptr<int32_t>() + int64_t{r} * b.page_table.stride[0];
    const int pages_used = (len[r] + kPageSize - 1) / kPageSize;
    for (int j = 0; j < pages_used; ++j)
      M3_CHECK_ARG(row[j] >= 0 && row[j] < num_pages, stage, ": request ", r, " page_table[", j,
                   "] = ", row[j], " is outside the pool of ", num_pages, " pages");
  }
  return Status::Ok();
}

}  // namespace m3attn
