// A provider for the Vercel AI SDK (`ai` 7: language and embedding models of specification v4)
// over Kiln's browser engine: `createKiln({ engine })` gives `kiln(modelId)`, a model for
// generateText, streamText, Output.object, tools and abort signals, and `kiln.embeddingModel(modelId)`
// for embed and embedMany. Requests go to the engine in OpenAI's shape (protocol.js).
import {
  APICallError, InvalidArgumentError, InvalidPromptError, NoSuchModelError, TooManyEmbeddingValuesForCallError,
  UnsupportedFunctionalityError,
} from "@ai-sdk/provider";

/**
 * @typedef {import("@ai-sdk/provider").LanguageModelV4} LanguageModelV4
 * @typedef {import("@ai-sdk/provider").LanguageModelV4CallOptions} CallOptions
 * @typedef {import("@ai-sdk/provider").LanguageModelV4GenerateResult} GenerateResult
 * @typedef {import("@ai-sdk/provider").LanguageModelV4StreamResult} StreamResult
 * @typedef {import("@ai-sdk/provider").LanguageModelV4StreamPart} StreamPart
 * @typedef {import("@ai-sdk/provider").LanguageModelV4Prompt} Prompt
 * @typedef {import("@ai-sdk/provider").LanguageModelV4Usage} Usage
 * @typedef {import("@ai-sdk/provider").LanguageModelV4FinishReason} FinishReason
 * @typedef {import("@ai-sdk/provider").EmbeddingModelV4} EmbeddingModelV4
 * @typedef {import("@ai-sdk/provider").EmbeddingModelV4CallOptions} EmbedOptions
 * @typedef {import("@ai-sdk/provider").EmbeddingModelV4Result} EmbedResult
 * @typedef {import("@ai-sdk/provider").ProviderV4} ProviderV4
 * @typedef {import("@ai-sdk/provider").SharedV4Warning} Warning
 * @typedef {ProviderV4 & ((modelId?: string) => LanguageModelV4)} KilnProvider
 * @typedef {{role: string, content: string | null, tool_calls?: object[], tool_call_id?: string}} ChatMessage
 */

/**
 * What the provider uses of an engine (protocol.js `createEngine`'s); `model` names one of the engine's
 * models where it holds several.
 * @typedef {object} Engine
 * @property {string} modelId
 * @property {{completions: {create: (request: object) => Promise<any>}}} chat
 * @property {{create: (request: object) => Promise<any>}} embeddings
 * @property {(model?: string) => Promise<unknown>} interrupt
 * @property {(model?: string) => Promise<any>} stats
 */

const PROVIDER = "kiln";
const MAX_EMBEDDINGS_PER_CALL = 2048; // the engine's limit (embeddings.js MOST_INPUTS)
const TEXT_ID = "text-0"; // a Kiln reply is one block of text
const FINISH_REASONS = { stop: "stop", length: "length", tool_calls: "tool-calls", abort: "interrupted" };
const SCHEMA_NAME = /^[A-Za-z0-9_-]{1,64}$/; // what the engine takes as json_schema.name

// A stream stopped early (aborted or cancelled) leaves its engine busy until the engine has stopped,
// a token later, while the SDK goes on at once: the engine's next request waits for that stop.
/** @type {WeakMap<Engine, Promise<unknown>>} */
const stopping = new WeakMap();

/**
 * The AI SDK provider of an engine (`createEngine`'s): `kiln(modelId)` and `kiln.languageModel(modelId)`
 * chat with it, `kiln.embeddingModel(modelId)` embeds with it; `modelId` defaults to the engine's model.
 *
 * @param {{engine: Engine}} settings
 * @returns {KilnProvider}
 */
export function createKiln({ engine }) {
  const languageModel = (modelId = engine.modelId) => new KilnLanguageModel(engine, modelId);
  const embeddingModel = (modelId = engine.modelId) => new KilnEmbeddingModel(engine, modelId);
  return Object.assign((modelId) => languageModel(modelId), {
    specificationVersion: /** @type {const} */ ("v4"),
    languageModel,
    embeddingModel,
    imageModel: (modelId) => {
      throw new NoSuchModelError({ modelId, modelType: "imageModel", message: "Kiln has no image models." });
    },
  });
}

const KINDS = { languageModel: "chat", embeddingModel: "embedding" }; // the engine's stats().kind

/**
 * Resolves if the engine runs `modelId` as a model of `modelType`, else rejects with a NoSuchModelError:
 * the engine refuses the stats of a model it does not hold (`not-loaded`), and says the kind of one it does.
 * @param {"languageModel" | "embeddingModel"} modelType
 */
async function checkServed(engine, modelId, modelType) {
  let stats;
  try {
    stats = await engine.stats(modelId);
  } catch (error) {
    throw sdkError(error, modelId, {}, modelType);
  }
  if (stats.kind !== KINDS[modelType]) {
    const kind = stats.kind === "chat" ? "a chat" : "an embedding";
    throw new NoSuchModelError({ modelId, modelType, message: `${modelId} is ${kind} model.` });
  }
}

/** @implements {LanguageModelV4} */
class KilnLanguageModel {
  /** @param {Engine} engine @param {string} modelId */
  constructor(engine, modelId) {
    this.engine = engine;
    this.modelId = modelId;
    this.specificationVersion = /** @type {const} */ ("v4");
    this.provider = PROVIDER;
    this.supportedUrls = {};
    this.served = null; // checkServed's promise, once asked
  }

  /** @param {CallOptions} options @returns {Promise<GenerateResult>} */
  async doGenerate(options) {
    const signal = options.abortSignal;
    const { request, warnings } = chatRequest(this.modelId, options, false);
    await (this.served ??= checkServed(this.engine, this.modelId, "languageModel"));
    await stopping.get(this.engine);
    signal?.throwIfAborted();
    const interrupt = () => this.engine.interrupt(this.modelId).catch(() => {});
    let completion;
    try {
      completion = await interruptingOnAbort(signal, interrupt, () => this.engine.chat.completions.create(request));
    } catch (error) {
      throw sdkError(error, this.modelId, request);
    }
    // Interrupted by the signal: the engine has stopped, so the next request will not find it busy.
    signal?.throwIfAborted();
    const { message, finish_reason: finishReason } = completion.choices[0];
    return {
      content: [
        ...(message.content ? [{ type: /** @type {const} */ ("text"), text: message.content }] : []),
        ...(message.tool_calls ?? []).map(toolCallContent),
      ],
      finishReason: finishReasonOf(finishReason),
      usage: usageOf(completion.usage),
      request: { body: request },
      response: { ...responseMetadata(completion), body: completion },
      warnings,
    };
  }

  /** @param {CallOptions} options @returns {Promise<StreamResult>} */
  async doStream(options) {
    const signal = options.abortSignal;
    const { request, warnings } = chatRequest(this.modelId, options, true);
    await (this.served ??= checkServed(this.engine, this.modelId, "languageModel"));
    await stopping.get(this.engine);
    signal?.throwIfAborted();
    const chunks = (await this.engine.chat.completions.create(request))[Symbol.asyncIterator]();
    // Ending the iteration interrupts the engine and waits until it stops.
    const stop = () => {
      const stopped = chunks.return();
      stopping.set(this.engine, stopped.catch(() => {}));
      return stopped;
    };
    signal?.addEventListener("abort", stop, { once: true });
    if (signal?.aborted) stop(); // while the request was being sent
    const stopListening = () => signal?.removeEventListener("abort", stop);
    const toError = (error) => sdkError(error, this.modelId, request);
    // The first chunk comes once the request is checked: a refused one rejects here, as an HTTP error would.
    let first;
    try {
      first = await chunks.next();
    } catch (error) {
      stopListening();
      throw toError(error);
    }
    const parts = streamParts(first, chunks, {
      warnings, signal, stopListening, includeRawChunks: options.includeRawChunks, toError,
    });
    return {
      stream: readableStream(parts, async () => {
        stopListening();
        await stop();
      }),
      request: { body: request },
    };
  }
}

/**
 * `run()`'s result, with `interrupt` called if `signal` aborts meanwhile: the engine then ends the
 * reply after its current token.
 */
async function interruptingOnAbort(signal, interrupt, run) {
  signal?.addEventListener("abort", interrupt, { once: true });
  try {
    return await run();
  } finally {
    signal?.removeEventListener("abort", interrupt);
  }
}

/** The stream parts of a streamed chat completion, from its first chunk on. */
async function* streamParts(first, chunks, { warnings, signal, stopListening, includeRawChunks, toError }) {
  yield { type: "stream-start", warnings };
  const reply = new StreamedReply(includeRawChunks);
  for (let next = first; !next.done;) {
    yield* reply.partsOf(next.value);
    try {
      next = await chunks.next();
    } catch (error) {
      yield { type: "error", error: toError(error) };
      reply.finishReason = { unified: "error", raw: undefined };
      break;
    }
  }
  stopListening();
  // The signal ended the iteration: the stream fails with its reason, as a fetch does.
  signal?.throwIfAborted();
  yield* reply.end();
}

/** The state of a streamed reply: its text block, and the finish reason and usage once they come. */
class StreamedReply {
  constructor(includeRawChunks) {
    this.includeRawChunks = includeRawChunks;
    this.started = false;
    this.textOpen = false;
    /** @type {FinishReason} */
    this.finishReason = { unified: "other", raw: undefined };
    this.usage = undefined;
  }

  /** @returns {Generator<StreamPart>} */
  *partsOf(chunk) {
    if (this.includeRawChunks) yield { type: "raw", rawValue: chunk };
    if (!this.started) {
      this.started = true;
      yield { type: "response-metadata", ...responseMetadata(chunk) };
    }
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) return;
    if (choice.delta.content) {
      if (!this.textOpen) yield { type: "text-start", id: TEXT_ID };
      this.textOpen = true;
      yield { type: "text-delta", id: TEXT_ID, delta: choice.delta.content };
    }
    // The engine sends each call whole, in the reply's last delta.
    for (const call of choice.delta.tool_calls ?? []) {
      yield { type: "tool-input-start", id: call.id, toolName: call.function.name };
      yield { type: "tool-input-delta", id: call.id, delta: call.function.arguments };
      yield { type: "tool-input-end", id: call.id };
      yield toolCallContent(call);
    }
    if (choice.finish_reason) this.finishReason = finishReasonOf(choice.finish_reason);
  }

  /** @returns {Generator<StreamPart>} */
  *end() {
    if (this.textOpen) yield { type: "text-end", id: TEXT_ID };
    yield { type: "finish", finishReason: this.finishReason, usage: usageOf(this.usage) };
  }
}

/** A ReadableStream of an async iterator's values; cancelling it runs `onCancel`. */
function readableStream(iterator, onCancel) {
  return new ReadableStream({
    async pull(controller) {
      try {
        const { value, done } = await iterator.next();
        if (done) controller.close();
        else controller.enqueue(value);
      } catch (error) {
        controller.error(error);
      }
    },
    cancel: onCancel,
  });
}

// ---- requests ----

/**
 * The engine's chat request for the SDK's call options, and warnings about what it leaves out.
 * `providerOptions.kiln` adds engine fields the SDK has no setting for (repetition_penalty, ignore_eos,
 * speculative).
 *
 * @param {string} modelId @param {CallOptions} options @param {boolean} stream
 */
function chatRequest(modelId, options, stream) {
  /** @type {Warning[]} */
  const warnings = [];
  if (options.reasoning !== undefined && !["provider-default", "none"].includes(options.reasoning)) {
    warnings.push({ type: "unsupported", feature: "reasoning", details: "the model runs as its chat template has it" });
  }
  const request = {
    ...options.providerOptions?.[PROVIDER],
    model: modelId,
    messages: chatMessages(options.prompt, warnings),
    max_tokens: options.maxOutputTokens,
    temperature: options.temperature,
    top_p: options.topP,
    top_k: options.topK,
    presence_penalty: options.presencePenalty,
    frequency_penalty: options.frequencyPenalty,
    seed: options.seed,
    stop: options.stopSequences,
    ...toolFields(options.tools, options.toolChoice, warnings),
    response_format: responseFormatOf(options.responseFormat),
    stream,
  };
  return { request, warnings };
}

/** OpenAI chat messages of the SDK's prompt. @param {Prompt} prompt @param {Warning[]} warnings */
function chatMessages(prompt, warnings) {
  return prompt.flatMap((message) => messagesOf(message, warnings));
}

/** @param {Prompt[number]} message @param {Warning[]} warnings @returns {ChatMessage[]} */
function messagesOf(message, warnings) {
  switch (message.role) {
    case "system":
      return [{ role: "system", content: message.content }];
    case "user":
      return [{ role: "user", content: message.content.map(textOf).join("") }];
    case "assistant":
      return [assistantMessage(message.content, warnings)];
    case "tool":
      return message.content.filter((part) => part.type === "tool-result").map((part) => ({
        role: "tool", tool_call_id: part.toolCallId, content: toolOutputText(part.output),
      }));
  }
}

function textOf(part) {
  if (part.type === "text") return part.text;
  throw unsupportedPart(part);
}

function unsupportedPart(part) {
  const what = part.type === "file" ? `${part.mediaType} file` : part.type;
  return new UnsupportedFunctionalityError({
    functionality: `${what} parts`, message: `Kiln's models take text only, not ${what} parts.`,
  });
}

/** An assistant turn: its text, and its tool calls with their arguments as JSON text. */
function assistantMessage(parts, warnings) {
  let text = "";
  const calls = [];
  for (const part of parts) {
    if (part.type === "text") text += part.text;
    else if (part.type === "tool-call") {
      const call = { name: part.toolName, arguments: JSON.stringify(part.input) };
      calls.push({ id: part.toolCallId, type: "function", function: call });
    } else if (part.type === "reasoning") {
      warnings.push({ type: "unsupported", feature: "reasoning parts in the prompt", details: "left out" });
    } else throw unsupportedPart(part);
  }
  if (calls.length === 0) return { role: "assistant", content: text };
  return { role: "assistant", content: text || null, tool_calls: calls };
}

/** A tool result as the text of a tool message. */
function toolOutputText(output) {
  switch (output.type) {
    case "text":
    case "error-text":
      return output.value;
    case "json":
    case "error-json":
      return JSON.stringify(output.value);
    case "execution-denied":
      return output.reason ?? "The tool's execution was denied.";
    case "content":
      return output.value.map(textOf).join("");
  }
}

/** OpenAI's `tools` and `tool_choice` of the SDK's function tools; provider tools are warned about. */
function toolFields(tools, toolChoice, warnings) {
  const functions = [];
  for (const tool of tools ?? []) {
    if (tool.type !== "function") {
      warnings.push({ type: "unsupported", feature: `provider tool ${tool.id}` });
      continue;
    }
    const { name, description, inputSchema } = tool;
    const described = description ? { description } : {};
    functions.push({ type: "function", function: { name, ...described, parameters: inputSchema } });
  }
  if (functions.length === 0) return {};
  return { tools: functions, tool_choice: toolChoiceOf(toolChoice) };
}

function toolChoiceOf(toolChoice) {
  if (toolChoice === undefined) return undefined;
  if (toolChoice.type === "tool") return { type: "function", function: { name: toolChoice.toolName } };
  return toolChoice.type;
}

/** The engine's response_format: a JSON schema's, or any JSON object's. */
function responseFormatOf(format) {
  if (format?.type !== "json") return undefined;
  if (!format.schema) return { type: "json_object" };
  const name = SCHEMA_NAME.test(format.name ?? "") ? format.name : "response";
  return { type: "json_schema", json_schema: { name, schema: format.schema } };
}

// ---- results ----

function toolCallContent(call) {
  const { id: toolCallId, function: { name: toolName, arguments: input } } = call;
  return { type: /** @type {const} */ ("tool-call"), toolCallId, toolName, input };
}

/** @returns {FinishReason} */
function finishReasonOf(raw) {
  return { unified: FINISH_REASONS[raw] ?? "other", raw: raw ?? undefined };
}

/**
 * The SDK's usage of the engine's: the prompt tokens the KV cache already held (a conversation's
 * earlier turns) are cache reads.
 * @returns {Usage}
 */
function usageOf(usage) {
  const prefilled = usage?.extra?.prefilled_tokens;
  return {
    inputTokens: {
      total: usage?.prompt_tokens,
      noCache: prefilled,
      cacheRead: prefilled === undefined ? undefined : usage.prompt_tokens - prefilled,
      cacheWrite: undefined,
    },
    outputTokens: { total: usage?.completion_tokens, text: usage?.completion_tokens, reasoning: undefined },
    raw: usage,
  };
}

function responseMetadata({ id, model, created }) {
  return { id, modelId: model, timestamp: new Date(created * 1000) };
}

// ---- errors ----

/**
 * The SDK's error for an engine's (errors.js), the engine's kept as `cause`: a bad request about the
 * messages is an invalid prompt, one about another field an invalid argument; an unknown or unloaded
 * model is no such model; anything else is an API call error, retryable where the engine was busy.
 * @param {"languageModel" | "embeddingModel"} [modelType]
 */
function sdkError(error, modelId, request, modelType = "languageModel") {
  const message = error?.message ?? String(error);
  const withCause = (sdk) => Object.assign(sdk, { cause: error });
  switch (error?.name === "EngineError" ? error.code : undefined) {
    case "bad-request":
    case "bad-response-format":
      if (/\bmessages?\b/.test(message)) {
        return new InvalidPromptError({ prompt: request.messages, message, cause: error });
      }
      return new InvalidArgumentError({ argument: requestField(message, request), message, cause: error });
    case "context-window-exceeded":
      return new InvalidPromptError({ prompt: request.messages, message, cause: error });
    case "no-chat-template":
      return withCause(new UnsupportedFunctionalityError({ functionality: "chat", message }));
    case "no-tool-support":
      return withCause(new UnsupportedFunctionalityError({ functionality: "tools", message }));
    case "model-not-found":
    case "not-loaded":
      return withCause(new NoSuchModelError({ modelId, modelType, message }));
  }
  return new APICallError({
    message, url: `kiln-web:${modelId}`, requestBodyValues: request, cause: error,
    isRetryable: error?.code === "busy", data: { code: error?.code },
  });
}

/** The request field an engine's message is about (it names it first), else "request". */
function requestField(message, request) {
  return Object.keys(request).find((key) => message.startsWith(key) || message.startsWith(`'${key}'`)) ?? "request";
}

// ---- embeddings ----

/** @implements {EmbeddingModelV4} */
class KilnEmbeddingModel {
  /** @param {Engine} engine @param {string} modelId */
  constructor(engine, modelId) {
    this.engine = engine;
    this.modelId = modelId;
    this.specificationVersion = /** @type {const} */ ("v4");
    this.provider = PROVIDER;
    this.maxEmbeddingsPerCall = MAX_EMBEDDINGS_PER_CALL;
    this.supportsParallelCalls = false; // the engine runs one request at a time
    this.served = null; // checkServed's promise, once asked
  }

  /**
   * The embeddings of `values`. The engine cannot stop an embedding request part-way: an abort is
   * seen before and after it.
   * @param {EmbedOptions} options @returns {Promise<EmbedResult>}
   */
  async doEmbed({ values, dimensions, abortSignal }) {
    if (values.length > MAX_EMBEDDINGS_PER_CALL) {
      throw new TooManyEmbeddingValuesForCallError({
        provider: PROVIDER, modelId: this.modelId, maxEmbeddingsPerCall: MAX_EMBEDDINGS_PER_CALL, values,
      });
    }
    abortSignal?.throwIfAborted();
    await (this.served ??= checkServed(this.engine, this.modelId, "embeddingModel"));
    const request = { model: this.modelId, input: values, dimensions, encoding_format: "float" };
    const reply = await this.engine.embeddings.create(request).catch((error) => {
      throw sdkError(error, this.modelId, request, "embeddingModel");
    });
    abortSignal?.throwIfAborted();
    return {
      embeddings: reply.data.map((item) => item.embedding),
      usage: { tokens: reply.usage.prompt_tokens },
      response: { body: reply },
      warnings: [],
    };
  }
}
