// Choosing the next token from a row of logits: the same definition as `Sampler` in
// kiln/sampling.py and web/src/sampler.js, step for step, so that a seed picks the same tokens in
// all three engines whenever the logits agree.
//
// Penalties in double (repetition over prompt and output, then presence + frequency × count over
// the output); tokens `allowed` forbids get -infinity; greedy (the first maximum) below temperature
// 1e-5; otherwise divide by the temperature, keep the top_k largest (ties to the lower id), weigh
// with ExpNonPositive, keep the most likely tokens until their weight reaches top_p of the total
// (ties to the lower id), and draw u from Mulberry32: the first kept token in id order whose running
// weight exceeds u × their total. Every sum runs in double in that stated order.
#ifndef KILN_SAMPLER_H_
#define KILN_SAMPLER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kiln {

// The fields of a GenerationConfig (kiln/engine.py) that choose tokens.
struct SamplingConfig {
  double temperature = 0.0;  // below 1e-5: greedy
  double top_p = 1.0;
  int64_t top_k = 0;  // 0: off
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::optional<uint64_t> seed;  // none: a random one
};

// mulberry32 on the seed's low 32 bits, as `seededRandom` in web/src/sampler.js: doubles in [0, 1).
class Mulberry32 {
 public:
  explicit Mulberry32(uint64_t seed) : state_(static_cast<uint32_t>(seed)) {}
  double operator()();

 private:
  uint32_t state_;
};

// e^x for x ≤ 0 from + − × ÷ alone, which IEEE 754 rounds the same on every machine and in every
// language: the weights must equal the other engines' bit for bit, and libm's exp differs between
// platforms in the last bit.
double ExpNonPositive(double x);

class Sampler {
 public:
  // `prompt_ids` count for the repetition penalty.
  Sampler(const SamplingConfig& config, const std::vector<int32_t>& prompt_ids);

  // Count a chosen token for the penalties.
  void Record(int32_t token);

  // The next token for `logits` (`vocab_size` of them, none NaN); with `allowed` (one flag per token
  // id), one of the allowed tokens.
  int32_t Sample(const float* logits, size_t vocab_size, const std::vector<bool>* allowed = nullptr);

 private:
  void Penalize(const float* logits, size_t vocab_size);

  SamplingConfig config_;
  Mulberry32 random_;
  std::unordered_set<int32_t> seen_;
  std::unordered_map<int32_t, int64_t> output_counts_;
  std::vector<double> row_;  // this step's penalized logits, reused from step to step
};

}  // namespace kiln

#endif  // KILN_SAMPLER_H_
