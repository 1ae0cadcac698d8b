// Usage: node list-functions.mjs <lib.wasm> [--expect name1,name2] [--device auto|cpu|webgpu]
//
// Loads a model library with tvmjs, creates its Relax VM and prints JSON:
//   {"library", "device", "functions": Relax functions in the executable,
//    "webgpu_kernels", "expected": {name: resolves via vm.getFunction}, "missing",
//    "metadata": what `_metadata` returns (null when absent), "webgpu": adapter or null}
// --device auto (default) compiles a WebGPU library's shaders when a WebGPU device is
// found and otherwise inspects it on the CPU; webgpu requires the device; cpu never asks.
// Exit status: 0, 1 when an expected function is missing, 2 when the library fails to load.
import {
  fail, loadLibrary, parseArgs, relaxFunctionNames, requestWebGPUDevice, vmFunction, webgpuKernels,
} from "./tvm-node.mjs";

async function main() {
  const args = parseArgs(process.argv.slice(2), {
    positional: ["library"],
    options: { expect: "", device: "auto" },
  });
  if (!["auto", "cpu", "webgpu"].includes(args.device)) throw new Error(`bad --device ${args.device}`);

  let library = await loadLibrary(args.library);
  const kernels = webgpuKernels(library.tvm);
  let webgpu = null;
  if (Object.keys(kernels).length > 0 && args.device !== "cpu") {
    let gpu = null;
    try {
      gpu = await requestWebGPUDevice();
    } catch (error) {
      if (args.device === "webgpu") throw error;
      webgpu = { available: false, reason: error.message };
    }
    if (gpu) {
      library.tvm.dispose();
      library = await loadLibrary(args.library, { gpu });
      const { vendor, architecture, description } = gpu.adapterInfo;
      webgpu = { available: true, adapter: { vendor, architecture, description },
                 pipelines: Object.keys(kernels).length };
    }
  }

  const { tvm, vm, device } = library;
  const expectedNames = args.expect.split(",").filter((name) => name.length > 0);
  const report = tvm.withNewScope(() => {
    const expected = Object.fromEntries(expectedNames.map((name) => [name, vmFunction(vm, name) !== undefined]));
    const getMetadata = vmFunction(vm, "_metadata");
    return {
      library: args.library,
      device: device.toString().startsWith("webgpu") ? "webgpu" : "cpu",
      functions: relaxFunctionNames(tvm),
      webgpu_kernels: Object.keys(kernels),
      expected,
      missing: expectedNames.filter((name) => !expected[name]),
      metadata: getMetadata ? JSON.parse(String(getMetadata())) : null,
      webgpu,
    };
  });
  process.stdout.write(JSON.stringify(report, null, 2) + "\n");
  tvm.dispose();
  process.exit(report.missing.length > 0 ? 1 : 0);
}

main().catch((error) => fail(error));
