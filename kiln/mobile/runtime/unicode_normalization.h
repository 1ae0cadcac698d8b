// Unicode Normalization Form C (UAX #15) as Python's unicodedata.normalize("NFC", ...) gives it, over
// the tables of unicode_tables.h (the same Unicode version). Hugging Face tokenizers' NFC normalizer
// gives the same but for about a hundred characters its Unicode 9 tables predate: marks given a
// combining class since (U+0C3C, U+1DFA), which it takes for starters, and U+11938, which it does
// not compose.
#ifndef KILN_MOBILE_RUNTIME_UNICODE_NORMALIZATION_H_
#define KILN_MOBILE_RUNTIME_UNICODE_NORMALIZATION_H_

#include <string>
#include <string_view>

namespace kiln {

// `text` in NFC. Bytes that are not valid UTF-8 are kept as they are, and nothing composes across them.
std::string NormalizeNfc(std::string_view text);

}  // namespace kiln

#endif  // KILN_MOBILE_RUNTIME_UNICODE_NORMALIZATION_H_
