// What an engine worker built by a bundler runs on: its npm packages imported by name (worker.js,
// which `kiln serve` serves unbundled, imports them by their paths in node_modules).
//
// tvmjs, the tokenizers and XGrammar are UMD bundles. A bundler that takes one for CommonJS hands over
// its exports (esbuild does so for @mlc-ai/web-runtime); one that takes it for an ES module leaves them
// on globalThis, as a browser does.
import * as tvmjs from "@mlc-ai/web-runtime";
import * as tokenizers from "@mlc-ai/web-tokenizers";
import * as xgrammarModule from "@mlc-ai/web-xgrammar";
import * as jinja from "@huggingface/jinja";
import { Engine } from "./engine.js";

// A bundle evaluates XGrammar once, so a `fresh` instance is the same one: after a schema it rejects
// (see structured.js) it serves on, where worker.js starts a new instance. XGrammar and jinja are
// imported statically: a service worker may not import() a module.
const xgrammar = globalThis.xgrammar ?? xgrammarModule;

export const runtime = {
  tvmjs: globalThis.tvmjs ?? tvmjs,
  tokenizers: globalThis.tokenizers ?? tokenizers,
  loadXgrammar: async () => xgrammar,
  loadJinja: async () => jinja,
};

/** Load one model for an engine host (engine-host.js) on the bundled runtime. */
export const loadEngine = (options) => Engine.load({ ...options, runtime });
