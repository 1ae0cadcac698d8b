// Where a model comes from: which of its libraries this browser can run, and its files, fetched
// with byte-level progress, md5-checked and kept in the Cache API for the next visit.
import { EngineError } from "./errors.js";
import { Md5, md5Hex } from "./md5.js";

// What Kiln's WebGPU kernels need beyond WebGPU's defaults (the attention kernels bind up to 10
// storage buffers; TVM's GPU schedules use 256-thread workgroups and up to 32 KB shared memory).
const KERNEL_LIMITS = {
  maxStorageBuffersPerShaderStage: 10,
  maxComputeInvocationsPerWorkgroup: 256,
  maxComputeWorkgroupStorageSize: 32 << 10,
};
const REQUESTED_LIMITS = ["maxBufferSize", "maxStorageBufferBindingSize", ...Object.keys(KERNEL_LIMITS)];
const OPTIONAL_FEATURES = ["shader-f16", "subgroups"];
const CACHE_PREFIX = "kiln-model";
const PARALLEL_DOWNLOADS = 4;
const MB = 1 << 20;

/** The folder URL of a model record, the way WebLLM reads it (`<model>/resolve/main/`). */
export function modelBaseUrl(record) {
  let url = record.model.endsWith("/") ? record.model : `${record.model}/`;
  if (!/\/resolve\/[^/]+\/$/.test(url)) url += "resolve/main/";
  return url;
}

/** Kiln's view of an app-config record; plain WebLLM records have one WebGPU library. */
function variantInfo(record) {
  return record.kiln ?? { family: record.model_id, libraries: { webgpu: record.model_lib } };
}

function formatMB(bytes) {
  return `${Math.ceil(bytes / MB)} MB`;
}

/** Why `adapter` cannot run `record`'s WebGPU library, or null when it can. */
function gpuProblem(adapter, record) {
  const missing = (record.required_features ?? []).filter((feature) => !adapter.features.has(feature));
  if (missing.length > 0) return `the GPU lacks the WebGPU feature ${missing.join(", ")}`;
  const needed = record.buffer_size_required_bytes ?? 0;
  if (needed > adapter.limits.maxStorageBufferBindingSize) {
    return `the model binds buffers of ${formatMB(needed)} but this GPU allows at most ` +
      `${formatMB(adapter.limits.maxStorageBufferBindingSize)} (maxStorageBufferBindingSize)`;
  }
  for (const [limit, value] of Object.entries(KERNEL_LIMITS)) {
    if (adapter.limits[limit] < value) return `the GPU's ${limit} is ${adapter.limits[limit]}, the kernels need ${value}`;
  }
  return null;
}

async function requestAdapter() {
  if (typeof navigator === "undefined" || navigator.gpu === undefined) {
    return { adapter: null, reason: "this browser has no WebGPU" };
  }
  try {
    const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    return adapter ? { adapter, reason: null } : { adapter: null, reason: "WebGPU is disabled or no GPU adapter is available" };
  } catch (error) {
    return { adapter: null, reason: `WebGPU adapter request failed: ${error.message}` };
  }
}

/**
 * Pick the model variant and library to run: the f16 variant of the model's family when the
 * GPU has shader-f16, else the f32 one; the CPU (`wasm`) library when WebGPU is missing or
 * cannot run any variant. `device` is "auto", "webgpu" (never fall back) or "wasm".
 *
 * Returns {record, backend: "webgpu" | "wasm", libraryUrl, adapter, fallbackReason}.
 */
export async function chooseBackend(appConfig, modelId, device = "auto") {
  const records = appConfig?.model_list ?? [];
  const requested = records.find((record) => record.model_id === modelId);
  if (!requested) {
    const known = records.map((record) => record.model_id).join(", ") || "none";
    throw new EngineError("model-not-found", `No model "${modelId}" in the app config (it has: ${known}).`);
  }
  const family = [requested, ...records.filter((record) => record !== requested
    && variantInfo(record).family === variantInfo(requested).family)];
  const reasons = [];
  let adapter = null;
  if (device !== "wasm") {
    const found = await requestAdapter();
    adapter = found.adapter;
    if (found.reason) reasons.push(found.reason);
  }
  if (adapter) {
    const wantsF16 = (record) => (record.required_features ?? []).includes("shader-f16");
    const candidates = family.filter((record) => variantInfo(record).libraries.webgpu);
    if (adapter.features.has("shader-f16")) candidates.sort((a, b) => wantsF16(b) - wantsF16(a));
    for (const record of candidates) {
      const problem = gpuProblem(adapter, record);
      if (!problem) {
        return { record, backend: "webgpu", libraryUrl: variantInfo(record).libraries.webgpu, adapter, fallbackReason: null };
      }
      reasons.push(`${record.model_id}: ${problem}`);
    }
    if (candidates.length === 0) reasons.push("the model has no WebGPU library");
  }
  const reason = reasons.join("; ");
  if (device !== "webgpu") {
    const record = family.find((candidate) => variantInfo(candidate).libraries.wasm);
    if (record) return { record, backend: "wasm", libraryUrl: variantInfo(record).libraries.wasm, adapter: null, fallbackReason: reason || null };
  }
  const code = adapter ? "unsupported-gpu" : "no-webgpu";
  const advice = device === "webgpu" ? "" : " The model has no CPU (wasm) library to fall back to; build one with " +
    "`kiln compile SOURCE -q QUANTIZATION -t wasm`.";
  throw new EngineError(code, `Cannot run ${modelId} on WebGPU: ${reason}.${advice}`);
}

/** A GPUDevice for `record` with the limits its kernels need (requested from `adapter`). */
export async function requestDevice(adapter, record) {
  const requiredLimits = Object.fromEntries(REQUESTED_LIMITS.map((limit) => [limit, adapter.limits[limit]]));
  // TVM's WGSL uses subgroup operations where the adapter offers them, as tvmjs's own device setup assumes.
  const requiredFeatures = [...new Set([...(record.required_features ?? []), ...OPTIONAL_FEATURES])]
    .filter((feature) => adapter.features.has(feature));
  try {
    return await adapter.requestDevice({ requiredLimits, requiredFeatures });
  } catch (error) {
    throw new EngineError("unsupported-gpu", `The GPU refused a device with the limits the model needs: ${error.message}`);
  }
}

async function fetchOrFail(url, init) {
  let response;
  try {
    response = await fetch(url, init);
  } catch (error) {
    throw new EngineError("network", `Could not download ${url}: ${error.message}. Check the connection and reload.`);
  }
  if (!response.ok) throw new EngineError("network", `Could not download ${url}: the server answered HTTP ${response.status}.`);
  return response;
}

/** Read a response body into one Uint8Array, reporting each chunk's size to `onBytes`. */
async function readBody(response, url, onBytes, md5) {
  const declared = Number(response.headers.get("Content-Length"));
  const chunks = [];
  let received = 0;
  const reader = response.body.getReader();
  for (;;) {
    let step;
    try {
      step = await reader.read();
    } catch (error) {
      throw new EngineError("network", `The download of ${url} broke off: ${error.message}. Reload to resume.`);
    }
    if (step.done) break;
    chunks.push(step.value);
    received += step.value.length;
    md5?.update(step.value);
    onBytes(step.value.length);
  }
  if (declared && received !== declared) {
    throw new EngineError("network", `The download of ${url} stopped after ${received} of ${declared} bytes. Reload to resume.`);
  }
  const bytes = new Uint8Array(received);
  let offset = 0;
  for (const chunk of chunks) {
    bytes.set(chunk, offset);
    offset += chunk.length;
  }
  return bytes;
}

function isQuotaError(error) {
  return error?.name === "QuotaExceededError" || /quota/i.test(String(error?.message));
}

function quotaError(bytes, estimate) {
  const free = estimate ? `; about ${formatMB(Math.max(0, estimate.quota - estimate.usage))} is free` : "";
  return new EngineError("quota-exceeded", `Not enough browser storage to keep the model: it needs ${formatMB(bytes)}` +
    `${free}. Free up disk space or clear this site's data, then reload.`);
}

/**
 * One build of one model: its files by URL, read from the Cache API when this build was
 * fetched before, else downloaded (md5-checked when the tensor cache gives an md5) and cached.
 *
 * The cache is keyed by the build id, a hash of `kiln-build.json` and `tensor-cache.json`
 * (always fetched fresh), so a rebuilt model never mixes old and new files. Without the Cache
 * API (an insecure origin) the files are kept in memory for this load only.
 */
export class ModelFiles {
  static async open(record, onProgress) {
    const baseUrl = modelBaseUrl(record);
    const [buildText, tensorCacheText, chatConfigText] = await Promise.all(
      ["kiln-build.json", "tensor-cache.json", "mlc-chat-config.json"].map(async (name) =>
        (await fetchOrFail(new URL(name, baseUrl), { cache: "no-cache" })).text()));
    const files = new ModelFiles(record, baseUrl, md5Hex(`${buildText}\n${tensorCacheText}`), onProgress);
    files.tensorCache = JSON.parse(tensorCacheText);
    files.chatConfig = JSON.parse(chatConfigText);
    files.cache = typeof caches === "undefined" ? null : await caches.open(files.cacheName);
    return files;
  }

  constructor(record, baseUrl, buildId, onProgress) {
    this.record = record;
    this.baseUrl = baseUrl;
    this.buildId = buildId;
    this.cacheName = `${CACHE_PREFIX}:${record.model_id}:${buildId}`;
    this.onProgress = onProgress;
    this.memory = new Map();
    this.totalBytes = 0;
    this.doneBytes = 0;
    this.downloadedBytes = 0;
    this.cachedBytes = 0;
  }

  url(name) {
    return new URL(name, this.baseUrl).href;
  }

  shardUrls() {
    return this.tensorCache.records.map((shard) => ({ url: this.url(shard.dataPath), nbytes: shard.nbytes, md5: shard.md5sum }));
  }

  /** The stored response for `url` when it has `nbytes` bytes (any size when nbytes is undefined). */
  async stored(url, nbytes) {
    if (!this.cache) return this.memory.has(url) ? new Response(this.memory.get(url)) : null;
    const response = await this.cache.match(url);
    if (!response) return null;
    if (nbytes === undefined || Number(response.headers.get("Content-Length")) === nbytes) return response;
    await this.cache.delete(url);
    return null;
  }

  /** Check the storage quota for the weights not stored yet (the other files' sizes are unknown until fetched). */
  async reserve() {
    let missingBytes = 0;
    for (const { url, nbytes } of this.shardUrls()) {
      this.totalBytes += nbytes;
      if (!await this.stored(url, nbytes)) missingBytes += nbytes;
    }
    if (this.cache && missingBytes > 0 && navigator.storage?.estimate) {
      const estimate = await navigator.storage.estimate();
      if (estimate.quota - estimate.usage < missingBytes) throw quotaError(missingBytes, estimate);
    }
  }

  report(text) {
    this.onProgress({
      phase: "fetch", text, loadedBytes: this.doneBytes, totalBytes: this.totalBytes,
      fraction: this.totalBytes ? Math.min(1, this.doneBytes / this.totalBytes) : 0,
    });
  }

  /** The bytes of one file, from the store or downloaded; `expected` = {nbytes, md5} when the tensor cache knows them. */
  async bytes(url, expected = {}) {
    const stored = await this.stored(url, expected.nbytes);
    if (!stored) return this.download(url, expected);
    const bytes = new Uint8Array(await stored.arrayBuffer());
    this.count(bytes.length, expected, true);
    this.report(`Read ${url.slice(url.lastIndexOf("/") + 1)} from the browser cache`);
    return bytes;
  }

  count(bytes, expected, fromStore) {
    if (expected.nbytes === undefined) this.totalBytes += bytes;
    this.doneBytes += bytes;
    if (fromStore) this.cachedBytes += bytes;
    else this.downloadedBytes += bytes;
  }

  async download(url, expected) {
    const name = url.slice(url.lastIndexOf("/") + 1);
    const response = await fetchOrFail(url, { cache: "no-cache" });
    if (expected.nbytes === undefined) this.totalBytes += Number(response.headers.get("Content-Length")) || 0;
    const md5 = expected.md5 ? new Md5() : null;
    const bytes = await readBody(response, url, (count) => {
      this.doneBytes += count;
      this.report(`Downloading ${name}`);
    }, md5);
    this.downloadedBytes += bytes.length;
    if (expected.nbytes !== undefined && bytes.length !== expected.nbytes) {
      throw new EngineError("integrity", `${name} has ${bytes.length} bytes, the tensor cache says ${expected.nbytes}: ` +
        "the model on the server is incomplete or was rebuilt during the download. Reload the page.");
    }
    if (md5) {
      const digest = md5.hexdigest();
      if (digest !== expected.md5) {
        throw new EngineError("integrity", `${name} failed its md5 check (got ${digest}, expected ${expected.md5}): ` +
          "the file on the server is corrupt or changed during the download. Reload the page.");
      }
    }
    await this.store(url, bytes, response.headers.get("Content-Type"));
    return bytes;
  }

  async store(url, bytes, contentType) {
    if (!this.cache) {
      this.memory.set(url, bytes);
      return;
    }
    const headers = { "Content-Length": String(bytes.length), "Content-Type": contentType ?? "application/octet-stream" };
    try {
      await this.cache.put(url, new Response(bytes, { headers }));
    } catch (error) {
      if (isQuotaError(error)) throw quotaError(bytes.length, await navigator.storage?.estimate?.());
      throw error;
    }
  }

  /** Store every weight shard not stored yet, PARALLEL_DOWNLOADS downloads at a time. */
  async fetchShards() {
    const queue = this.shardUrls();
    const next = async () => {
      for (let file = queue.shift(); file; file = queue.shift()) {
        if (await this.stored(file.url, file.nbytes)) {
          this.count(file.nbytes, file, true);
          this.report("Found the weights in the browser cache");
        } else {
          await this.download(file.url, file);
        }
      }
    };
    await Promise.all(Array.from({ length: PARALLEL_DOWNLOADS }, next));
  }

  /** The stored shards in order, as {shard, bytes}, one at a time (after fetchShards). */
  async *storedShards() {
    for (const [index, { url, nbytes }] of this.shardUrls().entries()) {
      const stored = await this.stored(url, nbytes);
      if (!stored) throw new EngineError("quota-exceeded", "The browser evicted the model's files while it loaded; reload the page.");
      this.memory.delete(url);
      yield { shard: this.tensorCache.records[index], bytes: new Uint8Array(await stored.arrayBuffer()) };
    }
  }

  /** Drop the caches of other builds of this model (they can never be used again). */
  async forgetOtherBuilds() {
    if (typeof caches === "undefined") return;
    const prefix = `${CACHE_PREFIX}:${this.record.model_id}:`;
    for (const name of await caches.keys()) {
      if (name.startsWith(prefix) && name !== this.cacheName) await caches.delete(name);
    }
  }
}
