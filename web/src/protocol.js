// The page ↔ worker protocol. The page calls `createEngine`, which starts the engine in a
// dedicated Web Worker and returns an object with the engine's API; every call becomes a
// message {id, method, params}, answered by {id, kind: "event" | "result" | "error", ...}.
// A worker-wide failure (the GPU device lost) arrives as {kind: "fatal", error}.
import { EngineError, asEngineError } from "./errors.js";

/** Make the app config's URLs absolute (the worker resolves against its own URL otherwise). */
function absoluteAppConfig(appConfig, base) {
  const absolute = (url) => (url ? new URL(url, base).href : url);
  return {
    ...appConfig,
    model_list: (appConfig.model_list ?? []).map((record) => ({
      ...record,
      model: absolute(record.model),
      model_lib: absolute(record.model_lib),
      ...(record.kiln ? {
        kiln: {
          ...record.kiln,
          libraries: Object.fromEntries(Object.entries(record.kiln.libraries ?? {}).map(([target, url]) => [target, absolute(url)])),
        },
      } : {}),
    })),
  };
}

/** Values pushed by one side and pulled with `for await` by the other; `onCancel` runs when the
 * consumer stops early (a `break` out of the loop). */
class AsyncQueue {
  constructor(onCancel = () => {}) {
    this.onCancel = onCancel;
    this.items = [];
    this.waiters = [];
    this.closed = false;
    this.failure = null;
  }

  push(item) {
    const waiter = this.waiters.shift();
    if (waiter) waiter.resolve({ value: item, done: false });
    else this.items.push(item);
  }

  close(failure = null) {
    this.closed = true;
    this.failure = failure;
    for (const waiter of this.waiters.splice(0)) {
      if (failure) waiter.reject(failure);
      else waiter.resolve({ value: undefined, done: true });
    }
  }

  next() {
    if (this.items.length > 0) return Promise.resolve({ value: this.items.shift(), done: false });
    if (this.closed) return this.failure ? Promise.reject(this.failure) : Promise.resolve({ value: undefined, done: true });
    return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
  }

  async return() {
    if (!this.closed) await this.onCancel();
    this.items = [];
    return { value: undefined, done: true };
  }

  [Symbol.asyncIterator]() {
    return this;
  }
}

class WorkerConnection {
  constructor(worker, onFatal) {
    this.worker = worker;
    this.pending = new Map();
    this.nextId = 1;
    this.failure = null;
    worker.onmessage = ({ data }) => this.receive(data, onFatal);
    worker.onerror = (event) => {
      event.preventDefault?.();
      this.fail(new EngineError("internal", `The engine worker failed: ${event.message ?? "it could not start"}`), onFatal);
    };
  }

  receive(message, onFatal) {
    if (message.kind === "fatal") {
      this.fail(EngineError.fromJSON(message.error), onFatal);
      return;
    }
    const call = this.pending.get(message.id);
    if (!call) return;
    if (message.kind === "event") {
      call.onEvent(message.data);
      return;
    }
    this.pending.delete(message.id);
    if (message.kind === "result") call.resolve(message.data);
    else call.reject(EngineError.fromJSON(message.error));
  }

  /** @param {EngineError} error @param {(error: EngineError) => void} [onFatal] */
  fail(error, onFatal = () => {}) {
    this.failure = error;
    for (const call of this.pending.values()) call.reject(error);
    this.pending.clear();
    onFatal(error);
  }

  /** @param {string} method @param {object} [params] @param {(event: any) => void} [onEvent] */
  call(method, params = {}, onEvent = () => {}) {
    if (this.failure) return Promise.reject(this.failure);
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onEvent });
      this.worker.postMessage({ id, method, params });
    });
  }
}

/**
 * @typedef {object} LoadProgress
 * @property {string} phase
 * @property {string} text
 * @property {number} [fraction]
 * @property {number} [loadedBytes]
 * @property {number} [totalBytes]
 *
 * @typedef {object} EngineOptions
 * @property {(progress: LoadProgress) => void} [onProgress]
 * @property {"auto" | "webgpu" | "wasm"} [device] "auto": WebGPU, else the CPU wasm library
 * @property {"webgpu" | "webgpu-subgroups" | "wasm"} [library] run this library of the model and no
 *   other (default: the best one the device runs: webgpu-subgroups where the GPU has subgroups)
 * @property {(error: EngineError) => void} [onError] failures outside a call (the GPU device lost)
 * @property {string | URL} [workerUrl] the engine's worker script (default: worker.js beside this module)
 * @property {number} [threads] threads for the CPU wasm library (default: the cores, at most 4); more than
 *   one needs a cross-origin isolated page (COOP/COEP headers), else it runs on one
 * @property {"at-load" | "on-first-use"} [shaders] when WebGPU compiles the library's shaders: all at load,
 *   while the weights download (default), or each when its kernel first runs (default on a software
 *   adapter such as SwiftShader, where the CPU compiles them)
 * @property {"prompt-lookup" | "off"} [speculative] decode speculatively by default (speculative.js): a request's
 *   own `speculative` field ("off" or "prompt-lookup") overrides it (default "off")
 */

/**
 * Start the engine for `modelId` of `appConfig` ({model_list: [...]}, WebLLM's format) in a worker.
 *
 * @param {{model_list: object[]}} appConfig
 * @param {string} modelId
 * @param {EngineOptions} [options]
 */
export async function createEngine(appConfig, modelId, {
  onProgress = () => {}, device = "auto", library, onError = () => {}, workerUrl, threads, shaders, speculative,
} = {}) {
  const worker = new Worker(workerUrl ?? new URL("./worker.js", import.meta.url), { type: "module" });
  const connection = new WorkerConnection(worker, onError);
  const base = globalThis.location?.href;
  let loaded;
  try {
    loaded = await connection.call("load", {
      appConfig: absoluteAppConfig(appConfig, base), modelId, device, library, threads, shaders, speculative,
    }, onProgress);
  } catch (error) {
    worker.terminate();
    throw error;
  }
  const call = (method, params) => connection.call(method, params);
  return {
    modelId: loaded.model_id,
    backend: loaded.backend,
    chat: {
      completions: {
        /**
         * OpenAI's chat.completions.create: a completion, or with `stream: true` an async iterable of chunks.
         * Sampling honours the native engine's fields (top_k, the penalties, ignore_eos, seed, …), and a
         * seed picks the native engine's tokens (sampler.js).
         */
        async create(request) {
          if (!request.stream) return call("chatCompletion", { request });
          // Leaving the loop early ends the generation (as closing an OpenAI stream does) and
          // waits for it to stop, so the next request does not find the engine busy.
          let finished = null;
          const chunks = new AsyncQueue(async () => {
            await call("interrupt");
            await finished;
          });
          finished = connection.call("chatCompletion", { request }, (chunk) => chunks.push(chunk))
            .then(() => chunks.close(), (error) => chunks.close(error));
          return chunks;
        },
      },
    },
    embeddings: {
      /**
       * OpenAI's embeddings.create (WebLLM's `engine.embeddings.create`), for an embedding model: `input` a
       * string or a list of them, `dimensions` (a Matryoshka length the model allows), `encoding_format`
       * "float" or "base64". Inputs past the model's longest are cut to their beginning.
       */
      create: (request) => call("embeddings", { request }),
    },
    /** Stop the running generation after its current token (finish_reason "abort"). */
    interrupt: () => call("interrupt"),
    /** Forget the conversation (clears the KV cache). */
    resetChat: () => call("resetChat"),
    stats: () => call("stats"),
    /** Token-level access to the model's one sequence, for parity checks and benchmarks. */
    session: {
      /** A text's ids without special tokens, as WebLLM encodes each piece of a prompt. */
      encode: (text) => call("encode", { text }),
      /** A raw text's ids with the special tokens the tokenizer adds (a BOS), as natively. */
      encodeText: (text) => call("encodeText", { text }),
      decodeText: (ids) => call("decodeText", { ids }),
      encodeChat: (messages) => call("encodeChat", { messages }),
      /** Append ids; {top: {ids, logits}} with options.topK, {logits: Float32Array} with options.full. */
      prefill: (ids, options = {}) => call("prefill", { ids, options }),
      decode: (id, options = {}) => call("decode", { id, options }),
      /** `request.max_tokens` sampled tokens after `ids` and the time per token in the model and in sampling. */
      generate: (ids, request) => call("generate", { ids, request }),
      /** prefill and decode, plus `kernels`: the GPU time of each kernel of the step (WebGPU with timestamp queries). */
      timePrefill: (ids, options = {}) => call("timePrefill", { ids, options }),
      /** embeddings.create, plus `kernels` (an embedding model on WebGPU with timestamp queries). */
      timeEmbeddings: (request) => call("timeEmbeddings", { request }),
      timeDecode: (id, options = {}) => call("timeDecode", { id, options }),
      /** One result per id (the logits after each position), as prefill's. */
      allLogits: (ids, options = {}) => call("allLogits", { ids, options }),
      rollback: (count) => call("rollback", { count }),
      cachedTokenIds: () => call("cachedTokenIds"),
    },
    /** Release the GPU and the worker. */
    unload: async () => {
      await call("unload").catch(() => {});
      worker.terminate();
      // A terminated worker never answers: later calls (a second unload too) must fail, not wait forever.
      connection.fail(new EngineError("not-loaded", "The engine was unloaded; create a new one."));
    },
  };
}

/**
 * The worker side: answer messages on `scope` (the worker's global) with an engine made by
 * `loadEngine({appConfig, modelId, device, library, threads, shaders, speculative, onProgress, onFatal})`.
 */
export function serveEngine(scope, loadEngine) {
  let engine = null;
  const loaded = () => {
    if (!engine) throw new EngineError("not-loaded", "The model is not loaded.");
    return engine;
  };
  // A Map, so that a message naming `constructor`, `__proto__` or `toString` finds no method.
  const methods = new Map(Object.entries({
    load: async ({ appConfig, modelId, device, library, threads, shaders, speculative }, emit) => {
      engine?.dispose();
      engine = null;
      engine = await loadEngine({
        appConfig, modelId, device, library: library ?? null, threads, shaders, speculative, onProgress: emit,
        onFatal: (error) => scope.postMessage({ kind: "fatal", error: error.toJSON() }),
      });
      return engine.stats();
    },
    chatCompletion: ({ request }, emit) => loaded().chatCompletion(request, emit),
    embeddings: ({ request }) => loaded().embeddings(request),
    interrupt: () => loaded().interrupt(),
    resetChat: () => loaded().resetChat(),
    stats: () => loaded().stats(),
    encode: ({ text }) => loaded().encode(text),
    encodeText: ({ text }) => loaded().encodeText(text),
    decodeText: ({ ids }) => loaded().decodeText(ids),
    encodeChat: ({ messages }) => loaded().encodeChat(messages),
    prefill: ({ ids, options }) => loaded().prefill(ids, options),
    decode: ({ id, options }) => loaded().decode(id, options),
    generate: ({ ids, request }) => loaded().generateTokens(ids, request),
    timePrefill: ({ ids, options }) => loaded().timePrefill(ids, options),
    timeEmbeddings: ({ request }) => loaded().timeEmbeddings(request),
    timeDecode: ({ id, options }) => loaded().timeDecode(id, options),
    allLogits: ({ ids, options }) => loaded().allLogits(ids, options),
    rollback: ({ count }) => loaded().rollback(count),
    cachedTokenIds: () => loaded().cachedTokenIds(),
    unload: () => {
      engine?.dispose();
      engine = null;
    },
  }));
  scope.onmessage = async ({ data: { id, method, params } }) => {
    const emit = (event) => scope.postMessage({ id, kind: "event", data: event });
    try {
      const handler = methods.get(method);
      if (!handler) throw new EngineError("bad-request", `unknown method ${JSON.stringify(method)}`);
      const result = await handler(params, emit);
      scope.postMessage({ id, kind: "result", data: result });
    } catch (error) {
      scope.postMessage({ id, kind: "error", error: asEngineError(error).toJSON() });
    }
  };
}
