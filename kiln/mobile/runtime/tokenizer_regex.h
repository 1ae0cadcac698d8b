// Text as the tokenizer reads it: UTF-8 characters, the Unicode properties of tokenizer.json's
// regular expressions, and those regular expressions themselves.
#ifndef KILN_MOBILE_RUNTIME_TOKENIZER_REGEX_H_
#define KILN_MOBILE_RUNTIME_TOKENIZER_REGEX_H_

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// One character of UTF-8 text and the bytes that spell it. Bytes that are not valid UTF-8 (the
// longest run that starts a valid sequence, as Unicode's "maximal subpart") read as one U+FFFD:
// the tokenizer then takes any bytes, and keeps them as they are.
struct Utf8Char {
  char32_t code_point;
  size_t size;
  bool valid;
};

Utf8Char ReadUtf8(std::string_view text, size_t at);
void AppendUtf8(char32_t code_point, std::string* text);
// `bytes` with each invalid part replaced by U+FFFD (Rust's String::from_utf8_lossy).
std::string ValidUtf8(std::string_view bytes);

bool IsLetter(char32_t code_point);      // \p{L}
bool IsNumber(char32_t code_point);      // \p{N}
bool IsWhiteSpace(char32_t code_point);  // \s

class RegexError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A regular expression of tokenizer.json, matched as Oniguruma (the tokenizers library's engine)
// matches it: backtracking, the leftmost match and of its alternatives the first that succeeds.
// The syntax is what tokenizers ship: | (...) (?:...) (?i:...) (?!...) [...] [^...] with ranges,
// the greedy quantifiers ? * + {n} {n,} {n,m}, \s \S \p{L} \p{N} \P{L} \P{N}, \r \n \t \f \v and
// escaped punctuation. Anything else throws RegexError naming it, as does a pattern that can match
// the empty string.
class TokenizerRegex {
 public:
  explicit TokenizerRegex(std::string_view pattern);
  static TokenizerRegex Literal(std::string_view text);

  struct Match {
    size_t begin;
    size_t end;
  };
  // The non-overlapping matches, left to right, as byte offsets.
  std::vector<Match> FindAll(std::string_view text) const;

 private:
  struct Program;
  explicit TokenizerRegex(std::shared_ptr<const Program> program);
  std::shared_ptr<const Program> program_;
};

}  // namespace kiln

#endif  // KILN_MOBILE_RUNTIME_TOKENIZER_REGEX_H_
