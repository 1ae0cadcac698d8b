// Embeddings in the browser: an embedding model's library (kiln/models/embedding.py) behind OpenAI's
// embeddings request and response, as WebLLM's `engine.embeddings.create` takes and gives them.
// The same contract as the native engine's, step by step (kiln/embeddings.py):
// - each input is tokenized without special tokens, cut on the right to leave room for them, then
//   wrapped in the ones the tokenizer adds to a single text (the config's prefix and suffix ids);
// - inputs run in batches of at most `max_batch_size`, longest first, each padded to its longest
//   with an attention mask;
// - the pooled vector is cut to `dimensions`, then scaled to unit length when the model normalizes.
import { EngineError } from "./errors.js";
import { LibrarySession } from "./library-session.js";

export const MOST_INPUTS = 2048;
const ENCODING_FORMATS = ["float", "base64"];
const shown = (value) => String(JSON.stringify(value) ?? value).slice(0, 40);

/** OpenAI's embeddings request, checked: {texts, dimensions, encodingFormat}. */
export function embeddingRequestFrom(request) {
  let texts = request?.input;
  texts = typeof texts === "string" ? [texts] : texts;
  if (!Array.isArray(texts) || texts.length === 0) {
    throw new EngineError("bad-request", "input should be a string or a non-empty list of strings");
  }
  if (texts.length > MOST_INPUTS) {
    throw new EngineError("bad-request", `input holds ${texts.length} texts; a request takes at most ${MOST_INPUTS}`);
  }
  texts.forEach((text, index) => {
    if (typeof text !== "string" || text.length === 0) {
      throw new EngineError("bad-request", `input[${index}] should be a non-empty string, got ${shown(text)}`);
    }
  });
  const dimensions = request.dimensions ?? null;
  if (dimensions !== null && !Number.isInteger(dimensions)) {
    throw new EngineError("bad-request", `dimensions should be a whole number, got ${shown(dimensions)}`);
  }
  const encodingFormat = request.encoding_format || "float";
  if (!ENCODING_FORMATS.includes(encodingFormat)) {
    throw new EngineError("bad-request", `encoding_format should be float or base64, got ${shown(encodingFormat)}`);
  }
  return { texts, dimensions, encodingFormat };
}

/** The width of the vectors a request gets: the model's, or one of its Matryoshka lengths. */
export function embeddingWidth(settings, dimensions) {
  if (dimensions === null || dimensions === settings.dimensions) return settings.dimensions;
  if (!settings.matryoshka_dimensions.includes(dimensions)) {
    const allowed = [settings.dimensions, ...settings.matryoshka_dimensions].join(", ");
    throw new EngineError("bad-request", `dimensions ${dimensions}: this model gives embeddings of ${allowed}`);
  }
  return dimensions;
}

/** An input's ids as the model runs them: cut on the right, wrapped in the special tokens. */
export function modelTokenIds(settings, textIds) {
  const room = settings.max_sequence_length - settings.prefix_token_ids.length - settings.suffix_token_ids.length;
  return [...settings.prefix_token_ids, ...Array.from(textIds).slice(0, room), ...settings.suffix_token_ids];
}

/** Indices of inputs in batches of at most `most`, longest first (a stable sort, as Python's). */
export function batches(lengths, most) {
  const order = lengths.map((_, index) => index).sort((a, b) => lengths[b] - lengths[a]);
  return Array.from({ length: Math.ceil(order.length / most) }, (_, i) => order.slice(i * most, (i + 1) * most));
}

/** A pooled vector cut to `width`, at unit length when the model normalizes (float32, as natively). */
export function finishedVector(pooled, width, normalize) {
  const vector = Float32Array.from(pooled.subarray(0, width));
  if (normalize) {
    const norm = Math.fround(Math.sqrt(vector.reduce((sum, value) => sum + value * value, 0)));
    const scale = Math.max(norm, 1e-12);
    for (let i = 0; i < vector.length; i += 1) vector[i] = Math.fround(vector[i] / scale);
  }
  return vector;
}

/** A vector as OpenAI sends it: numbers, or base64 of its little-endian float32 bytes. */
export function encodedVector(vector, encodingFormat) {
  if (encodingFormat === "float") return Array.from(vector);
  const bytes = new Uint8Array(vector.buffer, vector.byteOffset, vector.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return globalThis.btoa(binary);
}

/** An embedding model's library on one device: token ids in, pooled vectors out. */
export class EmbeddingSession extends LibrarySession {
  async initialize(shards, onUpload) {
    await this.open(["sentence_embeddings"], shards, onUpload);
  }

  /** One pooled vector per input (each within the model's longest input): Float32Arrays of the model's width. */
  async pooled(inputs, settings) {
    const vectors = new Array(inputs.length);
    for (const batch of batches(inputs.map((ids) => ids.length), settings.max_batch_size)) {
      const rows = await this.runBatch(batch.map((index) => inputs[index]));
      batch.forEach((index, row) => { vectors[index] = rows[row]; });
    }
    return vectors;
  }

  async runBatch(inputs) {
    const tvm = this.tvm;
    const longest = Math.max(...inputs.map((ids) => ids.length));
    const ids = new Int32Array(inputs.length * longest);
    const mask = new Int32Array(inputs.length * longest);
    inputs.forEach((input, row) => {
      ids.set(input, row * longest);
      mask.fill(1, row * longest, row * longest + input.length);
    });
    let pooled;
    tvm.beginScope();
    try {
      const shape = [inputs.length, longest];
      const result = this.functions.sentence_embeddings(tvm.empty(shape, "int32", this.device).copyFrom(ids),
        tvm.empty(shape, "int32", this.device).copyFrom(mask), this.params);
      pooled = this.onHost(result);
    } finally {
      tvm.endScope();
    }
    await this.device.sync();
    try {
      const width = pooled.shape[1];
      const flat = new Float32Array(tvm.memory.memory.buffer, pooled.getCPUDataAddress(), inputs.length * width);
      return inputs.map((_, row) => flat.slice(row * width, (row + 1) * width));
    } finally {
      pooled.dispose();
    }
  }
}

/** OpenAI's embeddings response to `request` from the engine's model (its `model` field is not read). */
export async function createEmbeddings(engine, request) {
  const settings = engine.chatConfig.embedding;
  const { texts, dimensions, encodingFormat } = embeddingRequestFrom(request);
  const width = embeddingWidth(settings, dimensions);
  const inputs = texts.map((text) => modelTokenIds(settings, engine.tokenizer.encode(text)));
  const pooled = await engine.session.pooled(inputs, settings);
  const promptTokens = inputs.reduce((sum, ids) => sum + ids.length, 0);
  return {
    object: "list",
    data: pooled.map((vector, index) => ({
      object: "embedding", index, embedding: encodedVector(finishedVector(vector, width, settings.normalize), encodingFormat),
    })),
    model: engine.record.model_id,
    usage: { prompt_tokens: promptTokens, total_tokens: promptTokens },
  };
}
