// Kiln's browser engine: `createEngine(appConfig, modelId, options)` runs a Kiln-compiled model in
// a Web Worker (WebGPU, else CPU wasm) behind an OpenAI-shaped chat API.
export { createEngine } from "./protocol.js";
export { EngineError, ERROR_CODES } from "./errors.js";
