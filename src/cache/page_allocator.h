// Page bookkeeping for a paged pool (SPEC sections 4 and 7): a free list of page ids, per-request
// page tables, slot mapping, and step reservations that roll back as a unit.
//
//   PageAllocator  free list over [0, num_pages); lowest ids first on a fresh allocator.
//   CacheManager   request id -> {pages, length}; token j of a request lives in slot
//                  pages[j / P] * P + j % P, P = tokens_per_page() (kPageSize = 128 unless the
//                  constructor says otherwise, e.g. 32 for the Eagle3 draft cache). reserve_step
//                  grows several requests at once and either succeeds for all of them or leaves
//                  every table and the free list exactly as they were (resource_exhausted names
//                  what was needed and what was free).
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "m3attn/config.h"
#include "m3attn/status.h"

namespace m3attn {

class PageAllocator {
 public:
  PageAllocator() = default;
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return num_pages_ - num_free(); }
  bool in_use(int32_t page) const;

  // Appends n page ids to *pages, or returns resource_exhausted and appends nothing.
  Status allocate(int64_t n, std::vector<int32_t>* pages);
  // Returns pages to the free list. Every id must be in range and in use, and no id may repeat;
  // otherwise invalid_argument and nothing is freed.
  Status free(const std::vector<int32_t>& pages);

 private:
  int64_t num_pages_ = 0;
  std::vector<int32_t> free_;  // a stack: back() is handed out next
  std::vector<uint8_t> used_;  // per page: 1 while allocated
};

// What one reserve_step changed, so that the step can be undone.
struct StepReservation {
  struct Entry {
    int64_t request_id = 0;
    bool admitted = false;  // the request did not exist before this step
    int64_t old_length = 0;
    size_t old_num_pages = 0;
  };
  std::vector<Entry> entries;
  int64_t pages_taken = 0;
};

class CacheManager {
 public:
  CacheManager() = default;
  // tokens_per_page < 1 is clamped to 1; use make() to have it (and the int32 slot range) checked.
  explicit CacheManager(int64_t num_pages, int tokens_per_page = kPageSize)
      : allocator_(num_pages), tokens_per_page_(tokens_per_page < 1 ? 1 : tokens_per_page) {}
  // Validating factory: num_pages >= 0, tokens_per_page >= 1, num_pages * tokens_per_page <= 2^31
  // (every slot fits int32); invalid_argument otherwise.
  static Result<CacheManager> make(int64_t num_pages, int tokens_per_page = kPageSize);

  const PageAllocator& allocator() const { return allocator_; }
  int64_t num_pages() const { return allocator_.num_pages(); }
  int64_t num_free_pages() const { return allocator_.num_free(); }
  int tokens_per_page() const { return tokens_per_page_; }
  // ceil(tokens / tokens_per_page); the static form defaults to kPageSize (128-token pages).
  static int64_t pages_for(int64_t tokens, int64_t tokens_per_page = kPageSize);
  // The same count in this manager's geometry.
  int64_t pages_needed(int64_t tokens) const { return pages_for(tokens, tokens_per_page_); }

  // A new request with no tokens (invalid_argument when the id exists).
  Status add_request(int64_t id);
  bool has_request(int64_t id) const { return requests_.count(id) != 0; }
  size_t num_requests() const { return requests_.size(); }
  std::vector<int64_t> request_ids() const;  // ascending
  // Length (tokens whose slots are reserved) and page table of a request; -1 / empty when unknown.
  int64_t length(int64_t id) const;
  const std::vector<int32_t>& pages(int64_t id) const;
  // Slot of token j of a request: pages[j / P] * P + j % P with P = tokens_per_page();
  // out_of_range past its pages.
  Result<int32_t> slot(int64_t id, int64_t token) const;

  // Grows (or keeps) one request to new_length tokens, allocating pages as needed; atomic.
  Status reserve(int64_t id, int64_t new_length);
  // Shrinks a request to new_length tokens (rejected speculative drafts), freeing whole pages past
  // ceil(new_length / tokens_per_page()).
  Status truncate(int64_t id, int64_t new_length);
  // Frees every page of a request and forgets it.
  Status release(int64_t id);

  // Grows every listed request (id, new_length) in one transaction; unknown ids are admitted when
  // admit_new is true. Duplicate ids, shrinking lengths or unknown ids (admit_new false) are
  // invalid_argument; running out of pages is resource_exhausted. On any failure every page the
  // step took is returned and every table is as before.
  Result<StepReservation> reserve_step(const std::vector<std::pair<int64_t, int64_t>>& grow_to,
                                       bool admit_new);
  // Undoes a successful reserve_step (must be the next change to those requests): pages taken are
  // freed, lengths restored, admitted requests forgotten.
  Status rollback(const StepReservation& reservation);

 private:
  struct Request {
    int64_t length = 0;
    std::vector<int32_t> pages;
  };
  void undo(const std::vector<StepReservation::Entry>& entries);

  PageAllocator allocator_;
  int tokens_per_page_ = kPageSize;
  std::map<int64_t, Request> requests_;
};

}  // namespace m3attn
