// kiln/mobile/runtime/tokenizer for the tests: `tokenize TOKENIZER_JSON` answers each JSON line on
// stdin with one JSON line:
//   "text"            {"ids": Encode(text), "text": Decode(those ids)}
//   [id, ...]         {"text": Decode(ids)}
//   {"token": "..."}  {"id": TokenToId(token)}, null when there is none
// `tokenize TOKENIZER_JSON --about` prints {"vocab_size": ..., "before": [...], "after": [...]}.
// A tokenizer.json the tokenizer refuses: its message on stderr, exit status 1.
#include <tvm/ffi/extra/json.h>

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer.h"

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

json::Array IdArray(const std::vector<int32_t>& ids) {
  json::Array array;
  for (int32_t id : ids) array.push_back(static_cast<int64_t>(id));
  return array;
}

std::vector<int32_t> Ids(const json::Array& array) {
  std::vector<int32_t> ids;
  for (const Any& id : array) ids.push_back(static_cast<int32_t>(id.cast<int64_t>()));
  return ids;
}

json::Object Answer(const kiln::Tokenizer& tokenizer, const json::Value& request) {
  json::Object answer;
  if (std::optional<String> text = request.as<String>()) {
    std::vector<int32_t> ids = tokenizer.Encode(std::string(*text));
    answer.Set(String("ids"), IdArray(ids));
    answer.Set(String("text"), String(tokenizer.Decode(ids)));
  } else if (std::optional<json::Array> ids = request.as<json::Array>()) {
    answer.Set(String("text"), String(tokenizer.Decode(Ids(*ids))));
  } else {
    std::string token(request.cast<json::Object>().at(String("token")).cast<String>());
    std::optional<int32_t> id = tokenizer.TokenToId(token);
    answer.Set(String("id"), id ? Any(static_cast<int64_t>(*id)) : Any(nullptr));
  }
  return answer;
}

json::Object About(const kiln::Tokenizer& tokenizer) {
  json::Object about;
  about.Set(String("vocab_size"), static_cast<int64_t>(tokenizer.VocabSize()));
  about.Set(String("before"), IdArray(tokenizer.SpecialTokensAround().before));
  about.Set(String("after"), IdArray(tokenizer.SpecialTokensAround().after));
  return about;
}

int main(int argc, char** argv) {
  std::ifstream file(argv[1], std::ios::binary);
  std::stringstream tokenizer_json;
  tokenizer_json << file.rdbuf();
  try {
    kiln::Tokenizer tokenizer = kiln::Tokenizer::FromJson(tokenizer_json.str());
    if (argc > 2 && std::string(argv[2]) == "--about") {
      std::cout << json::Stringify(About(tokenizer)) << "\n";
      return 0;
    }
    for (std::string line; std::getline(std::cin, line);) {
      std::cout << json::Stringify(Answer(tokenizer, json::Parse(line))) << "\n" << std::flush;
    }
  } catch (const kiln::TokenizerError& error) {
    std::cerr << error.what() << "\n";
    return 1;
  }
  return 0;
}
