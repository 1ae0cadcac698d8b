// Speculative decoding: tokens proposed ahead of the reply, verified by the model in one pass. The
// same definition as kiln/speculative.py and web/src/speculative.js, step for step (read the
// Python docstring): prompt lookup proposes what followed the latest earlier occurrence of the
// reply's last tokens; one `prefill_all_logits` pass over the last token and the proposed ones
// gives their rows, and the engine's sampler picks every token from them as from decode steps,
// with its own seeded draws, so a seed gives the same reply with or without speculation.
#ifndef KILN_SPECULATIVE_H_
#define KILN_SPECULATIVE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "model.h"
#include "pass_costs.h"

namespace kiln {

// Prompt lookup's n-gram sizes and proposal lengths (the Python defaults).
struct Speculation {
  int ngram_min = 2;
  int ngram_max = 4;
  int first_proposal = 4;
  int max_proposal = 12;
};

// Proposes what followed the latest earlier occurrence of the history's last n tokens, the longest n that occurs.
class PromptLookup {
 public:
  PromptLookup(const Speculation& speculation, const std::vector<int32_t>& history);
  void Extend(int32_t token);
  std::vector<int32_t> Propose(int count) const;

 private:
  int ngram_min_, ngram_max_;
  std::vector<int32_t> history_;
  // per size: n-gram → where its latest occurrence with a token after it starts
  std::map<int, std::map<std::vector<int32_t>, size_t>> latest_;
};

struct SpeculationStats {
  int64_t steps = 0;     // model passes after the prompt's prefill (verify passes and decode steps)
  int64_t proposed = 0;  // tokens proposed and verified
  int64_t accepted = 0;  // of those, the ones the reply took
};

// A reply's model steps after its prompt: one decode step per token, or, with a speculation,
// verified rows ahead of the reply (Lookahead in kiln/speculative.py).
class DecodingSteps {
 public:
  DecodingSteps(Model& model, const std::optional<Speculation>& speculation, const std::vector<int32_t>& prompt_ids);
  // The logits after `token`, the reply's latest.
  std::vector<float> LogitsAfter(int32_t token);
  // Leave the cache holding the reply's tokens and no proposed ones.
  void Settle();
  const SpeculationStats& stats() const { return stats_; }

 private:
  struct Row {
    int32_t token;
    std::vector<float> logits;
  };
  std::vector<int32_t> Proposal() const;

  Model& model_;
  std::optional<Speculation> speculation_;
  std::optional<PromptLookup> lookup_;
  int proposal_length_ = 0;
  std::deque<Row> rows_;
  SpeculationStats stats_;
  PassCosts costs_;
  double pass_seconds_ = 0;  // the time of the pass the rows came from
  int pass_accepted_ = 0;    // its rows the reply took so far
};

}  // namespace kiln

#endif  // KILN_SPECULATIVE_H_
