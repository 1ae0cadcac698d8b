// The engine in the site's service worker, for bundlers (the package's `kiln-web/service-worker`): a
// service worker module that imports it serves `createServiceWorkerEngine` to every page of its origin.
import { loadEngine } from "./bundle-runtime.js";
import { serveEngineInServiceWorker } from "./engine-host.js";

serveEngineInServiceWorker(self, loadEngine);
