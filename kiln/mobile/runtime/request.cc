#include "request.h"

#include <cmath>
#include <random>
#include <sstream>

#include "errors.h"

namespace kiln {
namespace {

namespace ffi = tvm::ffi;

constexpr int64_t kLargestSeed = (int64_t{1} << 53) - 1;  // JavaScript's Number.MAX_SAFE_INTEGER

[[noreturn]] void BadRequest(const std::string& message) { throw EngineError(ErrorCode::kBadRequest, message); }

// The request's field, else the chat config's (for the fields the model's config sets), else absent.
std::optional<ffi::Any> Field(const json::Object& request, const json::Object& chat_config, const char* name,
                              bool from_model) {
  auto value = request.Get(name);
  if (value.has_value() && *value != nullptr) return value;
  if (!from_model) return std::nullopt;
  auto configured = chat_config.Get(name);
  if (configured.has_value() && *configured != nullptr) return configured;
  return std::nullopt;
}

std::optional<double> NumberOf(const ffi::Any& value) {
  if (auto integer = value.as<int64_t>()) return static_cast<double>(*integer);
  if (auto real = value.as<double>()) return *real;
  return std::nullopt;
}

std::string Shown(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
}

double NumberIn(const json::Object& request, const json::Object& chat_config, const char* name, double fallback,
                double low, double high, bool low_open, bool from_model) {
  auto value = Field(request, chat_config, name, from_model);
  if (!value.has_value()) return fallback;
  std::optional<double> number = NumberOf(*value);
  if (!number.has_value() || !std::isfinite(*number) || *number > high || (low_open ? *number <= low : *number < low)) {
    BadRequest(std::string(name) + " must be a number in " + (low_open ? "(" : "[") + Shown(low) + ", " + Shown(high) +
               "]");
  }
  return *number;
}

std::optional<int64_t> IntegerOf(const ffi::Any& value) {
  if (auto integer = value.as<int64_t>()) return integer;
  if (auto real = value.as<double>(); real && std::isfinite(*real) && std::floor(*real) == *real &&
                                      std::fabs(*real) <= static_cast<double>(kLargestSeed)) {
    return static_cast<int64_t>(*real);
  }
  return std::nullopt;
}

uint64_t RandomSeed() {
  std::random_device random;
  return (uint64_t{random()} << 21 ^ random()) & kLargestSeed;
}

std::vector<std::string> StopsOf(const std::optional<ffi::Any>& value) {
  if (!value.has_value()) return {};
  if (auto text = value->as<ffi::String>()) return {std::string(*text)};
  std::vector<std::string> stops;
  if (auto list = value->try_cast<json::Array>()) {
    for (const ffi::Any& stop : *list) {
      auto text = stop.as<ffi::String>();
      if (!text.has_value()) BadRequest("stop must be a string or a list of strings");
      stops.emplace_back(*text);
    }
    return stops;
  }
  BadRequest("stop must be a string or a list of strings");
}

}  // namespace

std::string SpeculativeMethodOf(const ffi::Any& value) {
  auto method = value.as<ffi::String>();
  if (!method.has_value() || (*method != "off" && *method != "prompt-lookup")) {
    BadRequest("speculative must be one of off, prompt-lookup");
  }
  return std::string(*method);
}

json::Object ParseRequest(const std::string& request_json) {
  ffi::String problem;
  json::Value value = json::Parse(request_json, &problem);
  if (!problem.empty()) BadRequest("the request is not JSON: " + std::string(problem));
  auto request = value.try_cast<json::Object>();
  if (!request.has_value()) BadRequest("the request must be a JSON object");
  return *request;
}

GenerationSettings SettingsOf(const json::Object& request, const json::Object& chat_config) {
  GenerationSettings settings;
  settings.temperature = NumberIn(request, chat_config, "temperature", 1, 0, 2, false, true);
  settings.top_p = NumberIn(request, chat_config, "top_p", 1, 0, 1, true, true);
  settings.repetition_penalty = NumberIn(request, chat_config, "repetition_penalty", 1, 0.01, 10, false, true);
  settings.presence_penalty = NumberIn(request, chat_config, "presence_penalty", 0, -2, 2, false, false);
  settings.frequency_penalty = NumberIn(request, chat_config, "frequency_penalty", 0, -2, 2, false, false);
  if (auto top_k = Field(request, chat_config, "top_k", false)) {
    auto integer = IntegerOf(*top_k);
    if (!integer.has_value() || *integer < 0) BadRequest("top_k must be an integer ≥ 0 (0 = off)");
    settings.top_k = *integer;
  }
  if (auto ignore_eos = Field(request, chat_config, "ignore_eos", false)) {
    auto flag = ignore_eos->as<bool>();
    if (!flag.has_value()) BadRequest("ignore_eos must be true or false");
    settings.ignore_eos = *flag;
  }
  if (auto max_tokens = Field(request, chat_config, "max_tokens", false)) {
    auto integer = IntegerOf(*max_tokens);
    if (!integer.has_value() || *integer <= 0) BadRequest("max_tokens must be a positive integer");
    settings.max_tokens = integer;
  }
  if (auto seed = Field(request, chat_config, "seed", false)) {
    auto integer = IntegerOf(*seed);
    if (!integer.has_value() || *integer < 0 || *integer > kLargestSeed)
      BadRequest("seed must be an integer in [0, 2^53)");
    settings.seed = static_cast<uint64_t>(*integer);
  } else {
    settings.seed = RandomSeed();
  }
  settings.stop = StopsOf(Field(request, chat_config, "stop", false));
  if (auto speculative = Field(request, chat_config, "speculative", false)) {
    settings.speculative = SpeculativeMethodOf(*speculative);
  }
  if (auto n = Field(request, chat_config, "n", false)) {
    auto integer = IntegerOf(*n);
    if (!integer.has_value() || *integer != 1) BadRequest("n must be 1");
  }
  return settings;
}

}  // namespace kiln
