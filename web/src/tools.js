// Tool calls: OpenAI's `tools` and `tool_choice`, as kiln/tools.py defines them natively (see its
// module doc): the same call formats recognized in the chat template, the same checks and error
// messages, the same formats holding the reply, and calls read out of the reply the same way.
// The tools are bounded like a response_format (MAX_FORMAT_CHARS of JSON), and so is each format
// they make, whichever call format the model has.
import { messageText } from "./chat-format.js";
import { EngineError } from "./errors.js";
import * as gemma4Calls from "./gemma4-calls.js";
import { fromGrammar, fromSchema, MAX_FORMAT_CHARS, structuralTagFrom } from "./structured.js";

const FUNCTION_NAME = /^[A-Za-z0-9_-]{1,64}$/;
const TOOL_CHOICES = ["none", "auto", "required"];
const CALL_ID_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const CALL_ID_LENGTH = 9; // Mistral's templates refuse other lengths; any client takes these
const ROLES = new Set(["system", "user", "assistant", "tool"]);

const badRequest = (message) => new EngineError("bad-request", message);
const isObject = (value) => typeof value === "object" && value !== null && !Array.isArray(value);

/** How a family's model writes one call: `opening`, the call, `closing` (ToolCallFormat natively). */
class ToolCallFormat {
  constructor(name, { templateMarker, opening, closing }) {
    Object.assign(this, { name, templateMarker, opening, closing });
  }

  /** What the model writes first when it starts a call. */
  get trigger() {
    return this.opening;
  }

  /** Tokens a call is written with that the grammar must let the model write, special or not. */
  get marks() {
    return [];
  }

  /** {outside: the text outside calls, calls: [{name, arguments}] of each complete call in it}. */
  callsIn(text) {
    const calls = [];
    const outside = [];
    let position = 0;
    for (let start = text.indexOf(this.trigger); start >= 0; start = text.indexOf(this.trigger, position)) {
      // A reply may end right after a call, without the closing.
      let end = this.closing ? text.indexOf(this.closing, start + this.opening.length) : -1;
      if (end < 0) end = text.length;
      const call = this.parsed(text.slice(start + this.opening.length, end));
      if (call === null) break;
      outside.push(text.slice(position, start));
      calls.push(call);
      position = Math.min(end + this.closing.length, text.length);
    }
    outside.push(text.slice(position));
    return { outside: outside.join("").trim(), calls };
  }
}

/** A call as JSON: `opening` + {"name": …, `argumentsKey`: {…}} + `closing`. */
class JSONCallFormat extends ToolCallFormat {
  constructor(name, { argumentsKey = "arguments", ...format }) {
    super(name, format);
    this.argumentsKey = argumentsKey;
  }

  get trigger() {
    return this.opening || '{"name": ';
  }

  parsed(body) {
    let call;
    try {
      call = JSON.parse(body);
    } catch {
      return null;
    }
    if (!isObject(call) || typeof call.name !== "string" || !(this.argumentsKey in call)) return null;
    return { name: call.name, arguments: call[this.argumentsKey] };
  }

  /** The structural tag that holds a call of `name` once the model starts it. */
  tag(name, parameters) {
    const begin = `${this.opening}{"name": ${JSON.stringify(name)}, "${this.argumentsKey}": `;
    return { begin, content: { type: "json_schema", json_schema: parameters }, end: `}${this.closing}` };
  }

  /** What holds a reply that must be one call (after the opening written for it) of one of `functions`. */
  forced(functions) {
    const key = this.argumentsKey;
    const calls = [...functions].map(([name, schema]) =>
      ({ type: "object", properties: { name: { const: name }, [key]: schema }, required: ["name", key] }));
    return fromSchema(calls.length === 1 ? calls[0] : { anyOf: calls });
  }
}

/** Gemma 4's `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>` (gemma4-calls.js). */
class Gemma4CallFormat extends ToolCallFormat {
  get marks() {
    return [this.opening, this.closing, gemma4Calls.QUOTE];
  }

  parsed(body) {
    return gemma4Calls.parseCall(body);
  }

  tag(name, parameters) {
    const content = { type: "grammar", grammar: gemma4Calls.argumentsGrammar(parameters) };
    return { begin: `${this.opening}call:${name}{`, content, end: `}${this.closing}` };
  }

  forced(functions) {
    return fromGrammar(gemma4Calls.callsGrammar(functions));
  }
}

export const TOOL_CALL_FORMATS = [
  // Qwen2.5, Qwen3, Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
  new JSONCallFormat("hermes", { templateMarker: "<tool_call>", opening: "<tool_call>\n", closing: "\n</tool_call>" }),
  // Llama 3.1 and later: the reply is the call's JSON.
  new JSONCallFormat("llama3_json", { templateMarker: '"parameters": dictionary of argument name', opening: "",
    closing: "", argumentsKey: "parameters" }),
  new Gemma4CallFormat("gemma4", { templateMarker: "<|tool_call>call:", opening: "<|tool_call>", closing: "<tool_call|>" }),
];

export function toolCallFormat(templateSource) {
  return TOOL_CALL_FORMATS.find((format) => templateSource.includes(format.templateMarker)) ?? null;
}

function newCallId() {
  return Array.from(crypto.getRandomValues(new Uint32Array(CALL_ID_LENGTH)),
    (byte) => CALL_ID_ALPHABET[byte % CALL_ID_ALPHABET.length]).join("");
}

/**
 * Checked `tools` and `tool_choice`: `functions` maps each name to its parameter schema; `choice`
 * is "none", "auto", "required" or a function's name. Null when the request has no tools (a
 * tool_choice of "none" or "auto" is then moot).
 */
export function toolRequestFrom(tools, toolChoice) {
  if (tools == null || (Array.isArray(tools) && tools.length === 0)) {
    if (![undefined, null, "none", "auto"].includes(toolChoice)) throw badRequest("tool_choice needs tools");
    return null;
  }
  if (!Array.isArray(tools)) throw badRequest("tools must be a list of {'type': 'function', 'function': {...}}");
  const functions = new Map();
  tools.forEach((tool, i) => {
    const fn = isObject(tool) && tool.type === "function" ? tool.function : undefined;
    if (!isObject(fn)) throw badRequest(`tools[${i}] must be {'type': 'function', 'function': {...}}`);
    if (typeof fn.name !== "string" || !FUNCTION_NAME.test(fn.name)) {
      throw badRequest(`tools[${i}].function.name must be 1 to 64 letters, digits, '_' or '-'`);
    }
    if (functions.has(fn.name)) throw badRequest(`tools[${i}]: a second function named '${fn.name}'`);
    const parameters = fn.parameters ?? { type: "object", properties: {} };
    if (!isObject(parameters)) throw badRequest(`tools[${i}].function.parameters must be a JSON Schema object`);
    functions.set(fn.name, parameters);
  });
  const request = new ToolRequest(tools, functions, choose(toolChoice, functions));
  checkSize(request);
  return request;
}

/** The tools' JSON, and every format they make (for any call format), within MAX_FORMAT_CHARS. */
function checkSize(request) {
  try {
    if (JSON.stringify(request.tools).length > MAX_FORMAT_CHARS) {
      throw badRequest(`the tools are longer than ${MAX_FORMAT_CHARS} characters of JSON`);
    }
    for (const callFormat of TOOL_CALL_FORMATS) request.responseFormat(callFormat);
  } catch (error) {
    if (error instanceof RangeError) throw badRequest("the tools nest too deeply");
    if (error.code !== "bad-response-format") throw error;
    throw badRequest(`the tools make a format too long: ${error.message}`);
  }
}

function choose(toolChoice, functions) {
  if (toolChoice == null) return "auto";
  if (TOOL_CHOICES.includes(toolChoice)) return toolChoice;
  const name = isObject(toolChoice) && toolChoice.type === "function" && isObject(toolChoice.function)
    ? toolChoice.function.name : undefined;
  if (typeof name !== "string") {
    throw badRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}");
  }
  if (!functions.has(name)) throw badRequest(`tool_choice names '${name}', which is not among the tools`);
  return name;
}

class ToolRequest {
  constructor(tools, functions, choice) {
    this.tools = tools;
    this.functions = functions;
    this.choice = choice;
  }

  /** What holds the reply ({kind, text}, as structured.js compiles it): calls' arguments to their
   * schemas (auto), or the whole reply to one call; null for none. */
  responseFormat(callFormat) {
    if (this.choice === "none") return null;
    if (this.choice === "auto") {
      const tags = [...this.functions].map(([name, schema]) => callFormat.tag(name, schema));
      return structuralTagFrom(tags, [callFormat.trigger]);
    }
    const names = this.choice === "required" ? [...this.functions.keys()] : [this.choice];
    return callFormat.forced(new Map(names.map((name) => [name, this.functions.get(name)])));
  }

  /** Text written into the prompt after the generation prompt: a forced call's opening. */
  replyOpening(callFormat) {
    return this.choice === "none" || this.choice === "auto" ? "" : callFormat.opening;
  }
}

/**
 * OpenAI messages of a conversation with tools, checked as the native server checks them and
 * shaped as chat templates expect them: content as text, a call's arguments as an object.
 */
export function templateMessages(messages) {
  if (!Array.isArray(messages) || messages.length === 0) throw badRequest("messages must be a non-empty list");
  return messages.map((message, index) => {
    if (!ROLES.has(message?.role)) {
      throw badRequest(`messages[${index}].role must be one of ${[...ROLES].join(", ")}`);
    }
    const calls = message.role === "assistant" && message.tool_calls != null ? templateCalls(message.tool_calls, index) : [];
    const callsOnly = calls.length > 0 && message.content == null;
    const checked = { role: message.role, content: callsOnly ? "" : messageText(message.content, index) };
    if (calls.length > 0) checked.tool_calls = calls;
    if (message.role === "tool") {
      if (typeof message.tool_call_id !== "string") throw badRequest(`messages[${index}].tool_call_id must be a string`);
      checked.tool_call_id = message.tool_call_id;
    }
    return checked;
  });
}

function templateCalls(calls, index) {
  const name = `messages[${index}].tool_calls`;
  if (!Array.isArray(calls)) throw badRequest(`${name} must be a list`);
  return calls.map((call) => {
    const fn = call?.function;
    if (!(isObject(fn) && typeof call.id === "string" && call.type === "function" && typeof fn.name === "string"
      && typeof fn.arguments === "string")) {
      throw badRequest(`${name} must be a list of {'id', 'type': 'function', 'function': {'name', 'arguments'}}`);
    }
    let args;
    try {
      args = JSON.parse(fn.arguments);
    } catch {
      throw badRequest(`${name}: the arguments of '${fn.name}' are not JSON text`);
    }
    return { id: call.id, type: "function", function: { name: fn.name, arguments: args } };
  });
}

/**
 * Streams a reply's text until a call may be starting (the format's trigger, or a tail that could
 * become it), then holds the rest back to be read as calls when the reply ends.
 */
export class ContentBeforeCalls {
  constructor(callFormat, functions, opening = "") {
    this.callFormat = callFormat;
    this.functions = functions;
    this.trigger = callFormat.trigger;
    this.held = "";
    this.inCall = false;
    this.feed(opening);
  }

  /** The part of `text` (with what was held before) that can be shown now. */
  feed(text) {
    this.held += text;
    if (this.inCall) return "";
    let at = this.held.indexOf(this.trigger);
    if (at >= 0) {
      this.inCall = true;
    } else {
      let tail = Math.min(this.held.length, this.trigger.length - 1);
      while (tail > 0 && !this.trigger.startsWith(this.held.slice(-tail))) --tail;
      at = this.held.length - tail;
    }
    const safe = this.held.slice(0, at);
    this.held = this.held.slice(at);
    return safe;
  }

  /** {content: the text not streamed yet, toolCalls: OpenAI's tool_calls}. */
  finish() {
    const { outside, calls } = this.callFormat.callsIn(this.held);
    // A call to a function it was not given: all text.
    if (calls.some((call) => !this.functions.has(call.name))) return { content: this.held, toolCalls: [] };
    return {
      content: outside,
      toolCalls: calls.map((call) => ({
        id: newCallId(), type: "function", function: { name: call.name, arguments: JSON.stringify(call.arguments) },
      })),
    };
  }
}
