// The worker side of the engine: the models one worker holds, by id, and the answers to the page's
// calls. A call is {id, method, params}; it is answered by {id, kind: "event" | "result" | "error"}.
// A model's failure outside a call (its GPU device lost) goes out as {kind: "fatal", model, error}.
//
// The same host serves a dedicated Web Worker, a service worker and an extension's service worker
// (`serveEngine*` below); only the way messages travel differs.
import { EngineError, asEngineError } from "./errors.js";

const MiB = 2 ** 20;
const mib = (bytes) => `${Math.round(bytes / MiB)} MiB`;

/** What a model needs on the library chosen for it (kiln/model_memory.py, in the app config), 0 when unknown. */
function accountedBytes({ record, library }) {
  return record.kiln?.memory_bytes?.[library] ?? (record.vram_required_MB ?? 0) * MiB;
}

/**
 * The memory the models of one engine may take together: `memoryBudget` when given, else half the
 * device's memory where the browser tells it (`navigator.deviceMemory`, GiB, at most 8), else no limit.
 * @param {number | null | undefined} memoryBudget
 * @param {{deviceMemory?: number} | undefined} [navigator]
 */
export function memoryBudgetFor(memoryBudget, navigator = /** @type {any} */ (globalThis.navigator)) {
  if (memoryBudget !== undefined && memoryBudget !== null) {
    if (!(Number.isFinite(memoryBudget) && memoryBudget > 0)) {
      throw new EngineError("bad-request", `memoryBudget must be a positive number of bytes, not ${JSON.stringify(memoryBudget)}`);
    }
    return memoryBudget;
  }
  return navigator?.deviceMemory ? navigator.deviceMemory * 2 ** 30 / 2 : Infinity;
}

/** The load options that make one loaded model the same as another: a load asking for the same reuses it. */
function loadKey({ appConfig, modelId, device, library, threads, shaders, speculative }) {
  const record = appConfig?.model_list?.find((entry) => entry.model_id === modelId) ?? null;
  return JSON.stringify({ record, device, library, threads, shaders, speculative });
}

export class EngineHost {
  /**
   * `loadEngine({appConfig, modelId, …, admit, onProgress, onFatal})` loads one model (Engine.load);
   * `broadcast(message)` sends a message about no call to every page connected.
   */
  constructor(loadEngine, broadcast) {
    this.loadEngine = loadEngine;
    this.broadcast = broadcast;
    this.models = new Map(); // the requested model id → {engine, key, accounted}
    // A Map, so that a message naming `constructor`, `__proto__` or `toString` finds no method.
    this.methods = new Map(Object.entries({
      load: (params, emit) => this.load(params, emit),
      unload: ({ model }) => this.unload(model),
      models: () => this.loadedModels(),
      chatCompletion: ({ request }, emit) => this.engineFor(request?.model).chatCompletion(request, emit),
      embeddings: ({ request }) => this.engineFor(request?.model).embeddings(request),
      interrupt: ({ model }) => this.engineFor(model).interrupt(),
      resetChat: ({ model }) => this.engineFor(model).resetChat(),
      stats: ({ model }) => this.engineFor(model).stats(),
      encode: ({ model, text }) => this.engineFor(model).encode(text),
      encodeText: ({ model, text }) => this.engineFor(model).encodeText(text),
      decodeText: ({ model, ids }) => this.engineFor(model).decodeText(ids),
      encodeChat: ({ model, messages }) => this.engineFor(model).encodeChat(messages),
      prefill: ({ model, ids, options }) => this.engineFor(model).prefill(ids, options),
      decode: ({ model, id, options }) => this.engineFor(model).decode(id, options),
      generate: ({ model, ids, request }) => this.engineFor(model).generateTokens(ids, request),
      timePrefill: ({ model, ids, options }) => this.engineFor(model).timePrefill(ids, options),
      timeEmbeddings: ({ model, request }) => this.engineFor(model).timeEmbeddings(request),
      timeDecode: ({ model, id, options }) => this.engineFor(model).timeDecode(id, options),
      allLogits: ({ model, ids, options }) => this.engineFor(model).allLogits(ids, options),
      rollback: ({ model, count }) => this.engineFor(model).rollback(count),
      cachedTokenIds: ({ model }) => this.engineFor(model).cachedTokenIds(),
    }));
  }

  /** Answer one call; `reply(message)` sends a message back to its caller. Resolves when the call is answered. */
  async answer({ id, method, params }, reply) {
    const emit = (event) => reply({ id, kind: "event", data: event });
    try {
      const handler = this.methods.get(method);
      if (!handler) throw new EngineError("bad-request", `unknown method ${JSON.stringify(method)}`);
      reply({ id, kind: "result", data: await handler(params ?? {}, emit) });
    } catch (error) {
      reply({ id, kind: "error", error: asEngineError(error).toJSON() });
    }
  }

  /**
   * Load `params.modelId` beside the models held. A model loaded already with the same options is
   * kept as it is (a second page of a service worker's site gets it at once: `reused: true`); with
   * other options it is loaded again. A model that would take the engine past its memory budget is
   * refused before anything downloads.
   */
  async load(params, emit) {
    const { modelId, memoryBudget } = params;
    const key = loadKey(params);
    const held = this.models.get(modelId);
    if (held?.key === key && !held.engine.failure && !held.engine.disposed) return { ...held.engine.stats(), reused: true };
    this.unload(modelId);
    const budget = memoryBudgetFor(memoryBudget);
    let accounted = 0;
    const engine = await this.loadEngine({
      ...params, library: params.library ?? null, onProgress: emit,
      admit: (choice) => {
        accounted = accountedBytes(choice);
        this.checkFits(choice.record.model_id, accounted, budget);
      },
      onFatal: (error) => this.broadcast({ kind: "fatal", model: modelId, error: error.toJSON() }),
    });
    this.models.set(modelId, { engine, key, accounted });
    return { ...engine.stats(), reused: false };
  }

  checkFits(modelId, needed, budget) {
    const held = [...this.models.entries()];
    const inUse = held.reduce((total, [, { accounted }]) => total + accounted, 0);
    if (inUse + needed <= budget) return;
    const holding = held.map(([id, { accounted }]) => `${id} (${mib(accounted)})`).join(", ");
    throw new EngineError("out-of-memory", `${modelId} needs about ${mib(needed)}, which does not fit the engine's ` +
      `memory budget of ${mib(budget)}` + (holding ? ` beside ${holding}` : "") +
      ". Unload a model, or give the engine a larger memoryBudget.");
  }

  /** Unload `modelId`, or every model when it is null or undefined. */
  unload(modelId) {
    const ids = modelId === undefined || modelId === null ? [...this.models.keys()] : [modelId];
    for (const id of ids) {
      this.models.get(id)?.engine.dispose();
      this.models.delete(id);
    }
  }

  loadedModels() {
    return [...this.models.entries()].map(([id, { engine, accounted }]) => ({
      id, model_id: engine.record.model_id, backend: engine.backend, kind: engine.stats().kind, accounted_bytes: accounted,
    }));
  }

  /**
   * The engine a call addresses: the model named (by the id it was loaded under or its record's),
   * else the only one held; naming none while several are held is an error, as in WebLLM.
   */
  engineFor(model) {
    const held = [...this.models.entries()];
    const names = held.map(([id]) => id).join(", ");
    if (model !== undefined && model !== null) {
      const found = held.find(([id, { engine }]) => id === model || engine.record.model_id === model);
      if (!found) {
        throw new EngineError("not-loaded", `The model ${JSON.stringify(model)} is not loaded` +
          (held.length ? ` (this engine holds ${names}).` : "."));
      }
      return found[1].engine;
    }
    if (held.length === 0) throw new EngineError("not-loaded", "The model is not loaded.");
    if (held.length > 1) {
      throw new EngineError("bad-request", `This engine holds several models (${names}): name one in the request's \`model\`.`);
    }
    return held[0][1].engine;
  }
}

/** A dedicated Web Worker's engine: calls arrive on `scope` (the worker's global) and are answered there. */
export function serveEngine(scope, loadEngine) {
  const post = (message) => scope.postMessage(message);
  const host = new EngineHost(loadEngine, post);
  scope.onmessage = ({ data }) => host.answer(data, post);
  return host;
}

/**
 * A service worker's engine (`scope` its global): each call comes as a message with a MessagePort for
 * its answers, and keeps the worker alive until answered (`waitUntil`). A ping answers with this
 * worker instance's id, so that a page sees when the browser stopped the worker and started it
 * again (the models are gone then). Must run when the worker script is evaluated, not in an event.
 */
export function serveEngineInServiceWorker(scope, loadEngine) {
  const instance = crypto.randomUUID();
  const broadcast = async (message) => {
    for (const client of await scope.clients.matchAll({ includeUncontrolled: true })) client.postMessage({ kiln: message });
  };
  const host = new EngineHost(loadEngine, broadcast);
  scope.addEventListener("message", (event) => {
    const call = event.data?.kilnCall;
    const port = event.ports?.[0];
    if (!call || !port) return;
    const reply = (message) => port.postMessage(message);
    if (call.method === "ping") {
      reply({ id: call.id, kind: "result", data: { instance } });
      return;
    }
    event.waitUntil(host.answer(call, reply));
  });
  return host;
}

/**
 * An MV3 extension's engine, in its service worker: `runtime` is `chrome.runtime`; pages of the
 * extension connect a port (`chrome.runtime.connect({name: EXTENSION_PORT})`) and call over it.
 */
export const EXTENSION_PORT = "kiln-engine";
export function serveEngineInExtension(runtime, loadEngine) {
  const ports = new Set();
  const broadcast = (message) => {
    for (const port of ports) port.postMessage(message);
  };
  const host = new EngineHost(loadEngine, broadcast);
  runtime.onConnect.addListener((port) => {
    if (port.name !== EXTENSION_PORT) return;
    ports.add(port);
    port.onDisconnect.addListener(() => ports.delete(port));
    port.onMessage.addListener((call) => host.answer(call, (message) => {
      if (ports.has(port)) port.postMessage(message);
    }));
  });
  return host;
}
