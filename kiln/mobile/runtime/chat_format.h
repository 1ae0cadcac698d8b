// Chat prompts from the `conv_template` of mlc-chat-config.json, laid out and encoded as the browser
// engine lays them out (web/src/chat-format.js, itself WebLLM 0.2.86's Conversation.getPromptArray):
// the system block, then each message as role + role_content_sep + content + seps[i % seps.length],
// then the assistant's role + role_empty_sep, each piece encoded on its own; `system_prefix_token_ids`
// go before them. Same checks, same error codes and messages as chat-format.js.
//
// Strings are UTF-8 where JavaScript's are UTF-16: the placeholders replaced are ASCII, so their first
// occurrence is at the same character either way, and byte offsets stand for character offsets.
#ifndef KILN_CHAT_FORMAT_H_
#define KILN_CHAT_FORMAT_H_

#include <tvm/ffi/extra/json.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kiln {

namespace json = tvm::ffi::json;

// A checked message: its role ("system", "user" or "assistant") and the text of its content.
struct ChatTurn {
  std::string role;
  std::string text;
};

// OpenAI-style `messages` checked (a non-empty list; roles system, user or assistant, system first
// only; content a string or a list of {type: "text", text} parts); bad-request errors otherwise.
std::vector<ChatTurn> NormalizeMessages(const json::Value& messages);

// The prompt for `messages`, ending with the assistant's turn opened for generation, as the pieces
// the browser engine encodes one by one (their text joined is the prompt's text). no-chat-template
// for the raw-completion conv_template ("LM"), bad-model for a conv_template without what it needs.
std::vector<std::string> FormatChat(const json::Object& conv_template, const json::Value& messages);

// The token ids of the pieces FormatChat gave: the conv_template's `system_prefix_token_ids`, then
// each piece encoded by `encode` on its own.
std::vector<int32_t> EncodePrompt(const json::Object& conv_template, const std::vector<std::string>& pieces,
                                  const std::function<std::vector<int32_t>(const std::string&)>& encode);

// The pieces' text from byte `start` on, cut where the pieces meet (each part is encoded on its own).
// `start` is the size of a text the joined pieces begin with (a previous prompt and its reply), so a
// character boundary, where chat-format.js's `piecesFrom` takes that text's length in UTF-16 units.
std::vector<std::string> PiecesFrom(const std::vector<std::string>& pieces, size_t start);

}  // namespace kiln

#endif  // KILN_CHAT_FORMAT_H_
