#include "chunk_stream.h"

#include <tvm/ffi/error.h>

#include <new>

namespace kiln {

EngineError AsEngineError(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const EngineError& engine_error) {
    return engine_error;
  } catch (const std::bad_alloc&) {
    return EngineError(ErrorCode::kOutOfMemory, "Out of memory: the model does not fit in the memory the app has.");
  } catch (const tvm::ffi::Error& tvm_error) {
    return EngineError(ErrorCode::kInternal, tvm_error.kind() + ": " + tvm_error.message());
  } catch (const std::exception& other) {
    return EngineError(ErrorCode::kInternal, other.what());
  } catch (...) {
    return EngineError(ErrorCode::kInternal, "an unknown error");
  }
}

std::optional<std::string> ChunkStream::Next() {
  std::unique_lock<std::mutex> lock(mutex_);
  arrived_.wait(lock, [this] { return !chunks_.empty() || finished_; });
  if (chunks_.empty()) return std::nullopt;
  std::string chunk = std::move(chunks_.front());
  chunks_.pop_front();
  return chunk;
}

void ChunkStream::Push(std::string chunk) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    chunks_.push_back(std::move(chunk));
  }
  arrived_.notify_one();
}

void ChunkStream::Finish(std::optional<EngineError> error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    finished_ = true;
  }
  arrived_.notify_one();
}

}  // namespace kiln
