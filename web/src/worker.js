// The engine's Web Worker. tvmjs and the tokenizers ship as UMD bundles: imported for their
// side effect, they define `globalThis.tvmjs` and `globalThis.tokenizers`.
import "../node_modules/@mlc-ai/web-runtime/lib/index.js";
import "../node_modules/@mlc-ai/web-tokenizers/lib/index.js";
import { Engine } from "./engine.js";
import { serveEngine } from "./engine-host.js";

// XGrammar (1.1 MB, for response formats) is imported the first time a request asks for a format.
// It defines `globalThis.xgrammar` too; importing it again under another URL evaluates the bundle
// again, and so gives a fresh wasm instance (see structured.js for why one is needed).
const XGRAMMAR_URL = new URL("../node_modules/@mlc-ai/web-xgrammar/lib/index.js", import.meta.url);
let xgrammarInstances = 0;
async function loadXgrammar({ fresh = false } = {}) {
  if (fresh || xgrammarInstances === 0) await import(`${XGRAMMAR_URL}?instance=${++xgrammarInstances}`);
  return globalThis.xgrammar;
}

// @huggingface/jinja (an ES module, 115 KB) renders chat templates for requests with tools; imported on the first one.
const loadJinja = () => import("../node_modules/@huggingface/jinja/dist/index.js");

const runtime = { tvmjs: globalThis.tvmjs, tokenizers: globalThis.tokenizers, loadXgrammar, loadJinja };
serveEngine(self, (options) => Engine.load({ ...options, runtime }));
