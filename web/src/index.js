// Kiln's browser engine: `createEngine(appConfig, modelId, options)` runs Kiln-compiled models in
// a Web Worker (WebGPU, else CPU wasm) behind an OpenAI-shaped chat API; `createServiceWorkerEngine`
// and `createExtensionEngine` run them in the site's or an extension's service worker.
export { createEngine, createExtensionEngine, createServiceWorkerEngine } from "./protocol.js";
export { EngineError, ERROR_CODES } from "./errors.js";
