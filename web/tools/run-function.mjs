// Usage: node run-function.mjs <lib.wasm> <function> <inputs.json> [--device auto|cpu|webgpu]
//
// Calls one Relax function of a model library with tvmjs and prints JSON
//   {"device", "outputs": [{"shape", "dtype", "data"}]}   (a tuple result gives several outputs)
// inputs.json is a list of tensors: [{"shape": [4, 8], "dtype": "float32", "data": [flat values]}].
// --device auto (default) runs a library with WebGPU kernels on WebGPU and others on the CPU.
import { readFile } from "node:fs/promises";
import { fail, loadLibrary, needsWebGPU, parseArgs, requestWebGPUDevice, vmFunction } from "./tvm-node.mjs";

async function main() {
  const args = parseArgs(process.argv.slice(2), {
    positional: ["library", "function", "inputs"],
    options: { device: "auto" },
  });
  if (!["auto", "cpu", "webgpu"].includes(args.device)) throw new Error(`bad --device ${args.device}`);
  const useGPU = args.device === "webgpu" || (args.device === "auto" && await needsWebGPU(args.library));
  const { tvm, vm, device } = await loadLibrary(args.library, { gpu: useGPU ? await requestWebGPUDevice() : null });
  const inputs = JSON.parse(await readFile(args.inputs, "utf8"));

  tvm.beginScope();
  const func = vmFunction(vm, args.function);
  if (func === undefined) throw new Error(`the library has no function ${args.function}`);
  const tensors = inputs.map(({ shape, dtype, data }) =>
    tvm.empty(shape, dtype, device).copyFrom(tvm.empty(shape, dtype, tvm.cpu()).copyFrom(data)));
  const result = func(...tensors);
  const results = result.size !== undefined && result.get !== undefined
    ? Array.from({ length: result.size() }, (_, i) => result.get(i))
    : [result];
  const hostCopies = results.map((tensor) => tvm.empty(tensor.shape, tensor.dtype, tvm.cpu()).copyFrom(tensor));
  await device.sync();
  const outputs = hostCopies.map((tensor) => ({
    shape: tensor.shape, dtype: tensor.dtype, data: Array.from(tensor.toArray()),
  }));
  tvm.endScope();
  process.stdout.write(JSON.stringify({ device: device.toString().split(":")[0], outputs }) + "\n");
  tvm.dispose();
  process.exit(0);
}

main().catch((error) => fail(error));
