// kiln/mobile/runtime/chat_format.cc with the conv_template of the mlc-chat-config.json at argv[1],
// on JSON lines from stdin, one JSON line out for each:
//   {"messages": [...]} → {"pieces": [...], "ids": [...]} or {"error": {"code": ..., "message": ...}};
//     the ids are EncodePrompt's with a stand-in tokenizer: a piece's byte count, then its bytes;
//   {"pieces": [...], "previous": "<text>"} → {"parts": [...]}: PiecesFrom the previous text's size.
#include "chat_format.h"

#include <tvm/ffi/extra/json.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "errors.h"

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

std::vector<int32_t> ByteIds(const std::string& text) {
  std::vector<int32_t> ids{static_cast<int32_t>(text.size())};
  for (unsigned char byte : text) ids.push_back(byte);
  return ids;
}

json::Array Strings(const std::vector<std::string>& texts) {
  json::Array array;
  for (const std::string& text : texts) array.push_back(String(text));
  return array;
}

json::Object Prompt(const json::Object& conv_template, const json::Value& messages) {
  json::Object answer;
  try {
    const std::vector<std::string> pieces = kiln::FormatChat(conv_template, messages);
    json::Array ids;
    for (int32_t id : kiln::EncodePrompt(conv_template, pieces, ByteIds)) ids.push_back(static_cast<int64_t>(id));
    answer.Set(String("pieces"), Strings(pieces));
    answer.Set(String("ids"), ids);
  } catch (const kiln::EngineError& error) {
    json::Object fields;
    fields.Set(String("code"), String(kiln::ErrorCodeName(error.code())));
    fields.Set(String("message"), String(error.what()));
    answer.Set(String("error"), fields);
  }
  return answer;
}

json::Object Parts(const json::Object& request) {
  std::vector<std::string> pieces;
  for (const Any& piece : request.at(String("pieces")).cast<json::Array>()) pieces.push_back(piece.cast<String>());
  json::Object answer;
  answer.Set(String("parts"), Strings(kiln::PiecesFrom(pieces, request.at(String("previous")).cast<String>().size())));
  return answer;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: chat_format <mlc-chat-config.json>\n";
    return 2;
  }
  std::stringstream config;
  config << std::ifstream(argv[1]).rdbuf();
  const json::Object conv_template =
      json::Parse(config.str()).cast<json::Object>().at(String("conv_template")).cast<json::Object>();
  std::string line;
  while (std::getline(std::cin, line)) {
    const json::Object request = json::Parse(line).cast<json::Object>();
    const json::Object answer =
        request.count(String("messages")) ? Prompt(conv_template, request.at(String("messages"))) : Parts(request);
    std::cout << json::Stringify(answer) << std::endl;
  }
}
