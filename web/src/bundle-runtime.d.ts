// The types of bundle-runtime.js: the engine it loads is untyped JS (engine.js is not type-checked),
// so the modules that use it (webllm.js's handlers) are checked against this boundary instead.
export declare const runtime: {
  tvmjs: object;
  tokenizers: object;
  loadXgrammar: () => Promise<object>;
  loadJinja: () => Promise<object>;
};
/** Load one model for an engine host (engine-host.js) on the bundled runtime. */
export declare function loadEngine(options: object): Promise<any>;
