// The engine in an MV3 extension's service worker, for bundlers (the package's
// `kiln-web/extension-service-worker`): the extension's pages reach it with `createExtensionEngine`.
import { loadEngine } from "./bundle-runtime.js";
import { serveEngineInExtension } from "./engine-host.js";

serveEngineInExtension(globalThis.chrome.runtime, loadEngine);
