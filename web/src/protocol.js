// The page ↔ worker protocol. The page calls `createEngine`, which starts the engine in a
// dedicated Web Worker and returns an object with the engine's API; every call becomes a
// message {id, method, params}, answered by {id, kind: "event" | "result" | "error", ...}.
// A worker-wide failure (the GPU device lost) arrives as {kind: "fatal", error}.
import { EngineError } from "./errors.js";
import { EXTENSION_PORT } from "./engine-host.js";

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

/** The page's end of a connection to an engine: calls and their answers (engine-host.js). */
class Connection {
  /** @param {(error: EngineError) => void} onFatal */
  constructor(onFatal) {
    this.onFatal = onFatal;
    this.pending = new Map();
    this.nextId = 1;
    this.failure = null; // the connection's own, which every call gets
    this.modelFailures = new Map(); // a model's (its GPU device lost), which the calls to it get
  }

  receive(message) {
    if (message.kind === "fatal") {
      const error = EngineError.fromJSON(message.error);
      this.modelFailures.set(message.model, error);
      this.rejectPending(error, (call) => call.model === message.model);
      this.onFatal(error);
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

  /** @param {EngineError} error @param {(call: {model: string | null}) => boolean} [matches] */
  rejectPending(error, matches = () => true) {
    for (const [id, call] of this.pending) {
      if (!matches(call)) continue;
      this.pending.delete(id);
      call.reject(error);
    }
  }

  /** @param {EngineError} error */
  fail(error) {
    this.failure = error;
    this.rejectPending(error);
    this.onFatal(error);
  }

  /**
   * @param {string} method @param {object} [params] @param {(event: any) => void} [onEvent]
   * @param {string | null} [model] the model the call addresses (its failure fails the call)
   */
  call(method, params = {}, onEvent = () => {}, model = null) {
    const failure = this.failure ?? this.modelFailures.get(model);
    if (failure) return Promise.reject(failure);
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onEvent, model });
      this.send({ id, method, params });
    });
  }

  /** Post one message to the engine's worker (each transport its own way). @param {object} message */
  send(message) {
    throw new Error(`${this.constructor.name} cannot send ${JSON.stringify(message)}`);
  }

  /** Before a call: whether the engine's worker was restarted since the last call (its models are gone). */
  async restarted() {
    return false;
  }

  close() {}
}

/** An engine in a dedicated Web Worker of the page. */
class WorkerConnection extends Connection {
  constructor(worker, onFatal) {
    super(onFatal);
    this.worker = worker;
    worker.onmessage = ({ data }) => this.receive(data);
    worker.onerror = (event) => {
      event.preventDefault?.();
      this.fail(new EngineError("internal", `The engine worker failed: ${event.message ?? "it could not start"}`));
    };
  }

  send(message) {
    this.worker.postMessage(message);
  }

  close() {
    this.worker.terminate();
  }
}

const lostCall = (where) => new EngineError("internal", `The browser stopped the engine's ${where} during this call; ` +
  "the next call loads the model again.");

/**
 * An engine in the site's service worker (engine-host.js serveEngineInServiceWorker): each call goes
 * as a message with a port of its own for the answers. A ping every `keepAliveMs` keeps the worker
 * alive while the page is open, and tells when the browser stopped it and started it again.
 */
class ServiceWorkerConnection extends Connection {
  constructor(serviceWorker, container, keepAliveMs, onFatal) {
    super(onFatal);
    this.serviceWorker = serviceWorker;
    this.instance = null;
    this.onBroadcast = ({ data }) => {
      if (data?.kiln) this.receive(data.kiln);
    };
    container.addEventListener("message", this.onBroadcast);
    this.container = container;
    this.keepAlive = setInterval(() => this.restarted().catch(() => {}), keepAliveMs);
  }

  send(message, onAnswer = (answer) => this.receive(answer)) {
    const channel = new MessageChannel();
    channel.port1.onmessage = ({ data }) => {
      if (data.kind !== "event") channel.port1.close();
      onAnswer(data);
    };
    this.serviceWorker.postMessage({ kilnCall: message }, [channel.port2]);
  }

  /** Ping the worker; a new instance id means the browser restarted it: calls in flight are lost. */
  async restarted() {
    const { instance } = await new Promise((resolve) => {
      this.send({ id: 0, method: "ping" }, ({ data }) => resolve(data));
    });
    const before = this.instance;
    this.instance = instance;
    if (before === null || before === instance) return false;
    this.rejectPending(lostCall("service worker"));
    this.modelFailures.clear();
    return true;
  }

  close() {
    clearInterval(this.keepAlive);
    this.container.removeEventListener("message", this.onBroadcast);
  }
}

/**
 * An engine in an MV3 extension's service worker (engine-host.js serveEngineInExtension), over a
 * `chrome.runtime` port. The port breaks when the browser stops the worker; the next call connects again.
 */
class ExtensionConnection extends Connection {
  constructor(runtime, portName, keepAliveMs, onFatal) {
    super(onFatal);
    this.runtime = runtime;
    this.portName = portName;
    this.port = null;
    this.connect();
    this.keepAlive = setInterval(() => this.port?.postMessage({ id: 0, method: "models", params: {} }), keepAliveMs);
  }

  connect() {
    const port = this.runtime.connect({ name: this.portName });
    port.onMessage.addListener((message) => this.receive(message));
    port.onDisconnect.addListener(() => {
      this.port = null;
      this.rejectPending(lostCall("extension service worker"));
    });
    this.port = port;
  }

  send(message) {
    this.port.postMessage(message);
  }

  async restarted() {
    if (this.port) return false;
    this.connect();
    this.modelFailures.clear();
    return true;
  }

  close() {
    clearInterval(this.keepAlive);
    this.port?.disconnect();
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
 * @property {number} [memoryBudget] bytes the engine's models may take together, as the app config accounts
 *   for them (default: half the device's memory where the browser tells it): a model past it is refused
 *   (`out-of-memory`) before it downloads
 */

const LOAD_OPTIONS = ["device", "library", "threads", "shaders", "speculative", "memoryBudget"];

/**
 * The page's engine: the API of the models an engine worker holds (a dedicated, service or extension
 * worker: the connection says which). A request names its model in `model`, as OpenAI's do; with one
 * model loaded it may leave it out.
 */
class EngineClient {
  constructor(connection, appConfig, options) {
    this.connection = connection;
    this.appConfig = absoluteAppConfig(appConfig, globalThis.location?.href);
    this.loadOptions = Object.fromEntries(LOAD_OPTIONS.map((name) => [name, options[name]]));
    this.loads = new Map(); // each model's load parameters, to load it again in a restarted worker
    this.modelId = null;
    this.backend = null;
    const client = this;
    this.chat = {
      completions: {
        /**
         * OpenAI's chat.completions.create: a completion, or with `stream: true` an async iterable of chunks.
         * Sampling honours the native engine's fields (top_k, the penalties, ignore_eos, seed, …), and a
         * seed picks the native engine's tokens (sampler.js).
         */
        create: (request) => client.chatCompletion(request),
      },
    };
    this.embeddings = {
      /**
       * OpenAI's embeddings.create (WebLLM's `engine.embeddings.create`), for an embedding model: `input` a
       * string or a list of them, `dimensions` (a Matryoshka length the model allows), `encoding_format`
       * "float" or "base64". Inputs past the model's longest are cut to their beginning.
       */
      create: (request) => client.call("embeddings", { request }, request?.model),
    };
    const call = (method, params = {}) => client.call(method, params, client.modelId);
    /** Token-level access to the first model's one sequence, for parity checks and benchmarks. */
    this.session = {
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
    };
  }

  /**
   * Load `modelId` of the app config beside the models held (`options` override the engine's), and
   * report progress to `onProgress`; resolves to the model's stats, with `reused: true` where the
   * worker held it already (a service worker's model, from an earlier page).
   */
  async load(modelId, { onProgress = () => {}, ...options } = {}) {
    const params = { appConfig: this.appConfig, ...this.loadOptions, ...options, modelId };
    await this.connection.restarted();
    this.connection.modelFailures.delete(modelId); // loading a failed model again clears its failure
    const loaded = await this.connection.call("load", params, onProgress, modelId);
    this.loads.set(modelId, params);
    this.modelId ??= modelId;
    this.backend ??= loaded.backend;
    return loaded;
  }

  /** The model a call reaches: the one it names, else (the engine holding one) the first loaded. */
  addressed(model) {
    return model ?? this.modelId;
  }

  /** Where the browser restarted the engine's worker since the last call, load the models it held again. */
  async reloadIfRestarted() {
    if (!(await this.connection.restarted())) return;
    for (const [modelId, loadParams] of this.loads) await this.connection.call("load", loadParams, () => {}, modelId);
  }

  async call(method, params = {}, model = null) {
    await this.reloadIfRestarted();
    return this.connection.call(method, { model, ...params }, () => {}, this.addressed(model));
  }

  async chatCompletion(request) {
    const model = request?.model ?? null;
    if (!request?.stream) return this.call("chatCompletion", { request }, model);
    await this.reloadIfRestarted();
    // Leaving the loop early ends the generation (as closing an OpenAI stream does) and
    // waits for it to stop, so the next request does not find the engine busy.
    let finished = null;
    const chunks = new AsyncQueue(async () => {
      await this.interrupt(model);
      await finished;
    });
    finished = this.connection.call("chatCompletion", { request }, (chunk) => chunks.push(chunk), this.addressed(model))
      .then(() => chunks.close(), (error) => chunks.close(error));
    return chunks;
  }

  /** Stop the model's running generation after its current token (finish_reason "abort"). */
  interrupt(model = null) {
    return this.connection.call("interrupt", { model }, () => {}, this.addressed(model));
  }

  /** Forget the model's conversation (clears its KV cache). */
  resetChat(model = null) {
    return this.call("resetChat", {}, model);
  }

  stats(model = null) {
    return this.call("stats", {}, model);
  }

  /** The models held: [{id, model_id, backend, kind, accounted_bytes}]. */
  models() {
    return this.call("models");
  }

  /**
   * Unload `model`, and the others keep working; with no model, unload them all and end the engine
   * (a dedicated worker is terminated; a service worker lives on, empty).
   */
  async unload(model = null) {
    if (model !== null) {
      await this.connection.call("unload", { model }, () => {}, model);
      this.loads.delete(model);
      if (this.modelId === model) this.modelId = this.loads.keys().next().value ?? null;
      return;
    }
    await this.connection.call("unload", {}).catch(() => {});
    this.loads.clear();
    this.connection.close();
    // A closed connection never answers: later calls (a second unload too) must fail, not wait forever.
    this.connection.failure = new EngineError("not-loaded", "The engine was unloaded; create a new one.");
  }
}

/** Load each of `modelIds` into `client` in turn; the first failure closes the connection and is thrown. */
async function loaded(client, modelIds, onProgress) {
  try {
    for (const modelId of [modelIds].flat()) await client.load(modelId, { onProgress });
  } catch (error) {
    client.connection.close();
    throw error;
  }
  return client;
}

/**
 * Start the engine for `modelId` of `appConfig` ({model_list: [...]}, WebLLM's format) in a
 * dedicated Web Worker; a list of ids loads each, for requests to name in `model`.
 *
 * @param {{model_list: object[]}} appConfig
 * @param {string | string[]} modelId
 * @param {EngineOptions & {worker?: Worker}} [options] `worker`: a worker the page started that serves the
 *   engine (`serveEngine`, or WebLLM's `WebWorkerMLCEngineHandler`), instead of one from `workerUrl`
 */
export function createEngine(appConfig, modelId, options = {}) {
  const { workerUrl, onError = () => {}, onProgress } = options;
  const worker = options.worker ?? new Worker(workerUrl ?? new URL("./worker.js", import.meta.url), { type: "module" });
  return loaded(new EngineClient(new WorkerConnection(worker, onError), appConfig, options), modelId, onProgress);
}

/**
 * The engine in the site's service worker (a module that imports `kiln-web/service-worker`, registered by
 * the page): the models stay loaded across the site's pages and tabs, so a page that asks for a model
 * the worker holds gets it at once. `keepAliveMs` (default 10 s) pings the worker so the browser keeps it
 * while a page is open; where the browser stopped it anyway, the next call loads the models again.
 *
 * @param {{model_list: object[]}} appConfig
 * @param {string | string[]} modelId
 * @param {EngineOptions & {keepAliveMs?: number, serviceWorker?: ServiceWorker}} [options]
 */
export async function createServiceWorkerEngine(appConfig, modelId, options = {}) {
  const { keepAliveMs = 10_000, onError = () => {}, onProgress } = options;
  const container = globalThis.navigator?.serviceWorker;
  if (!container) throw new EngineError("bad-request", "This page has no service workers (an insecure origin, or a private window).");
  const serviceWorker = options.serviceWorker ?? (await container.ready).active;
  const connection = new ServiceWorkerConnection(serviceWorker, container, keepAliveMs, onError);
  return loaded(new EngineClient(connection, appConfig, options), modelId, onProgress);
}

/**
 * The engine in an MV3 extension's service worker (its background script imports
 * `kiln-web/extension-service-worker`), for the extension's pages, popup and side panel.
 *
 * @param {{model_list: object[]}} appConfig
 * @param {string | string[]} modelId
 * @param {EngineOptions & {keepAliveMs?: number, portName?: string}} [options] `portName`: the name the
 *   worker's host listens for (engine-host.js EXTENSION_PORT)
 */
export async function createExtensionEngine(appConfig, modelId, options = {}) {
  const { keepAliveMs = 10_000, onError = () => {}, onProgress, portName = EXTENSION_PORT } = options;
  const runtime = globalThis.chrome?.runtime;
  if (!runtime?.connect) throw new EngineError("bad-request", "createExtensionEngine runs in a page of a Chrome extension.");
  const connection = new ExtensionConnection(runtime, portName, keepAliveMs, onError);
  return loaded(new EngineClient(connection, appConfig, options), modelId, onProgress);
}
