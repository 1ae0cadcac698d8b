// The engine's Web Worker for bundlers (the package's `kiln-web/worker`).
import { loadEngine } from "./bundle-runtime.js";
import { serveEngine } from "./engine-host.js";

serveEngine(self, loadEngine);
