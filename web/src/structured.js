// Structured output: a reply held to a JSON Schema, to any JSON object, or to an EBNF grammar.
//
// The same definition as kiln/structured.py, with @mlc-ai/web-xgrammar 0.1.27 (built from the
// xgrammar 0.1.27 the native side pins): the same accepted `response_format` shapes and limits,
// the same token table, the same compile options and the same mask (XGrammar's, and well-formed
// UTF-8, and in JSON no raw control byte), so greedy constrained replies are the same tokens
// natively and in the browser.
import { EngineError } from "./errors.js";

// A format is compiled while the request waits; bound what a client can make it compile.
export const MAX_FORMAT_CHARS = 64 * 1024;
// Any JSON object: the schema {"type": "object"}, not strict, so that it may have any properties.
const ANY_OBJECT_SCHEMA = '{"type": "object"}';
const SCHEMA_NAME = /^[A-Za-z0-9_-]{1,64}$/;
const VOCAB_TYPES = ["raw", "byte_fallback", "byte_level"];
// Python's indent=None (one line); web-xgrammar reads an undefined indent as 2.
const ONE_LINE = -1;
const XGRAMMAR_LOCATION = /^\[[^\]]*\] \S+:\d+: /; // "[FATAL] /project/cpp/json_schema_converter.cc:885: "

const problem = (message) => new EngineError("bad-response-format", message);

/**
 * OpenAI's `response_format` (and WebLLM's: a schema string in json_object, or {type: "grammar",
 * grammar: EBNF}) as {kind, text}: "json_object" (any object), "json_schema" (`text` is the
 * schema as JSON) or "grammar" (`text` is EBNF in XGrammar's dialect); null for plain text.
 */
export function responseFormatFrom(value) {
  if (!isObject(value) || typeof value.type !== "string") {
    throw problem("response_format must be an object with a string 'type'");
  }
  switch (value.type) {
    case "text":
      return null;
    case "json_object":
      return value.schema == null ? { kind: "json_object", text: "" } : fromSchema(value.schema);
    case "json_schema": {
      const spec = value.json_schema;
      if (!isObject(spec)) throw problem("response_format.json_schema must be an object with 'name' and 'schema'");
      if (typeof spec.name !== "string" || !SCHEMA_NAME.test(spec.name)) {
        throw problem("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'");
      }
      if (spec.strict !== undefined && typeof spec.strict !== "boolean") {
        throw problem("response_format.json_schema.strict must be true or false");
      }
      if (!("schema" in spec)) throw problem("response_format.json_schema.schema is missing");
      return fromSchema(spec.schema);
    }
    case "grammar":
      return fromGrammar(value.grammar);
    default:
      throw problem(`response_format.type must be text, json_object, json_schema or grammar, not '${value.type}'`);
  }
}

function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** A JSON Schema, as an object or as its JSON text (passed on as written: XGrammar reads property order). */
export function fromSchema(schema) {
  let text = schema;
  if (typeof schema === "string") {
    if (schema.length > MAX_FORMAT_CHARS) throw problem(`the JSON schema is longer than ${MAX_FORMAT_CHARS} characters`);
    try {
      schema = JSON.parse(schema);
    } catch (error) {
      throw problem(`the JSON schema is not JSON: ${error.message}`);
    }
  } else {
    text = JSON.stringify(schema);
  }
  if (!isObject(schema) && typeof schema !== "boolean") throw problem("the JSON schema must be an object");
  if (text.length > MAX_FORMAT_CHARS) throw problem(`the JSON schema is longer than ${MAX_FORMAT_CHARS} characters`);
  return { kind: "json_schema", text };
}

/**
 * Free text in which each tag ({begin, content, end}), once its trigger appears, runs from its
 * `begin` through text fitting its `content` (a JSON schema or a grammar, in XGrammar's structural
 * tag format) to its `end` (how tools.js holds tool calls), bounded as natively.
 */
export function structuralTagFrom(tags, triggers) {
  const tagged = tags.map((tag) => ({ type: "tag", ...tag }));
  const text = JSON.stringify({ type: "structural_tag", format: { type: "triggered_tags", triggers, tags: tagged } });
  if (text.length > MAX_FORMAT_CHARS) throw problem(`the structural tag is longer than ${MAX_FORMAT_CHARS} characters`);
  return { kind: "structural_tag", text };
}

export function fromGrammar(grammar) {
  if (typeof grammar !== "string" || !grammar.trim()) throw problem("the grammar must be a non-empty EBNF string");
  if (grammar.length > MAX_FORMAT_CHARS) throw problem(`the grammar is longer than ${MAX_FORMAT_CHARS} characters`);
  return { kind: "grammar", text: grammar };
}

/** Byte-level BPE's alphabet: each byte is a printable character (GPT-2's bytes_to_unicode). */
function gpt2ByteDecoder() {
  const printable = (byte) => (byte >= 0x21 && byte < 0x7f) || (byte >= 0xa1 && byte < 0xad) || byte >= 0xae;
  const decoder = new Map();
  let others = 0;
  for (let byte = 0; byte < 256; ++byte) {
    decoder.set(String.fromCodePoint(printable(byte) ? byte : 0x100 + others++), byte);
  }
  return decoder;
}

const BYTE_FALLBACK_TOKEN = /^<0x([0-9A-Fa-f]{2})>$/;
const utf8 = new TextEncoder();

/** The bytes a token stands for, read as XGrammar reads it. */
function tokenBytes(token, vocabType, byteDecoder) {
  if (vocabType === "byte_level") {
    return Array.from(token, (c) => (byteDecoder.has(c) ? [byteDecoder.get(c)] : [...utf8.encode(c)])).flat();
  }
  if (vocabType === "byte_fallback") {
    const byte = BYTE_FALLBACK_TOKEN.exec(token);
    return byte ? [parseInt(byte[1], 16)] : [...utf8.encode(token.replaceAll("\u2581", " "))];
  }
  return [...utf8.encode(token)];
}

// Well-formed UTF-8 (Unicode's Table 3-7) as an automaton: per state, [first byte, last byte, next
// state]. State 0 is "between characters"; the others expect continuation bytes.
export const UTF8_STEPS = [
  [[0x00, 0x7f, 0], [0xc2, 0xdf, 1], [0xe0, 0xe0, 3], [0xe1, 0xec, 2], [0xed, 0xed, 4], [0xee, 0xef, 2],
    [0xf0, 0xf0, 6], [0xf1, 0xf3, 5], [0xf4, 0xf4, 7]],
  [[0x80, 0xbf, 0]], [[0x80, 0xbf, 1]], [[0xa0, 0xbf, 1]], [[0x80, 0x9f, 1]],
  [[0x80, 0xbf, 2]], [[0x90, 0xbf, 2]], [[0x80, 0x8f, 2]],
];
const UTF8_STATES = UTF8_STEPS.length;
const UTF8_NEXT = UTF8_STEPS.map((steps) => Array.from({ length: 256 },
  (_, byte) => steps.find(([low, high]) => low <= byte && byte <= high)?.[2] ?? -1));

/** The automaton's state after `bytes` from `state`; -1 when they cannot continue well-formed UTF-8. */
function utf8After(state, bytes) {
  for (const byte of bytes) {
    state = UTF8_NEXT[state][byte];
    if (state < 0) return -1;
  }
  return state;
}

/**
 * Ids of the special added tokens of a tokenizer.json (its bytes), but for `marks` (the tokens a
 * tool call is written with: Gemma 4's <|tool_call> and <|"|>); none for a tokenizer.model.
 */
export function specialTokenIds(tokenizerJSON, marks = []) {
  if (!tokenizerJSON) return new Set();
  const { added_tokens: added = [] } = JSON.parse(new TextDecoder().decode(tokenizerJSON));
  return new Set(added.filter((token) => token.special && !marks.includes(token.content)).map((token) => token.id));
}

/**
 * A model's tokens as XGrammar and the masks see them, as `TokenTable` in kiln/structured.py.
 *
 * `strings`: the tokenizer's tokens by id, special tokens as "" (XGrammar never allows those,
 * except its stop tokens at the end). `utf8Next[state × vocabSize + token]`: the UTF-8 automaton's
 * state after the token, -1 if it would break a character. `hasControl[token]`: 1 when the token
 * holds a byte below 0x20, which a compact JSON reply never holds raw.
 */
export class TokenTable {
  constructor(tokenizer, specialIds, vocabType, vocabSize) {
    this.vocabSize = vocabSize;
    this.strings = Array.from({ length: tokenizer.getVocabSize() },
      (_, id) => (specialIds.has(id) ? "" : tokenizer.idToToken(id) ?? ""));
    const byteDecoder = gpt2ByteDecoder();
    this.utf8Next = new Int8Array(UTF8_STATES * vocabSize).fill(-1);
    this.utf8Next.fill(0, 0, vocabSize); // a special token, and ids past the tokenizer's, end no character
    this.hasControl = new Uint8Array(vocabSize);
    this.strings.forEach((token, id) => {
      const bytes = tokenBytes(token, vocabType, byteDecoder);
      this.hasControl[id] = bytes.some((byte) => byte < 0x20) ? 1 : 0;
      if (bytes.every((byte) => byte < 0x80)) return;
      for (let state = 0; state < UTF8_STATES; ++state) this.utf8Next[state * vocabSize + id] = utf8After(state, bytes);
    });
  }
}

/**
 * web-xgrammar is built without C++ exceptions: on a schema or grammar it rejects, it prints why
 * on console.error ("[FATAL] …/json_schema_converter.cc:885: Check failed: … : Type should be a
 * string") and aborts the call with a bare "Aborted()", leaving its wasm stack unwound (some tens
 * of aborts later, every call fails with "memory access out of bounds"). So the reason is read
 * from the console, and an instance that aborted is replaced by a fresh one.
 */
let printed = null; // lines printed while an xgrammar call runs
let listening = false;
function listenToConsoleErrors() {
  if (listening) return;
  const print = console.error;
  console.error = (...args) => (printed ? printed.push(args.join(" ")) : print(...args));
  listening = true;
}

/**
 * Compiles response formats against one model's token table, as `GrammarCompiler` in
 * kiln/structured.py; caches the compiled formats. `loadXgrammar({fresh})` returns the
 * @mlc-ai/web-xgrammar module (a new wasm instance of it with `fresh`).
 */
export class Grammars {
  constructor({ loadXgrammar, tokenizer, tokenizerJSON, chatConfig, stopTokenIds, marks = async () => [] }) {
    this.loadXgrammar = loadXgrammar;
    this.marks = marks; // async () → the special tokens the model's tool calls are written with
    this.tokenizer = tokenizer;
    this.tokenizerJSON = tokenizerJSON;
    this.chatConfig = chatConfig;
    this.vocabSize = chatConfig.vocab_size;
    this.stopTokenIds = [...stopTokenIds].sort((a, b) => a - b);
    this.table = null;
    this.compiler = null;
    this.compiled = new Map();
  }

  async compilerOnce({ fresh = false } = {}) {
    if (this.compiler && !fresh) return this.compiler;
    const info = this.chatConfig.tokenizer_info;
    if (!isObject(info) || !VOCAB_TYPES.includes(info.token_postproc_method)) {
      throw new EngineError("bad-model", "mlc-chat-config.json has no usable tokenizer_info; rebuild the model with kiln compile");
    }
    listenToConsoleErrors();
    this.xgrammar = await this.loadXgrammar({ fresh });
    const vocabType = info.token_postproc_method;
    this.table ??= new TokenTable(this.tokenizer, specialTokenIds(this.tokenizerJSON, await this.marks()), vocabType,
      this.vocabSize);
    const tokenizerInfo = await this.xgrammar.TokenizerInfo.createTokenizerInfo(this.table.strings, vocabType,
      Boolean(info.prepend_space_in_encode), this.vocabSize, this.stopTokenIds);
    this.compiler = await this.xgrammar.GrammarCompiler.createGrammarCompiler(tokenizerInfo);
    this.compiled.clear();
    return this.compiler;
  }

  /** The compiled `format` ({kind, text}: a response format, or tools.js's "structural_tag" that holds
   * tool calls); a format XGrammar rejects is a "bad-response-format" error. */
  async compile(format) {
    const key = `${format.kind}\n${format.text}`;
    if (this.compiled.has(key)) return this.compiled.get(key);
    const compiler = await this.compilerOnce();
    printed = [];
    try {
      const compiled = format.kind === "json_object"
        ? await compiler.compileJSONSchema(ANY_OBJECT_SCHEMA, false, ONE_LINE, undefined, false)
        : format.kind === "json_schema"
          ? await compiler.compileJSONSchema(format.text, false, ONE_LINE, undefined, true)
          : format.kind === "structural_tag"
            ? await compiler.compileStructuralTag(format.text)
            : await compiler.compileGrammar(format.text);
      this.compiled.set(key, compiled);
      return compiled;
    } catch (error) {
      const reason = printed.find((line) => XGRAMMAR_LOCATION.test(line))?.replace(XGRAMMAR_LOCATION, "") ?? error.message;
      printed = null;
      await this.compilerOnce({ fresh: true });
      throw problem(`the ${formatName(format.kind)} cannot be used: ${reason}`);
    } finally {
      printed = null;
    }
  }

  /** A new reply's TokenConstraint for `format`. */
  async constraint(format) {
    const compiled = await this.compile(format);
    const matcher = await this.xgrammar.GrammarMatcher.createGrammarMatcher(compiled);
    const constraint = new TokenConstraint(matcher, this.table, format.kind.startsWith("json"));
    // e.g. "root ::= root": no text matches it
    if (!(await constraint.grammarAllows()).some((bit) => bit)) throw problem(`the ${formatName(format.kind)} accepts no text`);
    return constraint;
  }
}

const formatName = (kind) => (kind.startsWith("json") ? "JSON schema" : kind.replace("_", " "));

/**
 * One reply's place in its format, as `TokenConstraint` in kiln/structured.py: a token may come
 * next when XGrammar's mask allows it, it keeps the text well-formed UTF-8, and, in a JSON reply,
 * it holds no control byte.
 */
export class TokenConstraint {
  constructor(matcher, table, json) {
    this.matcher = matcher;
    this.table = table;
    this.excluded = json ? table.hasControl : new Uint8Array(table.vocabSize);
    this.utf8State = 0;
    this.maskSeconds = 0; // time spent computing masks, for the usage numbers
    this.steps = 0;
  }

  /** A Uint8Array with 1 for each token id XGrammar's mask allows next. */
  async grammarAllows() {
    const bitmask = await this.matcher.getNextTokenBitmask();
    const allows = new Uint8Array(this.table.vocabSize);
    for (let id = 0; id < allows.length; ++id) allows[id] = (bitmask[id >>> 5] >>> (id & 31)) & 1;
    return allows;
  }

  /** A Uint8Array with 1 for each token id that may come next. */
  async allowed() {
    const started = performance.now();
    const grammarAllows = await this.grammarAllows();
    const { vocabSize, utf8Next } = this.table;
    const row = this.utf8State * vocabSize;
    const allowed = new Uint8Array(vocabSize);
    let any = 0;
    for (let id = 0; id < vocabSize; ++id) {
      allowed[id] = grammarAllows[id] & (utf8Next[row + id] >= 0) & (this.excluded[id] ^ 1);
      any |= allowed[id];
    }
    this.maskSeconds += (performance.now() - started) / 1000;
    this.steps += 1;
    return any ? allowed : grammarAllows; // the grammar can only go on with a broken character: let it
  }

  accept(token) {
    if (!this.matcher.acceptToken(token)) {
      throw new EngineError("internal", `token ${token} does not fit the response format (the sampler chose a masked token)`);
    }
    this.utf8State = Math.max(0, this.table.utf8Next[this.utf8State * this.table.vocabSize + token]);
  }

  /**
   * How many of `tokens`, from the first, may come next one after another (speculative decoding's
   * proposals); the place in the format stays where it is (kiln/structured.py `fitting`).
   */
  fitting(tokens) {
    const { vocabSize, utf8Next } = this.table;
    let taken = 0;
    let utf8State = this.utf8State;
    for (const token of tokens) {
      const next = utf8Next[utf8State * vocabSize + token];
      if (next < 0 || this.excluded[token] || !this.matcher.acceptToken(token)) break;
      taken += 1;
      utf8State = next;
    }
    if (taken > 0) this.matcher.rollBack(taken);
    return taken;
  }

  /** The reply is complete and its stop token taken. */
  get finished() {
    return this.matcher.isTerminated();
  }

  dispose() {
    this.matcher.dispose();
  }
}
