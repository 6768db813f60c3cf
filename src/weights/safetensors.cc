#include "weights/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace m3attn {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// dtypes

Result<DType> safetensors_dtype_from_string(const std::string& dtype) {
  if (dtype == "BF16") return DType::kBF16;
  if (dtype == "F32") return DType::kF32;
  if (dtype == "I32") return DType::kI32;
  if (dtype == "F8_E4M3") return DType::kE4M3;
  if (dtype == "F8_E8M0") return DType::kE8M0;
  return unsupported("safetensors dtype \"", dtype,
                     "\" is not supported (supported: BF16, F32, I32, F8_E4M3, F8_E8M0)");
}

const char* safetensors_dtype_string(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF32:
      return "F32";
    case DType::kI32:
      return "I32";
    case DType::kE4M3:
      return "F8_E4M3";
    case DType::kE8M0:
      return "F8_E8M0";
  }
  return "?";
}

namespace {

// Element size of every standard safetensors dtype (0 for strings that are not one).
int standard_dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

Status unsupported_entry(const std::string& file, const SafetensorsEntry& e) {
  return unsupported(file, ": tensor \"", e.name, "\" has dtype \"", e.dtype_string,
                     "\", which m3attn does not support (supported: BF16, F32, I32, F8_E4M3, "
                     "F8_E8M0)");
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string SafetensorsEntry::shape_string() const {
  std::ostringstream os;
  os << "[";
  for (size_t d = 0; d < shape.size(); ++d) os << (d ? ", " : "") << shape[d];
  os << "]";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The bytes of a file: a read-only mapping or an owned buffer.

struct SafetensorsFile::Mapping {
  const uint8_t* data = nullptr;
  int64_t size = 0;
  void* mapped = nullptr;  // non-null when mmap'ed
  std::vector<uint8_t> owned;

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (mapped) munmap(mapped, static_cast<size_t>(size));
  }
};

namespace {

std::string errno_text() { return std::strerror(errno); }

bool checked_mul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Reads a JSON value that must be a non-negative integer fitting in int64.
bool json_to_index(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    const auto i = v.get<int64_t>();
    if (i < 0) return false;
    *out = i;
    return true;
  }
  return false;
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open safetensors file ", path, ": ", errno_text());
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    return io_error("cannot stat ", path, ": ", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error(path, " is not a regular file");
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<int64_t>(st.st_size);
  if (mapping->size > 0) {
    void* p = mmap(nullptr, static_cast<size_t>(mapping->size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const std::string err = errno_text();
      ::close(fd);
      return io_error("cannot map ", path, " (", mapping->size, " bytes): ", err);
    }
    mapping->mapped = p;
    mapping->data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return parse(std::move(mapping), path);
}

Result<SafetensorsFile> SafetensorsFile::from_bytes(std::vector<uint8_t> bytes,
                                                    const std::string& name) {
  auto mapping = std::make_shared<Mapping>();
  mapping->owned = std::move(bytes);
  mapping->data = mapping->owned.data();
  mapping->size = static_cast<int64_t>(mapping->owned.size());
  return parse(std::move(mapping), name);
}

Result<SafetensorsFile> SafetensorsFile::parse(std::shared_ptr<Mapping> mapping,
                                               const std::string& name) {
  const int64_t file_size = mapping->size;
  if (file_size < 8)
    return data_loss(name, ": file is ", file_size,
                     " bytes, shorter than the 8-byte safetensors header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | mapping->data[i];
  if (header_len > static_cast<uint64_t>(file_size - 8))
    return data_loss(name, ": header length ", header_len, " runs past the end of the file (",
                     file_size, " bytes): the file is truncated or not safetensors");
  // The same bound as the reference implementation: a larger header is corrupt, not a model.
  constexpr uint64_t kMaxHeader = 100u << 20;
  if (header_len > kMaxHeader)
    return data_loss(name, ": header length ", header_len, " exceeds the ", kMaxHeader,
                     "-byte limit of safetensors headers");
  const char* hbegin = reinterpret_cast<const char*>(mapping->data + 8);
  const char* hend = hbegin + header_len;

  // Duplicate top-level names are invisible after parsing (the last one wins), so they are caught
  // while parsing.
  std::set<std::string> seen;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json header = json::parse(hbegin, hend, on_event, /*allow_exceptions=*/false);
  if (header.is_discarded())
    return data_loss(name, ": the safetensors header (", header_len, " bytes) is not valid JSON");
  if (!header.is_object())
    return data_loss(name, ": the safetensors header must be a JSON object, got ",
                     header.type_name());
  if (!duplicate.empty())
    return data_loss(name, ": tensor name \"", duplicate, "\" appears twice in the header");

  SafetensorsFile file;
  file.path_ = name;
  const int64_t data_begin = 8 + static_cast<int64_t>(header_len);
  const int64_t data_size = file_size - data_begin;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object())
        return data_loss(name, ": __metadata__ must be an object of strings, got ", v.type_name());
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return data_loss(name, ": __metadata__ value of \"", m.key(), "\" must be a string, got ",
                           m.value().type_name());
        file.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object())
      return data_loss(name, ": tensor \"", key, "\" must be described by an object, got ",
                       v.type_name());
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!v.contains(field))
        return data_loss(name, ": tensor \"", key, "\" has no \"", field, "\" field");
    SafetensorsEntry e;
    e.name = key;
    if (!v["dtype"].is_string())
      return data_loss(name, ": tensor \"", key, "\" dtype must be a string");
    const std::string dtype_str = v["dtype"].get<std::string>();
    e.dtype_string = dtype_str;
    e.element_size = standard_dtype_size(dtype_str);
    if (e.element_size == 0)
      return unsupported(name, ": tensor \"", key, "\" has dtype \"", dtype_str,
                         "\", which is not a safetensors dtype");
    auto dt = safetensors_dtype_from_string(dtype_str);
    e.supported = dt.ok();
    if (e.supported) e.dtype = dt.value();
    const json& shape = v["shape"];
    if (!shape.is_array()) return data_loss(name, ": tensor \"", key, "\" shape must be an array");
    int64_t numel = 1;
    for (const json& d : shape) {
      int64_t s = 0;
      if (!json_to_index(d, &s))
        return data_loss(name, ": tensor \"", key, "\" shape ", shape.dump(),
                         " has an entry that is not a non-negative integer");
      e.shape.push_back(s);
      if (!checked_mul(numel, s, &numel))
        return data_loss(name, ": tensor \"", key, "\" shape ", shape.dump(),
                         " overflows 64-bit element counts");
    }
    int64_t nbytes = 0;
    if (!checked_mul(numel, e.element_size, &nbytes))
      return data_loss(name, ": tensor \"", key, "\" shape ", shape.dump(),
                       " overflows 64-bit byte counts");
    const json& off = v["data_offsets"];
    int64_t begin = 0, end = 0;
    if (!off.is_array() || off.size() != 2 || !json_to_index(off[0], &begin) ||
        !json_to_index(off[1], &end))
      return data_loss(name, ": tensor \"", key, "\" data_offsets ", off.dump(),
                       " must be two non-negative integers [begin, end]");
    if (begin > end)
      return data_loss(name, ": tensor \"", key, "\" data_offsets [", begin, ", ", end,
                       "] are reversed");
    if (end > data_size)
      return data_loss(name, ": tensor \"", key, "\" data_offsets [", begin, ", ", end,
                       "] run past the data region of ", data_size,
                       " bytes (the file is truncated)");
    if (end - begin != nbytes)
      return data_loss(name, ": tensor \"", key, "\" occupies ", end - begin, " bytes but shape ",
                       e.shape_string(), " of ", dtype_str, " needs ", nbytes);
    e.offset = data_begin + begin;
    e.size = nbytes;
    file.entries_.push_back(std::move(e));
  }
  std::sort(file.entries_.begin(), file.entries_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.offset != b.offset ? a.offset < b.offset : a.size < b.size;
            });
  int64_t prev_end = data_begin;
  const SafetensorsEntry* prev = nullptr;
  for (size_t i = 0; i < file.entries_.size(); ++i) {
    const SafetensorsEntry& e = file.entries_[i];
    if (e.size > 0 && prev != nullptr && e.offset < prev_end)
      return data_loss(name, ": tensors \"", prev->name, "\" and \"", e.name,
                       "\" overlap in the data region");
    if (e.size > 0) {
      prev_end = e.offset + e.size;
      prev = &e;
    }
    file.by_name_[e.name] = i;
  }
  file.mapping_ = std::move(mapping);
  return file;
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

int64_t SafetensorsFile::file_size() const { return mapping_ ? mapping_->size : 0; }

const uint8_t* SafetensorsFile::bytes(const SafetensorsEntry& entry) const {
  const SafetensorsEntry* e = mapping_ ? find(entry.name) : nullptr;
  return e == nullptr ? nullptr : mapping_->data + e->offset;
}

Result<TensorView> SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return invalid_argument(path_, ": no tensor named \"", name, "\"");
  if (!e->supported) return unsupported_entry(path_, *e);
  if (e->shape.size() > static_cast<size_t>(kMaxDims))
    return unsupported(path_, ": tensor \"", name, "\" has ", e->shape.size(),
                       " dimensions, more than the ", kMaxDims, " a TensorView holds");
  if (e->size > 0 && (reinterpret_cast<uintptr_t>(mapping_->data) + e->offset) %
                             static_cast<uintptr_t>(dtype_size(e->dtype)) !=
                         0)
    return unsupported(path_, ": tensor \"", name, "\" at byte ", e->offset,
                       " is not aligned to its ", dtype_size(e->dtype),
                       "-byte elements; use read() for a copy");
  // A zero-size tensor still gets a non-null pointer so that the view counts as defined.
  void* p = const_cast<uint8_t*>(mapping_->data + std::min(e->offset, mapping_->size - 1));
  return TensorView::contiguous(p, e->dtype, e->shape, Device::cpu());
}

Result<Tensor> SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return invalid_argument(path_, ": no tensor named \"", name, "\"");
  if (!e->supported) return unsupported_entry(path_, *e);
  Tensor t(e->dtype, e->shape);
  if (e->size > 0) std::memcpy(t.data(), mapping_->data + e->offset, static_cast<size_t>(e->size));
  return t;
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

// Appends the elements of a strided CPU view in row-major order.
void gather(const TensorView& t, std::vector<uint8_t>& out) {
  const int64_t es = dtype_size(t.dtype);
  const int64_t n = t.numel();
  if (n == 0) return;
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(n * es));
  uint8_t* dst = out.data() + base;
  const auto* src = static_cast<const uint8_t*>(t.data);
  if (t.is_contiguous()) {
    std::memcpy(dst, src, static_cast<size_t>(n * es));
    return;
  }
  int64_t idx[kMaxDims] = {};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.stride[d];
    std::memcpy(dst + i * es, src + off * es, static_cast<size_t>(es));
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

}  // namespace

Result<std::vector<uint8_t>> encode_safetensors(
    const std::vector<NamedTensor>& tensors, const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    M3_CHECK_ARG(!name.empty(), "safetensors: tensor names must not be empty");
    M3_CHECK_ARG(name.rfind("__", 0) != 0, "safetensors: tensor name \"", name,
                 "\" must not start with \"__\" (reserved for __metadata__)");
    M3_CHECK_ARG(names.insert(name).second, "safetensors: tensor name \"", name,
                 "\" is given twice");
    M3_CHECK_ARG(t.device.type == DeviceType::kCPU, "safetensors: tensor \"", name, "\" is on ",
                 t.device.to_string(), "; only host tensors can be written");
    M3_CHECK_ARG(t.ndim >= 0 && t.ndim <= kMaxDims, "safetensors: tensor \"", name, "\" has ",
                 t.ndim, " dimensions");
    for (int d = 0; d < t.ndim; ++d)
      M3_CHECK_ARG(t.shape[d] >= 0, "safetensors: tensor \"", name, "\" has a negative shape ",
                   t.shape_string());
    M3_CHECK_ARG(t.numel() == 0 || t.data != nullptr, "safetensors: tensor \"", name,
                 "\" has no data");
  }
  // Larger elements first (stable), so that every tensor is aligned to its element size inside the
  // 8-byte aligned data region, and tensors are contiguous without gaps.
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].second.dtype) > dtype_size(tensors[b].second.dtype);
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = meta;
  }
  int64_t offset = 0;
  for (size_t i : order) {
    const auto& [name, t] = tensors[i];
    const int64_t nbytes = t.numel() * dtype_size(t.dtype);
    std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
    header[name] = {{"dtype", safetensors_dtype_string(t.dtype)},
                    {"shape", shape},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument(
        "safetensors: cannot encode the header (names and metadata must be "
        "valid UTF-8): ",
        e.what());
  }
  while (text.size() % 8 != 0) text.push_back(' ');

  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + static_cast<size_t>(offset));
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(len >> (8 * i)));
  out.insert(out.end(), text.begin(), text.end());
  for (size_t i : order) gather(tensors[i].second, out);
  return out;
}

Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  auto bytes = encode_safetensors(tensors, metadata);
  M3_RETURN_IF_ERROR(bytes.status());
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return io_error("cannot create ", path, ": ", errno_text());
  const auto& b = bytes.value();
  const size_t written = b.empty() ? 0 : std::fwrite(b.data(), 1, b.size(), f);
  const bool close_ok = std::fclose(f) == 0;
  if (written != b.size() || !close_ok)
    return io_error("writing ", path, " failed after ", written, " of ", b.size(), " bytes");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {

Result<json> read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot open ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_loss(path, " is not valid JSON");
  return j;
}

}  // namespace

Result<Checkpoint> Checkpoint::from_files(std::vector<SafetensorsFile> files) {
  Checkpoint c;
  c.files_ = std::move(files);
  for (size_t i = 0; i < c.files_.size(); ++i) {
    for (const SafetensorsEntry& e : c.files_[i].entries()) {
      auto [it, inserted] = c.where_.emplace(e.name, i);
      M3_CHECK_ARG(inserted, "checkpoint: tensor \"", e.name, "\" is in both ",
                   c.files_[it->second].path(), " and ", c.files_[i].path());
    }
  }
  if (!c.files_.empty()) c.directory_ = fs::path(c.files_[0].path()).parent_path().string();
  return c;
}

Result<Checkpoint> Checkpoint::open(const std::string& path) {
  std::error_code ec;
  fs::path p(path);
  fs::path index_path;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors.index.json", ec)) {
      index_path = p / "model.safetensors.index.json";
    } else if (fs::exists(p / "model.safetensors", ec)) {
      p = p / "model.safetensors";
    } else {
      std::vector<fs::path> found;
      for (const auto& de : fs::directory_iterator(p, ec))
        if (de.path().extension() == ".safetensors") found.push_back(de.path());
      if (found.size() != 1)
        return io_error("checkpoint directory ", path, " has no model.safetensors.index.json and ",
                        found.size(), " .safetensors files (need exactly one)");
      p = found[0];
    }
  } else if (p.extension() == ".json") {
    index_path = p;
  }

  if (index_path.empty()) {
    auto file = SafetensorsFile::open(p.string());
    M3_RETURN_IF_ERROR(file.status());
    std::vector<SafetensorsFile> files;
    files.push_back(std::move(file).value());
    return from_files(std::move(files));
  }

  auto index = read_json_file(index_path.string());
  M3_RETURN_IF_ERROR(index.status());
  const json& j = index.value();
  const std::string ip = index_path.string();
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    return data_loss(ip, ": the index must be an object with a \"weight_map\" object");
  const fs::path dir = index_path.parent_path();
  Checkpoint c;
  c.directory_ = dir.string();
  std::map<std::string, size_t> shard_ids;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      return data_loss(ip, ": weight_map entry of \"", it.key(), "\" must be a file name");
    const std::string shard = it.value().get<std::string>();
    const fs::path rel(shard);
    bool escapes = shard.empty() || rel.is_absolute();
    for (const auto& part : rel)
      if (part == "..") escapes = true;
    if (escapes)
      return data_loss(ip, ": weight_map entry of \"", it.key(), "\" names \"", shard,
                       "\", which is not a file inside the checkpoint directory");
    auto sid = shard_ids.find(shard);
    if (sid == shard_ids.end()) {
      auto file = SafetensorsFile::open((dir / rel).string());
      M3_RETURN_IF_ERROR(file.status());
      sid = shard_ids.emplace(shard, c.files_.size()).first;
      c.files_.push_back(std::move(file).value());
    }
    if (!c.files_[sid->second].contains(it.key()))
      return data_loss(ip, ": weight_map puts \"", it.key(), "\" in ", shard,
                       ", which does not hold it");
    c.where_[it.key()] = sid->second;
  }
  return c;
}

const SafetensorsFile* Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : &files_[it->second];
}

const SafetensorsEntry* Checkpoint::find(const std::string& name) const {
  const SafetensorsFile* f = file_of(name);
  return f ? f->find(name) : nullptr;
}

Result<TensorView> Checkpoint::view(const std::string& name) const {
  const SafetensorsFile* f = file_of(name);
  if (f == nullptr) return invalid_argument("checkpoint has no tensor named \"", name, "\"");
  return f->view(name);
}

Result<Tensor> Checkpoint::read(const std::string& name) const {
  const SafetensorsFile* f = file_of(name);
  if (f == nullptr) return invalid_argument("checkpoint has no tensor named \"", name, "\"");
  return f->read(name);
}

std::vector<std::string> Checkpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& kv : where_) names.push_back(kv.first);
  return names;
}

}  // namespace m3attn
