// The CPU wasm library on several threads (docs/wasm-threads.md).
//
// Kiln links the `wasm` library on shared, imported memory with a thread pool behind TVM's parallel
// loops (kiln/compile/toolchain/kiln_threads.cc). Its helpers are Web Workers (wasm-thread.js), each an instance of
// the same module on the same memory. Shared memory needs a cross-origin isolated page (COOP/COEP,
// which `kiln serve` sends); elsewhere the engine clears the import's shared flag and runs the same
// file on one thread. A library without imported memory (WebGPU, older builds) loads as before.
import { EngineError } from "./errors.js";
import { useUnsignedAddresses } from "./wasm-memory.js";

const MEMORY_IMPORT = 2;
const SHARED_LIMITS = 0x02;
const IMPORT_SECTION = 2;
// The imports emscripten's JS glue would answer for a threaded build; the library runs without it.
const MAIN_THREAD_SETUP = "__emscripten_init_main_thread_js";
const QUIET_IMPORTS = ["emscripten_unwind_to_js_event_loop", "emscripten_check_blocking_allowed"];
const HELPER_START_MS = 10_000;
// More threads than this gain little on a 135M-1.5B model and cost phones their efficiency cores.
const DEFAULT_MAX_THREADS = 4;
const MAX_THREADS = 16; // the pool's helpers (KILN_MAX_HELPERS in kiln/compile/toolchain/kiln_threads.cc) and the caller
const PAGE_BYTES = 1 << 16;
const WASM32_PAGES = 1 << 16; // 4 GiB

function readLEB(bytes, offset) {
  let value = 0;
  let shift = 0;
  for (;;) {
    const byte = bytes[offset++];
    value += (byte & 0x7f) * 2 ** shift;
    shift += 7;
    if ((byte & 0x80) === 0) return [value, offset];
  }
}

function skipName(bytes, offset) {
  const [length, start] = readLEB(bytes, offset);
  return start + length;
}

/**
 * The library's imported memory as {initial, maximum, shared} in 64 KiB pages, plus `flagsOffset`
 * (the byte that says shared), or null for a library that exports its memory.
 */
export function importedMemory(bytes) {
  let offset = 8; // magic and version
  while (offset < bytes.length) {
    const id = bytes[offset];
    const [size, start] = readLEB(bytes, offset + 1);
    if (id === IMPORT_SECTION) {
      let [count, at] = readLEB(bytes, start);
      for (; count > 0; --count) {
        at = skipName(bytes, skipName(bytes, at));
        const kind = bytes[at++];
        if (kind === MEMORY_IMPORT) {
          const flagsOffset = at;
          const flags = bytes[at++];
          let initial;
          let maximum;
          [initial, at] = readLEB(bytes, at);
          if (flags & 0x01) [maximum] = readLEB(bytes, at);
          return { initial, maximum, shared: (flags & SHARED_LIMITS) !== 0, flagsOffset };
        }
        at = skipImportDescription(bytes, kind, at);
      }
      return null;
    }
    offset = start + size;
  }
  return null;
}

function skipImportDescription(bytes, kind, at) {
  if (kind === 0) return readLEB(bytes, at)[1]; // function: a type index
  if (kind === 1) { // table: element type and limits
    const flags = bytes[at + 1];
    at = readLEB(bytes, at + 2)[1];
    return flags & 0x01 ? readLEB(bytes, at)[1] : at;
  }
  if (kind === 3) return at + 2; // global: value type and mutability
  throw new Error(`the library imports something of unknown kind ${kind}`);
}

/** How many threads a page can give the library: 1 unless it is cross-origin isolated and in a worker. */
export function availableThreads(requested) {
  const isolated = globalThis.crossOriginIsolated === true && typeof SharedArrayBuffer !== "undefined";
  // The calling thread waits for its helpers (memory.atomic.wait32), which a page's main thread may not.
  const inWorker = globalThis.WorkerGlobalScope !== undefined && globalThis instanceof globalThis.WorkerGlobalScope;
  if (!isolated || !inWorker) return 1;
  const wanted = Math.floor(requested ?? Math.min(navigator.hardwareConcurrency || 1, DEFAULT_MAX_THREADS));
  return Number.isFinite(wanted) ? Math.min(Math.max(1, wanted), MAX_THREADS) : 1;
}

/**
 * Instantiate a model library with tvmjs. For a threaded library, start up to `threads` - 1 helpers
 * (when the page allows threads). A library that imports its memory gets the first of `maximumBytes`
 * (capped at what it declares: wasm32's 4 GiB) that the browser can reserve: a browser reserves
 * shared memory's maximum up front, which a 32-bit one cannot do for 4 GiB, so the engine offers the
 * model's own needs next. Returns {tvm, threads, maximumBytes, stop}: `threads` counts the calling
 * one, `maximumBytes` is the memory's maximum (null for a library that exports its memory).
 */
export async function instantiateLibrary(tvmjs, bytes, { threads = 1, log = () => {}, maximumBytes = [Infinity] } = {}) {
  const wasi = tvmjs.createPolyfillWASI();
  const memorySpec = importedMemory(bytes);
  if (memorySpec === null) {
    return { tvm: instantiated(await tvmjs.instantiate(bytes, wasi, log)), threads: 1, maximumBytes: null, stop() {} };
  }
  const shared = memorySpec.shared && threads > 1;
  if (memorySpec.shared && !shared) {
    bytes = new Uint8Array(bytes); // a copy (a Node Buffer's slice would share its bytes)
    bytes[memorySpec.flagsOffset] &= ~SHARED_LIMITS;
  }
  const memory = reserveMemory(memorySpec, shared, maximumBytes);
  let exports = null;
  wasi.imports.env = {
    ...wasi.imports.env,
    memory,
    [MAIN_THREAD_SETUP]: (thread) => exports.kiln_threads_adopt_main_thread(thread),
    ...Object.fromEntries(QUIET_IMPORTS.map((name) => [name, () => {}])),
  };
  // tvmjs hands the instance to the WASI glue, which reads the memory from its exports.
  const startGlue = wasi.start;
  wasi.start = (instance) => {
    exports = instance.exports;
    startGlue({ exports: { ...instance.exports, memory } });
  };
  const tvm = instantiated(await tvmjs.instantiate(bytes, wasi, log));
  if (!shared) return { tvm, threads: 1, maximumBytes: memory.maximumBytes, stop() {} };

  const helpers = await startHelpers(bytes, memory, exports, threads - 1).catch((error) => {
    log(`${error.message}; the library runs on one thread`);
    return [];
  });
  return {
    tvm,
    threads: exports.kiln_threads_count(),
    maximumBytes: memory.maximumBytes,
    stop() {
      exports.kiln_threads_stop();
      helpers.forEach((worker) => worker.terminate());
    },
  };
}

/** The library's memory, with the first of `maximumBytes` the browser reserves; its maximum in `maximumBytes`. */
function reserveMemory(spec, shared, maximumBytes) {
  const declared = spec.maximum ?? WASM32_PAGES;
  const tried = [];
  for (const bytes of maximumBytes) {
    const maximum = Math.max(spec.initial, Math.min(declared, Math.ceil(bytes / PAGE_BYTES)));
    try {
      return Object.assign(new WebAssembly.Memory({ initial: spec.initial, maximum, shared }),
        { maximumBytes: maximum * PAGE_BYTES });
    } catch (error) {
      tried.push(`${maximum * PAGE_BYTES / 2 ** 20} MiB (${error.message})`);
    }
  }
  throw new EngineError("out-of-memory", `The browser could not reserve memory for the model's CPU library: ` +
    `${tried.join("; ")}. Close other tabs, or use a smaller model.`);
}

function instantiated(tvm) {
  useUnsignedAddresses(tvm);
  return tvm;
}

async function startHelpers(bytes, memory, exports, count) {
  const stackTops = exports.kiln_threads_reserve(count);
  if (stackTops === 0) throw new Error(`the library's thread pool could not reserve ${count} helpers`);
  const tops = new Uint32Array(memory.buffer, stackTops, count).slice();
  const module = await WebAssembly.compile(bytes);
  const url = new URL("./wasm-thread.js", import.meta.url);
  const helpers = [];
  const started = [];
  for (let index = 0; index < count; ++index) {
    const worker = new Worker(url, { type: "module", name: `kiln wasm thread ${index + 1}` });
    helpers.push(worker);
    started.push(new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`wasm thread ${index + 1} did not start in ${HELPER_START_MS / 1000} s`)), HELPER_START_MS);
      worker.onmessage = () => { clearTimeout(timer); resolve(); };
      worker.onerror = (event) => { clearTimeout(timer); reject(new Error(`wasm thread ${index + 1} failed: ${event.message}`)); };
    }));
    worker.postMessage({ module, memory, stackTop: tops[index], index });
  }
  try {
    await Promise.all(started);
  } catch (error) {
    exports.kiln_threads_stop();
    helpers.forEach((worker) => worker.terminate());
    throw error;
  }
  return helpers;
}
