// Usage: node decode-node.mjs <model_dir> [--library webgpu|webgpu-subgroups] [--prompt-tokens 16]
//                             [--decode-tokens 16]
//
// Runs a compiled model's WebGPU library in Node on Dawn the way the browser engine runs it (its
// ModelSession): prefills prompt tokens, decodes greedily, times one more decode step kernel by
// kernel and prints JSON
//   {library, adapter, layers, decode_tokens_per_s, decode_step_dispatches, dispatches_per_layer,
//    decode_step_barriers, barriers_per_layer, decode_step_kernels: [{kernel, ms, dispatches, barriers, loopBarriers}]}
// Barriers are those each invocation passes outside loops, counted as `kiln bench browser` counts them.
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import { ModelSession } from "../src/engine.js";
import { KernelTimer } from "../src/kernel-timer.js";
import { requestDevice } from "../src/loader.js";
import { DAWN_HINT, fail, installWebGPU, loadLibrary, parseArgs } from "./tvm-node.mjs";

// Dawn rounds timestamps to 0.1 ms unless told not to (Chromium's flags for `kiln bench browser`).
const PRECISE_TIMESTAMPS = ["enable-dawn-features=allow_unsafe_apis", "disable-dawn-features=timestamp_quantization"];

const readJson = async (path) => JSON.parse(await readFile(path, "utf8"));

async function* shards(modelDir, tensorCache) {
  for (const shard of tensorCache.records) {
    yield { shard, bytes: new Uint8Array(await readFile(join(modelDir, shard.dataPath))) };
  }
}

function argmax(logits) {
  let best = 0;
  for (let i = 1; i < logits.length; ++i) if (logits[i] > logits[best]) best = i;
  return best;
}

async function main() {
  const args = parseArgs(process.argv.slice(2), {
    positional: ["model"],
    options: { library: "webgpu-subgroups", "prompt-tokens": "16", "decode-tokens": "16" },
  });
  const build = await readJson(join(args.model, "kiln-build.json"));
  const library = build.targets?.[args.library]?.library;
  if (!library) throw new Error(`${args.model} has no ${args.library} library`);
  const chatConfig = await readJson(join(args.model, "mlc-chat-config.json"));

  await installWebGPU(PRECISE_TIMESTAMPS);
  const adapter = await globalThis.navigator.gpu.requestAdapter();
  if (!adapter) throw new Error(`no WebGPU adapter. ${DAWN_HINT}`);
  const device = await requestDevice(adapter, {});
  const timer = KernelTimer.attach(device); // before tvmjs makes its pipelines
  const { tvm } = await loadLibrary(join(args.model, library), { gpu: { device } });
  const session = new ModelSession(tvm, tvm.webgpu(), "webgpu");
  await session.initialize(shards(args.model, await readJson(join(args.model, "tensor-cache.json"))), () => {});

  const vocab = chatConfig.vocab_size;
  const prompt = Array.from({ length: Number(args["prompt-tokens"]) }, (_, i) => (i * 7919 + 13) % vocab);
  let logits = await session.prefill(prompt);
  const decodeTokens = Number(args["decode-tokens"]);
  const started = performance.now();
  for (let i = 0; i < decodeTokens; ++i) logits = await session.decode(argmax(logits));
  const seconds = (performance.now() - started) / 1000;
  const dispatches = session.lastDecodeDispatches;
  const [, kernels] = timer ? await timer.time(() => session.decode(argmax(logits))) : [null, null];

  const layers = chatConfig.model_config.num_hidden_layers;
  const barriers = kernels && kernels.reduce((sum, kernel) => sum + kernel.dispatches * kernel.barriers, 0);
  const info = adapter.info ?? {};
  process.stdout.write(JSON.stringify({
    library: args.library,
    adapter: { vendor: info.vendor, architecture: info.architecture, description: info.description },
    layers,
    decode_tokens_per_s: decodeTokens / seconds,
    decode_step_dispatches: dispatches,
    dispatches_per_layer: dispatches / layers,
    decode_step_barriers: barriers,
    barriers_per_layer: barriers === null ? null : barriers / layers,
    decode_step_kernels: kernels,
  }) + "\n");
  tvm.dispose();
  process.exit(0);
}

main().catch((error) => fail(error));
