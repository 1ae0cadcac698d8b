// The model layer of the mobile runtime (model.h), for tests/mobile: argv[1] a model folder, then the
// prompt's ids; prints the logits after the prompt and the greedy tokens after them, as JSON lines.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "errors.h"
#include "model.h"

int main(int argc, char** argv) {
  constexpr int kGreedyTokens = 32;
  try {
    kiln::Model model(argv[1], "");
    std::vector<int32_t> ids;
    for (int i = 2; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
    std::vector<float> logits = model.Prefill(ids);
    std::printf("[");
    for (size_t i = 0; i < logits.size(); ++i) std::printf("%s%.9g", i ? "," : "", logits[i]);
    std::printf("]\n[");
    for (int step = 0; step < kGreedyTokens; ++step) {
      int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      std::printf("%s%d", step ? "," : "", token);
      logits = model.Decode(token);
    }
    std::printf("]\n");
  } catch (const kiln::EngineError& error) {
    std::fprintf(stderr, "%s: %s\n", kiln::ErrorCodeName(error.code()), error.what());
    return 1;
  }
  return 0;
}
