// A chat-completion request's generation settings, with the fields, ranges, defaults and messages
// of web/src/engine.js's generationSettings (and the native server's API).
#ifndef KILN_REQUEST_H_
#define KILN_REQUEST_H_

#include <tvm/ffi/extra/json.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

namespace json = tvm::ffi::json;

struct GenerationSettings {
  double temperature = 1;
  double top_p = 1;
  int64_t top_k = 0;
  double repetition_penalty = 1;
  double presence_penalty = 0;
  double frequency_penalty = 0;
  bool ignore_eos = false;
  std::optional<int64_t> max_tokens;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  // "off" or "prompt-lookup" (speculative.h); none: the engine's own
  std::optional<std::string> speculative;
};

// "off" or "prompt-lookup" from a request's or an engine config's `speculative` field; else a bad-request EngineError.
std::string SpeculativeMethodOf(const tvm::ffi::Any& value);

// The request's settings; what it leaves out of temperature, top_p and repetition_penalty comes
// from the chat config (mlc-chat-config.json). A bad field is a bad-request EngineError.
GenerationSettings SettingsOf(const json::Object& request, const json::Object& chat_config);

// The request's JSON object; text that is not one is a bad-request EngineError.
json::Object ParseRequest(const std::string& request_json);

}  // namespace kiln

#endif  // KILN_REQUEST_H_
