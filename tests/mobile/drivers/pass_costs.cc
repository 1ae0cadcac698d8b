// kiln/mobile/runtime/pass_costs.cc on JSON lines from stdin, one JSON line out for each:
//   {"tokens": n, "pass_steps": c, "accepted": [a, ...]} → {"time": "<hex double>", "steps": [...]}:
//   the simulated reply of tests/helpers/simulated_reply.py (every pass costs c decode steps and takes
//   the next of the a's in turn, a decode step takes 1; a step is -1 for a decode step, else its
//   pass's accepted tokens).
#include "pass_costs.h"

#include <tvm/ffi/extra/json.h>

#include <cstdio>
#include <iostream>
#include <string>

namespace json = tvm::ffi::json;
using tvm::ffi::String;

json::Object Replay(const json::Object& request) {
  const int64_t tokens = request.at(String("tokens")).cast<int64_t>();
  const double pass_steps = request.at(String("pass_steps")).cast<double>();
  const json::Array accepted = request.at(String("accepted")).cast<json::Array>();
  kiln::PassCosts costs;
  double time = 0;
  int64_t made = 0, passes = 0;
  json::Array steps;
  while (made < tokens) {
    if (costs.MayPropose()) {
      const int64_t taken = accepted[passes++ % static_cast<int64_t>(accepted.size())].cast<int64_t>();
      time += pass_steps;
      costs.Verified(pass_steps, static_cast<int>(taken));
      steps.push_back(taken);
      made += 1 + taken;
    } else {
      time += 1.0;
      costs.Decoded(1.0);
      steps.push_back(static_cast<int64_t>(-1));
      made += 1;
    }
  }
  char hex[64];
  std::snprintf(hex, sizeof hex, "%a", time);
  json::Object reply;
  reply.Set(String("time"), String(hex));
  reply.Set(String("steps"), steps);
  return reply;
}

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::cout << std::string(json::Stringify(Replay(json::Parse(line).cast<json::Object>()))) << std::endl;
  }
  return 0;
}
