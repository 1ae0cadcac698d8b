// kiln/mobile/runtime/sampler.cc on JSON lines from stdin, one JSON line out for each:
//   {"logits": [...], "config": {temperature, top_p, top_k, repetition_penalty, presence_penalty,
//    frequency_penalty, seed}, "prompt_ids": [...], "steps": n, "record": bool, "allowed": [bool...]}
//     → {"tokens": [...]}: n tokens sampled from the same row, each recorded before the next when "record";
//   {"exp": ["<hex double>", ...]} → {"exp": [...]}: ExpNonPositive of each, as hex (exact);
//   {"random": {"seed": s, "count": n}} → {"random": [...]}: Mulberry32's first n doubles, as hex.
#include <tvm/ffi/extra/json.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "sampler.h"

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

std::string Hex(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%a", value);
  return text;
}

double Field(const json::Object& object, const char* key, double absent) {
  return object.count(String(key)) ? object.at(String(key)).cast<double>() : absent;
}

kiln::SamplingConfig ConfigFrom(const json::Object& fields) {
  kiln::SamplingConfig config;
  config.temperature = Field(fields, "temperature", config.temperature);
  config.top_p = Field(fields, "top_p", config.top_p);
  config.top_k = static_cast<int64_t>(Field(fields, "top_k", 0));
  config.repetition_penalty = Field(fields, "repetition_penalty", config.repetition_penalty);
  config.presence_penalty = Field(fields, "presence_penalty", config.presence_penalty);
  config.frequency_penalty = Field(fields, "frequency_penalty", config.frequency_penalty);
  if (fields.count(String("seed")) && fields.at(String("seed")) != nullptr) {
    config.seed = static_cast<uint64_t>(fields.at(String("seed")).cast<int64_t>());
  }
  return config;
}

json::Array Tokens(const json::Object& request) {
  std::vector<float> logits;
  for (const Any& value : request.at(String("logits")).cast<json::Array>()) logits.push_back(value.cast<double>());
  std::vector<int32_t> prompt_ids;
  for (const Any& id : request.at(String("prompt_ids")).cast<json::Array>()) prompt_ids.push_back(id.cast<int64_t>());
  std::vector<bool> allowed;
  if (request.count(String("allowed"))) {
    for (const Any& flag : request.at(String("allowed")).cast<json::Array>()) allowed.push_back(flag.cast<bool>());
  }
  kiln::Sampler sampler(ConfigFrom(request.at(String("config")).cast<json::Object>()), prompt_ids);
  const bool record = request.at(String("record")).cast<bool>();
  json::Array tokens;
  for (int64_t step = 0; step < request.at(String("steps")).cast<int64_t>(); ++step) {
    const int32_t token = sampler.Sample(logits.data(), logits.size(), allowed.empty() ? nullptr : &allowed);
    if (record) sampler.Record(token);
    tokens.push_back(static_cast<int64_t>(token));
  }
  return tokens;
}

json::Array Exponentials(const json::Array& arguments) {
  json::Array results;
  for (const Any& argument : arguments) {
    const double x = std::strtod(argument.cast<String>().c_str(), nullptr);
    results.push_back(String(Hex(kiln::ExpNonPositive(x))));
  }
  return results;
}

json::Array RandomDoubles(const json::Object& request) {
  kiln::Mulberry32 random(static_cast<uint64_t>(request.at(String("seed")).cast<int64_t>()));
  json::Array doubles;
  for (int64_t i = 0; i < request.at(String("count")).cast<int64_t>(); ++i) doubles.push_back(String(Hex(random())));
  return doubles;
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    const json::Object request = json::Parse(line).cast<json::Object>();
    json::Object answer;
    if (request.count(String("exp"))) {
      answer.Set(String("exp"), Exponentials(request.at(String("exp")).cast<json::Array>()));
    } else if (request.count(String("random"))) {
      answer.Set(String("random"), RandomDoubles(request.at(String("random")).cast<json::Object>()));
    } else {
      answer.Set(String("tokens"), Tokens(request));
    }
    std::cout << json::Stringify(answer) << std::endl;
  }
}
