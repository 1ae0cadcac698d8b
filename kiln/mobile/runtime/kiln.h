/* Kiln's engine for apps: load a compiled model and stream OpenAI chat completions, in JSON.
 *
 * An engine holds one model and one chat (its KV cache). Requests and chunks are the OpenAI
 * chat-completion JSON the browser engine and `kiln serve` take and give; errors carry the codes
 * those engines use. Every function is safe to call from one thread at a time per engine, except
 * kiln_abort, which any thread may call while a completion runs.
 */
#ifndef KILN_H_
#define KILN_H_

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_engine kiln_engine;

/* Called with each `chat.completion.chunk` as JSON (UTF-8, complete characters only); the last
 * chunk carries `usage`. Return non-zero to stop: the reply ends after its current step, and its last
 * two chunks (finish_reason "abort", then the usage) still come. */
typedef int (*kiln_chunk_fn)(const char* chunk_json, void* user);

/* What the functions that return an int return: KILN_OK, or an error code. The codes and their
 * names (kiln_last_error_code) are the browser engine's, web/src/errors.js, in its order. */
enum kiln_status {
  KILN_OK = 0,
  KILN_BAD_REQUEST = 1,             /* "bad-request": the request is not JSON or has a bad field */
  KILN_BAD_RESPONSE_FORMAT = 2,     /* "bad-response-format" */
  KILN_NO_CHAT_TEMPLATE = 3,        /* "no-chat-template": a base model completes raw text only */
  KILN_NO_TOOL_SUPPORT = 4,         /* "no-tool-support" */
  KILN_BUSY = 5,                    /* "busy": a completion is already running */
  KILN_MODEL_NOT_FOUND = 6,         /* "model-not-found" */
  KILN_NO_WEBGPU = 7,               /* "no-webgpu" (the browser's) */
  KILN_UNSUPPORTED_GPU = 8,         /* "unsupported-gpu" */
  KILN_DEVICE_LOST = 9,             /* "device-lost" */
  KILN_OUT_OF_MEMORY = 10,          /* "out-of-memory" */
  KILN_QUOTA_EXCEEDED = 11,         /* "quota-exceeded" (the browser's) */
  KILN_NETWORK = 12,                /* "network" */
  KILN_INTEGRITY = 13,              /* "integrity": a weight shard does not match its digest */
  KILN_BAD_MODEL = 14,              /* "bad-model": the model folder is missing files or inconsistent */
  KILN_INCOMPATIBLE_MODEL = 15,     /* "incompatible-model": built by another Kiln major.minor or TVM */
  KILN_NOT_LOADED = 16,             /* "not-loaded" */
  KILN_INTERNAL = 17,               /* "internal": anything else */
  KILN_CONTEXT_WINDOW_EXCEEDED = 18 /* "context-window-exceeded": start a new chat */
};

/* `config_json`: {"model": "<model folder>", "model_lib": "<library path>" or "system://<prefix>",
 * "num_threads": n (optional, default: the cores), "speculative": "prompt-lookup" or "off" (optional,
 * default "off": how replies are decoded unless a request's own "speculative" field says otherwise;
 * prompt lookup proposes tokens the model verifies several at a time, the reply unchanged)}.
 * NULL on error: kiln_last_error(NULL) says why. */
kiln_engine* kiln_engine_create(const char* config_json);

/* Run one chat completion (`request_json`: an OpenAI chat-completion request; "stream" is implied),
 * calling `on_chunk` for every chunk. Returns KILN_OK, or an error code with kiln_last_error set. */
int kiln_chat_completion(kiln_engine* engine, const char* request_json, kiln_chunk_fn on_chunk, void* user);

/* A completion whose chunks the app pulls, on any one thread at a time (what Kotlin's Flow and Swift's
 * AsyncSequence wrap). */
typedef struct kiln_stream kiln_stream;

/* Start a chat completion; NULL on error (kiln_last_error(engine): a busy engine). Errors of the
 * request itself end the stream: kiln_stream_next gives NULL and kiln_stream_status their code. */
kiln_stream* kiln_chat_completion_start(kiln_engine* engine, const char* request_json);

/* The next chunk's JSON, waiting for it; valid until the next call. NULL once the reply has ended. */
const char* kiln_stream_next(kiln_stream* stream);

/* -1 while chunks may still come; then KILN_OK, or the error code (kiln_last_error says why). */
int kiln_stream_status(const kiln_stream* stream);

/* Drop the stream: a reply still running ends after its current step (finish_reason "abort"), and
 * the engine is free for the next completion when this returns. */
void kiln_stream_free(kiln_stream* stream);

/* End the running completion from any thread: it finishes with finish_reason "abort". */
void kiln_abort(kiln_engine* engine);

/* Forget the chat: the next completion prefills its whole prompt. */
int kiln_reset(kiln_engine* engine);

/* The ids of `text` in the model's tokenizer as JSON ({"ids": [...]}), valid until the next call on
 * this engine; NULL on error. */
const char* kiln_tokenize(kiln_engine* engine, const char* text);

/* The last error's message (UTF-8), valid until the next call on this engine; with a NULL engine,
 * why the last kiln_engine_create on this thread failed. NULL when there was none. */
const char* kiln_last_error(const kiln_engine* engine);

/* The code of the last error as the browser engine names it ("bad-request", …), or NULL. */
const char* kiln_last_error_code(const kiln_engine* engine);

/* Free the engine (its streams first); a completion still running ends first. */
void kiln_engine_free(kiln_engine* engine);

/* This runtime's Kiln version ("major.minor.patch"): it loads models built by the same major.minor. */
const char* kiln_version(void);

#ifdef __cplusplus
}
#endif

#endif /* KILN_H_ */
