// Load a model library (.wasm linked by kiln.compile.toolchain.wasm_toolchain) in Node with tvmjs
// (@mlc-ai/web-runtime), on the CPU or on WebGPU (Dawn's Node bindings, npm `webgpu`).
import { readFile } from "node:fs/promises";
import tvmjs from "@mlc-ai/web-runtime";
import { instantiateLibrary } from "../src/wasm-threads.js";

// tvmjs and the wasm's C++ side print through console.log; stdout is kept for our JSON.
console.log = (...args) => console.error(...args);

/**
 * Give Node a navigator.gpu from Dawn (npm `webgpu`) unless the host has one; `dawnFlags` are
 * Dawn's toggles, as in Chromium's --enable-dawn-features. Throws with the reason.
 */
export async function installWebGPU(dawnFlags = []) {
  if (globalThis.navigator?.gpu !== undefined) return;
  let dawn;
  try {
    dawn = await import("webgpu");
  } catch (error) {
    throw new Error(`no WebGPU in this Node: the npm package "webgpu" is missing (${error.message})`, {
      cause: error,
    });
  }
  Object.assign(globalThis, dawn.globals);
  // Dawn's bindings poll for finished GPU work with setImmediate, a busy loop while work is pending
  // that takes a core from SwiftShader's threads (SmolLM2 decodes at 1.4 instead of 2.1 tokens/s on
  // two cores): poll every millisecond instead.
  globalThis.setImmediate = (callback, ...args) => setTimeout(callback, 0, ...args);
  Object.defineProperty(globalThis, "navigator", {
    value: { ...globalThis.navigator, gpu: dawn.create(dawnFlags) },
    configurable: true,
    writable: true,
  });
}

/** Find a WebGPU device: the host's navigator.gpu, else Dawn for Node. Throws with the reason. */
export async function requestWebGPUDevice() {
  await installWebGPU();
  let found;
  try {
    found = await tvmjs.detectGPUDevice();
  } catch (error) {
    throw new Error(`${error.message} ${DAWN_HINT}`, { cause: error });
  }
  if (found === undefined) throw new Error(`no WebGPU adapter. ${DAWN_HINT}`);
  return found;
}

export const DAWN_HINT =
  "On Linux without a GPU, Dawn needs Vulkan with SwiftShader: set XDG_RUNTIME_DIR, " +
  "VK_ICD_FILENAMES=/usr/lib/chromium/vk_swiftshader_icd.json and, when libvulkan1 is not " +
  "installed, LD_LIBRARY_PATH=/usr/lib/chromium.";

/**
 * Instantiate a model library and create its Relax VM.
 *
 * Without `gpu`, WebGPU kernels are not compiled: each one is replaced by a function that
 * throws when called, so the library can still be loaded and inspected on a machine with
 * no WebGPU. With `gpu` (from requestWebGPUDevice) every shader is compiled into a pipeline,
 * as WebLLM does, and the VM runs on the GPU.
 */
export async function loadLibrary(wasmPath, { gpu = null } = {}) {
  const wasm = await readFile(wasmPath);
  // One thread: a threaded CPU library runs on unshared memory here.
  const { tvm } = await instantiateLibrary(tvmjs, wasm, { log: (msg) => console.error(msg) });
  const uncompiledKernels = [];
  if (gpu) {
    tvm.initWebGPU(gpu.device);
    tvm.beginScope();
    await tvm.asyncLoadWebGPUPipelines(tvm.systemLib());
    tvm.endScope();
  } else {
    tvm.registerFunc("wasm.WebGPUCreateShader", (info) => {
      const { name } = JSON.parse(info);
      uncompiledKernels.push(name);
      return () => {
        throw new Error(`WebGPU kernel ${name} cannot run: the library was loaded without WebGPU`);
      };
    });
  }
  const device = gpu ? tvm.webgpu() : tvm.cpu();
  tvm.beginScope();
  const vm = tvm.detachFromCurrentScope(tvm.createVirtualMachine(device));
  tvm.endScope();
  return { tvm, vm, device, uncompiledKernels };
}

/** The library's WebGPU kernels (name → launch info); empty for a CPU library. */
export function webgpuKernels(tvm) {
  return tvm.withNewScope(() => {
    const getFmap = tvm.systemLib().getFunction("webgpu.get_fmap", true);
    return getFmap ? JSON.parse(getFmap()) : {};
  });
}

/** Names of the Relax functions in the library's VM executable, in its order. */
export function relaxFunctionNames(tvm) {
  return tvm.withNewScope(() => {
    const asText = tvm.systemLib().getFunction("as_text", true);
    return [...asText().matchAll(/^@(\S+):$/gm)].map((match) => match[1]);
  });
}

/** The VM function `name`, or undefined when the library has none. */
export function vmFunction(vm, name) {
  try {
    const func = vm.getFunction(name);
    return typeof func === "function" ? func : undefined;
  } catch {
    return undefined;
  }
}

/** Whether the library has WebGPU kernels; decided by loading it once without a GPU. */
export async function needsWebGPU(wasmPath) {
  const { tvm } = await loadLibrary(wasmPath);
  const needed = Object.keys(webgpuKernels(tvm)).length > 0;
  tvm.dispose();
  return needed;
}

/** Parse `--name value` options after positional arguments. */
export function parseArgs(argv, { positional, options }) {
  const values = { ...options };
  const rest = [];
  for (let i = 0; i < argv.length; ++i) {
    const arg = argv[i];
    if (arg.startsWith("--")) {
      const key = arg.slice(2);
      if (!(key in options) || i + 1 >= argv.length) throw new Error(`unknown or incomplete option ${arg}`);
      values[key] = argv[++i];
    } else {
      rest.push(arg);
    }
  }
  if (rest.length !== positional.length) {
    throw new Error(`expected arguments: ${positional.map((p) => `<${p}>`).join(" ")}`);
  }
  positional.forEach((name, i) => (values[name] = rest[i]));
  return values;
}

/** Print `error` as one line and exit non-zero. */
export function fail(error, code = 2) {
  console.error(`error: ${error.message ?? error}`);
  process.exit(code);
}
