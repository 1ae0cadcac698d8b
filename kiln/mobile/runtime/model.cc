#include "model.h"

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/dtype.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "errors.h"
#include "md5.h"

namespace kiln {
namespace {

namespace ffi = tvm::ffi;
using tvm::runtime::Tensor;

constexpr int64_t kSequenceId = 0;
// A hybrid model's recurrent state keeps this many steps, and the engine this many copies of it as it was
// after a prompt's prefill (kiln/model_memory.py's RECURRENT_HISTORY, RECURRENT_SNAPSHOTS).
constexpr int kRecurrentHistory = 8;
constexpr size_t kRecurrentSnapshots = 2;
constexpr int64_t kPageSize = 16;  // kiln/model_memory.py's PAGE_SIZE: the libraries' KV-cache kernels assume it
constexpr int kPooledAllocator = 2;
constexpr const char* kSystemLibScheme = "system://";

std::string Join(const std::string& folder, const std::string& name) {
  return name.empty() || name[0] == '/' ? name : folder + "/" + name;
}

// A field of a model file that must be there with the right type; else a bad-model error naming the file.
template <typename T>
T Required(const json::Object& object, const char* key, const std::string& path) {
  auto value = object.Get(key);
  std::optional<T> typed = value.has_value() ? value->try_cast<T>() : std::nullopt;
  if (!typed.has_value()) throw EngineError(ErrorCode::kBadModel, path + ": no valid \"" + key + "\"");
  return *typed;
}

template <typename T>
T Optional(const json::Object& object, const char* key, T fallback) {
  auto value = object.Get(key);
  if (!value.has_value() || *value == nullptr) return fallback;
  return value->try_cast<T>().value_or(fallback);
}

std::string SeriesOf(const std::string& version) {
  size_t first_dot = version.find('.');
  size_t second_dot = first_dot == std::string::npos ? std::string::npos : version.find('.', first_dot + 1);
  return version.substr(0, second_dot);
}

// Refuse a build of another Kiln major.minor or another TVM, as kiln/runtime.py's check_build_versions
// and web/src/loader.js do.
void CheckBuildVersions(const json::Object& build, const std::string& folder) {
  std::string built_kiln = Optional<ffi::String>(build, "kiln_version", "");
  json::Object versions = Optional<json::Object>(build, "versions", json::Object());
  std::string built_tvm = Optional<ffi::String>(versions, "tvm", "");
  if (SeriesOf(built_kiln) != SeriesOf(KILN_VERSION) || built_tvm != KILN_TVM_VERSION) {
    throw EngineError(ErrorCode::kIncompatibleModel,
                      folder + ": built by Kiln " + (built_kiln.empty() ? "(not recorded)" : built_kiln) +
                          " with TVM " + (built_tvm.empty() ? "(not recorded)" : built_tvm) +
                          ", but this runtime is Kiln " + KILN_VERSION + " with TVM " + KILN_TVM_VERSION +
                          ", which runs builds of Kiln " + SeriesOf(KILN_VERSION) +
                          ".x made with its TVM: rebuild the model with this kiln compile");
  }
}

ffi::Function RequiredFunction(const ffi::Module& module, const char* name) {
  ffi::Optional<ffi::Function> function = module->GetFunction(name);
  if (!function.has_value()) {
    throw EngineError(ErrorCode::kBadModel,
                      std::string("the model library has no function ") + name + "; rebuild it with kiln compile");
  }
  return *function;
}

ffi::Function GlobalFunction(const char* name) {
  ffi::Optional<ffi::Function> function = ffi::Function::GetGlobal(name);
  if (!function.has_value()) throw EngineError(ErrorCode::kInternal, std::string("the runtime lacks ") + name);
  return *function;
}

// The logits of each position a step gave (prefill gives its last position's only).
std::vector<std::vector<float>> Rows(const Tensor& logits) {
  int64_t vocab = logits->shape[logits->ndim - 1];
  int64_t count = 1;
  for (int i = 0; i < logits->ndim; ++i) count *= logits->shape[i];
  count /= vocab;
  std::vector<float> all(count * vocab);
  logits.CopyToBytes(all.data(), all.size() * sizeof(float));
  std::vector<std::vector<float>> rows;
  for (int64_t row = 0; row < count; ++row)
    rows.emplace_back(all.begin() + row * vocab, all.begin() + (row + 1) * vocab);
  return rows;
}

}  // namespace

std::string ReadModelFile(const std::string& path, const char* what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw EngineError(ErrorCode::kBadModel, path + ": " + what + " is missing or unreadable");
  std::ostringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

namespace {

// The bytes a tensor of `shape` and `dtype` takes; nullopt for a negative size or one past 2^62 bytes.
std::optional<int64_t> TensorBytes(const json::Array& shape, DLDataType dtype) {
  constexpr int64_t kLargest = int64_t{1} << 62;
  int64_t bytes = (dtype.bits * dtype.lanes + 7) / 8;
  for (const ffi::Any& size : shape) {
    std::optional<int64_t> extent = size.as<int64_t>();
    if (!extent.has_value() || *extent < 0 || (*extent > 0 && bytes > kLargest / *extent)) return std::nullopt;
    bytes *= *extent;
  }
  return bytes;
}

// One weight of a shard, checked against the shard before anything is allocated for it.
std::pair<std::string, Tensor> LoadRecord(const json::Object& record, const std::string& shard_bytes,
                                          const std::string& index_path) {
  std::string name = Required<ffi::String>(record, "name", index_path);
  json::Array shape = Required<json::Array>(record, "shape", index_path);
  int64_t offset = Required<int64_t>(record, "byteOffset", index_path);
  int64_t nbytes = Required<int64_t>(record, "nbytes", index_path);
  DLDataType dtype;
  try {
    dtype = ffi::StringToDLDataType(Required<ffi::String>(record, "dtype", index_path));
  } catch (const ffi::Error&) {
    throw EngineError(ErrorCode::kBadModel, index_path + ": the record of " + name + " has an unknown dtype");
  }
  std::optional<int64_t> expected = TensorBytes(shape, dtype);
  int64_t available = static_cast<int64_t>(shard_bytes.size());
  if (!expected || *expected != nbytes || offset < 0 || offset > available || nbytes > available - offset) {
    throw EngineError(ErrorCode::kBadModel, index_path + ": the record of " + name + " does not fit its shard");
  }
  std::vector<int64_t> extents;
  for (const ffi::Any& size : shape) extents.push_back(size.cast<int64_t>());
  Tensor tensor = Tensor::Empty(ffi::Shape(extents), dtype, DLDevice{kDLCPU, 0});
  tensor.CopyFromBytes(shard_bytes.data() + offset, nbytes);
  return {name, tensor};
}

}  // namespace

json::Object ReadJsonFile(const std::string& path) {
  std::string text = ReadModelFile(path, "the file");
  ffi::String problem;
  json::Value value = json::Parse(text, &problem);
  if (!problem.empty())
    throw EngineError(ErrorCode::kBadModel, path + ": malformed JSON (" + std::string(problem) + ")");
  std::optional<json::Object> object = value.try_cast<json::Object>();
  if (!object.has_value()) throw EngineError(ErrorCode::kBadModel, path + ": not a JSON object");
  return *object;
}

Model::Model(const std::string& folder, const std::string& model_lib)
    : folder_(folder),
      build_(ReadJsonFile(Join(folder, "kiln-build.json"))),
      chat_config_(ReadJsonFile(Join(folder, "mlc-chat-config.json"))),
      library_(LoadLibrary(model_lib)),
      vm_(RequiredFunction(library_, "vm_load_executable")().cast<ffi::Module>()),
      add_sequence_(GlobalFunction("vm.builtin.kv_state_add_sequence")),
      remove_sequence_(GlobalFunction("vm.builtin.kv_state_remove_sequence")),
      begin_forward_(GlobalFunction("vm.builtin.kv_state_begin_forward")),
      end_forward_(GlobalFunction("vm.builtin.kv_state_end_forward")),
      popn_(GlobalFunction("vm.builtin.kv_state_popn")) {
  vocab_size_ = static_cast<int>(Required<int64_t>(chat_config_, "vocab_size", Join(folder, "mlc-chat-config.json")));
  RequiredFunction(vm_, "vm_initialization")(static_cast<int>(kDLCPU), 0, kPooledAllocator);

  std::string metadata_text = RequiredFunction(vm_, "_metadata")().cast<ffi::String>();
  json::Object metadata = json::Parse(metadata_text).cast<json::Object>();
  const std::string where = "the library's metadata";
  context_window_size_ = static_cast<int>(Required<int64_t>(metadata, "context_window_size", where));
  prefill_chunk_size_ = static_cast<int>(Required<int64_t>(metadata, "prefill_chunk_size", where));
  sliding_window_size_ = static_cast<int>(Optional<int64_t>(metadata, "sliding_window_size", -1));
  layer_window_size_ = static_cast<int>(Optional<int64_t>(metadata, "layer_sliding_window_size", -1));
  layer_window_chunked_prefill_ = Optional<bool>(metadata, "layer_window_chunked_prefill", false);
  all_logits_chunk_size_ = static_cast<int>(Optional<int64_t>(metadata, "all_logits_chunk_size", prefill_chunk_size_));
  embed_ = RequiredFunction(vm_, "embed");
  prefill_ = RequiredFunction(vm_, "prefill");
  decode_ = RequiredFunction(vm_, "decode");
  prefill_all_logits_ = RequiredFunction(vm_, "prefill_all_logits");
  for (const ffi::Any& rows : Optional<json::Array>(metadata, "verify_rows", json::Array())) {
    int64_t count = rows.try_cast<int64_t>().value_or(0);
    if (count < 1) throw EngineError(ErrorCode::kBadModel, where + ": verify_rows must hold row counts");
    verify_[static_cast<int>(count)] = RequiredFunction(vm_, ("verify_" + std::to_string(count)).c_str());
  }
  LoadParams(Required<json::Array>(metadata, "params", where));

  kv_cache_ = RequiredFunction(vm_, "create_tir_paged_kv_cache")(
      ffi::Shape({1}), ffi::Shape({context_window_size_}), ffi::Shape({prefill_chunk_size_}), ffi::Shape({kPageSize}),
      ffi::Shape({sliding_window_size_ > 0 ? 1 : 0}));
  states_ = {kv_cache_};
  recurrent_ = Optional<ffi::String>(metadata, "kv_state_kind", "kv_cache") == "hybrid";
  if (recurrent_) {
    states_.push_back(RequiredFunction(vm_, "create_rnn_state")(ffi::Shape({1}), ffi::Shape({kRecurrentHistory})));
    snapshot_state_ = RequiredFunction(vm_, "rnn_state_snapshot");
    restore_state_ = RequiredFunction(vm_, "rnn_state_restore");
  }
  AddSequence();
}

ffi::Module Model::LoadLibrary(const std::string& model_lib) const {
  CheckBuildVersions(build_, folder_);
  auto system_lib = [](const std::string& prefix) {
    return GlobalFunction("ffi.SystemLib")(prefix).cast<ffi::Module>();
  };
  if (model_lib.rfind(kSystemLibScheme, 0) == 0) {
    return system_lib(model_lib.substr(std::string(kSystemLibScheme).size()) + "_");
  }
  std::string path = model_lib;
  if (path.empty()) {
    json::Object targets = Optional<json::Object>(build_, "targets", json::Object());
    json::Object entry = Optional<json::Object>(targets, KILN_TARGET, json::Object());
    // A phone target's library is linked into the app: the build record names its prefix.
    std::string prefix = Optional<ffi::String>(entry, "system_lib_prefix", "");
    if (!prefix.empty()) return system_lib(prefix);
    path = Optional<ffi::String>(entry, "library", "");
    if (path.empty()) {
      throw EngineError(ErrorCode::kBadModel, folder_ + ": no " KILN_TARGET
                                                        " library in this model folder; build it with "
                                                        "kiln compile … --target " KILN_TARGET);
    }
  }
  path = Join(folder_, path);
  if (!std::ifstream(path))
    throw EngineError(ErrorCode::kBadModel, path + ": the model library is missing or unreadable");
  return ffi::Module::LoadFromFile(path);
}

// The parameters in the order the library takes them, from shards whose md5 matches tensor-cache.json,
// read one shard at a time (the peak is the weights plus one shard).
void Model::LoadParams(const json::Array& param_specs) {
  const std::string index_path = Join(folder_, "tensor-cache.json");
  json::Object index = ReadJsonFile(index_path);
  std::map<std::string, Tensor> loaded;
  for (const ffi::Any& shard_any : Required<json::Array>(index, "records", index_path)) {
    json::Object shard = shard_any.cast<json::Object>();
    std::string shard_path = Join(folder_, Required<ffi::String>(shard, "dataPath", index_path));
    std::string bytes = ReadModelFile(shard_path, "the weight shard");
    if (static_cast<int64_t>(bytes.size()) != Required<int64_t>(shard, "nbytes", index_path)) {
      throw EngineError(ErrorCode::kIntegrity, shard_path + ": the weight shard has " + std::to_string(bytes.size()) +
                                                   " bytes, not the ones tensor-cache.json gives");
    }
    std::string md5 = Optional<ffi::String>(shard, "md5sum", "");
    if (!md5.empty() && Md5Hex(bytes) != md5) {
      throw EngineError(
          ErrorCode::kIntegrity,
          shard_path + ": the weight shard does not match its md5 in tensor-cache.json (corrupt or replaced)");
    }
    for (const ffi::Any& record : Required<json::Array>(shard, "records", index_path)) {
      auto [name, tensor] = LoadRecord(record.try_cast<json::Object>().value_or(json::Object()), bytes, index_path);
      loaded.emplace(name, tensor);
    }
  }
  std::vector<Tensor> params;
  for (const ffi::Any& spec : param_specs) {
    std::string name = spec.cast<json::Object>().Get("name").value().cast<ffi::String>();
    auto found = loaded.find(name);
    if (found == loaded.end()) {
      throw EngineError(ErrorCode::kBadModel, index_path + ": the tensor cache has no weight " + name +
                                                  "; the model folder is from another build");
    }
    params.push_back(found->second);
  }
  params_ = ffi::Array<Tensor>(params.begin(), params.end());
}

void Model::AddSequence() {
  for (const ffi::Any& state : states_) add_sequence_(state, kSequenceId);
  if (sliding_window_size_ > 0) {
    GlobalFunction("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(kv_cache_, kSequenceId,
                                                                                  sliding_window_size_, 0);
  }
  cached_ids_.clear();
  undoable_steps_ = 0;
  snapshots_.clear();
}

void Model::Reset() {
  for (const ffi::Any& state : states_) remove_sequence_(state, kSequenceId);
  AddSequence();
}

// Once a sliding window has dropped tokens, the ones before it cannot come back: then it forgets them all.
// A recurrent state undoes its last single-token steps; further back, it goes back to its latest snapshot
// at or before the point (the caller prefills the rest again), or else forgets all (kiln/runtime.py).
int Model::Rollback(int count) {
  if (count <= 0) return static_cast<int>(cached_ids_.size());
  bool lost = sliding_window_size_ > 0 && static_cast<int>(cached_ids_.size()) > sliding_window_size_;
  if (lost) {
    Reset();
  } else if (!recurrent_ || count <= undoable_steps_) {
    for (const ffi::Any& state : states_) popn_(state, kSequenceId, count);
    cached_ids_.resize(cached_ids_.size() - count);
    undoable_steps_ -= count;
  } else {
    RestoreSnapshot(cached_ids_.size() - count);
  }
  while (!snapshots_.empty() && snapshots_.back().kept > cached_ids_.size()) snapshots_.pop_back();
  return static_cast<int>(cached_ids_.size());
}

void Model::TakeSnapshot() {
  begin_forward_(states_[1], ffi::Shape({kSequenceId}), ffi::Shape({1}));
  snapshots_.push_back({cached_ids_.size(), snapshot_state_(states_[1]).cast<ffi::Array<Tensor>>()});
  if (snapshots_.size() > kRecurrentSnapshots) snapshots_.erase(snapshots_.begin());
}

// Back to the latest snapshot at or before `point` cached tokens: the KV cache pops to it, the recurrent
// state takes it as a step's result; with none, the sequence starts over.
void Model::RestoreSnapshot(size_t point) {
  while (!snapshots_.empty() && snapshots_.back().kept > point) snapshots_.pop_back();
  if (snapshots_.empty()) {
    Reset();
    return;
  }
  const Snapshot& snapshot = snapshots_.back();
  popn_(kv_cache_, kSequenceId, static_cast<int>(cached_ids_.size() - snapshot.kept));
  begin_forward_(states_[1], ffi::Shape({kSequenceId}), ffi::Shape({1}));
  restore_state_(states_[1], snapshot.copy);
  end_forward_(states_[1]);
  cached_ids_.resize(snapshot.kept);
  undoable_steps_ = 0;
}

// Past a sliding window, tokens go one at a time (as kiln/runtime.py's _chunk_size explains).
int Model::ChunkSize(int longest) const {
  int cached = static_cast<int>(cached_ids_.size());
  int room = longest;
  if (sliding_window_size_ > 0) {
    room = sliding_window_size_ + 1 - cached;
  } else if (layer_window_size_ > 0 && cached > 0 && !layer_window_chunked_prefill_) {
    room = layer_window_size_ - cached;
  }
  return std::max(1, std::min(longest, room));
}

int Model::SpeculationRoom() const {
  return std::min(RollbackRoom(), verify_.empty() ? context_window_size_ : verify_.rbegin()->first);
}

int Model::RollbackRoom() const {
  if (recurrent_) return 0;  // a recurrent state cannot undo a step of several tokens
  int cached = static_cast<int>(cached_ids_.size());
  int room = context_window_size_ - cached;
  return sliding_window_size_ > 0 ? std::min(room, sliding_window_size_ - cached) : room;
}

void Model::CheckRoom(size_t count) const {
  if (cached_ids_.size() + count > static_cast<size_t>(context_window_size_)) {
    throw EngineError(ErrorCode::kContextWindowExceeded,
                      std::to_string(cached_ids_.size() + count) + " tokens exceed the context window of " +
                          std::to_string(context_window_size_) + "; start a new chat.");
  }
}

std::vector<float> Model::Prefill(const std::vector<int32_t>& ids) {
  if (ids.empty()) throw EngineError(ErrorCode::kBadRequest, "nothing to prefill: no tokens");
  CheckRoom(ids.size());
  std::vector<float> logits;
  for (size_t start = 0; start < ids.size();) {
    size_t size = std::min<size_t>(ChunkSize(prefill_chunk_size_), ids.size() - start);
    std::vector<int32_t> chunk(ids.begin() + start, ids.begin() + start + size);
    logits = Rows(Step(size > 1 ? prefill_ : decode_, chunk)).back();
    start += size;
  }
  if (recurrent_ && ids.size() > 1) TakeSnapshot();
  return logits;
}

std::vector<float> Model::Decode(int32_t id) { return Prefill({id}); }

std::vector<std::vector<float>> Model::AllLogits(const std::vector<int32_t>& ids) {
  CheckRoom(ids.size());
  auto verify = verify_.lower_bound(static_cast<int>(ids.size()));
  if (!ids.empty() && verify != verify_.end() && verify->first <= RollbackRoom()) {
    int padding = verify->first - static_cast<int>(ids.size());
    std::vector<int32_t> padded = ids;
    padded.insert(padded.end(), padding, ids.back());
    std::vector<std::vector<float>> rows = Rows(Step(verify->second, padded));
    rows.resize(ids.size());
    Rollback(padding);
    return rows;
  }
  std::vector<std::vector<float>> rows;
  for (size_t start = 0; start < ids.size();) {
    size_t size = std::min<size_t>(ChunkSize(all_logits_chunk_size_), ids.size() - start);
    std::vector<std::vector<float>> chunk_rows =
        Rows(Step(prefill_all_logits_, std::vector<int32_t>(ids.begin() + start, ids.begin() + start + size)));
    std::move(chunk_rows.begin(), chunk_rows.end(), std::back_inserter(rows));
    start += size;
  }
  return rows;
}

Tensor Model::Step(const ffi::Function& step, const std::vector<int32_t>& ids) {
  const int64_t count = static_cast<int64_t>(ids.size());
  Tensor ids_tensor = Tensor::Empty(ffi::Shape({count}), DLDataType{kDLInt, 32, 1}, DLDevice{kDLCPU, 0});
  ids_tensor.CopyFromBytes(ids.data(), ids.size() * sizeof(int32_t));
  Tensor embeds = embed_(ids_tensor, params_).cast<Tensor>();
  Tensor batch = embeds.CreateView(ffi::Shape({1, count, embeds->shape[embeds->ndim - 1]}), embeds->dtype);
  for (const ffi::Any& state : states_) begin_forward_(state, ffi::Shape({kSequenceId}), ffi::Shape({count}));
  ffi::Any result = recurrent_ ? step(batch, states_[0], states_[1], params_) : step(batch, states_[0], params_);
  ffi::Array<ffi::Any> outputs = result.cast<ffi::Array<ffi::Any>>();
  for (const ffi::Any& state : states_) end_forward_(state);
  cached_ids_.insert(cached_ids_.end(), ids.begin(), ids.end());
  undoable_steps_ = count == 1 ? std::min(undoable_steps_ + 1, kRecurrentHistory - 1) : 0;
  return outputs[0].cast<Tensor>();
}

}  // namespace kiln
