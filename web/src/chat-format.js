// Chat prompts from the `conv_template` of mlc-chat-config.json, laid out and encoded as WebLLM
// 0.2.86 lays them out (Conversation.getPromptArray in @mlc-ai/web-llm): the system block, then each
// message as role + role_content_sep + content + seps[i % seps.length], then the assistant's role +
// role_empty_sep, each piece encoded on its own; `system_prefix_token_ids` go before them. (A
// SentencePiece tokenizer that prepends "▁" to each text it encodes gives other ids for the pieces
// than for their joined text.)
//
// Kiln derives the conv_template from the model's jinja chat template and checks at compile time
// that both give the same token ids (kiln/compile/chat_config/conv_template.py); the tests compare token ids.
import { EngineError } from "./errors.js";

const ROLES = new Set(["system", "user", "assistant"]);
// MLC's conv_template name for a model without a chat template: it completes raw text only.
export const RAW_COMPLETION = "LM";
// What WebLLM puts between a role and its content when the template does not say.
const DEFAULT_ROLE_SEP = ": ";

/** The text of a message's content: a string, or OpenAI's list of {type: "text", text} parts. */
export function messageText(content, index) {
  if (typeof content === "string") return content;
  if (Array.isArray(content) && content.every((part) => part?.type === "text" && typeof part.text === "string")) {
    return content.map((part) => part.text).join("");
  }
  throw new EngineError("bad-request", `messages[${index}].content must be a string or a list of text parts`);
}

/** Check OpenAI-style messages; returns [{role, text}]. */
export function normalizeMessages(messages) {
  if (!Array.isArray(messages) || messages.length === 0) {
    throw new EngineError("bad-request", "messages must be a non-empty list");
  }
  return messages.map((message, index) => {
    if (!ROLES.has(message?.role)) {
      throw new EngineError("bad-request", `messages[${index}].role must be one of system, user, assistant`);
    }
    if (message.role === "system" && index !== 0) {
      throw new EngineError("bad-request", "only the first message may be a system message");
    }
    return { role: message.role, text: messageText(message.content, index) };
  });
}

/** `template` with its first `placeholder` replaced by `text`, taken literally (WebLLM passes the
 * text as a replacement string, so a `$&` or `$'` in a message would be expanded). */
function fill(template, placeholder, text) {
  return template.replace(placeholder, () => text);
}

/** A message's content in its role template (`role_templates`), when the conv_template has one.
 * The unused `{function_string}` goes before the text goes in, so a message's own one stays. */
function roleContent(convTemplate, turn) {
  const template = convTemplate.role_templates?.[turn.role];
  if (template === undefined) return turn.text;
  return fill(template.replace("{function_string}", ""), `{${turn.role}_message}`, turn.text);
}

/** The system block for `systemMessage`: none for an empty one when the template shows no empty block. */
function systemBlock(convTemplate, systemMessage) {
  if (systemMessage === "" && convTemplate.render_empty_system_message === false) return "";
  return fill(convTemplate.system_template, "{system_message}", systemMessage);
}

/** The prompt for `messages`, ending with the assistant's turn opened for generation, as the
 * pieces WebLLM encodes one by one (their text joined is the prompt's text). */
export function formatChat(convTemplate, messages) {
  if (convTemplate.name === RAW_COMPLETION) {
    throw new EngineError("no-chat-template", "This model has no chat template (a base model): it completes raw text, it does not chat.");
  }
  if (!convTemplate.seps?.length) throw new EngineError("bad-model", "The conv_template of mlc-chat-config.json has no seps.");
  const turns = normalizeMessages(messages);
  const system = systemBlock(convTemplate, turns[0].role === "system" ? turns.shift().text : convTemplate.system_message);
  const pieces = system === "" ? [] : [system];
  turns.forEach((turn, index) => {
    // Families without a system role (Llama 2, Mistral) put the system block where the first role would be.
    const opensWithSystem = convTemplate.add_role_after_system_message === false && system !== "" && index === 0;
    const role = opensWithSystem ? "" : convTemplate.roles[turn.role] + (convTemplate.role_content_sep ?? DEFAULT_ROLE_SEP);
    pieces.push(role + roleContent(convTemplate, turn) + convTemplate.seps[index % convTemplate.seps.length]);
  });
  pieces.push(convTemplate.roles.assistant + (convTemplate.role_empty_sep ?? DEFAULT_ROLE_SEP));
  return pieces;
}

/** The token ids of the pieces `formatChat` gave: the conv_template's `system_prefix_token_ids`
 * (a BOS token the template prints first), then each piece encoded by `encode` on its own. */
export function encodePrompt(convTemplate, pieces, encode) {
  return [...(convTemplate.system_prefix_token_ids ?? []), ...pieces.flatMap((piece) => encode(piece))];
}

/** The pieces' text from character `start` on, cut where the pieces meet (each part is encoded on its own). */
export function piecesFrom(pieces, start) {
  const parts = [];
  let end = 0;
  for (const piece of pieces) {
    end += piece.length;
    if (end > start) parts.push(piece.slice(Math.max(0, start - (end - piece.length))));
  }
  return parts;
}

/**
 * The ids a tokenizer.json post-processor puts around one encoded text, as Hugging Face `tokenizers`
 * does with `add_special_tokens` (a BOS before it, an EOS after it): {before, after}. The tokenizer's
 * own `encode` leaves them out, as WebLLM's does; the native engine's raw prompts carry them.
 * @param {any} postProcessor the `post_processor` of tokenizer.json
 * @returns {{before: number[], after: number[]}}
 */
export function specialTokensAround(postProcessor) {
  switch (postProcessor?.type) {
    case "TemplateProcessing": {
      const single = postProcessor.single ?? [];
      const ids = (pieces) => pieces.flatMap((piece) => postProcessor.special_tokens[piece.SpecialToken.id].ids);
      const at = single.findIndex((piece) => piece.Sequence);
      return at < 0 ? { before: ids(single), after: [] } : { before: ids(single.slice(0, at)), after: ids(single.slice(at + 1)) };
    }
    case "BertProcessing":
    case "RobertaProcessing":
      return { before: [postProcessor.cls[1]], after: [postProcessor.sep[1]] };
    case "Sequence":
      // Each processor wraps what the ones before it gave.
      return (postProcessor.processors ?? []).map(specialTokensAround).reduce(
        (inner, outer) => ({ before: [...outer.before, ...inner.before], after: [...inner.after, ...outer.after] }),
        { before: [], after: [] });
    default:
      return { before: [], after: [] };
  }
}
