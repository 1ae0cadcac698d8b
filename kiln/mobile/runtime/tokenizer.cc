// Each piece mirrors its namesake in Hugging Face tokenizers (tokenizers/src/...), down to the
// quirks that change ids or text: the tests compare both on the same tokenizer.json files.
#include "tokenizer.h"

#include <tvm/ffi/extra/json.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <iterator>
#include <queue>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "tokenizer_regex.h"
#include "unicode_normalization.h"

namespace kiln {

namespace {

namespace json = tvm::ffi::json;
using tvm::ffi::Any;
using tvm::ffi::String;

// ---- reading tokenizer.json --------------------------------------------------------------------

[[noreturn]] void Refuse(const std::string& problem) { throw TokenizerError("tokenizer.json: " + problem); }

[[noreturn]] void RefuseType(const std::string& section, const std::string& type) {
  Refuse("the " + section + " " + type + " is not supported");
}

std::string Quoted(const std::string& text) { return "\"" + text + "\""; }

// The value under `key`; nothing when it is missing or null.
std::optional<Any> Field(const json::Object& object, const std::string& key) {
  std::optional<Any> value = object.Get(String(key));
  if (!value || *value == nullptr) return std::nullopt;
  return value;
}

Any Required(const json::Object& object, const std::string& key, const std::string& owner) {
  std::optional<Any> value = Field(object, key);
  if (!value) Refuse(owner + " has no " + key);
  return *value;
}

json::Object AsObject(const Any& value, const std::string& what) {
  std::optional<json::Object> object = value.as<json::Object>();
  if (!object) Refuse(what + " is not an object");
  return *object;
}

json::Array AsArray(const Any& value, const std::string& what) {
  std::optional<json::Array> array = value.as<json::Array>();
  if (!array) Refuse(what + " is not an array");
  return *array;
}

std::string AsString(const Any& value, const std::string& what) {
  std::optional<String> text = value.as<String>();
  if (!text) Refuse(what + " is not a string");
  return std::string(*text);
}

int32_t AsId(const Any& value, const std::string& what) {
  std::optional<int64_t> id = value.as<int64_t>();
  if (!id || *id < 0 || *id > INT32_MAX) Refuse(what + " is not a token id");
  return static_cast<int32_t>(*id);
}

int64_t AsCount(const Any& value, const std::string& what) {
  std::optional<int64_t> count = value.as<int64_t>();
  if (!count || *count < 0) Refuse(what + " is not a count");
  return *count;
}

std::string StringField(const json::Object& object, const std::string& key, const std::string& owner) {
  return AsString(Required(object, key, owner), owner + "'s " + key);
}

bool FlagField(const json::Object& object, const std::string& key, bool missing, const std::string& owner) {
  std::optional<Any> value = Field(object, key);
  if (!value) return missing;
  std::optional<bool> flag = value->as<bool>();
  if (!flag) Refuse(owner + "'s " + key + " is not true or false");
  return *flag;
}

std::string TypeOf(const json::Object& object, const std::string& section) {
  return StringField(object, "type", "the " + section);
}

// One character, as Metaspace's replacement and Strip's content are.
char32_t CharacterField(const json::Object& object, const std::string& key, const std::string& owner) {
  std::string text = StringField(object, key, owner);
  if (text.empty() || ReadUtf8(text, 0).size != text.size()) Refuse(owner + "'s " + key + " is not one character");
  return ReadUtf8(text, 0).code_point;
}

// A pattern: {"String": literal text} or {"Regex": a regular expression}.
TokenizerRegex PatternField(const json::Object& object, const std::string& owner) {
  json::Object pattern = AsObject(Required(object, "pattern", owner), owner + "'s pattern");
  if (std::optional<Any> literal = Field(pattern, "String")) {
    std::string text = AsString(*literal, owner + "'s pattern");
    if (text.empty()) Refuse(owner + " with an empty pattern is not supported");
    return TokenizerRegex::Literal(text);
  }
  std::string regex = StringField(pattern, "Regex", owner + "'s pattern");
  try {
    return TokenizerRegex(regex);
  } catch (const RegexError& error) {
    Refuse(owner + "'s regex " + Quoted(regex) + " is not supported: " + error.what());
  }
}

// ---- splitting text ----------------------------------------------------------------------------

struct Piece {
  std::string text;
  bool at_text_start;  // begins the text given to Encode (Metaspace's prepend_scheme "first")
};

struct Span {
  size_t begin;
  size_t end;
  bool is_match;
};

// The text cut at `matches`, the gaps between them included (Pattern::find_matches).
std::vector<Span> SpansOf(std::string_view text, const std::vector<TokenizerRegex::Match>& matches) {
  std::vector<Span> spans;
  size_t at = 0;
  for (const TokenizerRegex::Match& match : matches) {
    if (at < match.begin) spans.push_back({at, match.begin, false});
    spans.push_back({match.begin, match.end, true});
    at = match.end;
  }
  if (at < text.size()) spans.push_back({at, text.size(), false});
  return spans;
}

template <typename Predicate>
std::vector<Span> CharacterSpans(std::string_view text, Predicate is_match) {
  std::vector<TokenizerRegex::Match> matches;
  for (size_t at = 0; at < text.size();) {
    Utf8Char c = ReadUtf8(text, at);
    if (is_match(c.code_point)) matches.push_back({at, at + c.size});
    at += c.size;
  }
  return SpansOf(text, matches);
}

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

SplitBehavior BehaviorField(const json::Object& object, const std::string& owner) {
  static const std::unordered_map<std::string, SplitBehavior> kBehaviors = {
      {"Removed", SplitBehavior::kRemoved},
      {"Isolated", SplitBehavior::kIsolated},
      {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
      {"MergedWithNext", SplitBehavior::kMergedWithNext},
      {"Contiguous", SplitBehavior::kContiguous},
  };
  std::string name = StringField(object, "behavior", owner);
  auto behavior = kBehaviors.find(name);
  if (behavior == kBehaviors.end()) Refuse(owner + "'s behavior " + name + " is not supported");
  return behavior->second;
}

// The spans that become pieces (NormalizedString::split).
std::vector<Span> Arrange(const std::vector<Span>& spans, SplitBehavior behavior) {
  std::vector<Span> arranged;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      return spans;
    case SplitBehavior::kRemoved:
      std::copy_if(spans.begin(), spans.end(), std::back_inserter(arranged), [](const Span& s) { return !s.is_match; });
      return arranged;
    case SplitBehavior::kContiguous:
      for (const Span& span : spans) {
        if (span.is_match == previous_match && !arranged.empty()) {
          arranged.back().end = span.end;
        } else {
          arranged.push_back(span);
        }
        previous_match = span.is_match;
      }
      return arranged;
    case SplitBehavior::kMergedWithPrevious:
      for (const Span& span : spans) {
        if (span.is_match && !previous_match && !arranged.empty()) {
          arranged.back().end = span.end;
        } else {
          arranged.push_back(span);
        }
        previous_match = span.is_match;
      }
      return arranged;
    case SplitBehavior::kMergedWithNext:
      for (auto span = spans.rbegin(); span != spans.rend(); ++span) {
        if (span->is_match && !previous_match && !arranged.empty()) {
          arranged.back().begin = span->begin;
        } else {
          arranged.push_back(*span);
        }
        previous_match = span->is_match;
      }
      std::reverse(arranged.begin(), arranged.end());
      return arranged;
  }
  return arranged;
}

std::vector<Piece> SplitPiece(const Piece& piece, const std::vector<Span>& spans, SplitBehavior behavior) {
  std::vector<Piece> pieces;
  for (const Span& span : Arrange(spans, behavior)) {
    if (span.begin == span.end) continue;
    pieces.push_back({piece.text.substr(span.begin, span.end - span.begin), piece.at_text_start && span.begin == 0});
  }
  return pieces;
}

std::string ReplaceAll(std::string_view text, const TokenizerRegex& pattern, const std::string& content) {
  std::string replaced;
  size_t at = 0;
  for (const TokenizerRegex::Match& match : pattern.FindAll(text)) {
    replaced.append(text.substr(at, match.begin - at));
    replaced += content;
    at = match.end;
  }
  replaced.append(text.substr(at));
  return replaced;
}

// ---- byte-level alphabet -----------------------------------------------------------------------

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for U+0100 onwards.
const std::array<char32_t, 256>& ByteCharacters() {
  static const std::array<char32_t, 256> characters = [] {
    std::array<char32_t, 256> table{};
    char32_t next_stand_in = 256;
    for (char32_t byte = 0; byte < 256; ++byte) {
      bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      table[byte] = printable ? byte : next_stand_in++;
    }
    return table;
  }();
  return characters;
}

std::string SpellBytes(std::string_view bytes) {
  static const std::array<std::string, 256> spellings = [] {
    std::array<std::string, 256> table;
    for (size_t byte = 0; byte < 256; ++byte) AppendUtf8(ByteCharacters()[byte], &table[byte]);
    return table;
  }();
  std::string spelled;
  for (char byte : bytes) spelled += spellings[static_cast<unsigned char>(byte)];
  return spelled;
}

std::optional<unsigned char> ByteOfCharacter(char32_t character) {
  static const std::unordered_map<char32_t, unsigned char> bytes = [] {
    std::unordered_map<char32_t, unsigned char> table;
    for (size_t byte = 0; byte < 256; ++byte) table.emplace(ByteCharacters()[byte], static_cast<unsigned char>(byte));
    return table;
  }();
  auto byte = bytes.find(character);
  if (byte == bytes.end()) return std::nullopt;
  return byte->second;
}

enum class PrependScheme { kAlways, kFirst, kNever };

PrependScheme PrependSchemeField(const json::Object& object, const std::string& owner) {
  if (!FlagField(object, "add_prefix_space", true, owner)) return PrependScheme::kNever;
  std::optional<Any> field = Field(object, "prepend_scheme");
  std::string scheme = field ? AsString(*field, owner + "'s prepend_scheme") : "always";
  if (scheme == "always") return PrependScheme::kAlways;
  if (scheme == "first") return PrependScheme::kFirst;
  if (scheme == "never") return PrependScheme::kNever;
  Refuse(owner + "'s prepend_scheme " + scheme + " is not supported");
}

// ---- normalizers -------------------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string Normalize(const std::string& text) const = 0;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string Normalize(const std::string& text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(TokenizerRegex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string Normalize(const std::string& text) const override { return ReplaceAll(text, pattern_, content_); }

 private:
  TokenizerRegex pattern_;
  std::string content_;
};

class NfcNormalizer final : public Normalizer {
 public:
  std::string Normalize(const std::string& text) const override { return NormalizeNfc(text); }
};

class NormalizerSequence final : public Normalizer {
 public:
  explicit NormalizerSequence(std::vector<std::unique_ptr<Normalizer>> normalizers)
      : normalizers_(std::move(normalizers)) {}
  std::string Normalize(const std::string& text) const override {
    std::string normalized = text;
    for (const auto& normalizer : normalizers_) normalized = normalizer->Normalize(normalized);
    return normalized;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> normalizers_;
};

std::unique_ptr<Normalizer> ReadNormalizer(const json::Object& object) {
  std::string type = TypeOf(object, "normalizer");
  std::string owner = "the normalizer " + type;
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> normalizers;
    for (const Any& item : AsArray(Required(object, "normalizers", owner), owner + "'s normalizers")) {
      normalizers.push_back(ReadNormalizer(AsObject(item, "a normalizer")));
    }
    return std::make_unique<NormalizerSequence>(std::move(normalizers));
  }
  if (type == "NFC") return std::make_unique<NfcNormalizer>();
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(StringField(object, "prepend", owner));
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(PatternField(object, owner), StringField(object, "content", owner));
  }
  RefuseType("normalizer", type);
}

// ---- pre-tokenizers ----------------------------------------------------------------------------

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual std::vector<Piece> Split(const Piece& piece) const = 0;
};

class PreTokenizerSequence final : public PreTokenizer {
 public:
  explicit PreTokenizerSequence(std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers)
      : pre_tokenizers_(std::move(pre_tokenizers)) {}

  std::vector<Piece> Split(const Piece& piece) const override {
    std::vector<Piece> pieces = {piece};
    for (const auto& pre_tokenizer : pre_tokenizers_) {
      std::vector<Piece> split;
      for (const Piece& each : pieces) {
        std::vector<Piece> parts = pre_tokenizer->Split(each);
        std::move(parts.begin(), parts.end(), std::back_inserter(split));
      }
      pieces = std::move(split);
    }
    return pieces;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers_;
};

// GPT-2's words, then each byte spelled as a character of the byte-level alphabet.
class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}

  std::vector<Piece> Split(const Piece& piece) const override {
    Piece spaced = piece;
    if (add_prefix_space_ && spaced.text[0] != ' ') spaced.text.insert(0, " ");
    std::vector<Piece> words = {spaced};
    if (use_regex_) {
      words = SplitPiece(spaced, SpansOf(spaced.text, gpt2_words_.FindAll(spaced.text)), SplitBehavior::kIsolated);
    }
    for (Piece& word : words) word.text = SpellBytes(word.text);
    return words;
  }

 private:
  bool add_prefix_space_;
  bool use_regex_;
  TokenizerRegex gpt2_words_{R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"};
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(TokenizerRegex pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}

  std::vector<Piece> Split(const Piece& piece) const override {
    std::vector<Span> spans = SpansOf(piece.text, pattern_.FindAll(piece.text));
    if (invert_) {
      for (Span& span : spans) span.is_match = !span.is_match;
    }
    return SplitPiece(piece, spans, behavior_);
  }

 private:
  TokenizerRegex pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual_digits) : individual_digits_(individual_digits) {}

  std::vector<Piece> Split(const Piece& piece) const override {
    SplitBehavior behavior = individual_digits_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
    return SplitPiece(piece, CharacterSpans(piece.text, IsNumber), behavior);
  }

 private:
  bool individual_digits_;
};

// Spaces become the replacement ("▁"), which also starts each word when `split`.
class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(char32_t replacement, PrependScheme prepend_scheme, bool split)
      : replacement_(replacement), prepend_scheme_(prepend_scheme), split_(split) {
    AppendUtf8(replacement, &replacement_text_);
  }

  std::vector<Piece> Split(const Piece& piece) const override {
    static const TokenizerRegex kSpace = TokenizerRegex::Literal(" ");
    Piece replaced{ReplaceAll(piece.text, kSpace, replacement_text_), piece.at_text_start};
    bool starts_with_replacement = replaced.text.compare(0, replacement_text_.size(), replacement_text_) == 0;
    bool prepend =
        prepend_scheme_ == PrependScheme::kAlways || (prepend_scheme_ == PrependScheme::kFirst && piece.at_text_start);
    if (prepend && !starts_with_replacement) replaced.text.insert(0, replacement_text_);
    if (!split_) return {replaced};
    auto is_replacement = [this](char32_t c) { return c == replacement_; };
    return SplitPiece(replaced, CharacterSpans(replaced.text, is_replacement), SplitBehavior::kMergedWithNext);
  }

 private:
  char32_t replacement_;
  std::string replacement_text_;
  PrependScheme prepend_scheme_;
  bool split_;
};

std::unique_ptr<PreTokenizer> ReadPreTokenizer(const json::Object& object) {
  std::string type = TypeOf(object, "pre_tokenizer");
  std::string owner = "the pre_tokenizer " + type;
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers;
    for (const Any& item : AsArray(Required(object, "pretokenizers", owner), owner + "'s pretokenizers")) {
      pre_tokenizers.push_back(ReadPreTokenizer(AsObject(item, "a pre_tokenizer")));
    }
    return std::make_unique<PreTokenizerSequence>(std::move(pre_tokenizers));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(FlagField(object, "add_prefix_space", true, owner),
                                                   FlagField(object, "use_regex", true, owner));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(PatternField(object, owner), BehaviorField(object, owner),
                                               FlagField(object, "invert", false, owner));
  }
  if (type == "Digits") {
    return std::make_unique<DigitsPreTokenizer>(FlagField(object, "individual_digits", false, owner));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(CharacterField(object, "replacement", owner),
                                                   PrependSchemeField(object, owner),
                                                   FlagField(object, "split", true, owner));
  }
  RefuseType("pre_tokenizer", type);
}

// ---- decoders ----------------------------------------------------------------------------------

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const = 0;
};

class DecoderSequence final : public Decoder {
 public:
  explicit DecoderSequence(std::vector<std::unique_ptr<Decoder>> decoders) : decoders_(std::move(decoders)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (const auto& decoder : decoders_) tokens = decoder->DecodeChain(std::move(tokens));
    return tokens;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> decoders_;
};

// The bytes the tokens spell, as one text; a token outside the byte-level alphabet (an added
// token such as "<|im_start|>") stands for its own UTF-8.
class ByteLevelDecoder final : public Decoder {
 public:
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) bytes += SpelledBytes(token).value_or(token);
    return {ValidUtf8(bytes)};
  }

 private:
  static std::optional<std::string> SpelledBytes(const std::string& token) {
    std::string bytes;
    for (size_t at = 0; at < token.size();) {
      Utf8Char c = ReadUtf8(token, at);
      std::optional<unsigned char> byte = ByteOfCharacter(c.code_point);
      if (!byte) return std::nullopt;
      bytes.push_back(static_cast<char>(*byte));
      at += c.size;
    }
    return bytes;
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme prepend_scheme)
      : replacement_(replacement), prepend_scheme_(prepend_scheme) {}

  // Every replacement becomes a space, except in the first token, where a prepending scheme
  // drops them all (not only the leading one).
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      bool drop = i == 0 && prepend_scheme_ != PrependScheme::kNever;
      std::string decoded;
      for (size_t at = 0; at < tokens[i].size();) {
        Utf8Char c = ReadUtf8(tokens[i], at);
        if (c.code_point != replacement_) {
          decoded.append(tokens[i], at, c.size);
        } else if (!drop) {
          decoded += ' ';
        }
        at += c.size;
      }
      tokens[i] = std::move(decoded);
    }
    return tokens;
  }

 private:
  char32_t replacement_;
  PrependScheme prepend_scheme_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(TokenizerRegex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) token = ReplaceAll(token, pattern_, content_);
    return tokens;
  }

 private:
  TokenizerRegex pattern_;
  std::string content_;
};

// Runs of <0xNN> tokens become the text their bytes spell, or one U+FFFD per byte when they do
// not spell valid UTF-8.
class ByteFallbackDecoder final : public Decoder {
 public:
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::vector<std::string> decoded;
    std::string bytes;
    auto flush_bytes = [&] {
      if (bytes.empty()) return;
      if (ValidUtf8(bytes) == bytes) {
        decoded.push_back(bytes);
      } else {
        decoded.insert(decoded.end(), bytes.size(), "\xEF\xBF\xBD");
      }
      bytes.clear();
    };
    for (std::string& token : tokens) {
      if (std::optional<char> byte = FallbackByte(token)) {
        bytes.push_back(*byte);
        continue;
      }
      flush_bytes();
      decoded.push_back(std::move(token));
    }
    flush_bytes();
    return decoded;
  }

 private:
  static std::optional<char> FallbackByte(const std::string& token) {
    if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return std::nullopt;
    auto hex = [](char digit) { return std::isxdigit(static_cast<unsigned char>(digit)) != 0; };
    if (!hex(token[3]) || !hex(token[4])) return std::nullopt;
    return static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16));
  }
};

class FuseDecoder final : public Decoder {
 public:
  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    std::string fused;
    for (const std::string& token : tokens) fused += token;
    return {fused};
  }
};

// Up to `start` leading and `stop` trailing `content` characters off each token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, int64_t start, int64_t stop) : content_(content), start_(start), stop_(stop) {}

  std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const override {
    for (std::string& token : tokens) {
      std::vector<Utf8Char> characters;
      for (size_t at = 0; at < token.size(); at += characters.back().size) characters.push_back(ReadUtf8(token, at));
      size_t first = 0;
      while (first < characters.size() && static_cast<int64_t>(first) < start_ && IsContent(characters[first])) ++first;
      size_t last = characters.size();
      auto stripped_at_end = [&] { return static_cast<int64_t>(characters.size() - last); };
      while (last > first && stripped_at_end() < stop_ && IsContent(characters[last - 1])) --last;
      size_t begin = 0;
      for (size_t i = 0; i < first; ++i) begin += characters[i].size;
      size_t end = begin;
      for (size_t i = first; i < last; ++i) end += characters[i].size;
      token = token.substr(begin, end - begin);
    }
    return tokens;
  }

 private:
  bool IsContent(const Utf8Char& c) const { return c.code_point == content_; }

  char32_t content_;
  int64_t start_;
  int64_t stop_;
};

std::unique_ptr<Decoder> ReadDecoder(const json::Object& object) {
  std::string type = TypeOf(object, "decoder");
  std::string owner = "the decoder " + type;
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> decoders;
    for (const Any& item : AsArray(Required(object, "decoders", owner), owner + "'s decoders")) {
      decoders.push_back(ReadDecoder(AsObject(item, "a decoder")));
    }
    return std::make_unique<DecoderSequence>(std::move(decoders));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(CharacterField(object, "replacement", owner),
                                              PrependSchemeField(object, owner));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(PatternField(object, owner), StringField(object, "content", owner));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    return std::make_unique<StripDecoder>(CharacterField(object, "content", owner),
                                          AsCount(Required(object, "start", owner), owner + "'s start"),
                                          AsCount(Required(object, "stop", owner), owner + "'s stop"));
  }
  RefuseType("decoder", type);
}

// ---- post-processors ---------------------------------------------------------------------------

SpecialTokens ReadTemplateProcessing(const json::Object& object, const std::string& owner) {
  json::Object special_tokens = AsObject(Required(object, "special_tokens", owner), owner + "'s special_tokens");
  SpecialTokens around;
  bool after_sequence = false;
  for (const Any& item : AsArray(Required(object, "single", owner), owner + "'s single")) {
    json::Object piece = AsObject(item, owner + "'s single item");
    if (Field(piece, "Sequence")) {
      after_sequence = true;
      continue;
    }
    json::Object special =
        AsObject(Required(piece, "SpecialToken", owner + "'s single item"), owner + "'s SpecialToken");
    std::string name = StringField(special, "id", owner + "'s SpecialToken");
    std::string what = owner + "'s special token " + Quoted(name);
    json::Object token = AsObject(Required(special_tokens, name, owner + "'s special_tokens"), what);
    std::vector<int32_t>& ids = after_sequence ? around.after : around.before;
    for (const Any& id : AsArray(Required(token, "ids", what), what + "'s ids")) {
      ids.push_back(AsId(id, what + "'s id"));
    }
  }
  return around;
}

int32_t SpecialTokenPairId(const json::Object& object, const std::string& key, const std::string& owner) {
  json::Array pair = AsArray(Required(object, key, owner), owner + "'s " + key);
  if (pair.size() != 2) Refuse(owner + "'s " + key + " is not a [token, id] pair");
  return AsId(pair[1], owner + "'s " + key + " id");
}

SpecialTokens ReadPostProcessor(const json::Object& object) {
  std::string type = TypeOf(object, "post_processor");
  std::string owner = "the post_processor " + type;
  if (type == "TemplateProcessing") return ReadTemplateProcessing(object, owner);
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    return {{SpecialTokenPairId(object, "cls", owner)}, {SpecialTokenPairId(object, "sep", owner)}};
  }
  if (type == "ByteLevel") return {};
  if (type == "Sequence") {
    // Each processor wraps what the ones before it gave.
    SpecialTokens around;
    for (const Any& item : AsArray(Required(object, "processors", owner), owner + "'s processors")) {
      SpecialTokens outer = ReadPostProcessor(AsObject(item, "a post_processor"));
      around.before.insert(around.before.begin(), outer.before.begin(), outer.before.end());
      around.after.insert(around.after.end(), outer.after.begin(), outer.after.end());
    }
    return around;
  }
  RefuseType("post_processor", type);
}

// ---- the BPE model -----------------------------------------------------------------------------

struct MergeStep {
  int32_t rank;  // lower merges first
  int32_t merged_id;
};

class BytePairModel {
 public:
  static BytePairModel FromJson(const json::Object& model);

  // Appends the ids of one word (tokenizers' BPE::tokenize).
  void Tokenize(const std::string& word, std::vector<int32_t>* ids) const {
    if (word.empty()) return;
    if (ignore_merges_) {
      auto whole = vocab_.find(word);
      if (whole != vocab_.end()) {
        ids->push_back(whole->second);
        return;
      }
    }
    std::vector<Symbol> symbols = Symbols(word);
    MergeAll(&symbols);
    for (const Symbol& symbol : symbols) {
      if (symbol.size != 0) ids->push_back(symbol.id);
    }
  }

  std::optional<int32_t> TokenToId(const std::string& token) const {
    auto id = vocab_.find(token);
    if (id == vocab_.end()) return std::nullopt;
    return id->second;
  }

  const std::string* IdToToken(int32_t id) const {
    auto token = tokens_.find(id);
    return token == tokens_.end() ? nullptr : &token->second;
  }

  size_t size() const { return vocab_.size(); }

 private:
  struct Symbol {
    int32_t id;
    int64_t previous;  // -1: none
    int64_t next;      // -1: none
    size_t size;       // bytes of the word; 0 once merged into the symbol before it
  };

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  std::optional<MergeStep> MergeOf(int32_t left, int32_t right) const {
    auto merge = merges_.find(PairKey(left, right));
    if (merge == merges_.end()) return std::nullopt;
    return merge->second;
  }

  // The word's characters as tokens (BPE::merge_word): a character the vocabulary lacks becomes
  // its <0xNN> byte tokens with byte_fallback, else the unknown token (one for a run of them with
  // fuse_unk), else nothing. As in tokenizers, a pending unknown token is placed after the byte
  // tokens of the characters that follow it.
  std::vector<Symbol> Symbols(const std::string& word) const {
    std::vector<Symbol> symbols;
    std::optional<Symbol> unknown;
    auto add = [&](int32_t id, size_t size) { symbols.push_back({id, 0, 0, size}); };
    for (size_t at = 0; at < word.size();) {
      size_t size = ReadUtf8(word, at).size;
      auto known = vocab_.find(word.substr(at, size));
      if (known != vocab_.end()) {
        if (unknown) add(unknown->id, unknown->size);
        unknown.reset();
        add(known->second, size);
      } else if (byte_fallback_ && HasByteTokens(word, at, size)) {
        for (size_t i = at; i < at + size; ++i) add(*byte_ids_[static_cast<unsigned char>(word[i])], 1);
      } else if (unknown_id_ && unknown && fuse_unknown_) {
        unknown->size += size;
      } else if (unknown_id_) {
        if (unknown) add(unknown->id, unknown->size);
        unknown = Symbol{*unknown_id_, 0, 0, size};
      }
      at += size;
    }
    if (unknown) add(unknown->id, unknown->size);
    for (size_t i = 0; i < symbols.size(); ++i) {
      symbols[i].previous = static_cast<int64_t>(i) - 1;
      symbols[i].next = i + 1 < symbols.size() ? static_cast<int64_t>(i) + 1 : -1;
    }
    return symbols;
  }

  bool HasByteTokens(const std::string& word, size_t at, size_t size) const {
    for (size_t i = at; i < at + size; ++i) {
      if (!byte_ids_[static_cast<unsigned char>(word[i])]) return false;
    }
    return true;
  }

  // The pair of neighbours with the lowest merge rank (the leftmost of equals) is merged, until
  // none is left (Word::merge_all).
  void MergeAll(std::vector<Symbol>* symbols_ptr) const {
    std::vector<Symbol>& symbols = *symbols_ptr;
    struct Candidate {
      int32_t rank;
      size_t position;
      int32_t merged_id;
    };
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
    };
    std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
    auto consider = [&](size_t left, size_t right) {
      if (std::optional<MergeStep> merge = MergeOf(symbols[left].id, symbols[right].id)) {
        queue.push({merge->rank, left, merge->merged_id});
      }
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) consider(i, i + 1);
    while (!queue.empty()) {
      Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.position];
      if (left.size == 0 || left.next < 0) continue;
      Symbol right = symbols[left.next];
      std::optional<MergeStep> still = MergeOf(left.id, right.id);
      if (!still || still->merged_id != top.merged_id) continue;  // a stale pair: a neighbour merged since
      symbols[left.next].size = 0;
      left.id = top.merged_id;
      left.size += right.size;
      left.next = right.next;
      if (right.next >= 0) symbols[right.next].previous = static_cast<int64_t>(top.position);
      if (left.previous >= 0) consider(left.previous, top.position);
      if (left.next >= 0) consider(top.position, left.next);
    }
  }

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<int32_t, std::string> tokens_;
  std::unordered_map<uint64_t, MergeStep> merges_;  // by PairKey
  std::optional<int32_t> unknown_id_;
  bool fuse_unknown_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;                        // a word that is itself a token is taken whole
  std::array<std::optional<int32_t>, 256> byte_ids_;  // <0x00> ... <0xFF>
};

// A merge: "left right" (older files) or ["left", "right"].
std::pair<std::string, std::string> MergePair(const Any& merge, const std::string& owner) {
  if (std::optional<String> line = merge.as<String>()) {
    std::string text(*line);
    size_t space = text.find(' ');
    if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
      Refuse(owner + "'s merge " + Quoted(text) + " is not two tokens");
    }
    return {text.substr(0, space), text.substr(space + 1)};
  }
  json::Array pair = AsArray(merge, owner + "'s merge");
  if (pair.size() != 2) Refuse(owner + "'s merge is not two tokens");
  return {AsString(pair[0], owner + "'s merge"), AsString(pair[1], owner + "'s merge")};
}

// tokenizers takes an empty or zero option as no option.
bool IsUnset(const std::optional<Any>& value) {
  if (!value) return true;
  if (std::optional<String> text = value->as<String>()) return text->empty();
  if (std::optional<double> number = value->as<double>()) return *number == 0;
  if (std::optional<int64_t> integer = value->as<int64_t>()) return *integer == 0;
  return false;
}

BytePairModel BytePairModel::FromJson(const json::Object& model) {
  const std::string owner = "the model BPE";
  for (const char* option : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!IsUnset(Field(model, option))) Refuse(owner + "'s " + option + " is not supported");
  }
  BytePairModel bpe;
  for (const auto& [token, id] : AsObject(Required(model, "vocab", owner), owner + "'s vocab")) {
    std::string text = AsString(token, owner + "'s vocab token");
    int32_t value = AsId(id, owner + "'s id of " + Quoted(text));
    bpe.vocab_.emplace(text, value);
    bpe.tokens_.emplace(value, text);
  }
  auto id_of = [&](const std::string& token, const std::string& use) {
    std::optional<int32_t> id = bpe.TokenToId(token);
    if (!id) Refuse(owner + "'s " + use + " " + Quoted(token) + " is not in its vocab");
    return *id;
  };
  int32_t rank = 0;
  for (const Any& merge : AsArray(Required(model, "merges", owner), owner + "'s merges")) {
    std::optional<String> line = merge.as<String>();
    // merges.txt's header line, which tokenizers skips as well
    if (line && std::string_view(line->data(), line->size()).substr(0, 8) == "#version") continue;
    auto [left, right] = MergePair(merge, owner);
    uint64_t pair = PairKey(id_of(left, "merge token"), id_of(right, "merge token"));
    bpe.merges_[pair] = {rank++, id_of(left + right, "merged token")};
  }
  if (std::optional<Any> unknown = Field(model, "unk_token")) {
    bpe.unknown_id_ = id_of(AsString(*unknown, owner + "'s unk_token"), "unk_token");
  }
  bpe.fuse_unknown_ = FlagField(model, "fuse_unk", false, owner);
  bpe.byte_fallback_ = FlagField(model, "byte_fallback", false, owner);
  bpe.ignore_merges_ = FlagField(model, "ignore_merges", false, owner);
  for (size_t byte = 0; byte < 256; ++byte) {
    char name[7];
    std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned>(byte));
    bpe.byte_ids_[byte] = bpe.TokenToId(name);
  }
  return bpe;
}

// ---- added tokens ------------------------------------------------------------------------------

struct AddedToken {
  int32_t id;
  bool lstrip;  // takes the white space before it
  bool rstrip;  // takes the white space after it
};

// Added tokens' texts as a trie of bytes, for the longest that starts at a place.
class AddedTokenTrie {
 public:
  void Insert(const std::string& text, size_t token) {
    uint32_t node = 0;
    for (char byte : text) {
      auto [child, inserted] = children_.emplace(EdgeKey(node, byte), static_cast<uint32_t>(tokens_.size()));
      if (inserted) tokens_.emplace_back();
      node = child->second;
    }
    tokens_[node] = token;
  }

  struct Found {
    size_t end;
    size_t token;
  };

  std::optional<Found> LongestAt(std::string_view text, size_t at) const {
    std::optional<Found> longest;
    uint32_t node = 0;
    for (size_t i = at; i < text.size(); ++i) {
      auto child = children_.find(EdgeKey(node, text[i]));
      if (child == children_.end()) break;
      node = child->second;
      if (tokens_[node]) longest = Found{i + 1, *tokens_[node]};
    }
    return longest;
  }

 private:
  static uint64_t EdgeKey(uint32_t node, char byte) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(byte);
  }

  std::vector<std::optional<size_t>> tokens_ = {std::nullopt};  // per node, the token that ends there
  std::unordered_map<uint64_t, uint32_t> children_;             // by EdgeKey
};

struct Segment {
  std::string text;
  std::optional<int32_t> added_id;
  bool at_text_start;
};

size_t LeadingWhiteSpace(std::string_view text) {
  size_t at = 0;
  while (at < text.size() && IsWhiteSpace(ReadUtf8(text, at).code_point)) at += ReadUtf8(text, at).size;
  return at;
}

size_t TrailingWhiteSpaceStart(std::string_view text) {
  size_t start = 0;
  for (size_t at = 0; at < text.size();) {
    Utf8Char c = ReadUtf8(text, at);
    at += c.size;
    if (!IsWhiteSpace(c.code_point)) start = at;
  }
  return start;
}

// The text cut around the added tokens found in it, leftmost-longest, with the white space
// their lstrip and rstrip take (AddedVocabulary::find_matches).
std::vector<Segment> SplitOnAddedTokens(std::string_view text, bool at_text_start, const AddedTokenTrie& trie,
                                        const std::vector<AddedToken>& tokens) {
  std::vector<Segment> segments;
  auto add = [&](size_t begin, size_t end, std::optional<int32_t> id) {
    if (begin >= end) return;
    segments.push_back({std::string(text.substr(begin, end - begin)), id, at_text_start && begin == 0});
  };
  size_t done = 0;
  for (size_t at = 0; at < text.size();) {
    std::optional<AddedTokenTrie::Found> found = trie.LongestAt(text, at);
    if (!found) {
      ++at;
      continue;
    }
    const AddedToken& token = tokens[found->token];
    size_t begin = at;
    size_t end = found->end;
    if (token.lstrip) {
      size_t from = std::min(done, begin);
      begin = std::max(from + TrailingWhiteSpaceStart(text.substr(from, begin - from)), done);
    }
    if (token.rstrip) end += LeadingWhiteSpace(text.substr(end));
    add(done, begin, std::nullopt);
    add(begin, end, token.id);
    done = end;
    at = found->end;
  }
  add(done, text.size(), std::nullopt);
  return segments;
}

std::string Join(const std::vector<std::string>& parts, const std::string& separator) {
  std::string joined;
  for (size_t i = 0; i < parts.size(); ++i) joined += (i ? separator : "") + parts[i];
  return joined;
}

}  // namespace

// ---- the tokenizer -----------------------------------------------------------------------------

struct Tokenizer::Pipeline {
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  BytePairModel model;
  std::unique_ptr<Decoder> decoder;
  SpecialTokens special_tokens;
  std::vector<AddedToken> added_tokens;
  AddedTokenTrie raw_added_tokens;         // normalized false: found in the text as given
  AddedTokenTrie normalized_added_tokens;  // normalized true: found, normalized, in the normalized text
  std::unordered_map<std::string, int32_t> added_ids;
  std::unordered_map<int32_t, std::string> added_texts;  // as Decode gives them: normalized when matched so
  size_t vocab_size = 0;

  void ReadAddedTokens(const json::Array& entries) {
    for (const Any& entry : entries) {
      json::Object object = AsObject(entry, "an added token");
      std::string content = StringField(object, "content", "an added token");
      std::string owner = "the added token " + Quoted(content);
      if (FlagField(object, "single_word", false, owner)) Refuse(owner + "'s single_word is not supported");
      if (content.empty()) continue;  // tokenizers ignores it
      AddedToken token{AsId(Required(object, "id", owner), owner + "'s id"), FlagField(object, "lstrip", false, owner),
                       FlagField(object, "rstrip", false, owner)};
      bool normalized = FlagField(object, "normalized", true, owner);
      std::string text = normalized && normalizer ? normalizer->Normalize(content) : content;
      (normalized ? normalized_added_tokens : raw_added_tokens).Insert(text, added_tokens.size());
      added_tokens.push_back(token);
      added_ids[content] = token.id;
      added_texts[token.id] = text;
    }
    vocab_size = model.size();
    for (const auto& [content, id] : added_ids) vocab_size += model.TokenToId(content) ? 0 : 1;
  }
};

Tokenizer::Tokenizer(std::unique_ptr<const Pipeline> pipeline) : pipeline_(std::move(pipeline)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::FromJson(const std::string& tokenizer_json) {
  String parse_error;
  json::Value root = json::Parse(tokenizer_json, &parse_error);
  if (!parse_error.empty()) throw TokenizerError("tokenizer.json is not valid JSON: " + std::string(parse_error));
  json::Object file = AsObject(root, "the file");
  auto pipeline = std::make_unique<Pipeline>();
  json::Object model = AsObject(Required(file, "model", "the file"), "the model");
  std::string model_type = TypeOf(model, "model");
  if (model_type != "BPE") RefuseType("model", model_type);
  pipeline->model = BytePairModel::FromJson(model);
  if (std::optional<Any> normalizer = Field(file, "normalizer")) {
    pipeline->normalizer = ReadNormalizer(AsObject(*normalizer, "the normalizer"));
  }
  if (std::optional<Any> pre_tokenizer = Field(file, "pre_tokenizer")) {
    pipeline->pre_tokenizer = ReadPreTokenizer(AsObject(*pre_tokenizer, "the pre_tokenizer"));
  }
  if (std::optional<Any> decoder = Field(file, "decoder")) {
    pipeline->decoder = ReadDecoder(AsObject(*decoder, "the decoder"));
  }
  if (std::optional<Any> post_processor = Field(file, "post_processor")) {
    pipeline->special_tokens = ReadPostProcessor(AsObject(*post_processor, "the post_processor"));
  }
  std::optional<Any> added_tokens = Field(file, "added_tokens");
  pipeline->ReadAddedTokens(added_tokens ? AsArray(*added_tokens, "added_tokens") : json::Array());
  return Tokenizer(std::move(pipeline));
}

std::vector<int32_t> Tokenizer::Encode(const std::string& text) const {
  const Pipeline& pipeline = *pipeline_;
  std::vector<int32_t> ids;
  for (const Segment& raw : SplitOnAddedTokens(text, true, pipeline.raw_added_tokens, pipeline.added_tokens)) {
    if (raw.added_id) {
      ids.push_back(*raw.added_id);
      continue;
    }
    std::string normalized = pipeline.normalizer ? pipeline.normalizer->Normalize(raw.text) : raw.text;
    for (const Segment& segment :
         SplitOnAddedTokens(normalized, raw.at_text_start, pipeline.normalized_added_tokens, pipeline.added_tokens)) {
      if (segment.added_id) {
        ids.push_back(*segment.added_id);
        continue;
      }
      Piece whole{segment.text, segment.at_text_start};
      std::vector<Piece> words =
          pipeline.pre_tokenizer ? pipeline.pre_tokenizer->Split(whole) : std::vector<Piece>{whole};
      for (const Piece& word : words) pipeline.model.Tokenize(word.text, &ids);
    }
  }
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::vector<std::string> tokens;
  for (int32_t id : ids) {
    auto added = pipeline_->added_texts.find(id);
    if (added != pipeline_->added_texts.end()) {
      tokens.push_back(added->second);
    } else if (const std::string* token = pipeline_->model.IdToToken(id)) {
      tokens.push_back(*token);
    }
  }
  if (!pipeline_->decoder) return Join(tokens, " ");
  return Join(pipeline_->decoder->DecodeChain(std::move(tokens)), "");
}

std::optional<int32_t> Tokenizer::TokenToId(const std::string& token) const {
  auto added = pipeline_->added_ids.find(token);
  if (added != pipeline_->added_ids.end()) return added->second;
  return pipeline_->model.TokenToId(token);
}

size_t Tokenizer::VocabSize() const { return pipeline_->vocab_size; }

const SpecialTokens& Tokenizer::SpecialTokensAround() const { return pipeline_->special_tokens; }

}  // namespace kiln
