#include "chat_format.h"

#include <optional>

#include "errors.h"

namespace kiln {
namespace {

using tvm::ffi::String;

// MLC's conv_template name for a model without a chat template: it completes raw text only.
constexpr const char* kRawCompletion = "LM";
// What WebLLM puts between a role and its content when the template does not say.
constexpr const char* kDefaultRoleSep = ": ";

EngineError BadRequest(const std::string& message) { return EngineError(ErrorCode::kBadRequest, message); }

// chat-format.js checks only the seps; a conv_template missing another field it reads there gives
// "undefined" in the prompt or a TypeError, and a bad-model error here.
EngineError BadModel(const std::string& field) {
  return EngineError(ErrorCode::kBadModel, "The conv_template of mlc-chat-config.json has no " + field + ".");
}

// `key` of `object`; null when absent (JavaScript's `??` takes both alike).
json::Value FieldOf(const json::Object& object, const char* key) {
  const auto found = object.find(String(key));
  return found == object.end() ? json::Value() : (*found).second;
}

std::string ConvString(const json::Value& value, const std::string& field) {
  const std::optional<String> text = value.as<String>();
  if (!text) throw BadModel(field);
  return std::string(*text);
}

std::string ConvStringOr(const json::Object& conv_template, const char* key, const char* absent) {
  const json::Value value = FieldOf(conv_template, key);
  return value == nullptr ? absent : ConvString(value, key);
}

// Whether `key` is `false` itself (JavaScript's `=== false`): absent, it is not.
bool IsFalse(const json::Object& conv_template, const char* key) {
  return FieldOf(conv_template, key).as<bool>() == false;
}

std::string RoleName(const json::Object& conv_template, const std::string& role) {
  const std::optional<json::Object> roles = FieldOf(conv_template, "roles").as<json::Object>();
  if (!roles) throw BadModel("roles");
  return ConvString(FieldOf(*roles, role.c_str()), "roles." + role);
}

// What opens a message of `role`: the role's name and what separates it from the content.
std::string RoleOpening(const json::Object& conv_template, const std::string& role) {
  return RoleName(conv_template, role) + ConvStringOr(conv_template, "role_content_sep", kDefaultRoleSep);
}

// `text` with its first `placeholder` replaced by `replacement`, taken literally (WebLLM passes the
// text as a replacement string, so a `$&` or `$'` in a message would be expanded).
std::string ReplaceFirst(std::string text, const std::string& placeholder, const std::string& replacement) {
  const size_t at = text.find(placeholder);
  if (at != std::string::npos) text.replace(at, placeholder.size(), replacement);
  return text;
}

// The text of a {type: "text", text} part; none for any other part.
std::optional<String> TextOfPart(const json::Value& part) {
  const std::optional<json::Object> fields = part.as<json::Object>();
  if (!fields || FieldOf(*fields, "type").as<String>() != "text") return std::nullopt;
  return FieldOf(*fields, "text").as<String>();
}

// The text of a message's content: a string, or OpenAI's list of {type: "text", text} parts.
std::string MessageText(const json::Value& content, size_t index) {
  if (const std::optional<String> text = content.as<String>()) return std::string(*text);
  const EngineError not_text =
      BadRequest("messages[" + std::to_string(index) + "].content must be a string or a list of text parts");
  const std::optional<json::Array> parts = content.as<json::Array>();
  if (!parts) throw not_text;
  std::string joined;
  for (const json::Value& part : *parts) {
    const std::optional<String> text = TextOfPart(part);
    if (!text) throw not_text;
    joined += std::string(*text);
  }
  return joined;
}

bool IsRole(const std::optional<String>& role) { return role == "system" || role == "user" || role == "assistant"; }

// A message's content in its role template (`role_templates`), when the conv_template has one.
// The unused `{function_string}` goes before the text goes in, so a message's own one stays.
std::string RoleContent(const json::Object& conv_template, const ChatTurn& turn) {
  const std::optional<json::Object> role_templates = FieldOf(conv_template, "role_templates").as<json::Object>();
  if (!role_templates || !role_templates->count(String(turn.role))) return turn.text;
  const std::string role_template =
      ConvString(FieldOf(*role_templates, turn.role.c_str()), "role_templates." + turn.role);
  return ReplaceFirst(ReplaceFirst(role_template, "{function_string}", ""), "{" + turn.role + "_message}", turn.text);
}

// The system block for `system_message`: none for an empty one when the template shows no empty block.
std::string SystemBlock(const json::Object& conv_template, const std::string& system_message) {
  if (system_message.empty() && IsFalse(conv_template, "render_empty_system_message")) return "";
  return ReplaceFirst(ConvString(FieldOf(conv_template, "system_template"), "system_template"), "{system_message}",
                      system_message);
}

}  // namespace

std::vector<ChatTurn> NormalizeMessages(const json::Value& messages) {
  const std::optional<json::Array> list = messages.as<json::Array>();
  if (!list || list->empty()) throw BadRequest("messages must be a non-empty list");
  std::vector<ChatTurn> turns;
  for (size_t index = 0; index < list->size(); ++index) {
    const std::optional<json::Object> message = (*list)[index].as<json::Object>();
    const std::optional<String> role = message ? FieldOf(*message, "role").as<String>() : std::nullopt;
    if (!IsRole(role)) {
      throw BadRequest("messages[" + std::to_string(index) + "].role must be one of system, user, assistant");
    }
    if (role == "system" && index != 0) throw BadRequest("only the first message may be a system message");
    turns.push_back({std::string(*role), MessageText(FieldOf(*message, "content"), index)});
  }
  return turns;
}

std::vector<std::string> FormatChat(const json::Object& conv_template, const json::Value& messages) {
  if (FieldOf(conv_template, "name").as<String>() == kRawCompletion) {
    throw EngineError(ErrorCode::kNoChatTemplate,
                      "This model has no chat template (a base model): it completes raw text, it does not chat.");
  }
  const std::optional<json::Array> seps = FieldOf(conv_template, "seps").as<json::Array>();
  if (!seps || seps->empty()) throw BadModel("seps");
  std::vector<ChatTurn> turns = NormalizeMessages(messages);
  const bool has_system_message = turns.front().role == "system";
  const std::string system = SystemBlock(
      conv_template,
      has_system_message ? turns.front().text : ConvString(FieldOf(conv_template, "system_message"), "system_message"));
  if (has_system_message) turns.erase(turns.begin());
  std::vector<std::string> pieces;
  if (!system.empty()) pieces.push_back(system);
  for (size_t index = 0; index < turns.size(); ++index) {
    // Families without a system role (Llama 2, Mistral) put the system block where the first role would be.
    const bool opens_with_system =
        IsFalse(conv_template, "add_role_after_system_message") && !system.empty() && index == 0;
    const std::string role = opens_with_system ? "" : RoleOpening(conv_template, turns[index].role);
    const size_t sep = index % seps->size();
    pieces.push_back(role + RoleContent(conv_template, turns[index]) +
                     ConvString((*seps)[sep], "seps[" + std::to_string(sep) + "]"));
  }
  pieces.push_back(RoleName(conv_template, "assistant") +
                   ConvStringOr(conv_template, "role_empty_sep", kDefaultRoleSep));
  return pieces;
}

std::vector<int32_t> EncodePrompt(const json::Object& conv_template, const std::vector<std::string>& pieces,
                                  const std::function<std::vector<int32_t>(const std::string&)>& encode) {
  std::vector<int32_t> ids;
  const json::Value prefix = FieldOf(conv_template, "system_prefix_token_ids");
  if (prefix != nullptr) {
    const std::optional<json::Array> prefix_ids = prefix.as<json::Array>();
    if (!prefix_ids) throw BadModel("system_prefix_token_ids (a list of token ids)");
    for (const json::Value& id : *prefix_ids) {
      const std::optional<int64_t> token = id.as<int64_t>();
      if (!token) throw BadModel("system_prefix_token_ids (a list of token ids)");
      ids.push_back(static_cast<int32_t>(*token));
    }
  }
  for (const std::string& piece : pieces) {
    const std::vector<int32_t> piece_ids = encode(piece);
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
  }
  return ids;
}

std::vector<std::string> PiecesFrom(const std::vector<std::string>& pieces, size_t start) {
  std::vector<std::string> parts;
  size_t end = 0;
  for (const std::string& piece : pieces) {
    const size_t begin = end;
    end += piece.size();
    if (end > start) parts.push_back(piece.substr(start > begin ? start - begin : 0));
  }
  return parts;
}

}  // namespace kiln
