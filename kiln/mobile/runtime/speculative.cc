#include "speculative.h"

#include <algorithm>
#include <chrono>

namespace kiln {

PromptLookup::PromptLookup(const Speculation& speculation, const std::vector<int32_t>& history)
    : ngram_min_(speculation.ngram_min), ngram_max_(speculation.ngram_max) {
  for (int32_t token : history) Extend(token);
}

void PromptLookup::Extend(int32_t token) {
  history_.push_back(token);
  for (int n = ngram_min_; n <= ngram_max_; ++n) {
    if (history_.size() < static_cast<size_t>(n) + 1) continue;
    size_t start = history_.size() - 1 - n;
    latest_[n][std::vector<int32_t>(history_.begin() + start, history_.begin() + start + n)] = start;
  }
}

std::vector<int32_t> PromptLookup::Propose(int count) const {
  for (int n = ngram_max_; n >= ngram_min_; --n) {
    if (history_.size() < static_cast<size_t>(n)) continue;
    auto sizes = latest_.find(n);
    if (sizes == latest_.end()) continue;
    auto found = sizes->second.find(std::vector<int32_t>(history_.end() - n, history_.end()));
    if (found == sizes->second.end()) continue;
    size_t from = found->second + n;
    size_t to = std::min(history_.size(), from + static_cast<size_t>(count));
    return std::vector<int32_t>(history_.begin() + from, history_.begin() + to);
  }
  return {};
}

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

DecodingSteps::DecodingSteps(Model& model, const std::optional<Speculation>& speculation,
                             const std::vector<int32_t>& prompt_ids)
    : model_(model), speculation_(speculation) {
  if (speculation_) {
    lookup_.emplace(*speculation_, prompt_ids);
    proposal_length_ = speculation_->first_proposal;
  }
}

std::vector<float> DecodingSteps::LogitsAfter(int32_t token) {
  if (lookup_) lookup_->Extend(token);
  if (!rows_.empty() && rows_.front().token == token) {
    stats_.accepted += 1;
    pass_accepted_ += 1;
    std::vector<float> logits = std::move(rows_.front().logits);
    rows_.pop_front();
    if (rows_.empty()) {
      proposal_length_ = std::min(speculation_->max_proposal, proposal_length_ * 2);
      costs_.Verified(pass_seconds_, pass_accepted_);
    }
    return logits;
  }
  if (!rows_.empty()) {
    proposal_length_ = std::max(1, proposal_length_ / 2);
    costs_.Verified(pass_seconds_, pass_accepted_);
    Settle();
  }
  stats_.steps += 1;
  std::vector<int32_t> proposal = costs_.MayPropose() ? Proposal() : std::vector<int32_t>{};
  const auto started = std::chrono::steady_clock::now();
  if (proposal.empty()) {
    std::vector<float> logits = model_.Decode(token);
    costs_.Decoded(SecondsSince(started));
    return logits;
  }
  stats_.proposed += static_cast<int64_t>(proposal.size());
  std::vector<int32_t> ids{token};
  ids.insert(ids.end(), proposal.begin(), proposal.end());
  std::vector<std::vector<float>> logits = model_.AllLogits(ids);
  pass_seconds_ = SecondsSince(started);
  pass_accepted_ = 0;
  for (size_t i = 0; i < proposal.size(); ++i) rows_.push_back({proposal[i], std::move(logits[i + 1])});
  return std::move(logits[0]);
}

std::vector<int32_t> DecodingSteps::Proposal() const {
  if (!lookup_) return {};
  int room = model_.SpeculationRoom() - 1;  // the token itself goes first
  return room > 0 ? lookup_->Propose(std::min(proposal_length_, room)) : std::vector<int32_t>{};
}

void DecodingSteps::Settle() {
  if (rows_.empty()) return;
  model_.Rollback(static_cast<int>(rows_.size()));
  rows_.clear();
}

}  // namespace kiln
