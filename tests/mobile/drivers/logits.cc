// The model layer of the mobile runtime (model.h), for tests/mobile: argv[1] a model folder, then the
// prompt's ids; prints the logits after the prompt, the greedy tokens after them, then verify passes
// (AllLogits) over the prompt's first 1, 3, 4 and 6 ids, each with the logits of a decode step of its
// first id after it, each rolled back, as JSON lines.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "errors.h"
#include "model.h"

void PrintRow(const std::vector<float>& row) {
  std::printf("[");
  for (size_t i = 0; i < row.size(); ++i) std::printf("%s%.9g", i ? "," : "", row[i]);
  std::printf("]");
}

int main(int argc, char** argv) {
  constexpr int kGreedyTokens = 32;
  try {
    kiln::Model model(argv[1], "");
    std::vector<int32_t> ids;
    for (int i = 2; i < argc; ++i) ids.push_back(std::atoi(argv[i]));
    std::vector<float> logits = model.Prefill(ids);
    PrintRow(logits);
    std::printf("\n[");
    for (int step = 0; step < kGreedyTokens; ++step) {
      int32_t token = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      std::printf("%s%d", step ? "," : "", token);
      logits = model.Decode(token);
    }
    std::printf("]\n[");
    for (int count : {1, 3, 4, 6}) {
      std::vector<int32_t> passed(ids.begin(), ids.begin() + count);
      std::printf("%s{\"rows\": [", count > 1 ? "," : "");
      std::vector<std::vector<float>> rows = model.AllLogits(passed);
      for (size_t row = 0; row < rows.size(); ++row) {
        if (row) std::printf(",");
        PrintRow(rows[row]);
      }
      std::printf("], \"after\": ");
      PrintRow(model.Decode(ids[0]));
      std::printf("}");
      model.Rollback(count + 1);
    }
    std::printf("]\n");
  } catch (const kiln::EngineError& error) {
    std::fprintf(stderr, "%s: %s\n", kiln::ErrorCodeName(error.code()), error.what());
    return 1;
  }
  return 0;
}
