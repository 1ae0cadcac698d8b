// The engine's Web Worker. tvmjs and the tokenizers ship as UMD bundles: imported for their
// side effect, they define `globalThis.tvmjs` and `globalThis.tokenizers`.
import "../node_modules/@mlc-ai/web-runtime/lib/index.js";
import "../node_modules/@mlc-ai/web-tokenizers/lib/index.js";
import { Engine } from "./engine.js";
import { serveEngine } from "./protocol.js";

const runtime = { tvmjs: globalThis.tvmjs, tokenizers: globalThis.tokenizers };
serveEngine(self, (options) => Engine.load({ ...options, runtime }));
