// A compiled model on TVM's runtime: the model folder checked and loaded, and the token-level
// steps over one sequence in TVM's paged KV cache. The same layer as kiln/runtime.py's NativeModel
// and web/src/engine.js's ModelSession; the engine builds chat completions on it.
#ifndef KILN_MODEL_H_
#define KILN_MODEL_H_

#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kiln {

namespace json = tvm::ffi::json;

// A file of the model folder; a missing one is a bad-model error naming it and `what` it is.
std::string ReadModelFile(const std::string& path, const char* what);

// A JSON file of the model folder, parsed; a missing or malformed one is a bad-model error naming it.
json::Object ReadJsonFile(const std::string& path);

class Model {
 public:
  // `model_lib`: a shared library's path (relative paths from the model folder) or "system://<prefix>"
  // for a model linked into the app; empty: the library kiln-build.json lists for this runtime's target.
  Model(const std::string& folder, const std::string& model_lib);

  // Append `ids` to the sequence (in chunks); the logits after the last one.
  std::vector<float> Prefill(const std::vector<int32_t>& ids);
  std::vector<float> Decode(int32_t id);
  // Append `ids`; the logits after each of them (a verify pass of speculative decoding). As many ids as
  // a verify function takes go through the shortest that does, padded with the last id, whose rows are
  // then rolled back (kiln/runtime.py all_logits).
  std::vector<std::vector<float>> AllLogits(const std::vector<int32_t>& ids);
  // How many tokens a speculative pass may put into the cache now: as many as can be rolled back, and no
  // more than the library's longest verify function takes (kiln/runtime.py speculation_room).
  int SpeculationRoom() const;
  // How many tokens may go into the cache now and still be rolled back.
  int RollbackRoom() const;
  // Forget the last `count` cached tokens; returns how many stay cached.
  int Rollback(int count);
  void Reset();

  const std::vector<int32_t>& cached_ids() const { return cached_ids_; }
  int context_window_size() const { return context_window_size_; }
  int vocab_size() const { return vocab_size_; }
  const json::Object& build() const { return build_; }
  const json::Object& chat_config() const { return chat_config_; }
  const std::string& folder() const { return folder_; }

 private:
  tvm::ffi::Module LoadLibrary(const std::string& model_lib) const;
  void LoadParams(const json::Array& param_specs);
  void AddSequence();
  int ChunkSize(int longest) const;
  void CheckRoom(size_t count) const;
  tvm::runtime::Tensor Step(const tvm::ffi::Function& step, const std::vector<int32_t>& ids);
  void TakeSnapshot();
  void RestoreSnapshot(size_t point);

  // A copy of the recurrent state as it was with `kept` tokens cached (after a prompt's prefill).
  struct Snapshot {
    size_t kept;
    tvm::ffi::Array<tvm::runtime::Tensor> copy;
  };

  std::string folder_;
  json::Object build_;  // kiln-build.json
  json::Object chat_config_;
  tvm::ffi::Module library_;
  tvm::ffi::Module vm_;
  tvm::ffi::Function embed_, prefill_, decode_, prefill_all_logits_;
  std::map<int, tvm::ffi::Function> verify_;  // by rows: `verify_<rows>` of the metadata's verify_rows
  // TVM's KV-state builtins, looked up once (kiln/runtime.py's _kv_builtin).
  tvm::ffi::Function add_sequence_, remove_sequence_, begin_forward_, end_forward_, popn_;
  tvm::ffi::Array<tvm::runtime::Tensor> params_;
  tvm::ffi::Any kv_cache_;
  // What the step functions take after the embeddings: the KV cache, and a hybrid model's recurrent state.
  std::vector<tvm::ffi::Any> states_;
  bool recurrent_ = false;
  int undoable_steps_ = 0;  // single-token steps the recurrent state can undo
  tvm::ffi::Function snapshot_state_, restore_state_;
  std::vector<Snapshot> snapshots_;  // oldest first
  int context_window_size_ = 0;
  int prefill_chunk_size_ = 0;
  int all_logits_chunk_size_ = 0;
  int sliding_window_size_ = -1;
  int layer_window_size_ = -1;
  bool layer_window_chunked_prefill_ = false;
  int vocab_size_ = 0;
  std::vector<int32_t> cached_ids_;
};

}  // namespace kiln

#endif  // KILN_MODEL_H_
