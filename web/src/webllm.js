// WebLLM's entry points over Kiln's engine (`kiln-web/webllm`): an app written for @mlc-ai/web-llm
// runs on Kiln's engine and Kiln's models by changing its import. The page's side is in
// webllm-engine.js; the workers' side (WebLLM's handlers) is here, on the bundled runtime.
import { EngineError } from "./errors.js";
import { EngineHost, serveEngineInServiceWorker } from "./engine-host.js";
import { loadEngine } from "./bundle-runtime.js";

export * from "./webllm-engine.js";

/** WebLLM's worker side of CreateWebWorkerMLCEngine: `self.onmessage = (message) => handler.onmessage(message)`. */
export class WebWorkerMLCEngineHandler {
  constructor() {
    const post = (message) => self.postMessage(message);
    this.host = new EngineHost(loadEngine, post);
    this.post = post;
  }

  onmessage(event) {
    return this.host.answer(event.data, this.post);
  }
}

// A service worker's message listener must be added while its script is first evaluated, and the
// browser does not run `activate` again when it restarts a stopped worker: WebLLM's examples make the
// handler in `activate`, so the engine listens from the moment this module is evaluated in a
// service worker, and the handler is a name for it.
const inServiceWorker = globalThis.ServiceWorkerGlobalScope !== undefined && self instanceof globalThis.ServiceWorkerGlobalScope;
const serviceWorkerHost = inServiceWorker && !globalThis.chrome?.runtime?.id ? serveEngineInServiceWorker(self, loadEngine) : null;

/** WebLLM's worker side of CreateServiceWorkerMLCEngine (the engine serves from the module's evaluation). */
export class ServiceWorkerMLCEngineHandler {
  constructor() {
    if (!serviceWorkerHost) throw new EngineError("bad-request", "ServiceWorkerMLCEngineHandler runs in a site's service worker.");
    this.host = serviceWorkerHost;
  }
}

/** WebLLM's worker side of CreateExtensionServiceWorkerMLCEngine: made with the first port, `setPort` for the next. */
export class ExtensionServiceWorkerMLCEngineHandler {
  constructor(port) {
    this.host = new EngineHost(loadEngine, (message) => this.port?.postMessage(message));
    this.setPort(port);
  }

  setPort(port) {
    this.port = port;
    port.onDisconnect?.addListener(() => {
      if (this.port === port) this.port = null;
    });
  }

  onmessage(call) {
    const port = this.port;
    return this.host.answer(call, (answer) => port?.postMessage(answer));
  }
}
