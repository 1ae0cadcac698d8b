// ESLint for the web package: `npx eslint .` here, run by `make lint` (and so by `make test`).
import js from "@eslint/js";

// Globals are listed by hand rather than taken whole from a browser preset, whose names such as
// `name`, `status` or `event` would hide a missing declaration. ECMAScript's own (Atomics,
// SharedArrayBuffer, globalThis, …) come with `ecmaVersion`.
const readonly = (names) => Object.fromEntries(names.map((name) => [name, "readonly"]));

// The engine runs in a page and in its Web Worker (or a service worker); the harness is a page.
const WEB = readonly([
  "self", "navigator", "location", "document", "console", "performance", "crypto",
  "fetch", "Response", "caches", "URL", "URLSearchParams", "TextEncoder", "TextDecoder",
  "Worker", "MessageChannel", "WebAssembly", "setTimeout", "clearTimeout", "setInterval", "clearInterval",
  "GPUBufferUsage", "GPUMapMode", "ReadableStream",
]);

// tools/ are Node scripts, and so is this file.
const NODE = readonly([
  "process", "console", "Buffer", "URL", "TextEncoder", "TextDecoder", "WebAssembly", "setTimeout", "clearTimeout",
  "performance",
]);

export default [
  {
    files: ["src/**/*.js", "harness/**/*.js", "tools/**/*.mjs", "eslint.config.js"],
    ...js.configs.recommended,
    languageOptions: { ecmaVersion: 2022, sourceType: "module" },
  },
  { files: ["src/**/*.js", "harness/**/*.js"], languageOptions: { globals: WEB } },
  { files: ["tools/**/*.mjs", "eslint.config.js"], languageOptions: { globals: NODE } },
];
