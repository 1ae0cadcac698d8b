#include "pass_costs.h"

#include <algorithm>
#include <cmath>

namespace kiln {

void PassCosts::Decoded(double seconds) {
  decode_seconds_ = decode_seconds_ ? 0.8 * *decode_seconds_ + 0.2 * seconds : seconds;
}

void PassCosts::Verified(double seconds, int accepted) {
  if (!decode_seconds_) {  // no decode step to judge it by yet: take one next (a draft always proposes)
    pause_ = 1;
    return;
  }
  double saved = accepted * *decode_seconds_ - (seconds - *decode_seconds_);
  worth_ = 0.5 * worth_ + 0.5 * saved;
  if (saved > 0) {
    backoff_ = 1;
  } else if (saved < 0 && worth_ < 0) {
    double pause = std::ceil(-saved / (kLossShare * *decode_seconds_)) * backoff_;
    pause_ = static_cast<int>(std::min<double>(kMaxPause, pause));
    backoff_ = std::min(kMaxPause, 2 * backoff_);
    worth_ = 0;
  }
}

bool PassCosts::MayPropose() {
  if (pause_ == 0) return true;
  pause_ -= 1;
  return false;
}

}  // namespace kiln
