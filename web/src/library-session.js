// A Kiln model library in tvmjs's Relax VM on one device: its `_metadata`, the functions an engine
// calls and the weights, uploaded shard by shard. The chat engine's ModelSession (engine.js) adds the
// KV cache; the embedding engine's EmbeddingSession (embeddings.js) runs its one function.
import { EngineError } from "./errors.js";

export class LibrarySession {
  constructor(tvm, device, backend) {
    this.tvm = tvm;
    this.device = device;
    this.backend = backend;
  }

  /** Create the VM, take `functionNames` from it, upload the weights (`shards` yields {shard, bytes}). */
  async open(functionNames, shards, onUpload) {
    const tvm = this.tvm;
    tvm.beginScope();
    this.vm = tvm.detachFromCurrentScope(tvm.createVirtualMachine(this.device));
    this.metadata = JSON.parse(String(this.vm.getFunction("_metadata")()));
    this.functions = {};
    tvm.endScope();
    this.takeFunctions(functionNames);

    const wanted = new Map(this.metadata.params.map((param, index) => [param.name, index]));
    const tensors = new Array(wanted.size);
    for await (const { shard, bytes } of shards) {
      for (const record of shard.records) {
        if (!wanted.has(record.name)) continue;
        tensors[wanted.get(record.name)] = this.upload(record, bytes.subarray(record.byteOffset, record.byteOffset + record.nbytes));
      }
      onUpload(shard);
    }
    const missing = this.metadata.params.find((param, index) => tensors[index] === undefined);
    if (missing) throw new EngineError("bad-model", `The tensor cache has no weight ${missing.name}; the model folder is from another build.`);
    await this.device.sync();
    tvm.beginScope();
    this.params = tvm.detachFromCurrentScope(tvm.makeTVMArray(tensors));
    tvm.endScope();
    tensors.forEach((tensor) => tensor.dispose());
  }

  /** Take `names` from the VM into `functions`. */
  takeFunctions(names) {
    const tvm = this.tvm;
    tvm.withNewScope(() => {
      for (const name of names) {
        try {
          this.functions[name] = tvm.detachFromCurrentScope(this.vm.getFunction(name));
        } catch (error) {
          throw new EngineError("bad-model", `The model library has no function ${name} (${error.message}); rebuild it with kiln compile.`);
        }
      }
    });
  }

  /**
   * One weight on the device. On the CPU the bytes go straight into the tensor's wasm memory: passed
   * through tvmjs's call, they would be staged in a call stack that grows to the largest weight and
   * keeps that size (a 262k-word embedding: 84-168 MB of wasm memory for good).
   */
  upload(record, bytes) {
    const tvm = this.tvm;
    return tvm.withNewScope(() => {
      const tensor = tvm.detachFromCurrentScope(tvm.empty(record.shape, record.dtype, this.device));
      if (this.backend !== "webgpu") {
        tvm.memory.storeRawBytes(tensor.getCPUDataAddress(), bytes);
      } else if (bytes.length % 4 !== 0) {
        // WebGPU buffer writes must be whole 4-byte words: stage odd-sized tensors on the CPU.
        tensor.copyFrom(tvm.empty(record.shape, record.dtype, tvm.cpu()).copyFromRawBytes(bytes));
      } else {
        tensor.copyFromRawBytes(bytes);
      }
      return tensor;
    });
  }

  /** A device result as a tensor in wasm memory (a WebGPU one copied back), detached from the scope. */
  onHost(result) {
    const tvm = this.tvm;
    return tvm.detachFromCurrentScope(this.backend === "webgpu"
      ? tvm.empty(result.shape, result.dtype, tvm.cpu()).copyFrom(result)
      : result);
  }

  dispose() {
    for (const object of [this.params, ...Object.values(this.functions ?? {}), this.vm]) object?.dispose();
  }
}
