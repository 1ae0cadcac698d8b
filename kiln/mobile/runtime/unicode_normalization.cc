#include "unicode_normalization.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "tokenizer_regex.h"
#include "unicode_tables.h"

namespace kiln {

namespace {

// A byte of invalid UTF-8 stands, while the text is normalized, for a value past the last code point:
// a starter that neither decomposes nor composes, written back as the byte it was.
constexpr char32_t kInvalidByteBase = 0x110000;

// Hangul syllables decompose and compose by arithmetic (The Unicode Standard, section 3.12).
constexpr char32_t kSyllableBase = 0xAC00;
constexpr char32_t kLeadingBase = 0x1100;
constexpr char32_t kVowelBase = 0x1161;
constexpr char32_t kTrailingBase = 0x11A7;
constexpr char32_t kLeadingCount = 19;
constexpr char32_t kVowelCount = 21;
constexpr char32_t kTrailingCount = 28;
constexpr char32_t kSyllableCount = kLeadingCount * kVowelCount * kTrailingCount;

bool IsSyllable(char32_t c) { return c >= kSyllableBase && c < kSyllableBase + kSyllableCount; }

unsigned char CombiningClass(char32_t c) {
  auto starts_after = [](char32_t value, const unicode::CombiningClassRange& range) { return value < range.first; };
  auto after =
      std::upper_bound(std::begin(unicode::kCombiningClasses), std::end(unicode::kCombiningClasses), c, starts_after);
  if (after == std::begin(unicode::kCombiningClasses) || c > std::prev(after)->last) return 0;
  return std::prev(after)->combining_class;
}

struct Character {
  char32_t code_point;
  unsigned char combining_class;
};

// Appends c's full canonical decomposition.
void AppendDecomposed(char32_t c, std::vector<Character>* characters) {
  if (IsSyllable(c)) {
    char32_t index = c - kSyllableBase;
    characters->push_back({kLeadingBase + index / (kVowelCount * kTrailingCount), 0});
    characters->push_back({kVowelBase + index % (kVowelCount * kTrailingCount) / kTrailingCount, 0});
    if (index % kTrailingCount != 0) characters->push_back({kTrailingBase + index % kTrailingCount, 0});
    return;
  }
  auto below = [](const unicode::Decomposition& entry, char32_t value) { return entry.code_point < value; };
  const unicode::Decomposition* entry =
      std::lower_bound(std::begin(unicode::kDecompositions), std::end(unicode::kDecompositions), c, below);
  if (entry != std::end(unicode::kDecompositions) && entry->code_point == c) {
    AppendDecomposed(entry->first, characters);
    if (entry->second != 0) AppendDecomposed(entry->second, characters);
    return;
  }
  characters->push_back({c, CombiningClass(c)});
}

// The canonical ordering: a stable sort of each run of non-starters by combining class (a sort, not
// insertion, so that a long run of marks takes n log n).
void OrderCanonically(std::vector<Character>* characters) {
  auto is_starter = [](const Character& c) { return c.combining_class == 0; };
  auto by_class = [](const Character& a, const Character& b) { return a.combining_class < b.combining_class; };
  for (auto run = characters->begin(); run != characters->end();) {
    run = std::find_if_not(run, characters->end(), is_starter);
    auto run_end = std::find_if(run, characters->end(), is_starter);
    if (run_end - run > 1) std::stable_sort(run, run_end, by_class);
    run = run_end;
  }
}

std::optional<char32_t> Composite(char32_t first, char32_t second) {
  if (first >= kLeadingBase && first < kLeadingBase + kLeadingCount && second >= kVowelBase &&
      second < kVowelBase + kVowelCount) {
    return kSyllableBase + ((first - kLeadingBase) * kVowelCount + (second - kVowelBase)) * kTrailingCount;
  }
  if (IsSyllable(first) && (first - kSyllableBase) % kTrailingCount == 0 && second > kTrailingBase &&
      second < kTrailingBase + kTrailingCount) {
    return first + (second - kTrailingBase);
  }
  auto below = [](const unicode::Composition& entry, std::pair<char32_t, char32_t> pair) {
    return std::tie(entry.first, entry.second) < std::tie(pair.first, pair.second);
  };
  const unicode::Composition* entry = std::lower_bound(
      std::begin(unicode::kCompositions), std::end(unicode::kCompositions), std::pair(first, second), below);
  if (entry == std::end(unicode::kCompositions) || entry->first != first || entry->second != second) {
    return std::nullopt;
  }
  return entry->composite;
}

// Canonical composition in place: each character joins the last starter before it unless a
// character between them is a starter or has a combining class as high as its own (is "blocked").
void Compose(std::vector<Character>* characters) {
  std::optional<size_t> starter;
  unsigned char last_class = 0;  // of the last character kept
  size_t kept = 0;
  for (const Character& c : *characters) {
    if (starter) {
      bool blocked = kept != *starter + 1 && (last_class == 0 || last_class >= c.combining_class);
      Character& joined = (*characters)[*starter];
      std::optional<char32_t> composite = blocked ? std::nullopt : Composite(joined.code_point, c.code_point);
      if (composite) {
        joined.code_point = *composite;
        continue;
      }
    }
    if (c.combining_class == 0) starter = kept;
    last_class = c.combining_class;
    (*characters)[kept++] = c;
  }
  characters->resize(kept);
}

}  // namespace

std::string NormalizeNfc(std::string_view text) {
  // ASCII is its own NFC, and most text given to a tokenizer is ASCII.
  if (std::all_of(text.begin(), text.end(), [](char byte) { return static_cast<unsigned char>(byte) < 0x80; })) {
    return std::string(text);
  }
  std::vector<Character> characters;
  characters.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    Utf8Char c = ReadUtf8(text, at);
    if (c.valid) {
      AppendDecomposed(c.code_point, &characters);
    } else {
      for (size_t i = 0; i < c.size; ++i) {
        characters.push_back({kInvalidByteBase + static_cast<unsigned char>(text[at + i]), 0});
      }
    }
    at += c.size;
  }
  OrderCanonically(&characters);
  Compose(&characters);
  std::string normalized;
  normalized.reserve(text.size());
  for (const Character& c : characters) {
    if (c.code_point >= kInvalidByteBase) {
      normalized.push_back(static_cast<char>(c.code_point - kInvalidByteBase));
    } else {
      AppendUtf8(c.code_point, &normalized);
    }
  }
  return normalized;
}

}  // namespace kiln
