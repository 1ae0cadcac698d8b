// Chat prompts from the `conv_template` of mlc-chat-config.json (MLC / WebLLM's format).
//
// Kiln writes the template from the model's jinja chat template (compile/configure.py), so for
// the same messages this gives the text the jinja template renders; the tests compare token ids.
import { EngineError } from "./errors.js";

const ROLES = new Set(["system", "user", "assistant"]);

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

/**
 * The prompt text for `messages`, ending with the assistant's turn opened for generation.
 *
 * The system message is the conversation's own when it starts with one, else the template's
 * default. Messages after it take the template's separators in turn (seps[0] after the first,
 * seps[1] after the second, ...), as MLC's conversation does.
 */
export function formatChat(convTemplate, messages) {
  const turns = normalizeMessages(messages);
  const systemMessage = turns[0].role === "system" ? turns.shift().text : convTemplate.system_message;
  let prompt = convTemplate.system_template.replace("{system_message}", systemMessage);
  turns.forEach((turn, index) => {
    const role = convTemplate.roles[turn.role];
    const sep = convTemplate.seps[index % convTemplate.seps.length];
    prompt += role + convTemplate.role_content_sep + turn.text + sep;
  });
  return prompt + convTemplate.roles.assistant + convTemplate.role_empty_sep;
}
