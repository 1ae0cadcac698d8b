// Errors the engine reports to its user: a stable code and a message a person can act on, as the
// browser engine's EngineError (web/src/errors.js) and the native engine's (kiln/engine.py).
#ifndef KILN_ERRORS_H_
#define KILN_ERRORS_H_

#include <stdexcept>
#include <string>

namespace kiln {

// The codes of ERROR_CODES in web/src/errors.js, in its order (a test holds the two lists together):
// (enumerator, name). A code's integer, what the C API returns, is its place in the list from 1 on
// (kSuccess, 0, is success), so that new codes, appended, leave the others' integers as they were.
#define KILN_ERROR_CODES(X)                    \
  X(kBadRequest, "bad-request")                \
  X(kBadResponseFormat, "bad-response-format") \
  X(kNoChatTemplate, "no-chat-template")       \
  X(kNoToolSupport, "no-tool-support")         \
  X(kBusy, "busy")                             \
  X(kModelNotFound, "model-not-found")         \
  X(kNoWebgpu, "no-webgpu")                    \
  X(kUnsupportedGpu, "unsupported-gpu")        \
  X(kDeviceLost, "device-lost")                \
  X(kOutOfMemory, "out-of-memory")             \
  X(kQuotaExceeded, "quota-exceeded")          \
  X(kNetwork, "network")                       \
  X(kIntegrity, "integrity")                   \
  X(kBadModel, "bad-model")                    \
  X(kIncompatibleModel, "incompatible-model")  \
  X(kNotLoaded, "not-loaded")                  \
  X(kInternal, "internal")                     \
  X(kContextWindowExceeded, "context-window-exceeded")

enum class ErrorCode : int {
  kSuccess = 0,
#define KILN_ERROR_ENUMERATOR(enumerator, name) enumerator,
  KILN_ERROR_CODES(KILN_ERROR_ENUMERATOR)
#undef KILN_ERROR_ENUMERATOR
};

// The code as the other engines name it ("bad-request", …); "" for kSuccess and for an integer past the list.
inline const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
#define KILN_ERROR_NAME(enumerator, name) \
  case ErrorCode::enumerator:             \
    return name;
    KILN_ERROR_CODES(KILN_ERROR_NAME)
#undef KILN_ERROR_NAME
    default:
      return "";
  }
}

class EngineError : public std::runtime_error {
 public:
  EngineError(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace kiln

#endif  // KILN_ERRORS_H_
