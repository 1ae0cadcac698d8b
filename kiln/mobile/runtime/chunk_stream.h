// One chat completion's chunks as the engine's worker thread makes them, for the thread that reads
// them: an app's thread pulls them one by one (or a callback is called on it), never the worker's.
#ifndef KILN_CHUNK_STREAM_H_
#define KILN_CHUNK_STREAM_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include "errors.h"

namespace kiln {

// The EngineError an exception stands for, as the browser engine's asEngineError sees it: out of
// memory, or internal with the original message.
EngineError AsEngineError(std::exception_ptr error);

class ChunkStream {
 public:
  // The next chunk, waiting for it; nullopt once the reply has ended (then `error()` says whether it failed).
  std::optional<std::string> Next();
  const std::optional<EngineError>& error() const { return error_; }
  // Ask the reply to end after its current step (finish_reason "abort"); its last chunks still come.
  void Cancel() { cancelled_ = true; }

  // The worker's side.
  bool cancelled() const { return cancelled_; }
  void Push(std::string chunk);
  void Finish(std::optional<EngineError> error);

 private:
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<std::string> chunks_;
  bool finished_ = false;
  std::optional<EngineError> error_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace kiln

#endif  // KILN_CHUNK_STREAM_H_
