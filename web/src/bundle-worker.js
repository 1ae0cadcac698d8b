// The engine's Web Worker for bundlers (the package's `kiln-web/worker`). It imports its npm packages
// by name; worker.js, which `kiln serve` serves unbundled, imports them by their paths in node_modules.
//
// tvmjs, the tokenizers and XGrammar are UMD bundles. A bundler that takes one for CommonJS hands over
// its exports (esbuild does so for @mlc-ai/web-runtime); one that takes it for an ES module leaves them
// on globalThis, as a browser does.
import * as tvmjs from "@mlc-ai/web-runtime";
import * as tokenizers from "@mlc-ai/web-tokenizers";
import { Engine } from "./engine.js";
import { serveEngine } from "./protocol.js";

// A bundle evaluates XGrammar once, so a `fresh` instance is the same one: after a schema it rejects
// (see structured.js) it serves on, where worker.js starts a new instance.
async function loadXgrammar() {
  const xgrammar = await import("@mlc-ai/web-xgrammar");
  return globalThis.xgrammar ?? xgrammar;
}

const loadJinja = () => import("@huggingface/jinja");

const runtime = { tvmjs: globalThis.tvmjs ?? tvmjs, tokenizers: globalThis.tokenizers ?? tokenizers, loadXgrammar, loadJinja };
serveEngine(self, (options) => Engine.load({ ...options, runtime }));
