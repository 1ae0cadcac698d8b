// A model's jinja chat template, rendered with @huggingface/jinja as kiln/chat_template.py renders
// it natively: trim_blocks and lstrip_blocks, transformers' `tojson` (no HTML escaping, an
// `indent`), `raise_exception` and `strftime_now` are @huggingface/jinja's own; the special tokens
// come from tokenizer_config.json. Ordinary chats are laid out from the conv_template
// (chat-format.js); the jinja template is rendered only for what a conv_template cannot express:
// tools.
//
// Kiln's build writes the template into tokenizer_config.json (kiln/compile/chat_config/configure.py), whichever
// file the checkpoint kept it in, so that is the one file read here.
//
// A template is code that came with the model. @huggingface/jinja interprets it without access to
// JavaScript's globals. What is bounded here is the rendered text (MAX_RENDERED_CHARS, as MAX_TEXT
// natively). Not bounded: the time a render takes and the memory it uses along the way, short of
// the JavaScript engine's own limits (a RangeError, reported like any other failure of the
// template). A runaway render holds only the engine's worker, which unloading terminates.
import { EngineError } from "./errors.js";

export const TOKENIZER_CONFIG = "tokenizer_config.json";
const MAX_RENDERED_CHARS = 1 << 23;
const SPECIAL_TOKEN_KEYS = ["bos_token", "eos_token", "unk_token", "pad_token"];

const badModel = (message) => new EngineError("bad-model", `${TOKENIZER_CONFIG}: ${message}`);

/** The default template's source in a tokenizer config's `chat_template`: a string, or named templates. */
function templateSource(config) {
  let source = config.chat_template;
  if (Array.isArray(source)) {
    const named = new Map(source.filter((t) => typeof t === "object" && t !== null).map((t) => [t.name, t.template]));
    if (!named.has("default")) {
      throw badModel(`named chat templates (${[...named.keys()].join(", ")}) but none is called 'default'`);
    }
    source = named.get("default");
  }
  if (source != null && typeof source !== "string") {
    throw badModel(`chat_template should be a string or named templates, got ${typeof source}`);
  }
  return source || null;
}

// Python's jinja2 (the native renderer) gives these filters an undefined value as an empty string
// (Gemma 4's template writes `value['type'] | upper` for a property without a type);
// @huggingface/jinja throws. `alignUndefined` makes it do as jinja2 does.
const STRING_FILTERS = new Set(["upper", "lower", "trim", "title", "capitalize", "string"]);
const aligned = new WeakSet();

function alignUndefined({ Interpreter, Environment, parse, tokenize }) {
  if (aligned.has(Interpreter)) return;
  const empty = new Interpreter(new Environment()).run(parse(tokenize(""))); // @huggingface/jinja's ""
  const applyFilter = Interpreter.prototype.applyFilter;
  Interpreter.prototype.applyFilter = function (operand, filterNode, environment) {
    const name = filterNode.type === "Identifier" ? filterNode.value : filterNode.callee?.value;
    const asEmpty = operand?.type === "UndefinedValue" && STRING_FILTERS.has(name);
    return applyFilter.call(this, asEmpty ? empty : operand, filterNode, environment);
  };
  aligned.add(Interpreter);
}

/** A special token as text: a string, or an added token's {content}. */
function specialTokenText(key, value) {
  const text = typeof value === "object" && value !== null ? value.content : value;
  if (text != null && typeof text !== "string") throw badModel(`${key} should be a string or {"content": string}`);
  return text ?? "";
}

export class ChatTemplate {
  /**
   * The template of a tokenizer_config.json (its bytes), or null when it has none (a base model).
   * `jinja` is the @huggingface/jinja module.
   */
  static fromTokenizerConfig(bytes, jinja) {
    let config;
    try {
      config = JSON.parse(new TextDecoder().decode(bytes));
    } catch (error) {
      throw badModel(`malformed JSON: ${error.message}`);
    }
    if (typeof config !== "object" || config === null || Array.isArray(config)) throw badModel("not a JSON object");
    const source = templateSource(config);
    if (source === null) return null;
    alignUndefined(jinja);
    let template;
    try {
      template = new jinja.Template(source);
    } catch (error) {
      throw badModel(`the chat_template does not parse: ${error.message}`);
    }
    const specialTokens = Object.fromEntries(SPECIAL_TOKEN_KEYS.map((key) => [key, specialTokenText(key, config[key])]));
    return new ChatTemplate(source, template, specialTokens);
  }

  constructor(source, template, specialTokens) {
    this.source = source;
    this.template = template;
    this.specialTokens = specialTokens;
  }

  /** The conversation as the template writes it, ending with the generation prompt; `tools` shown when given. */
  render(messages, tools) {
    let text;
    try {
      text = this.template.render({ messages, ...(tools ? { tools } : {}), add_generation_prompt: true, ...this.specialTokens });
    } catch (error) {
      // The template's own raise_exception (a role it does not know, …) throws here too.
      throw new EngineError("bad-request", `The chat template refuses or fails on these messages: ${error.message}`);
    }
    if (text.length > MAX_RENDERED_CHARS) {
      throw new EngineError("bad-request", `The chat template was stopped: its output passes ${MAX_RENDERED_CHARS} characters`);
    }
    return text;
  }
}
