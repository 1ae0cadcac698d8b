// GPU time per WebGPU kernel, from timestamp queries written at the start and end of each compute
// pass (tvmjs gives every dispatch a pass of its own), and the workgroup barriers in its code. The
// timer wraps the device before tvmjs compiles its pipelines, so it knows each pipeline's kernel
// (its entry point and WGSL); outside `time()` the passes are left as they are. Chromium rounds
// timestamps to 0.1 ms unless it runs with
// `--enable-dawn-features=allow_unsafe_apis --disable-dawn-features=timestamp_quantization`.

// WebGPU's largest query set; a step with more dispatches is timed in its first 2048.
const MAX_QUERIES = 4096;
const UNKNOWN_KERNEL = (kernel) => ({ kernel, barriers: 0, loopBarriers: 0 });
const BARRIER_OR_BLOCK = /\b(?:workgroupBarrier|storageBarrier|textureBarrier)\s*\(\s*\)|[{}();]/g;

/**
 * The barrier calls in WGSL `code`: {barriers: those outside loops, which each invocation passes
 * once, loopBarriers: those inside `for`, `while` or `loop` bodies, passed once per iteration}.
 */
export function countBarriers(code) {
  const source = code.replace(/\/\/.*$/gm, "");
  const openBlocks = []; // for each open `{`: is it a loop's body?
  let statementStart = 0;
  let parens = 0;
  let barriers = 0;
  let loopBarriers = 0;
  for (const { 0: token, index } of source.matchAll(BARRIER_OR_BLOCK)) {
    if (token === "(") parens += 1;
    else if (token === ")") parens -= 1;
    else if (token === "{") openBlocks.push(/^\s*(?:for|while|loop)\b/.test(source.slice(statementStart, index)));
    else if (token === "}") openBlocks.pop();
    else if (token !== ";") openBlocks.includes(true) ? (loopBarriers += 1) : (barriers += 1);
    if (token === "{" || token === "}" || (token === ";" && parens === 0)) statementStart = index + 1;
  }
  return { barriers, loopBarriers };
}

export class KernelTimer {
  /** A timer on `device`, or null when the device lacks the `timestamp-query` feature. */
  static attach(device) {
    return device.features.has("timestamp-query") ? new KernelTimer(device) : null;
  }

  constructor(device) {
    this.device = device;
    this.kernels = new WeakMap(); // pipeline → {kernel, barriers, loopBarriers}
    this.shaderCode = new WeakMap(); // shader module → WGSL
    this.passes = null; // while timing: the kernel of each pass, in order
    this.querySet = device.createQuerySet({ type: "timestamp", count: MAX_QUERIES });
    const timer = this;
    const createShaderModule = device.createShaderModule.bind(device);
    device.createShaderModule = (descriptor) => {
      const module = createShaderModule(descriptor);
      timer.shaderCode.set(module, descriptor.code);
      return module;
    };
    for (const method of ["createComputePipeline", "createComputePipelineAsync"]) {
      const create = device[method].bind(device);
      device[method] = (descriptor) => {
        const { entryPoint, module } = descriptor.compute;
        const census = { kernel: entryPoint, ...countBarriers(timer.shaderCode.get(module) ?? "") };
        const named = (pipeline) => (timer.kernels.set(pipeline, census), pipeline);
        const made = create(descriptor);
        return made instanceof Promise ? made.then(named) : named(made);
      };
    }
    const createEncoder = device.createCommandEncoder.bind(device);
    device.createCommandEncoder = (descriptor) => {
      const encoder = createEncoder(descriptor);
      const beginPass = encoder.beginComputePass.bind(encoder);
      encoder.beginComputePass = (passDescriptor = {}) => timer.timedPass(beginPass, passDescriptor);
      return encoder;
    };
  }

  timedPass(beginPass, descriptor) {
    const index = this.passes?.length;
    if (index === undefined || 2 * index + 2 > MAX_QUERIES) return beginPass(descriptor);
    const pass = beginPass({
      ...descriptor,
      timestampWrites: { querySet: this.querySet, beginningOfPassWriteIndex: 2 * index, endOfPassWriteIndex: 2 * index + 1 },
    });
    this.passes.push(UNKNOWN_KERNEL("(no kernel)"));
    const setPipeline = pass.setPipeline.bind(pass);
    pass.setPipeline = (pipeline) => {
      this.passes[index] = this.kernels.get(pipeline) ?? UNKNOWN_KERNEL("(unnamed)");
      setPipeline(pipeline);
    };
    return pass;
  }

  /**
   * Run `work` (which must finish its GPU work, e.g. by reading a result back) with every pass
   * timed; returns [work's result, [{kernel, ms, dispatches, barriers, loopBarriers}] slowest
   * first], the barriers counted per dispatch as countBarriers counts them.
   */
  async time(work) {
    if (this.passes !== null) throw new Error("KernelTimer.time is not reentrant");
    this.passes = [];
    let result;
    let passes;
    try {
      result = await work();
    } finally {
      passes = this.passes;
      this.passes = null;
    }
    const timestamps = await this.read(2 * passes.length);
    const byKernel = new Map();
    passes.forEach((census, index) => {
      const entry = byKernel.get(census.kernel) ?? { ...census, ms: 0, dispatches: 0 };
      entry.ms += Number(timestamps[2 * index + 1] - timestamps[2 * index]) / 1e6;
      entry.dispatches += 1;
      byKernel.set(census.kernel, entry);
    });
    return [result, [...byKernel.values()].sort((a, b) => b.ms - a.ms)];
  }

  async read(count) {
    if (count === 0) return new BigUint64Array(0);
    const bytes = count * BigUint64Array.BYTES_PER_ELEMENT;
    const resolved = this.device.createBuffer({ size: bytes, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
    const readable = this.device.createBuffer({ size: bytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    const encoder = this.device.createCommandEncoder();
    encoder.resolveQuerySet(this.querySet, 0, count, resolved, 0);
    encoder.copyBufferToBuffer(resolved, 0, readable, 0, bytes);
    this.device.queue.submit([encoder.finish()]);
    try {
      await readable.mapAsync(GPUMapMode.READ);
      return new BigUint64Array(readable.getMappedRange().slice(0));
    } finally {
      resolved.destroy();
      readable.destroy();
    }
  }
}
