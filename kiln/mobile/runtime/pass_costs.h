// Speculative decoding's pass costs, in a file of their own so that a host program can replay them
// (tests/mobile/drivers/pass_costs.cc).
#ifndef KILN_PASS_COSTS_H_
#define KILN_PASS_COSTS_H_

#include <optional>

namespace kiln {

// Whether verify passes pay for themselves here, in time (PassCosts in kiln/speculative.py and
// web/src/speculative.js, step for step): where their recent worth falls below zero, proposals
// pause for as many decode steps as keep the loss of the pass that lost within kLossShare of their
// time, twice the pause before after each further loss with no pass saving time between (at most
// kMaxPause). A pass before any decode step is followed by one, to judge passes by.
class PassCosts {
 public:
  void Decoded(double seconds);
  void Verified(double seconds, int accepted);
  bool MayPropose();

 private:
  static constexpr double kLossShare = 0.1;
  static constexpr int kMaxPause = 256;
  std::optional<double> decode_seconds_;  // a decode step's time, a running mean
  double worth_ = 0;                      // seconds a pass saved, a running mean
  int pause_ = 0;                         // decode steps before the next proposal
  int backoff_ = 1;  // what the next pause is multiplied by: doubled at each, 1 once a pass saves time
};

}  // namespace kiln

#endif  // KILN_PASS_COSTS_H_
