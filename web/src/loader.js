// Where a model comes from: which of its libraries this browser can run, and its files, fetched
// with byte-level progress, checked against the SHA-256 digests of the build record and kept in
// the Cache API for the next visit.
import { EngineError } from "./errors.js";
import { KILN_VERSION, TVM_SERIES } from "./version.js";

// What Kiln's WebGPU kernels need beyond WebGPU's defaults (the attention kernels bind up to 10
// storage buffers; TVM's GPU schedules use 256-thread workgroups and up to 32 KB shared memory).
const KERNEL_LIMITS = {
  maxStorageBuffersPerShaderStage: 10,
  maxComputeInvocationsPerWorkgroup: 256,
  maxComputeWorkgroupStorageSize: 32 << 10,
};
const REQUESTED_LIMITS = ["maxBufferSize", "maxStorageBufferBindingSize", ...Object.keys(KERNEL_LIMITS)];
const OPTIONAL_FEATURES = ["shader-f16", "subgroups", "timestamp-query"];
const CACHE_PREFIX = "kiln-model";
const BUILD_RECORD = "kiln-build.json";
const PARALLEL_DOWNLOADS = 4;
const REPORT_EVERY_MS = 100; // download progress, at most this often
const MB = 1 << 20;
// wasm32 addresses 4 GiB: all the CPU library's memory (kiln/targets.py WASM32_MEMORY).
export const WASM32_BYTES = 2 ** 32;

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

/** The bytes `record`'s CPU (wasm) library needs (kiln/model_memory.py), 0 when the record does not say. */
export function wasmBytes(record) {
  return variantInfo(record).memory_bytes?.wasm ?? 0;
}

function formatMB(bytes) {
  return `${Math.ceil(bytes / MB)} MB`;
}

const fileName = (url) => url.slice(url.lastIndexOf("/") + 1);

function formatSeconds(seconds) {
  return seconds < 90 ? `${Math.ceil(seconds)} s` : `${Math.ceil(seconds / 60)} min`;
}

/** Why `adapter` cannot run `record`'s WebGPU library, or null when it can. */
function gpuProblem(adapter, record) {
  const missing = (record.required_features ?? []).filter((feature) => !adapter.features.has(feature));
  if (missing.length > 0) return `the GPU lacks the WebGPU feature ${missing.join(", ")}`;
  const needed = record.buffer_size_required_bytes ?? 0;
  for (const limit of ["maxStorageBufferBindingSize", "maxBufferSize"]) {
    if (needed > adapter.limits[limit]) {
      return `the model's largest buffer takes ${formatMB(needed)} but this GPU allows at most ` +
        `${formatMB(adapter.limits[limit])} (${limit})`;
    }
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

// Adapters that run WebGPU on the CPU: SwiftShader (Chrome's fallback), Mesa's llvmpipe/lavapipe, WARP.
const SOFTWARE_ADAPTER = /swiftshader|llvmpipe|lavapipe|microsoft basic render|\bwarp\b/i;

/** The adapter's name when it renders in software, else null. */
export function softwareAdapter(adapter) {
  const info = adapter.info ?? {};
  const name = [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(" ");
  if (SOFTWARE_ADAPTER.test(name)) return name;
  return info.isFallbackAdapter || adapter.isFallbackAdapter ? name || "a fallback adapter" : null;
}

// A record's WebGPU libraries, best first, with the adapter feature each needs.
const WEBGPU_LIBRARIES = [
  { library: "webgpu-subgroups", feature: "subgroups" },
  { library: "webgpu", feature: null },
];
const LIBRARIES = [...WEBGPU_LIBRARIES.map(({ library }) => library), "wasm"];

/** The name of the best WebGPU library of `record` that `adapter` runs (only `pinned`, when given). */
function webgpuLibrary(record, adapter, pinned) {
  const built = variantInfo(record).libraries;
  const runnable = ({ library, feature }) => built[library] && (!feature || adapter.features.has(feature))
    && (!pinned || pinned === library);
  return WEBGPU_LIBRARIES.find(runnable)?.library ?? null;
}

/**
 * Pick the model variant and library to run: the f16 variant of the model's family when the
 * GPU has shader-f16, else the f32 one, with its subgroup kernels (`webgpu-subgroups`) when the
 * GPU has subgroups; the CPU (`wasm`) library when WebGPU is missing or cannot run any variant,
 * or (in "auto") when the adapter renders in software, where the CPU library runs 50–100×
 * faster. `device` is "auto", "webgpu" (never fall back) or "wasm"; `library` pins one library by
 * its target name (`webgpu`, `webgpu-subgroups` or `wasm`) and implies its device.
 *
 * Returns {record, backend: "webgpu" | "wasm", library, libraryUrl, adapter, fallbackReason}.
 */
export async function chooseBackend(appConfig, modelId, device = "auto", library = null) {
  if (library !== null && !LIBRARIES.includes(library)) {
    throw new EngineError("bad-request", `Unknown library "${library}" (one of ${LIBRARIES.join(", ")}).`);
  }
  if (library !== null) device = library === "wasm" ? "wasm" : "webgpu";
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
  const software = adapter && softwareAdapter(adapter);
  const runsOnCpu = (record) => variantInfo(record).libraries.wasm && wasmBytes(record) <= WASM32_BYTES;
  if (software && device === "auto" && family.some(runsOnCpu)) {
    reasons.push(`the WebGPU adapter renders in software (${software}), slower than the CPU library`);
    adapter = null;
  }
  if (adapter) {
    const wantsF16 = (record) => (record.required_features ?? []).includes("shader-f16");
    const libraries = WEBGPU_LIBRARIES.map((entry) => entry.library).filter((name) => !library || name === library);
    const candidates = family.filter((record) => libraries.some((name) => variantInfo(record).libraries[name]));
    if (adapter.features.has("shader-f16")) candidates.sort((a, b) => wantsF16(b) - wantsF16(a));
    for (const record of candidates) {
      const chosen = webgpuLibrary(record, adapter, library);
      const problem = gpuProblem(adapter, record) ?? (chosen ? null : "the GPU lacks the WebGPU feature subgroups");
      if (!problem) {
        const libraryUrl = variantInfo(record).libraries[chosen];
        return { record, backend: "webgpu", library: chosen, libraryUrl, adapter, fallbackReason: null };
      }
      reasons.push(`${record.model_id}: ${problem}`);
    }
    if (candidates.length === 0) reasons.push(`the model has no ${library ?? "WebGPU"} library`);
  }
  const reason = reasons.join("; ");
  if (device !== "webgpu") {
    const record = family.find(runsOnCpu) ?? family.find((candidate) => variantInfo(candidate).libraries.wasm);
    if (record) {
      const needed = wasmBytes(record);
      if (needed > WASM32_BYTES) {
        throw new EngineError("out-of-memory", `${record.model_id} needs ${formatMB(needed)} of memory on the CPU, ` +
          `more than the ${formatMB(WASM32_BYTES)} its wasm library can address${reason ? ` (WebGPU: ${reason})` : ""}. ` +
          "Use a smaller model or quantization, or a browser with WebGPU.");
      }
      const libraryUrl = variantInfo(record).libraries.wasm;
      return { record, backend: "wasm", library: "wasm", libraryUrl, adapter: null, fallbackReason: reason || null };
    }
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

/** The refusal of a file longer than the `nbytes` tensor-cache.json gives it; `how` says how it showed. */
function oversizeError(url, nbytes, how) {
  return new EngineError("integrity", `${url} is longer than the ${nbytes} bytes tensor-cache.json gives it (${how}): ` +
    "the file is corrupt, was altered, or belongs to another build. Reload the page.");
}

/**
 * Read a response body into one Uint8Array, reporting each chunk's size to `onBytes`. With
 * `nbytes` (the size the tensor cache records) a longer body is refused before reading, when its
 * Content-Length says so, or as soon as it passes `nbytes`, never held whole.
 */
async function readBody(response, url, onBytes, nbytes) {
  const declared = Number(response.headers.get("Content-Length"));
  if (nbytes !== undefined && declared > nbytes) {
    await response.body?.cancel().catch(() => {});
    throw oversizeError(url, nbytes, `its Content-Length is ${declared}`);
  }
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
    received += step.value.length;
    if (nbytes !== undefined && received > nbytes) {
      await reader.cancel().catch(() => {});
      throw oversizeError(url, nbytes, "the download passed them");
    }
    chunks.push(step.value);
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

/** SHA-256 of `bytes` as 64 lowercase hex digits (SubtleCrypto: only on HTTPS or localhost pages). */
export async function sha256Hex(bytes) {
  if (globalThis.crypto?.subtle === undefined) {
    throw new EngineError("integrity", "The model's files cannot be verified: browsers offer SHA-256 (SubtleCrypto) " +
      "only to pages served over HTTPS or from localhost. Serve the page over HTTPS.");
  }
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

function isQuotaError(error) {
  return error?.name === "QuotaExceededError" || /quota/i.test(String(error?.message));
}

function quotaError(bytes, estimate) {
  const free = estimate ? `; about ${formatMB(Math.max(0, estimate.quota - estimate.usage))} is free` : "";
  return new EngineError("quota-exceeded", `Not enough browser storage to keep the model: it needs ${formatMB(bytes)}` +
    `${free}. Free up disk space or clear this site's data, then reload.`);
}

/** The build record's SHA-256 (checked against the one the app-config record pins, if any) and its file digests. */
async function buildRecord(record, baseUrl) {
  const response = await fetchOrFail(new URL(BUILD_RECORD, baseUrl), { cache: "no-cache" });
  const bytes = new Uint8Array(await response.arrayBuffer());
  const digest = await sha256Hex(bytes);
  const pinned = record.kiln_build_sha256;
  if (pinned !== undefined && digest !== pinned.toLowerCase()) {
    throw new EngineError("integrity", `${BUILD_RECORD} has SHA-256 ${digest}, but the app config pins ${pinned}: ` +
      "the model on the server is not the build this page expects.");
  }
  const build = JSON.parse(new TextDecoder().decode(bytes));
  if (typeof build.files !== "object" || build.files === null) {
    throw new EngineError("integrity", `${BUILD_RECORD} lists no file digests, so no file of the model can be verified; ` +
      "rebuild the model with this version of kiln compile.");
  }
  checkBuildVersions(build);
  return { digest, files: build.files };
}

/** major.minor of a version ("0.27" of "0.27.0.post1"). */
const versionSeries = (version) => (typeof version === "string" ? version.split(".").slice(0, 2).join(".") : undefined);

/**
 * Refuse a build of another Kiln major.minor (its files may mean something else) or of another TVM
 * series than tvmjs's. Every build record Kiln writes holds both versions, so a record without
 * them is refused too. kiln/runtime.py applies the same rule natively (there the TVM version must
 * be the very one: the library was compiled against that TVM runtime).
 */
function checkBuildVersions(build) {
  const kiln = build.kiln_version;
  const tvm = build.versions?.tvm;
  if (versionSeries(kiln) !== versionSeries(KILN_VERSION) || versionSeries(tvm) !== TVM_SERIES) {
    throw new EngineError("incompatible-model", `The model was built by Kiln ${kiln ?? "(not recorded)"} with ` +
      `TVM ${tvm ?? "(not recorded)"}, but this engine is Kiln ${KILN_VERSION}, which runs builds of Kiln ` +
      `${versionSeries(KILN_VERSION)}.x made with TVM ${TVM_SERIES}.x: rebuild the model with kiln compile ${KILN_VERSION}.`);
  }
}

/**
 * One build of one model: its files by URL, each checked against its SHA-256 in the build record
 * (`kiln-build.json`, always fetched fresh) whether it was downloaded or read from the Cache API.
 * A file without a digest in the record is refused.
 *
 * The cache is keyed by the build id, the SHA-256 of the build record, so a rebuilt model never
 * mixes old and new files. Without the Cache API the files are kept in memory for this load only.
 */
export class ModelFiles {
  static async open(record, onProgress) {
    const baseUrl = modelBaseUrl(record);
    const build = await buildRecord(record, baseUrl);
    const files = new ModelFiles(record, baseUrl, build, onProgress);
    files.cache = typeof caches === "undefined" ? null : await caches.open(files.cacheName);
    const json = async (name) => JSON.parse(new TextDecoder().decode(await files.bytes(files.url(name))));
    files.tensorCache = await json("tensor-cache.json");
    files.chatConfig = await json("mlc-chat-config.json");
    return files;
  }

  constructor(record, baseUrl, build, onProgress) {
    this.record = record;
    this.baseUrl = baseUrl;
    this.folderUrl = new URL(record.model.endsWith("/") ? record.model : `${record.model}/`).href;
    this.buildId = build.digest;
    this.digests = build.files;
    this.cacheName = `${CACHE_PREFIX}:${record.model_id}:${this.buildId}`;
    this.onProgress = onProgress;
    this.memory = new Map();
    this.totalBytes = 0;
    this.doneBytes = 0;
    this.downloadedBytes = 0;
    this.cachedBytes = 0;
    this.receivedBytes = 0; // downloaded so far, files not yet finished included: the download's rate
    this.startedAt = performance.now();
    this.files = new Map(); // name → {name, loadedBytes, totalBytes}, in the order they started
    this.reportedAt = -Infinity;
    this.verifiedHere = new Set(); // URLs downloaded and verified by this load: read back without hashing again
  }

  url(name) {
    return new URL(name, this.baseUrl).href;
  }

  /** The file's path in the model folder and its SHA-256 from the build record. */
  expected(url) {
    // WebLLM's folder URL (`…/resolve/main/`) or the plain one, as the app config's library URLs use.
    const folder = [this.baseUrl, this.folderUrl].find((prefix) => url.startsWith(prefix));
    const path = folder ? url.slice(folder.length) : url;
    const sha256 = folder ? this.digests[path] : undefined;
    if (typeof sha256 !== "string") {
      throw new EngineError("integrity", `${path} has no SHA-256 in ${BUILD_RECORD}, so it cannot be verified: ` +
        "the engine loads only files the build recorded. Rebuild the model with kiln compile.");
    }
    return { path, sha256 };
  }

  /** `bytes` when their SHA-256 is the build record's; `source` ("server" or "cache") names where they came from. */
  async verified(url, bytes, source) {
    const { path, sha256 } = this.expected(url);
    const digest = await sha256Hex(bytes);
    if (digest === sha256) return bytes;
    if (source === "server") {
      throw new EngineError("integrity", `${path} from the server has SHA-256 ${digest}, but ${BUILD_RECORD} says ` +
        `${sha256}: the file is corrupt, was altered, or belongs to another build. Reload the page.`);
    }
    await this.forget(url);
    throw new EngineError("integrity", `${path} in the browser cache has SHA-256 ${digest}, but ${BUILD_RECORD} says ` +
      `${sha256}: the stored copy is corrupt or was altered. It has been removed; reload the page to download it again.`);
  }

  shardUrls() {
    return this.tensorCache.records.map((shard) => ({ url: this.url(shard.dataPath), nbytes: shard.nbytes }));
  }

  /** The stored response for `url`, or null. */
  async stored(url) {
    if (!this.cache) return this.memory.has(url) ? new Response(this.memory.get(url)) : null;
    return (await this.cache.match(url)) ?? null;
  }

  async forget(url) {
    this.memory.delete(url);
    await this.cache?.delete(url);
  }

  /** Check the storage quota for the weights not stored yet (the other files' sizes are unknown until fetched). */
  async reserve() {
    let missingBytes = 0;
    for (const { url, nbytes } of this.shardUrls()) {
      this.totalBytes += nbytes;
      if (!await this.stored(url)) missingBytes += nbytes;
    }
    if (this.cache && missingBytes > 0 && navigator.storage?.estimate) {
      const estimate = await navigator.storage.estimate();
      if (estimate.quota - estimate.usage < missingBytes) throw await this.outOfStorage(this.totalBytes);
    }
  }

  /** Track `bytes` more of file `name` (of `totalBytes`) and report the load; `done` reports at once. */
  progress(name, bytes, totalBytes, text, done = false) {
    const file = this.files.get(name) ?? { name, loadedBytes: 0, totalBytes };
    file.loadedBytes += bytes;
    this.files.set(name, file);
    const now = performance.now();
    if (!done && now - this.reportedAt < REPORT_EVERY_MS) return;
    this.reportedAt = now;
    const rate = this.receivedBytes / ((now - this.startedAt) / 1000);
    const left = Math.max(0, this.totalBytes - this.doneBytes);
    const secondsLeft = this.receivedBytes > 0 && rate > 0 ? left / rate : null;
    const amounts = `${formatMB(this.doneBytes)} of ${formatMB(this.totalBytes)}`;
    this.onProgress({
      phase: "fetch",
      text: `${text} (${amounts}${secondsLeft === null ? "" : `, ${formatSeconds(secondsLeft)} left`})`,
      loadedBytes: this.doneBytes, totalBytes: this.totalBytes, secondsLeft,
      fraction: this.totalBytes ? Math.min(1, this.doneBytes / this.totalBytes) : 0,
      files: [...this.files.values()].map((entry) => ({ ...entry })),
    });
  }

  /** The verified bytes of one file, from the store or downloaded; `nbytes` when the tensor cache knows the size. */
  async bytes(url, nbytes) {
    const stored = await this.stored(url);
    if (!stored) return this.download(url, nbytes);
    const bytes = await this.verified(url, new Uint8Array(await stored.arrayBuffer()), "cache");
    this.count(bytes.length, nbytes, true);
    this.progress(fileName(url), bytes.length, bytes.length, `Read ${fileName(url)} from the browser cache`, true);
    return bytes;
  }

  count(bytes, nbytes, fromStore) {
    if (nbytes === undefined) this.totalBytes += bytes;
    this.doneBytes += bytes;
    if (fromStore) this.cachedBytes += bytes;
    else this.downloadedBytes += bytes;
  }

  /**
   * Download, verify and store one file. A download that breaks off stores nothing: the next load
   * fetches that file again, and finds the files stored before it in the cache.
   */
  async download(url, nbytes) {
    this.expected(url); // a file without a digest is refused before it is downloaded
    const name = fileName(url);
    const response = await fetchOrFail(url, { cache: "no-cache" });
    const size = nbytes ?? (Number(response.headers.get("Content-Length")) || 0);
    if (nbytes === undefined) this.totalBytes += size;
    const bytes = await readBody(response, url, (count) => {
      this.doneBytes += count;
      this.receivedBytes += count;
      this.progress(name, count, size, `Downloading ${name}`);
    }, nbytes);
    this.downloadedBytes += bytes.length;
    await this.verified(url, bytes, "server");
    await this.store(url, bytes, response.headers.get("Content-Type"));
    this.verifiedHere.add(url);
    this.progress(name, 0, size, `Downloaded ${name}`, true);
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
      if (isQuotaError(error)) throw await this.outOfStorage(this.totalBytes);
      throw error;
    }
  }

  /**
   * The quota-exceeded error for a model of `bytes`, once the files this build stored are removed:
   * without room for all of them they are no model, only taken space.
   */
  async outOfStorage(bytes) {
    this.outOfRoom = true;
    await caches.delete(this.cacheName);
    return quotaError(bytes, await navigator.storage?.estimate?.());
  }

  /** Store every weight shard not stored yet, PARALLEL_DOWNLOADS downloads at a time. */
  async fetchShards() {
    const queue = this.shardUrls();
    const next = async () => {
      for (let file = queue.shift(); file && !this.outOfRoom; file = queue.shift()) {
        if (await this.stored(file.url)) {
          this.count(file.nbytes, file.nbytes, true);
          this.progress(fileName(file.url), file.nbytes, file.nbytes, "Found the weights in the browser cache");
        } else {
          await this.download(file.url, file.nbytes);
        }
      }
    };
    await Promise.all(Array.from({ length: PARALLEL_DOWNLOADS }, next));
  }

  /** The stored shards in order, verified, as {shard, bytes}, one at a time (after fetchShards). */
  async *storedShards() {
    for (const [index, { url }] of this.shardUrls().entries()) {
      const stored = await this.stored(url);
      if (!stored) throw new EngineError("quota-exceeded", "The browser evicted the model's files while it loaded; reload the page.");
      let bytes = new Uint8Array(await stored.arrayBuffer());
      if (!this.verifiedHere.has(url)) bytes = await this.verified(url, bytes, "cache");
      this.memory.delete(url);
      yield { shard: this.tensorCache.records[index], bytes };
    }
  }

  /**
   * Drop the caches of other builds of this model (they can never be used again): those named for
   * its model id whose every file lies in its folder, so that an app config that reuses the id for
   * a model elsewhere never clears this one's builds.
   */
  async forgetOtherBuilds() {
    if (typeof caches === "undefined") return;
    const prefix = `${CACHE_PREFIX}:${this.record.model_id}:`;
    for (const name of await caches.keys()) {
      if (name.startsWith(prefix) && name !== this.cacheName && await this.holdsOnlyThisModel(name)) {
        await caches.delete(name);
      }
    }
  }

  async holdsOnlyThisModel(cacheName) {
    const requests = await (await caches.open(cacheName)).keys();
    return requests.every((request) => request.url.startsWith(this.folderUrl));
  }
}
