#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "chat_format.h"
#include "errors.h"
#include "request.h"
#include "sampler.h"
#include "text_stream.h"

namespace kiln {
namespace {

namespace ffi = tvm::ffi;
using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

std::string Quoted(const std::string& text) { return std::string(json::Stringify(ffi::String(text))); }

std::string Number(double value) { return std::string(json::Stringify(value)); }

std::string CompletionId() {
  std::random_device random;
  char hex[25];
  for (int i = 0; i < 12; ++i) std::snprintf(hex + 2 * i, 3, "%02x", static_cast<unsigned>(random() & 0xff));
  return std::string("chatcmpl-") + hex;
}

// One chat completion's chunks, in OpenAI's shapes (web/src/engine.js's ChatReply).
class ReplyChunks {
 public:
  explicit ReplyChunks(const std::string& model)
      : head_("{\"id\":" + Quoted(CompletionId()) + ",\"object\":\"chat.completion.chunk\",\"created\":" +
              std::to_string(
                  std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                      .count()) +
              ",\"model\":" + Quoted(model) + ",\"choices\":") {}

  // `delta_json`: the delta's members, e.g. "\"content\":\"Hi\"".
  std::string Delta(const std::string& delta_json, const char* finish_reason = nullptr) const {
    std::string finish = finish_reason ? Quoted(finish_reason) : "null";
    return head_ + "[{\"index\":0,\"delta\":{" + delta_json + "},\"finish_reason\":" + finish + ",\"logprobs\":null}]}";
  }

  std::string Usage(const std::string& usage_json) const { return head_ + "[],\"usage\":" + usage_json + "}"; }

 private:
  std::string head_;
};

std::vector<int32_t> IdsOf(const std::optional<ffi::Any>& value) {
  std::vector<int32_t> ids;
  if (!value.has_value() || *value == nullptr) return ids;
  if (auto single = value->as<int64_t>()) return {static_cast<int32_t>(*single)};
  for (const ffi::Any& id : value->cast<json::Array>()) ids.push_back(static_cast<int32_t>(id.cast<int64_t>()));
  return ids;
}

SamplingConfig SamplingOf(const GenerationSettings& settings) {
  return {settings.temperature,
          settings.top_p,
          settings.top_k,
          settings.repetition_penalty,
          settings.presence_penalty,
          settings.frequency_penalty,
          settings.seed};
}

// Clears a flag when the scope ends, however it ends.
class Holding {
 public:
  explicit Holding(std::atomic<bool>& flag) : flag_(flag) {}
  ~Holding() { flag_ = false; }

 private:
  std::atomic<bool>& flag_;
};

}  // namespace

struct Engine::Run {
  std::vector<int32_t> tokens;
  const char* finish_reason = nullptr;
  int prefilled = 0;
  double prefill_seconds = 0;
  Clock::time_point first_token_at, last_token_at;
  SpeculationStats speculation;
};

namespace {

// OpenAI's usage, with Kiln's timings in `extra` (README, "Benchmarks").
std::string UsageJson(size_t prompt_tokens, size_t completion_tokens, const Engine::Run& run,
                      Clock::time_point started) {
  size_t generated = run.tokens.size();
  std::string decode_rate =
      generated > 1 ? Number((generated - 1) / SecondsBetween(run.first_token_at, run.last_token_at)) : "null";
  return "{\"prompt_tokens\":" + std::to_string(prompt_tokens) +
         ",\"completion_tokens\":" + std::to_string(completion_tokens) +
         ",\"total_tokens\":" + std::to_string(prompt_tokens + completion_tokens) +
         ",\"extra\":{\"prefilled_tokens\":" + std::to_string(run.prefilled) +
         ",\"time_to_first_token_s\":" + Number(SecondsBetween(started, run.first_token_at)) +
         ",\"prefill_tokens_per_s\":" + Number(run.prefilled / run.prefill_seconds) +
         ",\"decode_tokens_per_s\":" + decode_rate +
         ",\"e2e_latency_s\":" + Number(SecondsBetween(started, Clock::now())) + ",\"mask_ms_per_token\":0" +
         ",\"model_steps\":" + std::to_string(run.speculation.steps) +
         ",\"proposed_tokens\":" + std::to_string(run.speculation.proposed) +
         ",\"accepted_tokens\":" + std::to_string(run.speculation.accepted) + "}}";
}

}  // namespace

Engine::Engine(const std::string& folder, const std::string& model_lib, const std::optional<Speculation>& speculation)
    : model_(std::make_unique<Model>(folder, model_lib)), speculation_(speculation) {
  const std::string tokenizer_path = folder + "/tokenizer.json";
  try {
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::FromJson(ReadModelFile(tokenizer_path, "the tokenizer")));
  } catch (const TokenizerError& error) {
    throw EngineError(ErrorCode::kBadModel, tokenizer_path + ": " + error.what());
  }
  std::optional<ffi::String> model_id = model_->build().Get("model_id").value_or(nullptr).try_cast<ffi::String>();
  model_id_ = model_id.has_value() ? std::string(*model_id) : folder;
  const json::Object& chat_config = model_->chat_config();
  auto conv_template = chat_config.Get("conv_template");
  if (!conv_template.has_value() || !conv_template->try_cast<json::Object>().has_value()) {
    throw EngineError(ErrorCode::kBadModel, folder + "/mlc-chat-config.json: no conv_template");
  }
  conv_template_ = conv_template->cast<json::Object>();
  stop_token_ids_ = IdsOf(conv_template_.Get("stop_token_ids"));
  for (int32_t id : IdsOf(chat_config.Get("eos_token_id"))) stop_token_ids_.push_back(id);
  if (auto stops = conv_template_.Get("stop_str"); stops.has_value() && *stops != nullptr) {
    for (const ffi::Any& stop : stops->cast<json::Array>()) stop_strings_.emplace_back(stop.cast<ffi::String>());
  }
  worker_ = std::thread([this] { Work(); });
}

// A conversation that continues the previous one (its text starts with the last prompt and reply)
// keeps that turn's exact token ids and encodes only the new text, each of its pieces on its own.
Engine::Prompt Engine::ChatPrompt(const json::Value& messages) const {
  std::vector<std::string> pieces = FormatChat(conv_template_, messages);
  std::string text;
  for (const std::string& piece : pieces) text += piece;
  auto encode = [this](const std::string& piece) { return tokenizer_->Encode(piece); };
  if (conversation_.has_value() && text.compare(0, conversation_->text.size(), conversation_->text) == 0) {
    std::vector<int32_t> ids = conversation_->ids;
    for (const std::string& part : PiecesFrom(pieces, conversation_->text.size())) {
      std::vector<int32_t> encoded = encode(part);
      ids.insert(ids.end(), encoded.begin(), encoded.end());
    }
    return {text, ids};
  }
  return {text, EncodePrompt(conv_template_, pieces, encode)};
}

// Bring the KV cache to `ids`, reusing the longest cached prefix (the last id always runs, to give logits).
std::vector<float> Engine::PrefillPrompt(const std::vector<int32_t>& ids, int* prefilled) {
  const std::vector<int32_t>& cached = model_->cached_ids();
  size_t common = 0;
  while (common < cached.size() && common + 1 < ids.size() && cached[common] == ids[common]) ++common;
  int kept = model_->Rollback(static_cast<int>(cached.size() - common));
  *prefilled = static_cast<int>(ids.size()) - kept;
  return model_->Prefill(std::vector<int32_t>(ids.begin() + kept, ids.end()));
}

Engine::~Engine() {
  abort_requested_ = true;
  {
    std::lock_guard<std::mutex> lock(task_mutex_);
    stopping_ = true;
  }
  task_posted_.notify_one();
  worker_.join();
}

void Engine::Work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(task_mutex_);
      task_posted_.wait(lock, [this] { return stopping_ || task_; });
      if (!task_) return;
      task = std::move(task_);
      task_ = nullptr;
    }
    task();
  }
}

std::shared_ptr<ChunkStream> Engine::Start(const std::string& request_json) {
  if (generating_.exchange(true)) {
    throw EngineError(ErrorCode::kBusy, "A generation is already running; wait for it or abort it.");
  }
  abort_requested_ = false;
  auto stream = std::make_shared<ChunkStream>();
  {
    std::lock_guard<std::mutex> lock(task_mutex_);
    task_ = [this, stream, request_json] {
      std::optional<EngineError> failure;
      try {
        Complete(request_json, *stream);
      } catch (...) {
        failure = AsEngineError(std::current_exception());
      }
      generating_ = false;  // before the reader hears of the end, so that it may start the next one
      stream->Finish(failure);
    };
  }
  task_posted_.notify_one();
  return stream;
}

void Engine::ChatCompletion(const std::string& request_json, const ChunkSink& on_chunk) {
  std::shared_ptr<ChunkStream> stream = Start(request_json);
  while (std::optional<std::string> chunk = stream->Next()) {
    if (!on_chunk(*chunk)) stream->Cancel();
  }
  if (stream->error()) throw *stream->error();
}

void Engine::Complete(const std::string& request_json, ChunkStream& stream) {
  const Clock::time_point started = Clock::now();
  auto on_chunk = [&stream](std::string chunk) {
    stream.Push(std::move(chunk));
    return !stream.cancelled();
  };
  json::Object request = ParseRequest(request_json);
  GenerationSettings settings = SettingsOf(request, model_->chat_config());
  for (const char* refused : {"tools", "response_format"}) {
    if (request.Get(refused).has_value() && *request.Get(refused) != nullptr) {
      throw EngineError(ErrorCode::kBadRequest, std::string("The mobile runtime does not take ") + refused + " yet.");
    }
  }
  Prompt prompt = ChatPrompt(request.Get("messages").value_or(json::Value(nullptr)));
  int64_t room = model_->context_window_size() - static_cast<int64_t>(prompt.ids.size());
  if (room <= 0) {
    throw EngineError(ErrorCode::kContextWindowExceeded, "The conversation has " + std::to_string(prompt.ids.size()) +
                                                             " tokens; the context window holds " +
                                                             std::to_string(model_->context_window_size()) +
                                                             ". Start a new chat.");
  }

  ReplyChunks reply(model_id_);
  bool listening = true;
  auto show = [&](const std::string& delta) {
    if (!delta.empty() && listening) listening = on_chunk(reply.Delta("\"content\":" + Quoted(delta)));
    return listening;
  };
  std::vector<std::string> stops = stop_strings_;
  stops.insert(stops.end(), settings.stop.begin(), settings.stop.end());
  TextStream text(*tokenizer_, stops);
  listening = on_chunk(reply.Delta("\"role\":\"assistant\",\"content\":\"\""));
  Run run;
  try {
    run = DecodeReply(prompt.ids, settings, std::min(settings.max_tokens.value_or(room), room), text, show, started);
  } catch (...) {
    Forget();  // a step that failed halfway leaves the cache undefined
    throw;
  }
  show(text.Flush());
  std::vector<int32_t> reply_ids =
      tokenizer_->Decode(text.ids()) == text.text() ? text.ids() : tokenizer_->Encode(text.text());
  std::vector<int32_t> conversation_ids = prompt.ids;
  conversation_ids.insert(conversation_ids.end(), reply_ids.begin(), reply_ids.end());
  conversation_ = Conversation{prompt.text + text.text(), conversation_ids};
  // The reply's end reaches the app even after it asked to stop: that is where it learns why and the usage.
  on_chunk(reply.Delta("", run.finish_reason));
  on_chunk(reply.Usage(UsageJson(prompt.ids.size(), text.ids().size(), run, started)));
}

// Prefills the prompt, then samples the reply into `text` (showing it as it comes) until a stop, the
// length, an abort or an app that stops listening (web/src/engine.js's decodeReply).
Engine::Run Engine::DecodeReply(const std::vector<int32_t>& prompt_ids, const GenerationSettings& settings,
                                int64_t max_tokens, TextStream& text,
                                const std::function<bool(const std::string&)>& show, Clock::time_point started) {
  Run run;
  std::vector<float> logits = PrefillPrompt(prompt_ids, &run.prefilled);
  run.prefill_seconds = SecondsBetween(started, Clock::now());
  std::optional<Speculation> speculation = speculation_;
  if (settings.speculative) {
    speculation = *settings.speculative == "off" ? std::nullopt
                                                 : std::optional<Speculation>(speculation_.value_or(Speculation()));
  }
  DecodingSteps steps(*model_, speculation, prompt_ids);
  SampleReply(run, std::move(logits), steps, prompt_ids, settings, max_tokens, text, show);
  steps.Settle();
  run.speculation = steps.stats();
  return run;
}

// DecodeReply's loop: a token from each row of logits until the reply ends; `steps` gives the next row.
void Engine::SampleReply(Run& run, std::vector<float> logits, DecodingSteps& steps,
                         const std::vector<int32_t>& prompt_ids, const GenerationSettings& settings, int64_t max_tokens,
                         TextStream& text, const std::function<bool(const std::string&)>& show) {
  Sampler sampler(SamplingOf(settings), prompt_ids);
  for (;;) {
    int32_t token = sampler.Sample(logits.data(), logits.size());
    sampler.Record(token);
    run.tokens.push_back(token);
    run.last_token_at = Clock::now();
    if (run.tokens.size() == 1) run.first_token_at = run.last_token_at;
    bool stop_token = std::find(stop_token_ids_.begin(), stop_token_ids_.end(), token) != stop_token_ids_.end();
    if (stop_token && !settings.ignore_eos) {
      run.finish_reason = "stop";
      return;
    }
    TextStream::Piece piece = text.Push(token);
    bool listening = show(piece.delta);
    if (piece.stopped) {
      run.finish_reason = "stop";
    } else if (static_cast<int64_t>(text.ids().size()) >= max_tokens) {
      run.finish_reason = "length";
    } else if (abort_requested_ || !listening) {
      run.finish_reason = "abort";
    }
    if (run.finish_reason != nullptr) return;
    logits = steps.LogitsAfter(token);
  }
}

void Engine::Reset() {
  if (generating_.exchange(true)) throw EngineError(ErrorCode::kBusy, "A generation is running; abort it first.");
  Holding holding(generating_);
  Forget();
}

void Engine::Forget() {
  model_->Reset();
  conversation_.reset();
}

}  // namespace kiln
