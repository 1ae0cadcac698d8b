// WebLLM's entry points over Kiln's engine (`kiln-web/webllm`): an app written for @mlc-ai/web-llm
// runs on Kiln's engine and Kiln's models by changing its import. This is the part of WebLLM's
// `MLCEngineInterface` chat apps use, with WebLLM's names and option names where they mean the same
// thing, and WebLLM's handlers for the workers; web/README.md ("WebLLM's entry points") lists what differs.
import { loadEngine } from "./bundle-runtime.js";
import { EngineHost, serveEngineInServiceWorker } from "./engine-host.js";
import { EngineError } from "./errors.js";
import { createEngine, createExtensionEngine, createServiceWorkerEngine } from "./protocol.js";

/** WebLLM's port name between an extension's pages and its service worker. */
const WEBLLM_EXTENSION_PORT = "web_llm_service_worker";
// ChatOptions that set a request's defaults; the others are fixed when Kiln compiles the model.
const SAMPLING_OPTIONS = ["temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"];

/**
 * Without `engineConfig.appConfig`, the models `kiln serve` hosts on the page's origin (WebLLM's
 * default, its prebuilt list on Hugging Face, holds no Kiln builds).
 */
async function appConfigOf(engineConfig) {
  if (engineConfig.appConfig) return engineConfig.appConfig;
  const url = new URL("/api/app-config.json", globalThis.location?.href);
  const response = await fetch(url);
  if (!response.ok) {
    throw new EngineError("model-not-found", `No appConfig was given and ${url} answered ${response.status}: ` +
      "pass engineConfig.appConfig (WebLLM's format), or serve the page with `kiln serve`.");
  }
  return response.json();
}

/** WebLLM's InitProgressReport ({progress, timeElapsed, text}) from Kiln's load progress. */
const progressReporter = (callback, started) => (/** @type {{fraction?: number, text: string}} */ { fraction, text }) =>
  callback?.({ progress: fraction ?? 0, timeElapsed: (performance.now() - started) / 1000, text });

/** ChatOptions as request defaults; the options Kiln fixes at compile time are named in a warning. */
function requestDefaults(chatOpts = {}) {
  const fixed = Object.keys(chatOpts).filter((name) => !SAMPLING_OPTIONS.includes(name));
  if (fixed.length) console.warn(`kiln-web/webllm: ${fixed.join(", ")} are fixed when Kiln compiles the model; ignored`);
  return Object.fromEntries(SAMPLING_OPTIONS.filter((name) => chatOpts[name] !== undefined).map((name) => [name, chatOpts[name]]));
}

/**
 * An engine with WebLLM's interface; `start(appConfig, modelIds, options)` makes the Kiln engine
 * it runs on (a dedicated worker, the site's service worker or an extension's).
 */
export class MLCEngine {
  /** @param {object} [engineConfig] WebLLM's MLCEngineConfig: appConfig, initProgressCallback, logLevel */
  constructor(engineConfig = {}, start = createEngine) {
    this.engineConfig = { ...engineConfig };
    this.start = start;
    this.engine = null;
    this.modelIds = [];
    this.defaults = new Map(); // model id → the request defaults of its ChatOptions
    this.messages = new Map(); // model id → the text of its last reply
    this.usages = new Map(); // model id → the usage of its last reply
    this.chat = { completions: { create: (request) => this.chatCompletion(request) } };
    this.embeddings = { create: (request) => this.embedding(request) };
  }

  setInitProgressCallback(callback) {
    this.engineConfig.initProgressCallback = callback;
  }

  getInitProgressCallback() {
    return this.engineConfig.initProgressCallback;
  }

  setAppConfig(appConfig) {
    this.engineConfig.appConfig = appConfig;
  }

  setLogLevel(logLevel) {
    this.engineConfig.logLevel = logLevel;
  }

  /**
   * Load `modelId` (or a list of them) with `chatOpts` (one per model for a list), unloading the models
   * this engine loaded before that are not asked for again. A model the engine's worker holds already
   * is not loaded again (a service worker's, from another page of the site).
   */
  async reload(modelId, chatOpts) {
    const modelIds = [modelId].flat();
    const optionsList = [chatOpts ?? {}].flat();
    modelIds.forEach((id, index) => this.defaults.set(id, requestDefaults(optionsList[index] ?? optionsList[0])));
    const onProgress = progressReporter(this.engineConfig.initProgressCallback, performance.now());
    if (this.engine === null) {
      this.engine = await this.start(await appConfigOf(this.engineConfig), modelIds, { onProgress });
    } else {
      for (const id of modelIds) await this.engine.load(id, { onProgress });
      for (const id of this.modelIds.filter((held) => !modelIds.includes(held))) await this.engine.unload(id);
    }
    this.modelIds = modelIds;
  }

  loaded() {
    if (this.engine === null) throw new EngineError("not-loaded", "No model is loaded: call reload(modelId) first.");
    return this.engine;
  }

  /** The model a request or call names, else the only one loaded (WebLLM's rule). */
  modelFor(model) {
    if (model !== undefined && model !== null) return model;
    if (this.modelIds.length === 1) return this.modelIds[0];
    throw new EngineError("bad-request", `Several models are loaded (${this.modelIds.join(", ")}): name one.`);
  }

  async chatCompletion(request) {
    const model = this.modelFor(request.model);
    const completion = await this.loaded().chat.completions.create({ ...this.defaults.get(model), ...request, model });
    if (!request.stream) {
      this.remember(model, completion.choices[0]?.message?.content ?? "", completion.usage);
      return completion;
    }
    return this.remembered(model, completion);
  }

  /** Pass a stream's chunks on, keeping its text and usage for getMessage and runtimeStatsText. */
  async* remembered(model, chunks) {
    let text = "";
    for await (const chunk of chunks) {
      text += chunk.choices[0]?.delta?.content ?? "";
      if (chunk.usage) this.remember(model, text, chunk.usage);
      yield chunk;
    }
  }

  remember(model, text, usage) {
    this.messages.set(model, text);
    this.usages.set(model, usage);
  }

  embedding(request) {
    return this.loaded().embeddings.create({ ...request, model: this.modelFor(request.model) });
  }

  /** The text of the last reply of `modelId`. */
  async getMessage(modelId) {
    return this.messages.get(this.modelFor(modelId)) ?? "";
  }

  /** The last reply's speeds, as WebLLM words them. */
  async runtimeStatsText(modelId) {
    const extra = this.usages.get(this.modelFor(modelId))?.extra;
    if (!extra) return "prefill: 0.0000 tokens/sec, decoding: 0.0000 tokens/sec";
    return `prefill: ${extra.prefill_tokens_per_s.toFixed(4)} tokens/sec, ` +
      `decoding: ${(extra.decode_tokens_per_s ?? 0).toFixed(4)} tokens/sec`;
  }

  async interruptGenerate() {
    if (this.engine) await Promise.all(this.modelIds.map((id) => this.engine.interrupt(id)));
  }

  /** Forget the conversation (`keepStats` keeps getMessage's and runtimeStatsText's). */
  async resetChat(keepStats = false, modelId) {
    const model = this.modelFor(modelId);
    await this.loaded().resetChat(model);
    if (!keepStats) {
      this.messages.delete(model);
      this.usages.delete(model);
    }
  }

  async unload() {
    await this.engine?.unload();
    this.engine = null;
    this.modelIds = [];
  }
}

/** WebLLM's CreateMLCEngine: the engine in a dedicated worker (Kiln's `kiln-web/worker`, bundled as worker.js beside the page). */
export async function CreateMLCEngine(modelId, engineConfig, chatOpts) {
  const engine = new MLCEngine(engineConfig);
  await engine.reload(modelId, chatOpts);
  return engine;
}

/** WebLLM's CreateWebWorkerMLCEngine: the engine in `worker`, a worker running WebWorkerMLCEngineHandler. */
export async function CreateWebWorkerMLCEngine(worker, modelId, engineConfig, chatOpts) {
  const engine = new MLCEngine(engineConfig, (appConfig, ids, options) => createEngine(appConfig, ids, { ...options, worker }));
  await engine.reload(modelId, chatOpts);
  return engine;
}

/**
 * WebLLM's CreateServiceWorkerMLCEngine: the engine in the site's service worker (registered by the
 * page; it runs ServiceWorkerMLCEngineHandler), pinged every `keepAliveMs`.
 */
export async function CreateServiceWorkerMLCEngine(modelId, engineConfig, chatOpts, keepAliveMs = 10_000) {
  const engine = new MLCEngine(engineConfig, (appConfig, ids, options) =>
    createServiceWorkerEngine(appConfig, ids, { ...options, keepAliveMs }));
  await engine.reload(modelId, chatOpts);
  return engine;
}

/** WebLLM's CreateExtensionServiceWorkerMLCEngine: the engine in the extension's service worker. */
export async function CreateExtensionServiceWorkerMLCEngine(modelId, engineConfig, chatOpts, keepAliveMs = 10_000) {
  const engine = new MLCEngine(engineConfig, (appConfig, ids, options) =>
    createExtensionEngine(appConfig, ids, { ...options, keepAliveMs, portName: WEBLLM_EXTENSION_PORT }));
  await engine.reload(modelId, chatOpts);
  return engine;
}

/** WebLLM's worker side of CreateWebWorkerMLCEngine: `self.onmessage = (message) => handler.onmessage(message)`. */
export class WebWorkerMLCEngineHandler {
  constructor() {
    const post = (message) => self.postMessage(message);
    this.host = new EngineHost(loadEngine, post);
    this.post = post;
  }

  onmessage(event) {
    return this.host.answer(event.data, this.post);
  }
}

// A service worker's message listener must be added while its script is first evaluated, and the
// browser does not run `activate` again when it restarts a stopped worker: WebLLM's examples make the
// handler in `activate`, so the engine listens from the moment this module is evaluated in a
// service worker, and the handler is a name for it.
const inServiceWorker = globalThis.ServiceWorkerGlobalScope !== undefined && self instanceof globalThis.ServiceWorkerGlobalScope;
const serviceWorkerHost = inServiceWorker && !globalThis.chrome?.runtime?.id ? serveEngineInServiceWorker(self, loadEngine) : null;

/** WebLLM's worker side of CreateServiceWorkerMLCEngine (the engine serves from the module's evaluation). */
export class ServiceWorkerMLCEngineHandler {
  constructor() {
    if (!serviceWorkerHost) throw new EngineError("bad-request", "ServiceWorkerMLCEngineHandler runs in a site's service worker.");
    this.host = serviceWorkerHost;
  }
}

/** WebLLM's worker side of CreateExtensionServiceWorkerMLCEngine: made with the first port, `setPort` for the next. */
export class ExtensionServiceWorkerMLCEngineHandler {
  constructor(port) {
    this.host = new EngineHost(loadEngine, (message) => this.port?.postMessage(message));
    this.setPort(port);
  }

  setPort(port) {
    this.port = port;
    port.onDisconnect?.addListener(() => {
      if (this.port === port) this.port = null;
    });
  }

  onmessage(call) {
    const port = this.port;
    return this.host.answer(call, (answer) => port?.postMessage(answer));
  }
}
