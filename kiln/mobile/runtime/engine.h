// The mobile engine: OpenAI chat completions over a Model, as web/src/engine.js's chatCompletion
// gives them (the same prompt layout from the conv_template, sampler, stops, usage, finish reasons
// and error codes), streamed as `chat.completion.chunk` JSON.
#ifndef KILN_ENGINE_H_
#define KILN_ENGINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "chunk_stream.h"
#include "model.h"
#include "request.h"
#include "speculative.h"
#include "text_stream.h"
#include "tokenizer.h"

namespace kiln {

// Receives each chunk's JSON; returns false to stop the completion (finish_reason "abort").
using ChunkSink = std::function<bool(const std::string& chunk_json)>;

// Every model step runs on the engine's own worker thread, whichever thread asks: TVM gives each
// thread that runs a parallel kernel a thread pool of its own for good, and apps call from many.
class Engine {
 public:
  struct Run;  // one reply's tokens, why it ended, and when

  // `speculation`: how replies are decoded unless a request's `speculative` field says otherwise.
  Engine(const std::string& folder, const std::string& model_lib,
         const std::optional<Speculation>& speculation = std::nullopt);
  ~Engine();

  // Start a completion on the worker; its chunks come through the stream (a busy engine throws here).
  std::shared_ptr<ChunkStream> Start(const std::string& request_json);
  // Run a completion, calling `on_chunk` on this thread for each chunk; throws its EngineError.
  void ChatCompletion(const std::string& request_json, const ChunkSink& on_chunk);
  // From any thread: the running completion ends after its current step.
  void Abort() { abort_requested_ = true; }
  void Reset();
  std::vector<int32_t> Tokenize(const std::string& text) const { return tokenizer_->Encode(text); }

 private:
  struct Conversation {
    std::string text;
    std::vector<int32_t> ids;
  };
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
  };

  void Complete(const std::string& request_json, ChunkStream& stream);
  void Work();
  Prompt ChatPrompt(const json::Value& messages) const;
  Run DecodeReply(const std::vector<int32_t>& prompt_ids, const GenerationSettings& settings, int64_t max_tokens,
                  TextStream& text, const std::function<bool(const std::string&)>& show,
                  std::chrono::steady_clock::time_point started);
  std::vector<float> PrefillPrompt(const std::vector<int32_t>& ids, int* prefilled);
  void SampleReply(Run& run, std::vector<float> logits, DecodingSteps& steps, const std::vector<int32_t>& prompt_ids,
                   const GenerationSettings& settings, int64_t max_tokens, TextStream& text,
                   const std::function<bool(const std::string&)>& show);
  void Forget();

  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string model_id_;
  json::Object conv_template_;
  std::vector<int32_t> stop_token_ids_;
  std::vector<std::string> stop_strings_;
  std::optional<Speculation> speculation_;
  std::optional<Conversation> conversation_;
  std::atomic<bool> generating_{false};
  std::atomic<bool> abort_requested_{false};
  // The worker's one task slot: one completion runs at a time.
  std::mutex task_mutex_;
  std::condition_variable task_posted_;
  std::function<void()> task_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace kiln

#endif  // KILN_ENGINE_H_
