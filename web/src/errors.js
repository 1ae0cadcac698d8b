// Errors the engine reports to its user: a stable `code` and a message a person can act on.
// They cross the worker boundary as {code, message} and become EngineErrors again on the page.

export const ERROR_CODES = [
  "bad-request",      // the caller passed something invalid
  "bad-response-format", // response_format is malformed, or XGrammar rejects its schema or grammar
  "no-chat-template", // a chat request to a model without a chat template (a base model)
  "no-tool-support",  // tools offered to a model whose chat template does not render them
  "busy",             // a generation is already running
  "model-not-found",  // the model id is not in the app config
  "no-webgpu",        // no WebGPU adapter and no CPU (wasm) library to fall back to
  "unsupported-gpu",  // the adapter lacks a feature or limit the model needs
  "device-lost",      // the GPU device went away (driver reset, out of memory, tab in background)
  "out-of-memory",    // GPU or wasm memory could not be allocated
  "quota-exceeded",   // browser storage cannot hold the model
  "network",          // a model file could not be downloaded
  "integrity",        // a model file does not match its SHA-256 in kiln-build.json, or has none there
  "bad-model",        // the model's files are inconsistent
  "incompatible-model", // the model was built by another Kiln major.minor or TVM series (see loader.js)
  "not-loaded",       // the engine was used before loading finished or after it failed
  "internal",         // anything else; the message carries the original error
  "context-window-exceeded", // the conversation no longer fits the model's context window: start a new chat
];

export class EngineError extends Error {
  constructor(code, message) {
    super(message);
    this.name = "EngineError";
    this.code = ERROR_CODES.includes(code) ? code : "internal";
  }

  toJSON() {
    return { code: this.code, message: this.message };
  }

  static fromJSON({ code, message }) {
    return new EngineError(code, message);
  }
}

const OUT_OF_MEMORY_PATTERNS = [/out of memory/i, /allocation failed/i, /memory\.grow/i, /Maximum memory size/i,
  /Cannot allocate/i];

/** Turn anything thrown into an EngineError, recognising out-of-memory failures. */
export function asEngineError(error) {
  if (error instanceof EngineError) return error;
  const message = String(error?.message ?? error);
  if (OUT_OF_MEMORY_PATTERNS.some((pattern) => pattern.test(message))) {
    return new EngineError("out-of-memory",
      `Out of memory: ${message}. Close other tabs or pick a smaller model, then reload the page.`);
  }
  return new EngineError("internal", message);
}
