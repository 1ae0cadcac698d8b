// kiln.h over kiln::Engine: every exception becomes an error code and a message, never a crash
// through the C boundary.
#include <memory>
#include <optional>
#include <string>

#include "engine.h"
#include "errors.h"
#include "kiln.h"
#include "request.h"

struct kiln_engine {
  std::unique_ptr<kiln::Engine> engine;
  std::string last_error;
  std::string last_error_code;
  std::string tokenized;
};

struct kiln_stream {
  kiln_engine* engine;
  std::shared_ptr<kiln::ChunkStream> chunks;
  std::string current;
  int status = -1;
};

namespace {

namespace json = tvm::ffi::json;
namespace ffi = tvm::ffi;

thread_local std::string create_error;
thread_local std::string create_error_code;

int Record(kiln_engine* engine, const kiln::EngineError& error) {
  engine->last_error = error.what();
  engine->last_error_code = kiln::ErrorCodeName(error.code());
  return static_cast<int>(error.code());
}

template <typename Call>
int Guarded(kiln_engine* engine, Call call) {
  if (engine == nullptr) return KILN_BAD_REQUEST;
  engine->last_error.clear();
  engine->last_error_code.clear();
  try {
    call();
    return KILN_OK;
  } catch (...) {
    return Record(engine, kiln::AsEngineError(std::current_exception()));
  }
}

std::string StringField(const json::Object& config, const char* key) {
  auto value = config.Get(key);
  if (!value.has_value() || *value == nullptr) return "";
  auto text = value->as<ffi::String>();
  if (!text.has_value()) throw kiln::EngineError(kiln::ErrorCode::kBadRequest, std::string(key) + " must be a string");
  return std::string(*text);
}

}  // namespace

extern "C" {

kiln_engine* kiln_engine_create(const char* config_json) {
  create_error.clear();
  create_error_code.clear();
  auto engine = std::make_unique<kiln_engine>();
  try {
    json::Object config = kiln::ParseRequest(config_json ? config_json : "");
    std::string model = StringField(config, "model");
    if (model.empty())
      throw kiln::EngineError(kiln::ErrorCode::kBadRequest, "the config needs \"model\": the model folder");
    std::optional<kiln::Speculation> speculation;
    if (auto method = config.Get("speculative"); method.has_value() && *method != nullptr) {
      if (kiln::SpeculativeMethodOf(*method) != "off") speculation = kiln::Speculation();
    }
    engine->engine = std::make_unique<kiln::Engine>(model, StringField(config, "model_lib"), speculation);
    return engine.release();
  } catch (...) {
    kiln::EngineError failure = kiln::AsEngineError(std::current_exception());
    create_error = failure.what();
    create_error_code = kiln::ErrorCodeName(failure.code());
    return nullptr;
  }
}

int kiln_chat_completion(kiln_engine* engine, const char* request_json, kiln_chunk_fn on_chunk, void* user) {
  return Guarded(engine, [&] {
    engine->engine->ChatCompletion(request_json ? request_json : "", [&](const std::string& chunk) {
      return on_chunk == nullptr || on_chunk(chunk.c_str(), user) == 0;
    });
  });
}

kiln_stream* kiln_chat_completion_start(kiln_engine* engine, const char* request_json) {
  auto stream = std::make_unique<kiln_stream>();
  stream->engine = engine;
  int status = Guarded(engine, [&] { stream->chunks = engine->engine->Start(request_json ? request_json : ""); });
  return status == KILN_OK ? stream.release() : nullptr;
}

const char* kiln_stream_next(kiln_stream* stream) {
  if (std::optional<std::string> chunk = stream->chunks->Next()) {
    stream->current = std::move(*chunk);
    return stream->current.c_str();
  }
  const std::optional<kiln::EngineError>& error = stream->chunks->error();
  stream->status = error ? Record(stream->engine, *error) : KILN_OK;
  return nullptr;
}

int kiln_stream_status(const kiln_stream* stream) { return stream->status; }

void kiln_stream_free(kiln_stream* stream) {
  if (stream == nullptr) return;
  stream->chunks->Cancel();
  while (stream->chunks->Next()) {
  }
  delete stream;
}

void kiln_abort(kiln_engine* engine) {
  if (engine != nullptr && engine->engine) engine->engine->Abort();
}

int kiln_reset(kiln_engine* engine) {
  return Guarded(engine, [&] { engine->engine->Reset(); });
}

const char* kiln_tokenize(kiln_engine* engine, const char* text) {
  int status = Guarded(engine, [&] {
    std::string ids;
    for (int32_t id : engine->engine->Tokenize(text ? text : "")) ids += (ids.empty() ? "" : ",") + std::to_string(id);
    engine->tokenized = "{\"ids\":[" + ids + "]}";
  });
  return status == KILN_OK ? engine->tokenized.c_str() : nullptr;
}

const char* kiln_last_error(const kiln_engine* engine) {
  const std::string& error = engine ? engine->last_error : create_error;
  return error.empty() ? nullptr : error.c_str();
}

const char* kiln_last_error_code(const kiln_engine* engine) {
  const std::string& code = engine ? engine->last_error_code : create_error_code;
  return code.empty() ? nullptr : code.c_str();
}

void kiln_engine_free(kiln_engine* engine) { delete engine; }

const char* kiln_version(void) { return KILN_VERSION; }

}  // extern "C"
