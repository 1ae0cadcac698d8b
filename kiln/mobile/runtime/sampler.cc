// Each + − × ÷ below rounds on its own, as numpy and JavaScript round it: clang fuses a * b + c into
// one fused multiply-add where the target has one (ARM), which rounds once where they round twice.
// -ffp-contract=fast and -ffast-math override this pragma: the runtime must not be built with them.
#pragma STDC FP_CONTRACT OFF

#include "sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace kiln {
namespace {

constexpr size_t kNucleusFirstSlice = 64;
// Sampling at a lower temperature is greedy anyway, and dividing logits by a subnormal one overflows.
constexpr double kGreedyBelowTemperature = 1e-5;
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2Hi = 6.93147180369123816490e-01;  // k × kLn2Hi is exact (fdlibm's split)
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kExpUnderflow = -708.0;           // below, e^x is subnormal: its weight counts as 0
constexpr std::array<double, 14> kExpTerms = [] {  // 1 / n! for n = 0 … 13, each the one before ÷ n
  std::array<double, 14> terms{1.0};
  for (size_t n = 1; n < terms.size(); ++n) terms[n] = terms[n - 1] / static_cast<double>(n);
  return terms;
}();

std::vector<size_t> Positions(size_t count) {
  std::vector<size_t> positions(count);
  std::iota(positions.begin(), positions.end(), size_t{0});
  return positions;
}

// The order top_k and top_p rank positions of `values` in: the larger value first, ties to the lower position.
auto RankingBy(const std::vector<double>& values) {
  return [&values](size_t a, size_t b) { return values[a] > values[b] || (values[a] == values[b] && a < b); };
}

// A running sum from the first to the last, as numpy's cumsum adds.
double Total(const std::vector<double>& weights) {
  double total = 0.0;
  for (double weight : weights) total += weight;
  return total;
}

// The first maximum, as numpy's argmax.
size_t FirstMaximum(const std::vector<double>& values) {
  size_t best = 0;
  for (size_t i = 1; i < values.size(); ++i) {
    if (values[i] > values[best]) best = i;
  }
  return best;
}

// Positions of the `count` largest values, ties to the lower position, in position order (selected, not sorted).
std::vector<size_t> TopK(const std::vector<double>& values, size_t count) {
  std::vector<size_t> top = Positions(values.size());
  std::nth_element(top.begin(), top.begin() + count, top.end(), RankingBy(values));
  top.resize(count);
  std::sort(top.begin(), top.end());
  return top;
}

std::vector<double> WeightsOf(const std::vector<double>& values) {
  const double max = *std::max_element(values.begin(), values.end());
  std::vector<double> weights(values.size());
  for (size_t i = 0; i < values.size(); ++i) weights[i] = ExpNonPositive(values[i] - max);
  return weights;
}

// How many of the first `ranked` positions of `ranking` it takes for their running weight to reach
// `threshold`, as numpy's searchsorted finds it (a NaN, when no candidate is finite, reaches it); 0: never.
size_t CountReaching(const std::vector<size_t>& ranking, size_t ranked, const std::vector<double>& weights,
                     double threshold) {
  double reached = 0.0;
  for (size_t count = 1; count <= ranked; ++count) {
    reached += weights[ranking[count - 1]];
    if (!(reached < threshold)) return count;
  }
  return 0;
}

// Positions of the most likely values whose weight first reaches top_p of the total weight, in
// position order. The first of them in the ranking are the cut a full ranking gives: ranks only a
// top slice, 8 times larger until it holds that weight (ranking the whole vocabulary every step
// costs as much as a decode step), as kiln/sampling.py does.
std::vector<size_t> Nucleus(const std::vector<double>& values, const std::vector<double>& weights, double top_p) {
  const double threshold = top_p * Total(weights);
  std::vector<size_t> ranking = Positions(values.size());
  for (size_t slice = kNucleusFirstSlice;; slice *= 8) {
    // Past a quarter of the vocabulary, selecting costs more than sorting it all.
    const bool whole = slice * 4 >= ranking.size();
    const size_t ranked = whole ? ranking.size() : slice;
    std::partial_sort(ranking.begin(), ranking.begin() + ranked, ranking.end(), RankingBy(values));
    const size_t count = CountReaching(ranking, ranked, weights, threshold);
    if (count > 0 || whole) {
      ranking.resize(count > 0 ? count : ranking.size());
      std::sort(ranking.begin(), ranking.end());
      return ranking;
    }
  }
}

// The first position whose running weight exceeds u × the total (the last one if rounding leaves none).
size_t Draw(const std::vector<double>& weights, double u) {
  const double target = u * Total(weights);
  double running = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) {
    running += weights[i];
    if (running > target) return i;
  }
  return weights.size() - 1;
}

template <typename T>
std::vector<T> Picked(const std::vector<T>& values, const std::vector<size_t>& positions) {
  std::vector<T> picked(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) picked[i] = values[positions[i]];
  return picked;
}

}  // namespace

double Mulberry32::operator()() {
  state_ += 0x6D2B79F5u;
  uint32_t t = state_;
  t = (t ^ (t >> 15)) * (t | 1u);
  t ^= t + (t ^ (t >> 7)) * (t | 61u);
  return static_cast<double>(t ^ (t >> 14)) / 4294967296.0;
}

double ExpNonPositive(double x) {
  if (x < kExpUnderflow) return 0.0;
  // -inf - -inf when no candidate is finite: NaN weights, as numpy's, choose the token numpy's do.
  if (std::isnan(x)) return x;
  // e^x = 2^k × e^r, |r| ≤ ln2 / 2; Taylor's series to r^13 is within an ulp.
  const double k = std::floor(x * kLog2e + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double total = kExpTerms.back();
  for (size_t n = kExpTerms.size() - 1; n-- > 0;) {
    total *= r;
    total += kExpTerms[n];
  }
  return std::ldexp(total, static_cast<int>(k));
}

Sampler::Sampler(const SamplingConfig& config, const std::vector<int32_t>& prompt_ids)
    : config_(config),
      random_(config.seed ? *config.seed : std::random_device{}()),
      seen_(prompt_ids.begin(), prompt_ids.end()) {}

void Sampler::Record(int32_t token) {
  seen_.insert(token);
  ++output_counts_[token];
}

void Sampler::Penalize(const float* logits, size_t vocab_size) {
  row_.assign(logits, logits + vocab_size);
  // Ids past the row (no tokenizer gives them) change nothing, as in the browser engine.
  const auto in_row = [vocab_size](int32_t id) { return id >= 0 && static_cast<size_t>(id) < vocab_size; };
  if (config_.repetition_penalty != 1.0) {
    for (int32_t id : seen_) {
      if (!in_row(id)) continue;
      double& value = row_[id];
      value = value > 0 ? value / config_.repetition_penalty : value * config_.repetition_penalty;
    }
  }
  for (const auto& [id, count] : output_counts_) {
    if (in_row(id)) row_[id] -= config_.presence_penalty + config_.frequency_penalty * static_cast<double>(count);
  }
}

int32_t Sampler::Sample(const float* logits, size_t vocab_size, const std::vector<bool>* allowed) {
  Penalize(logits, vocab_size);
  if (allowed != nullptr) {
    for (size_t id = 0; id < vocab_size; ++id) {
      if (!allowed->at(id)) row_[id] = -std::numeric_limits<double>::infinity();
    }
  }
  if (config_.temperature < kGreedyBelowTemperature) return static_cast<int32_t>(FirstMaximum(row_));
  for (double& value : row_) value /= config_.temperature;
  const bool top_k = config_.top_k > 0 && static_cast<uint64_t>(config_.top_k) < vocab_size;
  std::vector<size_t> ids = top_k ? TopK(row_, static_cast<size_t>(config_.top_k)) : Positions(vocab_size);
  const std::vector<double> candidates = Picked(row_, ids);
  std::vector<double> weights = WeightsOf(candidates);
  if (config_.top_p < 1.0) {
    const std::vector<size_t> kept = Nucleus(candidates, weights, config_.top_p);
    ids = Picked(ids, kept);
    weights = Picked(weights, kept);
  }
  return static_cast<int32_t>(ids[Draw(weights, random_())]);
}

}  // namespace kiln
