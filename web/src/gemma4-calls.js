// Gemma 4's tool calls, as kiln/gemma4_calls.py defines them natively (see its module doc):
// `<|tool_call>call:NAME{key:value,...}<tool_call|>` in the syntax of the chat template's
// `format_argument`, the same EBNF holding a call's arguments to the function's parameter schema,
// and the same reading of a call's text.

export const QUOTE = '<|"|>';
const CALL = /^\s*call:([A-Za-z0-9_-]{1,64})\{/;
const NUMBER = /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/y;
const BARE_KEY = /[^:{}[\],\s]+/y;
const LITERALS = [["true", true], ["false", false], ["null", null]];
const MAX_LISTED_INTEGERS = 256; // an integer range narrower than this is held as the list of its values

const COMMON_RULES = String.raw`
gany ::= gstring | gnumber | "true" | "false" | "null" | garray | gobject
garray ::= "[" (gany ("," gany)*)? "]"
gobject ::= "{" gpairs "}"
gpairs ::= (gpair ("," gpair)*)?
gpair ::= [A-Za-z_] [A-Za-z0-9_]* ":" gany
gstring ::= "<|\"|>" gchar* "<|\"|>"
gchar ::= [^<] | "<" [^|]
gint ::= "0" | [1-9] [0-9]*
ginteger ::= "-"? gint
gnumber ::= "-"? gint ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
`;
const TYPE_RULES = {
  string: "gstring", integer: "ginteger", number: "gnumber", array: "garray", object: "gobject",
  boolean: '("true" | "false")', null: '"null"',
};

const isObject = (value) => typeof value === "object" && value !== null && !Array.isArray(value);
// jinja's dictsort: by key, case ignored
const byKey = ([a], [b]) => (a.toLowerCase() < b.toLowerCase() ? -1 : a.toLowerCase() > b.toLowerCase() ? 1 : 0);

/** Python's json.dumps of a number: integers without a fraction, floats with one. */
function numberText(value) {
  return Number.isInteger(value) && !Object.is(value, -0) ? String(value) : pythonFloat(value);
}

function pythonFloat(value) {
  const text = String(value);
  if (/[.e]/.test(text)) return text.replace(/e([+-])(\d)$/, "e$10$2");
  return `${text}.0`;
}

/** A JSON value as the template's format_argument writes a call's argument (keys bare). */
export function formatValue(value) {
  if (typeof value === "string") return QUOTE + value + QUOTE;
  if (value === null || typeof value === "boolean") return String(value);
  if (Array.isArray(value)) return `[${value.map(formatValue).join(",")}]`;
  if (isObject(value)) {
    return `{${Object.entries(value).sort(byKey).map(([key, item]) => `${key}:${formatValue(item)}`).join(",")}}`;
  }
  return numberText(value);
}

const literalText = (text) => JSON.stringify(text);
const literal = (value) => literalText(formatValue(value));

/** A string schema's "min,max" lengths (max may be left open), null when it bounds neither. */
function lengthBounds(schema) {
  const low = schema.minLength ?? 0;
  const high = schema.maxLength ?? null;
  if (!Number.isInteger(low) || low < 0 || (high !== null && !(Number.isInteger(high) && high >= low))) return null;
  return low === 0 && high === null ? null : `${low},${high ?? ""}`;
}

function listedIntegers(schema) {
  const { minimum: low, maximum: high } = schema;
  if (!Number.isInteger(low) || !Number.isInteger(high) || high - low < 0 || high - low >= MAX_LISTED_INTEGERS) return null;
  return Array.from({ length: high - low + 1 }, (_, i) => low + i);
}

/** EBNF rules for values of JSON schemas, named r0, r1, ... as they are made. */
class ArgumentsGrammar {
  constructor() {
    this.rules = [];
  }

  rule(body) {
    const name = `r${this.rules.length}`;
    this.rules.push(`${name} ::= ${body}`);
    return name;
  }

  value(schema) {
    if (!isObject(schema)) return "gany";
    if ("const" in schema) return literal(schema.const);
    if (Array.isArray(schema.enum) && schema.enum.length) return `(${schema.enum.map(literal).join(" | ")})`;
    for (const key of ["anyOf", "oneOf"]) {
      if (Array.isArray(schema[key]) && schema[key].length) {
        return `(${schema[key].map((branch) => this.value({ ...schema, [key]: null, ...branch })).join(" | ")})`;
      }
    }
    const kind = schema.type ?? ("properties" in schema ? "object" : null);
    if (Array.isArray(kind)) return `(${kind.map((type) => this.value({ ...schema, type })).join(" | ")})`;
    if (kind === "array" && isObject(schema.items)) {
      const item = this.rule(this.value(schema.items));
      return this.rule(`"[" (${item} ("," ${item})*)? "]"`);
    }
    if (kind === "object" && isObject(schema.properties)) return this.rule(`"{" ${this.properties(schema)} "}"`);
    const lengths = kind === "string" ? lengthBounds(schema) : null;
    if (lengths) return this.rule(`"<|\\"|>" gchar{${lengths}} "<|\\"|>"`);
    const values = kind === "integer" ? listedIntegers(schema) : null;
    if (values) return `(${values.map(literal).join(" | ")})`;
    return TYPE_RULES[kind] ?? "gany";
  }

  /** The properties of an object schema between its braces, in order, commas between. */
  properties(schema) {
    const required = Array.isArray(schema.required) ? schema.required : [];
    const pairs = Object.entries(schema.properties).map(([key, value]) =>
      [this.rule(`${literalText(`${key}:`)} ${this.value(value)}`), required.includes(key)]);
    // rest: the pairs from here on after a pair was written; first: the same before any was.
    let rest = '""';
    let first = '""';
    for (const [pair, needed] of pairs.reverse()) {
      const restAfter = rest;
      rest = this.rule(`"," ${pair} ${restAfter}` + (needed ? "" : ` | ${restAfter}`));
      first = this.rule(`${pair} ${restAfter}` + (needed ? "" : ` | ${first}`));
    }
    return first;
  }

  text(root) {
    return [`root ::= ${root}`, ...this.rules].join("\n") + COMMON_RULES;
  }
}

const hasProperties = (parameters) => isObject(parameters) && isObject(parameters.properties);

/** EBNF for what a call writes between `{` and `}`: its arguments, held to `parameters`. */
export function argumentsGrammar(parameters) {
  const grammar = new ArgumentsGrammar();
  return grammar.text(hasProperties(parameters) ? grammar.properties(parameters) : "gpairs");
}

/** EBNF for a forced call after its opening (`<|tool_call>`): one of `functions` (a Map), closed. */
export function callsGrammar(functions) {
  const grammar = new ArgumentsGrammar();
  const calls = [...functions].map(([name, parameters]) => {
    const body = grammar.rule(hasProperties(parameters) ? grammar.properties(parameters) : "gpairs");
    return `${literalText(`call:${name}{`)} ${body} "}"`;
  });
  return grammar.text(`(${calls.join(" | ")}) "<tool_call|>"`);
}

/** Reads one value of the call syntax from `text` at `at`; throws where it is not one. */
class Reader {
  constructor(text, at = 0) {
    this.text = text;
    this.at = at;
  }

  skipSpace() {
    while (this.at < this.text.length && /\s/.test(this.text[this.at])) ++this.at;
  }

  take(expected) {
    this.skipSpace();
    if (!this.text.startsWith(expected, this.at)) return false;
    this.at += expected.length;
    return true;
  }

  quoted() {
    const end = this.text.indexOf(QUOTE, this.at);
    if (end < 0) throw new SyntaxError("an unclosed string");
    const value = this.text.slice(this.at, end);
    this.at = end + QUOTE.length;
    return value;
  }

  value() {
    this.skipSpace();
    if (this.take(QUOTE)) return this.quoted();
    if (this.take("{")) return Object.fromEntries(this.items("}", () => this.pair()));
    if (this.take("[")) return this.items("]", () => this.value());
    for (const [word, value] of LITERALS) if (this.take(word)) return value;
    NUMBER.lastIndex = this.at;
    const number = NUMBER.exec(this.text);
    if (number === null) throw new SyntaxError(`no value at ${this.at}`);
    this.at = NUMBER.lastIndex;
    return JSON.parse(number[0]);
  }

  items(closing, item) {
    const items = [];
    if (this.take(closing)) return items;
    items.push(item());
    while (this.take(",")) items.push(item());
    if (!this.take(closing)) throw new SyntaxError(`no '${closing}' at ${this.at}`);
    return items;
  }

  pair() {
    this.skipSpace();
    let key;
    if (this.take(QUOTE)) {
      key = this.quoted();
    } else {
      BARE_KEY.lastIndex = this.at;
      const bare = BARE_KEY.exec(this.text);
      if (bare === null) throw new SyntaxError(`no key at ${this.at}`);
      key = bare[0];
      this.at = BARE_KEY.lastIndex;
    }
    if (!key || !this.take(":")) throw new SyntaxError(`no ':' after a key at ${this.at}`);
    return [key, this.value()];
  }
}

/** {name, arguments} of a call's text after `<|tool_call>` (`call:NAME{...}`), null if it is not one. */
export function parseCall(body) {
  const call = CALL.exec(body);
  if (call === null) return null;
  const reader = new Reader(body, call[0].length - 1);
  let args;
  try {
    args = reader.value();
  } catch (error) {
    if (error instanceof SyntaxError) return null;
    throw error;
  }
  reader.skipSpace();
  return reader.at === body.length ? { name: call[1], arguments: args } : null;
}
