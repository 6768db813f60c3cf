#include "cache/page_allocator.h"

#include <set>

#include "m3attn/config.h"

namespace m3attn {

namespace {
// Slots are int32: page * tokens_per_page + row < 2^31.
constexpr int64_t kMaxTokensPerRequest = int64_t{1} << 31;
}  // namespace

PageAllocator::PageAllocator(int64_t num_pages)
    : num_pages_(num_pages < 0 ? 0 : num_pages), used_(static_cast<size_t>(num_pages_), 0) {
  free_.reserve(static_cast<size_t>(num_pages_));
  for (int64_t p = num_pages_ - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

bool PageAllocator::in_use(int32_t page) const {
  return page >= 0 && page < num_pages_ && used_[static_cast<size_t>(page)] != 0;
}

Status PageAllocator::allocate(int64_t n, std::vector<int32_t>* pages) {
  M3_CHECK_ARG(n >= 0, "cannot allocate a negative number of pages (", n, ")");
  if (n > num_free())
    return resource_exhausted("out of KV pages: need ", n, ", ", num_free(), " of ", num_pages_,
                              " free");
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_.back();
    free_.pop_back();
    used_[static_cast<size_t>(p)] = 1;
    pages->push_back(p);
  }
  return Status::Ok();
}

Status PageAllocator::free(const std::vector<int32_t>& pages) {
  std::set<int32_t> seen;
  for (int32_t p : pages) {
    M3_CHECK_ARG(p >= 0 && p < num_pages_, "page ", p, " is outside the pool of ", num_pages_,
                 " pages");
    M3_CHECK_ARG(used_[static_cast<size_t>(p)] != 0, "page ", p, " is not allocated");
    M3_CHECK_ARG(seen.insert(p).second, "page ", p, " is freed twice in one call");
  }
  for (int32_t p : pages) {
    used_[static_cast<size_t>(p)] = 0;
    free_.push_back(p);
  }
  return Status::Ok();
}

Result<CacheManager> CacheManager::make(int64_t num_pages, int tokens_per_page) {
  M3_CHECK_ARG(num_pages >= 0, "number of pages must be >= 0, got ", num_pages);
  M3_CHECK_ARG(tokens_per_page >= 1, "tokens per page must be >= 1, got ", tokens_per_page);
  M3_CHECK_ARG(num_pages <= kMaxTokensPerRequest / tokens_per_page, num_pages, " pages of ",
               tokens_per_page, " tokens exceed the int32 slot range (2^31 slots)");
  return CacheManager(num_pages, tokens_per_page);
}

int64_t CacheManager::pages_for(int64_t tokens, int64_t tokens_per_page) {
  if (tokens_per_page < 1) tokens_per_page = 1;
  return tokens <= 0 ? 0 : (tokens + tokens_per_page - 1) / tokens_per_page;
}

Status CacheManager::add_request(int64_t id) {
  M3_CHECK_ARG(!has_request(id), "request ", id, " already exists");
  requests_[id] = Request{};
  return Status::Ok();
}

std::vector<int64_t> CacheManager::request_ids() const {
  std::vector<int64_t> ids;
  ids.reserve(requests_.size());
  for (const auto& kv : requests_) ids.push_back(kv.first);
  return ids;
}

int64_t CacheManager::length(int64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? -1 : it->second.length;
}

const std::vector<int32_t>& CacheManager::pages(int64_t id) const {
  static const std::vector<int32_t> kNone;
  auto it = requests_.find(id);
  return it == requests_.end() ? kNone : it->second.pages;
}

Result<int32_t> CacheManager::slot(int64_t id, int64_t token) const {
  auto it = requests_.find(id);
  M3_CHECK_ARG(it != requests_.end(), "request ", id, " does not exist");
  const std::vector<int32_t>& pages = it->second.pages;
  const int64_t P = tokens_per_page_;
  if (token < 0 || token / P >= static_cast<int64_t>(pages.size()))
    return out_of_range("token ", token, " of request ", id, " is outside its ", pages.size(),
                        " pages");
  return static_cast<int32_t>(int64_t{pages[static_cast<size_t>(token / P)]} * P + token % P);
}

Status CacheManager::reserve(int64_t id, int64_t new_length) {
  M3_CHECK_ARG(has_request(id), "request ", id, " does not exist");
  return reserve_step({{id, new_length}}, false).status();
}

Status CacheManager::truncate(int64_t id, int64_t new_length) {
  auto it = requests_.find(id);
  M3_CHECK_ARG(it != requests_.end(), "request ", id, " does not exist");
  Request& r = it->second;
  M3_CHECK_ARG(new_length >= 0 && new_length <= r.length, "cannot truncate request ", id,
               " of length ", r.length, " to ", new_length);
  const size_t keep = static_cast<size_t>(pages_needed(new_length));
  std::vector<int32_t> drop(r.pages.begin() + static_cast<std::ptrdiff_t>(keep), r.pages.end());
  M3_RETURN_IF_ERROR(allocator_.free(drop));
  r.pages.resize(keep);
  r.length = new_length;
  return Status::Ok();
}

Status CacheManager::release(int64_t id) {
  auto it = requests_.find(id);
  M3_CHECK_ARG(it != requests_.end(), "request ", id, " does not exist");
  M3_RETURN_IF_ERROR(allocator_.free(it->second.pages));
  requests_.erase(it);
  return Status::Ok();
}

void CacheManager::undo(const std::vector<StepReservation::Entry>& entries) {
  // Newest first, so that pages return to the free list in the reverse order they left it and a
  // failed step leaves the allocator in exactly its previous state.
  for (auto e = entries.rbegin(); e != entries.rend(); ++e) {
    auto it = requests_.find(e->request_id);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    std::vector<int32_t> taken(r.pages.begin() + static_cast<std::ptrdiff_t>(e->old_num_pages),
                               r.pages.end());
    // Freed in reverse so the next allocation hands them out in the same order again.
    std::vector<int32_t> reversed(taken.rbegin(), taken.rend());
    Status s = allocator_.free(reversed);
    (void)s;  // pages of a live reservation are always allocated
    r.pages.resize(e->old_num_pages);
    r.length = e->old_length;
    if (e->admitted) requests_.erase(it);
  }
}

Result<StepReservation> CacheManager::reserve_step(
    const std::vector<std::pair<int64_t, int64_t>>& grow_to, bool admit_new) {
  // Validation first: nothing changes on a rejected call.
  std::set<int64_t> ids;
  for (const auto& [id, len] : grow_to) {
    M3_CHECK_ARG(ids.insert(id).second, "request ", id, " appears twice in one step");
    M3_CHECK_ARG(len >= 0 && len < kMaxTokensPerRequest, "request ", id, " length ", len,
                 " is outside [0, 2^31)");
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      M3_CHECK_ARG(admit_new, "request ", id, " does not exist");
    } else {
      M3_CHECK_ARG(len >= it->second.length, "request ", id, " cannot grow from ",
                   it->second.length, " to ", len, " tokens (use truncate to shrink)");
    }
  }
  StepReservation res;
  for (const auto& [id, len] : grow_to) {
    StepReservation::Entry e;
    e.request_id = id;
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      e.admitted = true;
      it = requests_.emplace(id, Request{}).first;
    }
    Request& r = it->second;
    e.old_length = r.length;
    e.old_num_pages = r.pages.size();
    res.entries.push_back(e);
    const int64_t need = pages_needed(len) - static_cast<int64_t>(r.pages.size());
    if (need > 0) {
      Status s = allocator_.allocate(need, &r.pages);
      if (!s.ok()) {
        const int64_t taken = res.pages_taken;
        undo(res.entries);
        return resource_exhausted("step needs ", taken + need, " more KV pages (request ", id,
                                  " needs ", need, " for ", len, " tokens), only ",
                                  allocator_.num_free(), " of ", allocator_.num_pages(),
                                  " are free; rolled back");
      }
      res.pages_taken += need;
    }
    r.length = len;
  }
  return res;
}

Status CacheManager::rollback(const StepReservation& reservation) {
  for (const auto& e : reservation.entries) {
    auto it = requests_.find(e.request_id);
    M3_CHECK_ARG(it != requests_.end(), "rollback: request ", e.request_id, " no longer exists");
    M3_CHECK_ARG(it->second.pages.size() >= e.old_num_pages, "rollback: request ", e.request_id,
                 " has fewer pages than before its step");
  }
  undo(reservation.entries);
  return Status::Ok();
}

}  // namespace m3attn
