#include "tokenizer_regex.h"

#include <algorithm>
#include <bitset>
#include <cctype>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "unicode_tables.h"

namespace kiln {

// ---- UTF-8 -------------------------------------------------------------------------------------

namespace {

constexpr char32_t kReplacementCharacter = 0xFFFD;

struct Utf8Lead {
  size_t size;  // 0: never starts a character
  unsigned char second_low;
  unsigned char second_high;
};

// Unicode's well-formed byte sequences (Table 3-7): the length a lead byte announces and the
// range of the byte after it, which rules out overlong forms, surrogates and code points past
// U+10FFFF.
Utf8Lead LeadOf(unsigned char byte) {
  if (byte < 0x80) return {1, 0, 0};
  if (byte >= 0xC2 && byte <= 0xDF) return {2, 0x80, 0xBF};
  if (byte == 0xE0) return {3, 0xA0, 0xBF};
  if (byte == 0xED) return {3, 0x80, 0x9F};
  if (byte >= 0xE1 && byte <= 0xEF) return {3, 0x80, 0xBF};
  if (byte == 0xF0) return {4, 0x90, 0xBF};
  if (byte >= 0xF1 && byte <= 0xF3) return {4, 0x80, 0xBF};
  if (byte == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

}  // namespace

Utf8Char ReadUtf8(std::string_view text, size_t at) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(text[at + i]); };
  Utf8Lead lead = LeadOf(byte(0));
  if (lead.size == 0) return {kReplacementCharacter, 1, false};
  if (lead.size == 1) return {byte(0), 1, true};
  char32_t code_point = byte(0) & (0x7F >> lead.size);
  for (size_t i = 1; i < lead.size; ++i) {
    unsigned char low = i == 1 ? lead.second_low : 0x80;
    unsigned char high = i == 1 ? lead.second_high : 0xBF;
    if (at + i >= text.size() || byte(i) < low || byte(i) > high) return {kReplacementCharacter, i, false};
    code_point = (code_point << 6) | (byte(i) & 0x3F);
  }
  return {code_point, lead.size, true};
}

void AppendUtf8(char32_t code_point, std::string* text) {
  if (code_point < 0x80) {
    text->push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800) {
    text->push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    text->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else if (code_point < 0x10000) {
    text->push_back(static_cast<char>(0xE0 | (code_point >> 12)));
    text->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    text->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else {
    text->push_back(static_cast<char>(0xF0 | (code_point >> 18)));
    text->push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
    text->push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    text->push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

std::string ValidUtf8(std::string_view bytes) {
  std::string text;
  text.reserve(bytes.size());
  for (size_t at = 0; at < bytes.size();) {
    Utf8Char c = ReadUtf8(bytes, at);
    if (c.valid) {
      text.append(bytes.substr(at, c.size));
    } else {
      AppendUtf8(kReplacementCharacter, &text);
    }
    at += c.size;
  }
  return text;
}

// ---- Unicode properties ------------------------------------------------------------------------

namespace {

template <typename Range, size_t N>
const Range* RangeOf(const Range (&ranges)[N], char32_t code_point) {
  auto starts_after = [](char32_t value, const Range& range) { return value < range.first; };
  auto after = std::upper_bound(std::begin(ranges), std::end(ranges), code_point, starts_after);
  return after != std::begin(ranges) && code_point <= std::prev(after)->last ? &*std::prev(after) : nullptr;
}

// A set of general categories, a bit each (unicode::GeneralCategory), or White_Space.
using Property = uint32_t;
constexpr Property kWhiteSpaceProperty = 1u << 31;

constexpr Property Categories(std::initializer_list<unicode::GeneralCategory> categories) {
  Property property = 0;
  for (unicode::GeneralCategory category : categories) property |= 1u << category;
  return property;
}

constexpr Property kLetter = Categories({unicode::kLu, unicode::kLl, unicode::kLt, unicode::kLm, unicode::kLo});
constexpr Property kNumber = Categories({unicode::kNd, unicode::kNl, unicode::kNo});
constexpr Property kMark = Categories({unicode::kMn, unicode::kMc, unicode::kMe});

// The names \p{...} takes: a category or a group of them.
const std::unordered_map<std::string, Property>& NamedProperties() {
  static const std::unordered_map<std::string, Property> properties = {
      {"L", kLetter},
      {"Lu", Categories({unicode::kLu})},
      {"Ll", Categories({unicode::kLl})},
      {"Lt", Categories({unicode::kLt})},
      {"Lm", Categories({unicode::kLm})},
      {"Lo", Categories({unicode::kLo})},
      {"M", kMark},
      {"Mn", Categories({unicode::kMn})},
      {"Mc", Categories({unicode::kMc})},
      {"Me", Categories({unicode::kMe})},
      {"N", kNumber},
      {"Nd", Categories({unicode::kNd})},
      {"Nl", Categories({unicode::kNl})},
      {"No", Categories({unicode::kNo})},
  };
  return properties;
}

bool HasProperty(Property property, char32_t code_point) {
  if ((property & kWhiteSpaceProperty) && RangeOf(unicode::kWhiteSpace, code_point)) return true;
  const unicode::CategoryRange* range = RangeOf(unicode::kCategories, code_point);
  return range && (property & (1u << range->category));
}

}  // namespace

bool IsLetter(char32_t code_point) { return HasProperty(kLetter, code_point); }
bool IsNumber(char32_t code_point) { return HasProperty(kNumber, code_point); }
bool IsWhiteSpace(char32_t code_point) { return HasProperty(kWhiteSpaceProperty, code_point); }

// ---- regular expressions -----------------------------------------------------------------------

namespace {

struct PropertyItem {
  Property property;
  bool negated;  // \S, \P{L}
};

struct CharClass {
  std::vector<std::pair<char32_t, char32_t>> ranges;
  std::vector<PropertyItem> properties;
  bool negated = false;    // [^...]
  std::bitset<128> ascii;  // Contains() for ASCII, which most text is, without the table lookups

  bool Contains(char32_t code_point) const { return code_point < 128 ? ascii[code_point] : Test(code_point); }

  bool Test(char32_t code_point) const {
    bool in_ranges = std::any_of(ranges.begin(), ranges.end(), [&](const auto& range) {
      return range.first <= code_point && code_point <= range.second;
    });
    bool in_properties = std::any_of(properties.begin(), properties.end(), [&](const PropertyItem& item) {
      return HasProperty(item.property, code_point) != item.negated;
    });
    return (in_ranges || in_properties) != negated;
  }

  void Seal() {
    for (char32_t code_point = 0; code_point < 128; ++code_point) ascii[code_point] = Test(code_point);
  }
};

struct Node {
  enum class Kind { kCharacter, kConcatenation, kAlternation, kRepeat, kNegativeLookahead };
  Kind kind;
  std::vector<Node> children;
  size_t char_class = 0;  // kCharacter: index into the program's classes
  int min = 0;            // kRepeat
  int max = 0;            // kRepeat; kUnbounded for * and +
};

Node CharacterNode(CharClass char_class, std::vector<CharClass>* classes) {
  char_class.Seal();
  classes->push_back(std::move(char_class));
  Node node{Node::Kind::kCharacter};
  node.char_class = classes->size() - 1;
  return node;
}

constexpr int kUnbounded = -1;
// A bound past this would blow the program up (each repetition is a copy): no tokenizer needs it.
constexpr int kLargestBound = 100;

bool CanMatchEmpty(const Node& node) {
  switch (node.kind) {
    case Node::Kind::kCharacter:
      return false;
    case Node::Kind::kConcatenation:
      return std::all_of(node.children.begin(), node.children.end(), CanMatchEmpty);
    case Node::Kind::kAlternation:
      return std::any_of(node.children.begin(), node.children.end(), CanMatchEmpty);
    case Node::Kind::kRepeat:
      return node.min == 0 || CanMatchEmpty(node.children[0]);
    case Node::Kind::kNegativeLookahead:
      return true;
  }
  return true;
}

// Recursive descent over the pattern's characters, building the tree and the character classes.
class Parser {
 public:
  Parser(std::string_view pattern, std::vector<CharClass>* classes) : classes_(*classes) {
    for (size_t at = 0; at < pattern.size();) {
      Utf8Char c = ReadUtf8(pattern, at);
      pattern_.push_back(c.code_point);
      at += c.size;
    }
  }

  Node Parse() {
    Node node = Alternation(false);
    if (at_ < pattern_.size()) Unsupported("an unmatched )");
    return node;
  }

 private:
  Node Alternation(bool ignore_case) {
    Node node{Node::Kind::kAlternation};
    node.children.push_back(Concatenation(ignore_case));
    while (Accept('|')) node.children.push_back(Concatenation(ignore_case));
    return node.children.size() == 1 ? std::move(node.children[0]) : node;
  }

  Node Concatenation(bool ignore_case) {
    Node node{Node::Kind::kConcatenation};
    while (at_ < pattern_.size() && Peek() != '|' && Peek() != ')') node.children.push_back(Quantified(ignore_case));
    return node;
  }

  Node Quantified(bool ignore_case) {
    Node atom = Atom(ignore_case);
    int min = 0;
    int max = 0;
    if (Accept('?')) {
      std::tie(min, max) = std::pair(0, 1);
    } else if (Accept('*')) {
      std::tie(min, max) = std::pair(0, kUnbounded);
    } else if (Accept('+')) {
      std::tie(min, max) = std::pair(1, kUnbounded);
    } else if (Accept('{')) {
      std::tie(min, max) = Bounds();
    } else {
      return atom;
    }
    Node repeat{Node::Kind::kRepeat};
    repeat.min = min;
    repeat.max = max;
    if (at_ < pattern_.size() && (Peek() == '?' || Peek() == '+' || Peek() == '*' || Peek() == '{')) {
      Unsupported("a lazy, possessive or double quantifier");
    }
    if (max == kUnbounded && CanMatchEmpty(atom)) Unsupported("a repeated part that can match nothing");
    repeat.children.push_back(std::move(atom));
    return repeat;
  }

  std::pair<int, int> Bounds() {
    int min = Number();
    int max = Accept(',') ? (Peek() == '}' ? kUnbounded : Number()) : min;
    if (!Accept('}') || (max != kUnbounded && max < min)) Unsupported("a malformed {n,m}");
    return {min, max};
  }

  int Number() {
    int number = 0;
    size_t start = at_;
    while (at_ < pattern_.size() && Peek() >= '0' && Peek() <= '9' && number <= kLargestBound) {
      number = number * 10 + static_cast<int>(pattern_[at_++] - '0');
    }
    if (at_ == start || number > kLargestBound) Unsupported("a bound that is not a number up to 100");
    return number;
  }

  Node Atom(bool ignore_case) {
    if (at_ >= pattern_.size()) Unsupported("a quantifier with nothing to repeat");
    char32_t c = pattern_[at_++];
    switch (c) {
      case '(':
        return Group(ignore_case);
      case '[':
        if (ignore_case) Unsupported("a [class] inside (?i:...)");
        return BracketClass();
      case '\\':
        return Escape(ignore_case);
      case '.':
      case '^':
      case '$':
        Unsupported(std::string(1, static_cast<char>(c)));
      case '?':
      case '*':
      case '+':
      case '{':
        Unsupported("a quantifier with nothing to repeat");
      default:
        return Literal(c, ignore_case);
    }
  }

  Node Group(bool ignore_case) {
    Node node;
    if (!Accept('?')) {
      node = Alternation(ignore_case);
    } else if (Accept(':')) {
      node = Alternation(ignore_case);
    } else if (Accept('i')) {
      if (!Accept(':')) Unsupported("(?i) other than (?i:...)");
      node = Alternation(true);
    } else if (Accept('!')) {
      node = Node{Node::Kind::kNegativeLookahead};
      node.children.push_back(Alternation(ignore_case));
    } else {
      Unsupported("a (?...) group other than (?:...), (?i:...) and (?!...)");
    }
    if (!Accept(')')) Unsupported("an unclosed (");
    return node;
  }

  // One item of a class: a property (\s, \p{L}, ...) or a character.
  struct ClassItem {
    bool is_property;
    PropertyItem property;
    char32_t character;
  };

  ClassItem EscapedItem() {
    if (at_ >= pattern_.size()) Unsupported("a \\ at the end");
    char32_t c = pattern_[at_++];
    switch (c) {
      case 's':
      case 'S':
        return {true, {kWhiteSpaceProperty, c == 'S'}, 0};
      case 'p':
      case 'P':
        return {true, {NamedProperty(), c == 'P'}, 0};
      case 'r':
        return {false, {}, '\r'};
      case 'n':
        return {false, {}, '\n'};
      case 't':
        return {false, {}, '\t'};
      case 'f':
        return {false, {}, '\f'};
      case 'v':
        return {false, {}, '\v'};
      default:
        bool ascii_alphanumeric = c < 128 && std::isalnum(static_cast<int>(c));
        if (ascii_alphanumeric) Unsupported(std::string("\\") + static_cast<char>(c));
        return {false, {}, c};
    }
  }

  Property NamedProperty() {
    std::string name;
    if (Accept('{')) {
      while (at_ < pattern_.size() && Peek() != '}' && Peek() < 128 && name.size() < 2)
        name += static_cast<char>(pattern_[at_++]);
      auto named = NamedProperties().find(name);
      if (Accept('}') && named != NamedProperties().end()) return named->second;
    }
    Unsupported("a \\p{...} other than \\p{L}, \\p{M}, \\p{N} and their categories (\\p{Lu}, \\p{Mn}, ...)");
  }

  Node Escape(bool ignore_case) {
    ClassItem item = EscapedItem();
    if (!item.is_property) return Literal(item.character, ignore_case);
    CharClass char_class;
    char_class.properties.push_back(item.property);
    return CharacterNode(std::move(char_class), &classes_);
  }

  Node BracketClass() {
    CharClass char_class;
    char_class.negated = Accept('^');
    while (!Accept(']')) {
      if (at_ >= pattern_.size()) Unsupported("an unclosed [");
      if (Peek() == '[' || (Peek() == '&' && at_ + 1 < pattern_.size() && pattern_[at_ + 1] == '&')) {
        Unsupported("a nested class or && inside [...]");
      }
      ClassItem item = Accept('\\') ? EscapedItem() : ClassItem{false, {}, pattern_[at_++]};
      if (item.is_property) {
        char_class.properties.push_back(item.property);
        continue;
      }
      char32_t last = item.character;
      if (Peek() == '-' && at_ + 1 < pattern_.size() && pattern_[at_ + 1] != ']') {
        ++at_;
        ClassItem end = Accept('\\') ? EscapedItem() : ClassItem{false, {}, pattern_[at_++]};
        if (end.is_property || end.character < item.character) Unsupported("a malformed range in [...]");
        last = end.character;
      }
      char_class.ranges.emplace_back(item.character, last);
    }
    return CharacterNode(std::move(char_class), &classes_);
  }

  Node Literal(char32_t c, bool ignore_case) {
    CharClass char_class;
    char_class.ranges.emplace_back(c, c);
    bool ascii_letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (ignore_case && ascii_letter) {
      char32_t lower = c | 0x20;
      char_class.ranges = {{lower, lower}, {lower - 0x20, lower - 0x20}};
      for (const unicode::FoldToAsciiLetter& fold : unicode::kFoldsToAsciiLetter) {
        if (static_cast<char32_t>(fold.letter) != lower) continue;
        char_class.ranges.emplace_back(fold.code_point, fold.code_point);
      }
    } else if (ignore_case && c >= 128) {
      Unsupported("a character beyond ASCII inside (?i:...)");
    }
    return CharacterNode(std::move(char_class), &classes_);
  }

  char32_t Peek() const { return at_ < pattern_.size() ? pattern_[at_] : 0; }

  bool Accept(char32_t c) {
    if (at_ >= pattern_.size() || pattern_[at_] != c) return false;
    ++at_;
    return true;
  }

  [[noreturn]] void Unsupported(const std::string& what) const {
    throw RegexError(what + " (at character " + std::to_string(at_) + ")");
  }

  std::vector<CharClass>& classes_;
  std::u32string pattern_;
  size_t at_ = 0;
};

struct Instruction {
  enum class Kind { kCharacter, kSplit, kJump, kNegativeLookahead, kMatch };
  Kind kind;
  size_t first = 0;       // kSplit: tried first; kJump: where to go
  size_t second = 0;      // kSplit: tried when `first` fails; kNegativeLookahead: where to go after it
  size_t char_class = 0;  // kCharacter
};

// The tree as instructions for a backtracking machine (the layout of Russ Cox's "Regular
// Expression Matching: the Virtual Machine Approach"); a lookahead's own instructions follow it
// and end in kMatch.
class Compiler {
 public:
  std::vector<Instruction> Compile(const Node& node) {
    Emit(node);
    Add({Instruction::Kind::kMatch});
    return std::move(instructions_);
  }

 private:
  void Emit(const Node& node) {
    switch (node.kind) {
      case Node::Kind::kCharacter: {
        Instruction character{Instruction::Kind::kCharacter};
        character.char_class = node.char_class;
        Add(character);
        return;
      }
      case Node::Kind::kConcatenation:
        for (const Node& child : node.children) Emit(child);
        return;
      case Node::Kind::kAlternation:
        return EmitAlternation(node);
      case Node::Kind::kRepeat:
        return EmitRepeat(node);
      case Node::Kind::kNegativeLookahead: {
        size_t lookahead = Add({Instruction::Kind::kNegativeLookahead});
        Emit(node.children[0]);
        Add({Instruction::Kind::kMatch});
        instructions_[lookahead].second = instructions_.size();
        return;
      }
    }
  }

  void EmitAlternation(const Node& node) {
    std::vector<size_t> jumps_to_end;
    for (size_t i = 0; i + 1 < node.children.size(); ++i) {
      size_t split = Add({Instruction::Kind::kSplit});
      instructions_[split].first = split + 1;
      Emit(node.children[i]);
      jumps_to_end.push_back(Add({Instruction::Kind::kJump}));
      instructions_[split].second = instructions_.size();
    }
    Emit(node.children.back());
    for (size_t jump : jumps_to_end) instructions_[jump].first = instructions_.size();
  }

  void EmitRepeat(const Node& node) {
    const Node& body = node.children[0];
    for (int i = 0; i < node.min; ++i) Emit(body);
    if (node.max == kUnbounded) {
      size_t split = Add({Instruction::Kind::kSplit});
      Emit(body);
      Instruction back{Instruction::Kind::kJump};
      back.first = split;
      Add(back);
      Prefer(split, instructions_.size());
      return;
    }
    std::vector<size_t> optional_splits;
    for (int i = node.min; i < node.max; ++i) {
      optional_splits.push_back(Add({Instruction::Kind::kSplit}));
      Emit(body);
    }
    for (size_t split : optional_splits) Prefer(split, instructions_.size());
  }

  // Quantifiers are greedy: one more repetition (right after the split) first, then `leave`.
  void Prefer(size_t split, size_t leave) {
    instructions_[split].first = split + 1;
    instructions_[split].second = leave;
  }

  size_t Add(const Instruction& instruction) {
    instructions_.push_back(instruction);
    return instructions_.size() - 1;
  }

  std::vector<Instruction> instructions_;
};

}  // namespace

struct TokenizerRegex::Program {
  Program(const Node& tree, std::vector<CharClass> char_classes) : classes(std::move(char_classes)) {
    if (CanMatchEmpty(tree)) throw RegexError("a pattern that can match the empty string");
    instructions = Compiler().Compile(tree);
  }

  std::vector<CharClass> classes;
  std::vector<Instruction> instructions;

  // Whether the instructions from `pc` match `text` at `at`; where the match ends.
  bool MatchAt(size_t pc, std::string_view text, size_t at, size_t* end) const {
    std::vector<std::pair<size_t, size_t>> backtrack;  // (pc, at) still to try
    for (;;) {
      const Instruction& instruction = instructions[pc];
      switch (instruction.kind) {
        case Instruction::Kind::kCharacter:
          if (at < text.size()) {
            Utf8Char c = ReadUtf8(text, at);
            if (classes[instruction.char_class].Contains(c.code_point)) {
              at += c.size;
              ++pc;
              continue;
            }
          }
          break;
        case Instruction::Kind::kSplit:
          backtrack.emplace_back(instruction.second, at);
          pc = instruction.first;
          continue;
        case Instruction::Kind::kJump:
          pc = instruction.first;
          continue;
        case Instruction::Kind::kNegativeLookahead: {
          size_t lookahead_end = 0;
          if (!MatchAt(pc + 1, text, at, &lookahead_end)) {
            pc = instruction.second;
            continue;
          }
          break;
        }
        case Instruction::Kind::kMatch:
          *end = at;
          return true;
      }
      if (backtrack.empty()) return false;
      std::tie(pc, at) = backtrack.back();
      backtrack.pop_back();
    }
  }
};

TokenizerRegex::TokenizerRegex(std::shared_ptr<const Program> program) : program_(std::move(program)) {}

TokenizerRegex::TokenizerRegex(std::string_view pattern) {
  std::vector<CharClass> classes;
  Node tree = Parser(pattern, &classes).Parse();
  program_ = std::make_shared<const Program>(tree, std::move(classes));
}

TokenizerRegex TokenizerRegex::Literal(std::string_view text) {
  std::vector<CharClass> classes;
  Node tree{Node::Kind::kConcatenation};
  for (size_t at = 0; at < text.size();) {
    Utf8Char c = ReadUtf8(text, at);
    CharClass char_class;
    char_class.ranges.emplace_back(c.code_point, c.code_point);
    tree.children.push_back(CharacterNode(std::move(char_class), &classes));
    at += c.size;
  }
  return TokenizerRegex(std::make_shared<const Program>(tree, std::move(classes)));
}

std::vector<TokenizerRegex::Match> TokenizerRegex::FindAll(std::string_view text) const {
  std::vector<Match> matches;
  for (size_t at = 0; at < text.size();) {
    size_t end = 0;
    if (program_->MatchAt(0, text, at, &end)) {
      matches.push_back({at, end});
      at = end;
    } else {
      at += ReadUtf8(text, at).size;
    }
  }
  return matches;
}

}  // namespace kiln
