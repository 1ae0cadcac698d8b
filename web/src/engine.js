// The browser engine: a Kiln model library on tvmjs (@mlc-ai/web-runtime), with its tokenizer,
// its chat template and OpenAI-shaped chat completions. It runs inside a Web Worker
// (worker.js); the page talks to it through protocol.js.
//
// It drives the library the way kiln/runtime.py does natively: one sequence in TVM's paged KV
// cache, `embed` then `prefill` (chunked) / `decode` / `prefill_all_logits`, parameters passed
// as one packed array. Logits come back to the host every step and tokens are chosen there.
import { encodePrompt, formatChat, piecesFrom, specialTokensAround } from "./chat-format.js";
import { ChatTemplate, TOKENIZER_CONFIG } from "./chat-template.js";
import { EmbeddingSession, createEmbeddings } from "./embeddings.js";
import { EngineError, asEngineError } from "./errors.js";
import { KernelTimer } from "./kernel-timer.js";
import { LibrarySession } from "./library-session.js";
import { ModelFiles, chooseBackend, requestDevice, softwareAdapter, wasmBytes } from "./loader.js";
import { Sampler, randomSeed, topK } from "./sampler.js";
import { decodingSteps, speculationFor } from "./speculative.js";
import { Grammars, responseFormatFrom } from "./structured.js";
import { ContentBeforeCalls, templateMessages, toolCallFormat, toolRequestFrom } from "./tools.js";
import { availableThreads, instantiateLibrary } from "./wasm-threads.js";

const PAGE_SIZE = 16;
const SEQUENCE_ID = 0;
// A hybrid model's recurrent state keeps this many steps, and the engine this many copies of it as it
// was after a prompt's prefill (kiln/model_memory.py RECURRENT_HISTORY, RECURRENT_SNAPSHOTS).
const RECURRENT_HISTORY = 8;
const RECURRENT_SNAPSHOTS = 2;
const REPLACEMENT_CHARACTER = "\uFFFD";
const KV_BUILTINS = ["kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_begin_forward",
  "kv_state_end_forward", "kv_state_popn"];

const seconds = (start, end = performance.now()) => (end - start) / 1000;
const MiB = 2 ** 20;
const mib = (bytes) => `${Math.round(bytes / MiB)} MiB`;

/**
 * The most memory to offer a CPU library whose model needs `needed` bytes (kiln/model_memory.py),
 * when the browser cannot reserve wasm32's 4 GiB: the accounting leaves out the runtime, its
 * threads, the kernels' scratch and forced decoding's plan (10-90 MiB at real sizes).
 */
export const cpuMemoryFor = (needed) => Math.ceil(needed * 1.25 + 64 * MiB);

/**
 * The EngineError for a CPU library that exited (its instance is dead): out of memory when what is
 * left of its memory could not hold the model's largest allocation, else an internal failure.
 */
export function cpuLibraryFailure(error, { usedBytes, maximumBytes, largestBuffer, neededBytes }) {
  if (maximumBytes - usedBytes < largestBuffer) {
    return new EngineError("out-of-memory", `The model's CPU library ran out of memory: it holds ${mib(usedBytes)} and ` +
      `may grow to ${mib(maximumBytes)}` + (neededBytes ? `; the model needs about ${mib(neededBytes)}` : "") +
      ". Close other tabs, or use a smaller model or quantization, then load it again.");
  }
  return new EngineError("internal", `The model's CPU library stopped (${error.message}) with ${mib(usedBytes)} of ` +
    `its ${mib(maximumBytes)} of memory in use. Load the model again.`);
}

/** Let queued messages (an interrupt) run between steps; the CPU backend never awaits otherwise. */
function yieldToEventLoop() {
  return new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => resolve();
    channel.port2.postMessage(null);
  });
}

/**
 * The compiled model on one device: parameters, KV cache (and a hybrid model's recurrent state: the
 * `states` the step functions take after the embeddings) and the token-level steps.
 * Tracks the token ids held in the KV cache so chats can reuse a cached prefix.
 */
export class ModelSession extends LibrarySession {
  constructor(tvm, device, backend) {
    super(tvm, device, backend);
    this.cachedIds = [];
    this.lastDecodeDispatches = null;
    this.lastDecodeIssueMs = null;
  }

  /** Create the VM, upload the weights shard by shard (`shards` yields {shard, bytes}), make the KV cache. */
  async initialize(shards, onUpload) {
    const tvm = this.tvm;
    await this.open(["embed", "prefill", "decode", "prefill_all_logits", "create_tir_paged_kv_cache"], shards, onUpload);
    tvm.beginScope();
    this.kvBuiltins = Object.fromEntries(KV_BUILTINS.map((name) =>
      [name, tvm.detachFromCurrentScope(tvm.getGlobalFunc(`vm.builtin.${name}`))]));
    tvm.endScope();
    this.contextWindowSize = this.metadata.context_window_size;
    this.prefillChunkSize = this.metadata.prefill_chunk_size;
    this.allLogitsChunkSize = this.metadata.all_logits_chunk_size ?? this.prefillChunkSize;
    this.verifyRows = [...(this.metadata.verify_rows ?? [])].sort((a, b) => a - b);
    this.takeFunctions(this.verifyRows.map((rows) => `verify_${rows}`));
    this.slidingWindowSize = this.metadata.sliding_window_size ?? -1;
    this.layerWindowSize = this.metadata.layer_sliding_window_size ?? -1;
    this.layerWindowChunkedPrefill = this.metadata.layer_window_chunked_prefill ?? false;

    this.recurrent = this.metadata.kv_state_kind === "hybrid";

    tvm.beginScope();
    const shape = (value) => tvm.makeShapeTuple([value]);
    this.kvCache = tvm.detachFromCurrentScope(this.functions.create_tir_paged_kv_cache(
      shape(1), shape(this.contextWindowSize), shape(this.prefillChunkSize), shape(PAGE_SIZE),
      shape(this.slidingWindowSize > 0 ? 1 : 0)));
    this.states = [this.kvCache];
    if (this.recurrent) {
      const create = this.vm.getFunction("create_rnn_state");
      this.states.push(tvm.detachFromCurrentScope(create(shape(1), shape(RECURRENT_HISTORY))));
      for (const name of ["rnn_state_snapshot", "rnn_state_restore"]) {
        this.functions[name] = tvm.detachFromCurrentScope(this.vm.getFunction(name));
      }
    }
    tvm.endScope();
    this.snapshots = []; // the recurrent state's: {kept, copy}
    this.addSequence();
  }

  addSequence() {
    const tvm = this.tvm;
    tvm.withNewScope(() => {
      for (const state of this.states) this.kvBuiltins.kv_state_add_sequence(state, tvm.scalar(SEQUENCE_ID, "int64"));
      if (this.slidingWindowSize > 0) {
        tvm.getGlobalFunc("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(this.kvCache,
          tvm.scalar(SEQUENCE_ID, "int64"), tvm.scalar(this.slidingWindowSize, "int32"), tvm.scalar(0, "int32"));
      }
    });
    this.cachedIds = [];
    this.undoableSteps = 0; // the recurrent state's
    this.keepSnapshots([]);
  }

  reset() {
    this.tvm.withNewScope(() => {
      for (const state of this.states) this.kvBuiltins.kv_state_remove_sequence(state, this.tvm.scalar(SEQUENCE_ID, "int64"));
    });
    this.addSequence();
  }

  /**
   * Forget the last `count` cached tokens; returns how many stay cached. Once a sliding window has
   * dropped tokens, the ones before it cannot come back: then it forgets them all. A recurrent state
   * undoes its last single-token steps; further back, it goes back to its latest snapshot at or before
   * the point (the caller prefills the rest again), or else forgets all (kiln/runtime.py rollback).
   */
  rollback(count) {
    if (count <= 0) return this.cachedIds.length;
    const lost = this.slidingWindowSize > 0 && this.cachedIds.length > this.slidingWindowSize;
    if (lost) {
      this.reset();
    } else if (!this.recurrent || count <= this.undoableSteps) {
      this.popStates(this.states, count);
      this.cachedIds.length -= count;
      this.undoableSteps -= count;
    } else {
      this.restoreSnapshot(this.cachedIds.length - count);
    }
    this.keepSnapshots(this.snapshots.filter(({ kept }) => kept <= this.cachedIds.length));
    return this.cachedIds.length;
  }

  popStates(states, count) {
    const tvm = this.tvm;
    tvm.withNewScope(() => {
      for (const state of states) {
        this.kvBuiltins.kv_state_popn(state, tvm.scalar(SEQUENCE_ID, "int64"), tvm.scalar(count, "int32"));
      }
    });
  }

  /** Begin a step of one token on the recurrent state alone: its snapshot and restore read and write that step's state. */
  beginStateStep() {
    const tvm = this.tvm;
    this.kvBuiltins.kv_state_begin_forward(this.states[1], tvm.makeShapeTuple([SEQUENCE_ID]), tvm.makeShapeTuple([1]));
  }

  takeSnapshot() {
    const tvm = this.tvm;
    tvm.beginScope();
    this.beginStateStep();
    const copy = tvm.detachFromCurrentScope(this.functions.rnn_state_snapshot(this.states[1]));
    tvm.endScope();
    this.keepSnapshots([...this.snapshots, { kept: this.cachedIds.length, copy }].slice(-RECURRENT_SNAPSHOTS));
  }

  /** Keep `snapshots`; free the copies of the others. */
  keepSnapshots(snapshots) {
    for (const snapshot of this.snapshots) if (!snapshots.includes(snapshot)) snapshot.copy.dispose();
    this.snapshots = snapshots;
  }

  /**
   * Back to the latest snapshot at or before `point` cached tokens: the KV cache pops to it, the
   * recurrent state takes it as a step's result; with none, the sequence starts over.
   */
  restoreSnapshot(point) {
    const snapshot = this.snapshots.filter(({ kept }) => kept <= point).at(-1);
    if (snapshot === undefined) {
      this.reset();
      return;
    }
    this.popStates([this.kvCache], this.cachedIds.length - snapshot.kept);
    this.tvm.withNewScope(() => {
      this.beginStateStep();
      this.functions.rnn_state_restore(this.states[1], snapshot.copy);
      this.kvBuiltins.kv_state_end_forward(this.states[1]);
    });
    this.cachedIds.length = snapshot.kept;
    this.undoableSteps = 0;
  }

  /**
   * Prefill chunks of `ids`, at most `maxRows` long. TVM's sliding-window prefill lets every token
   * of a chunk see the whole kept window, and its GPU kernels for per-layer windows go wrong once
   * the window drops cached tokens from a chunk's view (Kiln fixes the CPU kernel: `_metadata`
   * says which): past a window, tokens go one at a time there (as kiln/runtime.py does).
   */
  * chunks(ids, maxRows = this.prefillChunkSize) {
    let start = 0;
    while (start < ids.length) {
      // this.cachedIds grows as the caller runs each chunk
      const cached = this.cachedIds.length;
      let room = Infinity;
      if (this.slidingWindowSize > 0) room = this.slidingWindowSize + 1 - cached;
      else if (this.layerWindowSize > 0 && cached > 0 && !this.layerWindowChunkedPrefill) room = this.layerWindowSize - cached;
      const size = Math.max(1, Math.min(maxRows, room));
      yield ids.slice(start, start + size);
      start += size;
    }
  }

  checkRoom(count) {
    if (this.cachedIds.length + count > this.contextWindowSize) {
      throw new EngineError("context-window-exceeded", `${this.cachedIds.length + count} tokens exceed the context window of ` +
        `${this.contextWindowSize}; start a new chat.`);
    }
  }

  /**
   * Run `functionName` on `ids` (at most one prefill chunk); logits as [rows, vocab] on the host.
   * The rows are views of the step's output in wasm memory, read where they lie: they hold until the
   * next step, which frees them (copy a row to keep it), or the next allocation, which may grow the
   * memory (and detach a single-threaded library's buffer).
   */
  async step(functionName, ids) {
    const tvm = this.tvm;
    const started = performance.now();
    this.logits?.dispose();
    this.logits = null;
    tvm.beginScope();
    try {
      const idsTensor = tvm.empty([ids.length], "int32", this.device).copyFrom(Int32Array.from(ids));
      const embeds = this.functions.embed(idsTensor, this.params);
      const batch = embeds.view([1, ids.length, embeds.shape[embeds.shape.length - 1]]);
      for (const state of this.states) {
        this.kvBuiltins.kv_state_begin_forward(state, tvm.makeShapeTuple([SEQUENCE_ID]), tvm.makeShapeTuple([ids.length]));
      }
      const result = this.functions[functionName](batch, ...this.states, this.params);
      for (const state of this.states) this.kvBuiltins.kv_state_end_forward(state);
      this.logits = this.onHost(result.get(0));
    } finally {
      tvm.endScope();
    }
    this.cachedIds.push(...ids);
    this.undoableSteps = ids.length === 1 ? Math.min(this.undoableSteps + 1, RECURRENT_HISTORY - 1) : 0;
    this.lastStepIssueMs = performance.now() - started; // the VM and tvmjs encoding the step, before the GPU runs it
    await this.device.sync();
    const { shape } = this.logits;
    const vocab = shape[shape.length - 1];
    const rows = shape.reduce((product, size) => product * size, 1) / vocab; // prefill: the last position's only
    const flat = new Float32Array(tvm.memory.memory.buffer, this.logits.getCPUDataAddress(), rows * vocab);
    return Array.from({ length: rows }, (_, row) => flat.subarray(row * vocab, (row + 1) * vocab));
  }

  /**
   * How many tokens a speculative pass may put into the cache now: as many as can still be rolled
   * back, and no more than the library's longest verify function takes (kiln/runtime.py speculation_room).
   */
  speculationRoom() {
    return Math.min(this.rollbackRoom(), this.verifyRows.at(-1) ?? this.contextWindowSize);
  }

  /**
   * How many tokens may go into the cache now and still be rolled back: the context window's room,
   * and under a sliding window only until it drops a token; none for a recurrent state, which cannot
   * undo a step of several tokens.
   */
  rollbackRoom() {
    if (this.recurrent) return 0;
    const room = this.contextWindowSize - this.cachedIds.length;
    return this.slidingWindowSize > 0 ? Math.min(room, this.slidingWindowSize - this.cachedIds.length) : room;
  }

  /** Append `ids` to the sequence; the logits after the last one. */
  async prefill(ids) {
    if (ids.length === 0) throw new EngineError("bad-request", "nothing to prefill: no tokens");
    this.checkRoom(ids.length);
    let rows;
    for (const chunk of this.chunks(ids)) {
      rows = await this.step(chunk.length > 1 ? "prefill" : "decode", chunk);
    }
    if (!this.recurrent || ids.length === 1) return rows[rows.length - 1];
    const logits = rows[rows.length - 1].slice(); // the snapshot may grow wasm memory, detaching the rows
    this.takeSnapshot();
    return logits;
  }

  async decode(id) {
    this.checkRoom(1);
    const dispatched = this.gpuDispatches();
    const [logits] = await this.step("decode", [id]);
    if (dispatched !== null) {
      this.lastDecodeDispatches = this.gpuDispatches() - dispatched;
      this.lastDecodeIssueMs = this.lastStepIssueMs;
    }
    return logits;
  }

  /** The compute dispatches the WebGPU runtime has issued so far (tvmjs counts them); null on wasm. */
  gpuDispatches() {
    return this.tvm.lib.webGPUContext?.shaderSubmitCounter ?? null;
  }

  /**
   * Logits at every position of `ids` (forced decoding), one row per id, in calls of at most
   * `all_logits_chunk_size` ids: the library plans each call's memory for that many rows. As many
   * ids as a verify function takes go through the shortest that does, padded with the last id,
   * whose rows are then rolled back (kiln/runtime.py all_logits).
   */
  async allLogits(ids) {
    this.checkRoom(ids.length);
    const verifyRows = this.verifyRows.find((rows) => ids.length <= rows && rows <= this.rollbackRoom());
    if (verifyRows !== undefined) {
      const padding = verifyRows - ids.length;
      const padded = [...ids, ...Array(padding).fill(ids[ids.length - 1])];
      const rows = (await this.step(`verify_${verifyRows}`, padded)).slice(0, ids.length).map((row) => row.slice());
      this.rollback(padding);
      return rows;
    }
    const rows = [];
    for (const chunk of this.chunks(ids, this.allLogitsChunkSize)) {
      rows.push(...(await this.step("prefill_all_logits", chunk)).map((row) => row.slice()));
    }
    return rows;
  }

  dispose() {
    const snapshots = (this.snapshots ?? []).map(({ copy }) => copy);
    for (const object of [this.logits, ...snapshots, ...(this.states ?? []), ...Object.values(this.kvBuiltins ?? {})]) object?.dispose();
    super.dispose();
  }
}

/** Incremental text of generated tokens: holds back incomplete UTF-8 and possible stop strings. */
export class TextStream {
  constructor(tokenizer, stopStrings) {
    this.tokenizer = tokenizer;
    this.stopStrings = stopStrings.filter((stop) => stop.length > 0);
    this.ids = [];
    this.emitted = 0;
    this.text = "";
  }

  /** Add a token; returns {delta, stopped}. */
  push(id) {
    this.ids.push(id);
    this.text = this.tokenizer.decode(Int32Array.from(this.ids));
    let stopAt = -1;
    for (const stop of this.stopStrings) {
      const at = this.text.indexOf(stop);
      if (at >= 0 && (stopAt < 0 || at < stopAt)) stopAt = at;
    }
    if (stopAt >= 0) {
      this.text = this.text.slice(0, stopAt);
      return { delta: this.flush(), stopped: true };
    }
    if (this.text.endsWith(REPLACEMENT_CHARACTER)) return { delta: "", stopped: false };
    let safe = this.text.length;
    for (const stop of this.stopStrings) {
      for (let length = Math.min(stop.length - 1, this.text.length); length > 0; --length) {
        if (this.text.endsWith(stop.slice(0, length))) {
          safe = Math.min(safe, this.text.length - length);
          break;
        }
      }
    }
    const delta = this.text.slice(this.emitted, Math.max(safe, this.emitted));
    this.emitted += delta.length;
    return { delta, stopped: false };
  }

  flush() {
    const delta = this.text.slice(this.emitted);
    this.emitted = this.text.length;
    return delta;
  }
}

function completionId() {
  return `chatcmpl-${Array.from(crypto.getRandomValues(new Uint8Array(12)), (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

/** One chat completion's chunks and reply, in OpenAI's shapes (natively: kiln/completions.py's Reply). */
class ChatReply {
  constructor(model) {
    this.id = completionId();
    this.created = Math.floor(Date.now() / 1000);
    this.model = model;
  }

  chunk(choices, extra = {}) {
    return { id: this.id, object: "chat.completion.chunk", created: this.created, model: this.model, choices, ...extra };
  }

  delta(delta, finishReason = null) {
    return this.chunk([{ index: 0, delta, finish_reason: finishReason, logprobs: null }]);
  }

  completion(message, finishReason, usage) {
    return {
      id: this.id, object: "chat.completion", created: this.created, model: this.model,
      choices: [{ index: 0, message, finish_reason: finishReason, logprobs: null }],
      usage,
    };
  }
}

/** OpenAI's usage, with Kiln's timings in `extra` (README, "Benchmarks"). */
function completionUsage(promptIds, text, run, started, constraint) {
  const { tokens, firstTokenAt, lastTokenAt } = run;
  return {
    prompt_tokens: promptIds.length,
    completion_tokens: text.ids.length,
    total_tokens: promptIds.length + text.ids.length,
    extra: {
      prefilled_tokens: run.prefilled,
      time_to_first_token_s: seconds(started, firstTokenAt),
      prefill_tokens_per_s: run.prefilled / run.prefillSeconds,
      // tokens after the first ÷ the time from the first to the last, sampling included
      decode_tokens_per_s: tokens.length > 1 ? (tokens.length - 1) / seconds(firstTokenAt, lastTokenAt) : null,
      e2e_latency_s: seconds(started),
      mask_ms_per_token: constraint?.steps > 0 ? (1000 * constraint.maskSeconds) / constraint.steps : 0,
      // model passes after the prompt's prefill (decode steps or verify passes), and speculation's tokens
      model_steps: run.stats.steps,
      proposed_tokens: run.stats.proposed,
      accepted_tokens: run.stats.accepted,
    },
  };
}

function numberIn(value, name, low, high, { lowOpen = false } = {}) {
  if (typeof value !== "number" || !Number.isFinite(value) || value > high || (lowOpen ? value <= low : value < low)) {
    throw new EngineError("bad-request", `${name} must be a number in ${lowOpen ? "(" : "["}${low}, ${high}]`);
  }
  return value;
}

// What a request leaves out comes from the chat config (mlc-chat-config.json) for these fields, as
// on the native server (kiln/server/api_request.py MODEL_DEFAULTS), else from DEFAULTS.
const MODEL_DEFAULTS = ["temperature", "top_p", "repetition_penalty"];
const DEFAULTS = { temperature: 1, top_p: 1, top_k: 0, repetition_penalty: 1, presence_penalty: 0, frequency_penalty: 0, ignore_eos: false };

/** The sampling settings of a request, with the fields and ranges of the native server's API. */
function generationSettings(request, chatConfig) {
  const field = (name) => request[name] ?? (MODEL_DEFAULTS.includes(name) ? chatConfig[name] : undefined) ?? DEFAULTS[name];
  const settings = {
    temperature: numberIn(field("temperature"), "temperature", 0, 2),
    topP: numberIn(field("top_p"), "top_p", 0, 1, { lowOpen: true }),
    topK: field("top_k"),
    repetitionPenalty: numberIn(field("repetition_penalty"), "repetition_penalty", 0.01, 10),
    presencePenalty: numberIn(field("presence_penalty"), "presence_penalty", -2, 2),
    frequencyPenalty: numberIn(field("frequency_penalty"), "frequency_penalty", -2, 2),
    ignoreEos: field("ignore_eos"),
    maxTokens: request.max_tokens ?? null,
    seed: request.seed ?? randomSeed(),
    stop: request.stop ?? [],
  };
  if (!(Number.isInteger(settings.topK) && settings.topK >= 0)) throw new EngineError("bad-request", "top_k must be an integer ≥ 0 (0 = off)");
  if (typeof settings.ignoreEos !== "boolean") throw new EngineError("bad-request", "ignore_eos must be true or false");
  if (settings.maxTokens !== null && !(Number.isInteger(settings.maxTokens) && settings.maxTokens > 0)) {
    throw new EngineError("bad-request", "max_tokens must be a positive integer");
  }
  if (!(Number.isSafeInteger(settings.seed) && settings.seed >= 0)) {
    throw new EngineError("bad-request", "seed must be an integer in [0, 2^53)");
  }
  if (typeof settings.stop === "string") settings.stop = [settings.stop];
  if (!Array.isArray(settings.stop) || !settings.stop.every((stop) => typeof stop === "string")) {
    throw new EngineError("bad-request", "stop must be a string or a list of strings");
  }
  if (request.n !== undefined && request.n !== 1) throw new EngineError("bad-request", "n must be 1");
  return settings;
}

const SHADER_COMPILATIONS = ["at-load", "on-first-use"];

/**
 * When the WebGPU shaders compile: all of them at load, as WebLLM does, while the weights download;
 * or each when its kernel first runs. `requested` picks; by default a software adapter (SwiftShader)
 * compiles them on first use: there the CPU compiles them, about 0.12 s each, and a chat runs about a
 * quarter of a library's kernels (18 of a Llama's 68: load and a first reply of a tiny Qwen2 took
 * 2.4 s against 9 s).
 */
function shaderCompilation(requested, adapter) {
  if (requested === undefined || requested === null) return adapter && softwareAdapter(adapter) ? "on-first-use" : "at-load";
  if (!SHADER_COMPILATIONS.includes(requested)) {
    throw new EngineError("bad-request", `shaders must be one of ${SHADER_COMPILATIONS.join(", ")}, not ${JSON.stringify(requested)}`);
  }
  return requested;
}

/**
 * One progress figure for a load whose parts overlap: downloading (or reading the cache),
 * compiling the GPU shaders (when they compile at load), uploading the weights; each part has a
 * share of the whole.
 */
class LoadProgress {
  constructor(onProgress, compilesShaders) {
    this.onProgress = onProgress;
    this.shares = compilesShaders ? { fetch: 0.5, compile: 0.3, upload: 0.2 } : { fetch: 0.7, compile: 0, upload: 0.3 };
    this.fractions = { fetch: 0, compile: 0, upload: 0 };
    this.texts = {};
  }

  update(part, fraction, text, extra = {}) {
    this.fractions[part] = Number.isFinite(fraction) ? Math.min(1, fraction) : 0;
    this.texts[part] = text;
    const running = Object.keys(this.texts).filter((name) => this.fractions[name] < 1).map((name) => this.texts[name]);
    this.onProgress({
      phase: part,
      text: running.length > 0 ? running.join(" · ") : text,
      fraction: Object.entries(this.shares).reduce((sum, [name, share]) => sum + share * this.fractions[name], 0),
      ...extra,
    });
  }
}

export class Engine {
  /**
   * Load `modelId` from `appConfig` (a WebLLM-style {model_list}).
   * `runtime` = {tvmjs, tokenizers, loadXgrammar, loadJinja}: the UMD modules of @mlc-ai/web-runtime
   * and web-tokenizers, a loader of @mlc-ai/web-xgrammar's (structured.js `Grammars`) and one of
   * @huggingface/jinja's ES module (chat templates for requests with tools).
   * `onProgress({phase, text, fraction})` reports the load; while files download it also gives
   * `loadedBytes`, `totalBytes`, `secondsLeft` (null until bytes arrive) and `files`
   * ([{name, loadedBytes, totalBytes}], as they started). `threads`: for the
   * CPU wasm library (wasm-threads.js). `library` pins one of the model's libraries by target name
   * (loader.js chooseBackend). `shaders`: when WebGPU compiles the library's shaders (`shaderCompilation`).
   * `speculative`: how replies are decoded unless a request says otherwise ("prompt-lookup" or "off").
   * `admit(choice)` sees the record and library chosen before anything downloads, and may refuse them by
   * throwing (engine-host.js: a model past the memory budget).
   */
  static async load({
    appConfig, modelId, device = "auto", library = null, threads, shaders, speculative, runtime, onProgress = () => {},
    onFatal = () => {}, admit = () => {},
  }) {
    const started = performance.now();
    const engineSpeculation = speculationFor({ speculative: speculative ?? "off" }, null);
    const choice = await chooseBackend(appConfig, modelId, device, library);
    admit(choice);
    const engine = new Engine(choice, onFatal);
    engine.speculation = engineSpeculation;
    engine.requestedThreads = choice.backend === "wasm" ? availableThreads(threads) : 1;
    const compilation = shaderCompilation(shaders, choice.adapter);
    engine.shaders = choice.backend === "webgpu" ? compilation : null;
    try {
      await engine.initialize(runtime, onProgress);
    } catch (error) {
      const failure = engine.failed(error);
      engine.dispose();
      throw failure;
    }
    engine.loadStats.seconds = seconds(started);
    onProgress({ phase: "ready", text: `Loaded ${engine.record.model_id} (${engine.backend})`, fraction: 1 });
    return engine;
  }

  constructor(choice, onFatal) {
    this.record = choice.record;
    this.backend = choice.backend;
    this.libraryTarget = choice.library;
    this.libraryUrl = choice.libraryUrl;
    this.adapter = choice.adapter;
    this.fallbackReason = choice.fallbackReason;
    this.onFatal = onFatal;
    this.failure = null;
    this.generating = false;
    this.interruptRequested = false;
    this.loadStats = {};
    this.lastRequest = null;
    this.conversation = null;
    this.chatTemplate = undefined; // the jinja one: undefined until read, null for a model without one
    this.tokenizerJSON = null;
    this.textSpecialTokens = null; // {before, after}: the ids the post-processor adds around a raw text
  }

  async initialize({ tvmjs, tokenizers, loadXgrammar, loadJinja }, onProgress) {
    const progress = new LoadProgress(onProgress, this.shaders === "at-load");
    this.loadJinja = loadJinja;
    const files = await ModelFiles.open(this.record, ({ fraction, text, ...download }) => progress.update("fetch", fraction,
      text, download));
    this.files = files; // for the chat template, read on the first request with tools
    this.chatConfig = files.chatConfig;
    const tokenizerName = this.chatConfig.tokenizer_files.find((name) => name === "tokenizer.json" || name === "tokenizer.model");
    if (!tokenizerName) throw new EngineError("bad-model", "mlc-chat-config.json lists no tokenizer.json or tokenizer.model");
    await files.reserve();

    const libraryBytes = await files.bytes(this.libraryUrl);
    const tokenizerBytes = await files.bytes(files.url(tokenizerName));
    this.tokenizer = tokenizerName === "tokenizer.json"
      ? await tokenizers.Tokenizer.fromJSON(tokenizerBytes.buffer)
      : await tokenizers.Tokenizer.fromSentencePiece(tokenizerBytes.buffer);
    const needed = wasmBytes(this.record);
    this.library = await instantiateLibrary(tvmjs, libraryBytes, {
      threads: this.requestedThreads, log: (message) => console.info(message),
      maximumBytes: needed ? [Infinity, cpuMemoryFor(needed)] : [Infinity],
    });
    this.tvm = this.library.tvm;

    // The weights download while the GPU compiles the shaders.
    const weightsStored = files.fetchShards();
    let device = this.tvm.cpu();
    if (this.backend === "webgpu") {
      this.gpuDevice = await requestDevice(this.adapter, this.record);
      this.gpuDevice.lost.then((info) => this.deviceLost(info));
      this.watchAllocations(this.gpuDevice);
      this.countPipelines(this.gpuDevice);
      this.kernelTimer = KernelTimer.attach(this.gpuDevice); // before tvmjs makes its pipelines
      this.tvm.initWebGPU(this.gpuDevice);
      let shadersCompiled = null; // on first use: tvmjs compiles each shader when its kernel first runs
      if (this.shaders === "at-load") {
        this.tvm.registerInitProgressCallback(({ progress: fraction, text }) => progress.update("compile", fraction, text));
        this.tvm.beginScope();
        shadersCompiled = this.tvm.asyncLoadWebGPUPipelines(this.tvm.systemLib());
        this.tvm.endScope();
      }
      await Promise.all([shadersCompiled, weightsStored]);
      device = this.tvm.webgpu();
    } else {
      await weightsStored;
    }

    const Session = this.chatConfig.embedding ? EmbeddingSession : ModelSession;
    this.session = new Session(this.tvm, device, this.backend);
    const shardCount = files.tensorCache.records.length;
    let uploaded = 0;
    await this.session.initialize(files.storedShards(), () => {
      uploaded += 1;
      progress.update("upload", uploaded / shardCount, `Loaded weight shard ${uploaded}/${shardCount} onto ${this.backend}`);
    });
    await this.checked();
    await files.forgetOtherBuilds();
    Object.assign(this.loadStats, {
      build_id: files.buildId, from_cache: files.downloadedBytes === 0,
      downloaded_bytes: files.downloadedBytes, cached_bytes: files.cachedBytes,
    });
    if (this.chatConfig.embedding) return;
    this.stopTokenIds = new Set([...(this.chatConfig.conv_template.stop_token_ids ?? []),
      ...[this.chatConfig.eos_token_id ?? []].flat()]);
    this.tokenizerJSON = tokenizerName === "tokenizer.json" ? tokenizerBytes : null;
    this.grammars = new Grammars({
      loadXgrammar, tokenizer: this.tokenizer, chatConfig: this.chatConfig, stopTokenIds: this.stopTokenIds,
      tokenizerJSON: this.tokenizerJSON, marks: async () => (await this.toolCallFormat())?.marks ?? [],
    });
  }

  /** Count the compute pipelines tvmjs makes, one a compiled shader (`stats().compiled_shaders`). */
  countPipelines(device) {
    this.compiledShaders = 0;
    for (const method of ["createComputePipeline", "createComputePipelineAsync"]) {
      const create = device[method].bind(device);
      device[method] = (descriptor) => {
        this.compiledShaders += 1;
        return create(descriptor);
      };
    }
  }

  /**
   * Report a GPU buffer the device cannot allocate as out-of-memory. The buffer's own error scope
   * catches the error before tvmjs's would (tvmjs destroys the device, which reads as device-lost).
   */
  watchAllocations(device) {
    const createBuffer = device.createBuffer.bind(device);
    device.createBuffer = (descriptor) => {
      device.pushErrorScope("out-of-memory");
      const buffer = createBuffer(descriptor);
      // Scopes settle in order: awaiting the last one awaits them all (see `checked`).
      this.allocationsChecked = device.popErrorScope().then((error) => {
        if (error === null || this.disposed || this.failure) return;
        this.failure = new EngineError("out-of-memory", `The GPU could not allocate ${mib(descriptor.size)} ` +
          `(${error.message}); the model needs about ${Math.round(this.record.vram_required_MB ?? 0)} MiB of GPU memory. ` +
          "Close other tabs or GPU-heavy pages, or use a smaller model, then load it again.");
        this.onFatal(this.failure);
        device.destroy();
      });
      return buffer;
    };
  }

  deviceLost(info) {
    if (this.disposed || this.failure) return;
    this.failure = new EngineError("device-lost", `The GPU device was lost (${info.message || info.reason || "no reason given"}). ` +
      "This happens when the GPU runs out of memory or its driver restarts. Reload the page to start again.");
    this.onFatal(this.failure);
  }

  throwIfFailed() {
    if (this.failure) throw this.failure;
  }

  /** throwIfFailed, once the GPU has answered for every buffer allocated so far (its errors come later). */
  async checked() {
    await this.allocationsChecked;
    this.throwIfFailed();
  }

  /**
   * The EngineError to report for `error`, thrown while loading or running the model. A CPU library
   * that exited cannot run again: the engine then stays failed (a new load starts a new one).
   */
  failed(error) {
    if (this.failure) return this.failure;
    if (error?.name !== "ExitStatus" || !this.library?.maximumBytes) return asEngineError(error);
    this.failure = cpuLibraryFailure(error, {
      usedBytes: this.tvm.memory.memory.buffer.byteLength,
      maximumBytes: this.library.maximumBytes,
      largestBuffer: this.record.buffer_size_required_bytes ?? 0,
      neededBytes: wasmBytes(this.record),
    });
    this.onFatal(this.failure);
    return this.failure;
  }

  // ---- token level: what parity checks drive (see protocol.js `engine.session`) ----

  encode(text) {
    return Array.from(this.tokenizer.encode(text));
  }

  /** Token ids of a raw text as the native engine encodes it: with the special tokens (a BOS) that the
   * tokenizer's post-processor adds, read from tokenizer.json on first use. */
  encodeText(text) {
    this.textSpecialTokens ??= specialTokensAround(
      this.tokenizerJSON ? JSON.parse(new TextDecoder().decode(this.tokenizerJSON)).post_processor : null);
    const { before, after } = this.textSpecialTokens;
    return [...before, ...this.encode(text), ...after];
  }

  decodeText(ids) {
    return this.tokenizer.decode(Int32Array.from(ids));
  }

  /** Token ids of the prompt for `messages`: the chat template applied, then encoded. */
  encodeChat(messages) {
    const convTemplate = this.chatConfig.conv_template;
    return encodePrompt(convTemplate, formatChat(convTemplate, messages), (text) => this.encode(text));
  }

  /** Run a token-level step under the engine's guards; `call(session)` returns rows of logits. */
  async sessionStep(call, { topK: k = 0, full = false } = {}) {
    this.throwIfFailed();
    if (this.generating) throw new EngineError("busy", "A generation is running; interrupt it first.");
    this.generating = true;
    try {
      const rows = await call(this.session);
      await this.checked();
      // A row is a view of wasm memory: posted as is, the whole memory would go with it.
      return rows.map((row) => ({ ...(k > 0 ? { top: topK(row, k) } : {}), ...(full ? { logits: row.slice() } : {}) }));
    } catch (error) {
      throw this.failed(error);
    } finally {
      this.generating = false;
    }
  }

  prefill(ids, options) {
    return this.sessionStep(async (session) => [await session.prefill(ids)], options).then((rows) => rows[0]);
  }

  decode(id, options) {
    return this.sessionStep(async (session) => [await session.decode(id)], options).then((rows) => rows[0]);
  }

  /**
   * `max_tokens` tokens after `ids` (appended to the sequence), chosen by the sampler with the
   * request's settings (the chat completion's fields; stop tokens do not end it), and where each
   * step's time goes: {token_ids, prefill_s, model_ms_per_token (a decode step), sample_ms_per_token}.
   */
  async generateTokens(ids, request) {
    this.throwIfFailed();
    if (this.generating) throw new EngineError("busy", "A generation is running; interrupt it first.");
    const settings = generationSettings(request, this.chatConfig);
    if (settings.maxTokens === null) throw new EngineError("bad-request", "max_tokens is required");
    this.generating = true;
    try {
      const started = performance.now();
      let logits = await this.session.prefill(ids);
      await this.checked();
      const prefillSeconds = seconds(started);
      const sampler = new Sampler(settings, ids);
      const tokens = [];
      let modelMs = 0;
      let sampleMs = 0;
      for (;;) {
        const sampling = performance.now();
        tokens.push(sampler.sample(logits));
        sampler.record(tokens.at(-1));
        sampleMs += performance.now() - sampling;
        if (tokens.length === settings.maxTokens) break;
        const stepping = performance.now();
        logits = await this.session.decode(tokens.at(-1));
        await this.checked();
        modelMs += performance.now() - stepping;
      }
      return {
        token_ids: tokens, prefill_s: prefillSeconds,
        model_ms_per_token: tokens.length > 1 ? modelMs / (tokens.length - 1) : null, sample_ms_per_token: sampleMs / tokens.length,
      };
    } catch (error) {
      throw this.failed(error);
    } finally {
      this.generating = false;
    }
  }

  /**
   * prefill, plus each kernel it ran with its GPU time and barriers (KernelTimer.time):
   * {…prefill's result, kernels: [{kernel, ms, dispatches, barriers, loopBarriers}]}.
   */
  timePrefill(ids, options) {
    return this.timeKernels(() => this.prefill(ids, options));
  }

  /** decode, plus the GPU time of each kernel it ran, as timePrefill. */
  timeDecode(id, options) {
    return this.timeKernels(() => this.decode(id, options));
  }

  /** embeddings, plus the GPU time of each kernel it ran, as timePrefill. */
  timeEmbeddings(request) {
    return this.timeKernels(() => this.embeddings(request));
  }

  async timeKernels(step) {
    if (!this.kernelTimer) {
      throw new EngineError("unsupported-gpu", "Kernel times need the WebGPU backend on an adapter with the timestamp-query feature.");
    }
    const [row, kernels] = await this.kernelTimer.time(step);
    return { ...row, kernels };
  }

  allLogits(ids, options) {
    return this.sessionStep((session) => session.allLogits(ids), options);
  }

  rollback(count) {
    this.throwIfFailed();
    return this.session.rollback(count);
  }

  cachedTokenIds() {
    return [...this.session.cachedIds];
  }

  // ---- chat level ----

  /**
   * The prompt of a chat request. A conversation that continues the previous one (its text
   * starts with the last prompt and reply) keeps that turn's exact token ids and encodes only
   * the new text (each of its pieces on its own), as the native engine does: the model sees its
   * own reply as it produced it, and the KV cache covers all of it.
   */
  chatPrompt(messages) {
    const convTemplate = this.chatConfig.conv_template;
    const pieces = formatChat(convTemplate, messages);
    return this.continuedPrompt(pieces, () => encodePrompt(convTemplate, pieces, (piece) => this.encode(piece)));
  }

  /** {text, ids} of `pieces`, encoded by `encodeAll` unless they continue the previous conversation. */
  continuedPrompt(pieces, encodeAll) {
    const text = pieces.join("");
    const previous = this.conversation;
    if (previous && text.startsWith(previous.text)) {
      const rest = piecesFrom(pieces, previous.text.length).flatMap((part) => this.encode(part));
      return { text, ids: [...previous.ids, ...rest] };
    }
    return { text, ids: encodeAll() };
  }

  /** The model's jinja chat template, or null (a base model); read and parsed on first use. */
  async jinjaChatTemplate() {
    if (this.chatTemplate === undefined) {
      const bytes = await this.files.bytes(this.files.url(TOKENIZER_CONFIG));
      this.chatTemplate = ChatTemplate.fromTokenizerConfig(bytes, await this.loadJinja());
    }
    return this.chatTemplate;
  }

  /** How this model writes a tool call (null: its template renders no tools, or it has none). */
  async toolCallFormat() {
    const template = await this.jinjaChatTemplate();
    return template === null ? null : toolCallFormat(template.source);
  }

  /**
   * A chat with tools, laid out by the model's jinja chat template (a conv_template can show neither
   * the tools nor the tool messages of the conversation): {prompt, responseFormat, calls}. Unless
   * tool_choice is "none" (a plain reply, held to the request's `requestedFormat`), the tools are
   * shown and `calls` reads calls out of the reply. As natively (`Engine._chat_prompt_ids`), the rendered text and a forced call's opening
   * are encoded as one piece, their special tokens read from the text.
   */
  async toolChat(messages, tools, requestedFormat) {
    const template = await this.jinjaChatTemplate();
    if (template === null) {
      throw new EngineError("no-chat-template", "This model has no chat template (a base model): it completes raw text, it does not chat.");
    }
    const rendered = (text) => this.continuedPrompt([text], () => this.encode(text));
    if (tools.choice === "none") {
      return { prompt: rendered(template.render(templateMessages(messages))), responseFormat: requestedFormat, calls: null };
    }
    const callFormat = await this.toolCallFormat();
    if (callFormat === null) {
      throw new EngineError("no-tool-support", `${this.record.model_id} cannot call tools: its chat template does not ` +
        "render them (or writes calls in a way Kiln does not read).");
    }
    const opening = tools.replyOpening(callFormat);
    return {
      prompt: rendered(template.render(templateMessages(messages), tools.tools) + opening),
      responseFormat: tools.responseFormat(callFormat),
      calls: new ContentBeforeCalls(callFormat, tools.functions, opening),
    };
  }

  rememberConversation(promptText, promptIds, reply) {
    const replyIds = this.decodeText(reply.ids) === reply.text ? reply.ids : this.encode(reply.text);
    this.conversation = { text: promptText + reply.text, ids: [...promptIds, ...replyIds] };
  }

  /** Bring the KV cache to `ids` minus its last token, reusing the longest cached prefix; the logits after `ids`. */
  async prefillPrompt(ids) {
    const cached = this.session.cachedIds;
    let common = 0;
    while (common < cached.length && common < ids.length - 1 && cached[common] === ids[common]) ++common;
    const kept = this.session.rollback(cached.length - common);
    const logits = await this.session.prefill(ids.slice(kept));
    return { logits, prefilled: ids.length - kept };
  }

  /** A reply's TokenConstraint; a tool's parameters that XGrammar rejects are a bad request about the tools. */
  async constraint({ responseFormat, calls }) {
    try {
      return await this.grammars.constraint(responseFormat);
    } catch (error) {
      if (calls === null || error.code !== "bad-response-format") throw error;
      throw new EngineError("bad-request", `tools: ${error.message}`);
    }
  }

  /** Refuse a request of the other kind of model: chat of an embedding model, embeddings of a chat model. */
  checkKind(embedding) {
    if (Boolean(this.chatConfig.embedding) === embedding) return;
    throw new EngineError("bad-request", embedding
      ? `${this.record.model_id} is a chat model: use chat.completions.create`
      : `${this.record.model_id} is an embedding model: use embeddings.create`);
  }

  /** OpenAI's embeddings response (embeddings.js): an embedding model's vectors for `request.input`. */
  async embeddings(request) {
    this.throwIfFailed();
    this.checkKind(true);
    if (this.generating) throw new EngineError("busy", "Another request is running; wait for it.");
    this.generating = true;
    try {
      return await createEmbeddings(this, request);
    } catch (error) {
      throw this.failed(error);
    } finally {
      this.generating = false;
    }
  }

  /**
   * An OpenAI chat completion, with OpenAI's `tools` and `tool_choice` (see tools.js). With
   * `stream: true`, `onChunk` receives each `chat.completion.chunk` (tool calls come whole in the
   * last delta; the chunk after it carries `usage`); the full completion is returned either way.
   */
  async chatCompletion(request, onChunk = () => {}) {
    this.throwIfFailed();
    this.checkKind(false);
    if (this.generating) throw new EngineError("busy", "A generation is already running; wait for it or interrupt it.");
    const settings = generationSettings(request, this.chatConfig);
    settings.speculation = speculationFor(request, this.speculation);
    const tools = toolRequestFrom(request.tools, request.tool_choice);
    if (tools && tools.choice !== "none" && request.response_format != null) {
      throw new EngineError("bad-request", "'response_format' cannot be combined with tools the model may call.");
    }
    const requestedFormat = request.response_format == null ? null : responseFormatFrom(request.response_format);
    this.generating = true;
    this.interruptRequested = false;
    const reply = new ChatReply(this.record.model_id);
    const send = request.stream ? onChunk : () => {};
    const text = new TextStream(this.tokenizer, [...this.chatConfig.conv_template.stop_str ?? [], ...settings.stop]);
    let calls = null; // reads tool calls out of the reply
    let content = ""; // the reply's text outside tool calls
    const show = (delta) => {
      const shown = calls ? calls.feed(delta) : delta;
      content += shown;
      if (shown) send(reply.delta({ content: shown }));
    };
    const started = performance.now();
    let prompt;
    let run;
    let constraint = null;
    try {
      const chat = tools ? await this.toolChat(request.messages, tools, requestedFormat)
        : { prompt: this.chatPrompt(request.messages), responseFormat: requestedFormat, calls: null };
      ({ prompt, calls } = chat);
      const maxTokens = this.replyRoom(prompt.ids, settings);
      if (chat.responseFormat) constraint = await this.constraint(chat);
      send(reply.delta({ role: "assistant", content: "" }));
      run = await this.decodeReply(prompt.ids, { settings, constraint, text, maxTokens, show, started });
    } catch (error) {
      throw this.failed(error);
    } finally {
      constraint?.dispose();
      this.generating = false;
    }
    show(text.flush());
    this.rememberConversation(prompt.text, prompt.ids, text);
    const { content: rest, toolCalls } = calls?.finish() ?? { content: "", toolCalls: [] };
    content += rest;
    if (rest) send(reply.delta({ content: rest }));
    const usage = completionUsage(prompt.ids, text, run, started, constraint);
    // The token ids (with the stop token that ended the reply) are kept for parity checks.
    this.lastRequest = { finish_reason: run.finishReason, token_ids: run.tokens, ...usage };
    const called = toolCalls.length > 0;
    const finishReason = called ? "tool_calls" : run.finishReason;
    send(reply.delta(called ? { tool_calls: toolCalls.map((call, index) => ({ index, ...call })) } : {}, finishReason));
    send(reply.chunk([], { usage }));
    const message = called
      ? { role: "assistant", content: content || null, tool_calls: toolCalls }
      : { role: "assistant", content };
    return reply.completion(message, finishReason, usage);
  }

  /** The most tokens a reply to `promptIds` may have: what the request asks, within the context window. */
  replyRoom(promptIds, settings) {
    const room = this.session.contextWindowSize - promptIds.length;
    if (room <= 0) {
      throw new EngineError("context-window-exceeded", `The conversation has ${promptIds.length} tokens; the context window holds ` +
        `${this.session.contextWindowSize}. Start a new chat.`);
    }
    return Math.min(settings.maxTokens ?? room, room);
  }

  /** Prefills `promptIds`, then samples the reply into `text` (showing it as it comes) until a stop, the
   * length or an interrupt. Returns the tokens, why they ended, and when. */
  async decodeReply(promptIds, { settings, constraint, text, maxTokens, show, started }) {
    const prompt = await this.prefillPrompt(promptIds);
    await this.checked();
    const steps = decodingSteps(this.session, settings.speculation, promptIds, constraint);
    const run = {
      tokens: [], finishReason: null, prefilled: prompt.prefilled, prefillSeconds: seconds(started), stats: steps.stats,
    };
    await this.sampleReply(run, prompt.logits, steps, { settings, constraint, text, maxTokens, show, promptIds });
    steps.settle();
    return run;
  }

  /** decodeReply's loop: a token from each row of logits until the reply ends; `steps` gives the next row. */
  async sampleReply(run, logits, steps, { settings, constraint, text, maxTokens, show, promptIds }) {
    const sampler = new Sampler(settings, promptIds);
    for (;;) {
      const token = sampler.sample(logits, constraint && await constraint.allowed());
      sampler.record(token);
      run.tokens.push(token);
      constraint?.accept(token);
      run.lastTokenAt = performance.now();
      run.firstTokenAt ??= run.lastTokenAt;
      // A finished format allows nothing more, so its stop token ends the reply even with ignore_eos.
      if (this.stopTokenIds.has(token) && (!settings.ignoreEos || constraint?.finished)) {
        run.finishReason = "stop";
        return;
      }
      const { delta, stopped } = text.push(token);
      show(delta);
      if (stopped) run.finishReason = "stop";
      else if (text.ids.length >= maxTokens) run.finishReason = "length";
      else if (this.interruptRequested) run.finishReason = "abort";
      if (run.finishReason) return;
      logits = await steps.logitsAfter(token);
      await yieldToEventLoop();
      await this.checked();
    }
  }

  interrupt() {
    this.interruptRequested = true;
  }

  resetChat() {
    this.throwIfFailed();
    if (this.generating) throw new EngineError("busy", "A generation is running; interrupt it first.");
    this.session.reset();
    this.conversation = null;
    this.lastRequest = null;
  }

  stats() {
    const adapterInfo = this.adapter?.info;
    return {
      model_id: this.record.model_id,
      backend: this.backend,
      library: this.libraryUrl,
      // the library's target: webgpu, webgpu-subgroups (its decode kernels use subgroup operations) or wasm
      library_target: this.libraryTarget,
      quantization: this.chatConfig?.quantization,
      adapter: adapterInfo ? { vendor: adapterInfo.vendor, architecture: adapterInfo.architecture, description: adapterInfo.description } : null,
      fallback_reason: this.fallbackReason,
      // threads the CPU wasm library's parallel loops run on (1 on WebGPU)
      threads: this.library?.threads ?? null,
      // when the WebGPU shaders compile: "at-load" or "on-first-use", and how many have (null on wasm)
      shaders: this.shaders,
      compiled_shaders: this.compiledShaders ?? null,
      context_window_size: this.session?.contextWindowSize,
      cached_tokens: this.session?.cachedIds?.length ?? 0,
      // "embedding" for an embedding model (engine.embeddings.create), else "chat"
      kind: this.chatConfig?.embedding ? "embedding" : "chat",
      // WebGPU compute dispatches of the last decode step: embedding, layers, head (null on wasm)
      decode_step_dispatches: this.session?.lastDecodeDispatches ?? null,
      // CPU time to issue that step (on WebGPU): a floor under its time however fast the GPU
      decode_step_issue_ms: this.session?.lastDecodeIssueMs ?? null,
      memory: this.memoryStats(),
      load: this.loadStats,
      last_request: this.lastRequest,
    };
  }

  /**
   * The memory the model holds: the library's wasm memory (which never shrinks: its peak) and the
   * most it may grow to, the GPU buffers tvmjs holds now and at most, and what the app config
   * accounts for (kiln/model_memory.py) on the library running.
   */
  memoryStats() {
    const gpu = this.tvm?.lib.webGPUContext;
    return {
      wasm_bytes: this.tvm?.memory.memory.buffer.byteLength ?? null,
      wasm_maximum_bytes: this.library?.maximumBytes ?? null,
      gpu_bytes: gpu?.currAllocatedBytes ?? null,
      gpu_peak_bytes: gpu?.peakAllocatedBytes ?? null,
      accounted_bytes: this.record.kiln?.memory_bytes?.[this.libraryTarget] ?? null,
    };
  }

  dispose() {
    this.disposed = true;
    this.session?.dispose();
    this.tokenizer?.dispose();
    this.library?.stop();
    this.tvm?.dispose();
    this.gpuDevice?.destroy();
  }
}
