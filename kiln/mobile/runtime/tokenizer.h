// The tokenizer of a Kiln model, read from its tokenizer.json and giving the ids and text that
// Hugging Face `tokenizers` gives for it: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2, and
// Qwen2.5 and Qwen3 with their NFC normalizer) and SentencePiece-style BPE with byte fallback
// (Llama 2, Mistral, Gemma). A tokenizer.json with any other piece (another model type,
// normalizer, pre-tokenizer, decoder or post-processor, or a regular expression beyond
// tokenizer_regex.h's) is refused when it is read, naming that piece.
#ifndef KILN_MOBILE_RUNTIME_TOKENIZER_H_
#define KILN_MOBILE_RUNTIME_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kiln {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The ids the post-processor puts around one sequence (BOS/EOS, [CLS]/[SEP]).
struct SpecialTokens {
  std::vector<int32_t> before;
  std::vector<int32_t> after;
};

class Tokenizer {
 public:
  // From the text of a tokenizer.json; throws TokenizerError for malformed or unsupported files.
  static Tokenizer FromJson(const std::string& tokenizer_json);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // `tokenizer.encode(text, add_special_tokens=False).ids`: added tokens in the text (such as
  // "<|im_start|>") are found, the post-processor's special tokens are not added.
  std::vector<int32_t> Encode(const std::string& text) const;
  // `tokenizer.decode(ids, skip_special_tokens=False)`; ids the vocabulary lacks are left out.
  std::string Decode(const std::vector<int32_t>& ids) const;
  std::optional<int32_t> TokenToId(const std::string& token) const;
  // The distinct tokens of the model and of added_tokens (`tokenizer.get_vocab_size()`).
  size_t VocabSize() const;
  const SpecialTokens& SpecialTokensAround() const;

 private:
  struct Pipeline;
  explicit Tokenizer(std::unique_ptr<const Pipeline> pipeline);
  std::unique_ptr<const Pipeline> pipeline_;
};

}  // namespace kiln

#endif  // KILN_MOBILE_RUNTIME_TOKENIZER_H_
