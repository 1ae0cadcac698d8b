"""Writes unicode_tables.h: the Unicode character properties the mobile runtime's tokenizer needs
(\\p{L}, \\p{M}, \\p{N} and their general categories, \\s and case-insensitive ASCII letters of the
tokenizer.json regular expressions, and the canonical decompositions, combining classes and
compositions of the NFC normalizer), as ranges of code points and sorted arrays, from this Python's
`unicodedata`.

    python kiln/mobile/runtime/make_unicode_tables.py [output]   (default: unicode_tables.h beside it)
"""

from __future__ import annotations

import string
import sys
import unicodedata
from pathlib import Path
from typing import Any, Callable

LAST_CODE_POINT = 0x10FFFF
# White_Space is Zs, Zl and Zp, and these controls: \t \n \v \f \r and NEXT LINE.
WHITE_SPACE_CONTROLS = frozenset((0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85))
HANGUL_SYLLABLES = (0xAC00, 0xD7A3)


# The general categories \\p{...} can name (letters, marks, numbers), in the order of the header's enum.
CATEGORIES = ("Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No")


def is_white_space(code_point: int) -> bool:
    return code_point in WHITE_SPACE_CONTROLS or unicodedata.category(chr(code_point)) in ("Zs", "Zl", "Zp")


def value_runs(value_of: Callable[[int], Any]) -> list[tuple[int, int, Any]]:
    """The code points whose value is not None, as (first, last, value) runs of one value."""
    runs: list[tuple[int, int, Any]] = []
    for code_point in range(LAST_CODE_POINT + 1):
        value = value_of(code_point)
        if value is None:
            continue
        if runs and runs[-1][1] == code_point - 1 and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], code_point, value)
        else:
            runs.append((code_point, code_point, value))
    return runs


def ranges(has_property: Callable[[int], bool]) -> list[tuple[int, int]]:
    """The code points that have the property, as (first, last) runs."""
    return [(first, last) for first, last, _ in value_runs(lambda code_point: has_property(code_point) or None)]


def category_runs() -> list[tuple[int, int, str]]:
    """The code points of CATEGORIES, as (first, last, category) runs of one category."""

    def category(code_point: int) -> str | None:
        name = unicodedata.category(chr(code_point))
        return name if name in CATEGORIES else None

    return value_runs(category)


def folds_to_ascii_letter() -> list[tuple[int, str]]:
    """Characters beyond ASCII whose case folding is one ASCII letter (LONG S → s, KELVIN SIGN → k):
    Oniguruma's (?i) matches them where the pattern has that letter."""
    letters = set(string.ascii_lowercase)
    return [
        (code_point, chr(code_point).casefold())
        for code_point in range(0x80, LAST_CODE_POINT + 1)
        if chr(code_point).casefold() in letters
    ]


def combining_class_runs() -> list[tuple[int, int, int]]:
    """The code points of a non-zero Canonical_Combining_Class, as (first, last, class) runs of one class."""
    return value_runs(lambda code_point: unicodedata.combining(chr(code_point)) or None)


def canonical_decompositions() -> dict[int, tuple[int, ...]]:
    """Each character's canonical Decomposition_Mapping (one or two characters, those without a <tag>),
    one level deep; Hangul syllables decompose by arithmetic and are left out."""
    decompositions = {}
    for code_point in range(LAST_CODE_POINT + 1):
        mapping = unicodedata.decomposition(chr(code_point))
        if mapping and not mapping.startswith("<") and not HANGUL_SYLLABLES[0] <= code_point <= HANGUL_SYLLABLES[1]:
            decompositions[code_point] = tuple(int(part, 16) for part in mapping.split())
    return decompositions


def compositions(decompositions: dict[int, tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """The pairs canonical composition joins, as (first, second, composite) sorted by pair: the
    two-character decompositions whose composite NFC gives back, which leaves out the full composition
    exclusions (singletons, non-starter decompositions and CompositionExclusions.txt)."""
    pairs = [
        (*pair, code_point)
        for code_point, pair in decompositions.items()
        if len(pair) == 2 and unicodedata.normalize("NFC", "".join(map(chr, pair))) == chr(code_point)
    ]
    return sorted(pairs)


def range_table(name: str, comment: str, runs: list[tuple[int, int]]) -> str:
    entries = [f"{{0x{first:04X}, 0x{last:04X}}}," for first, last in runs]
    rows = [" ".join(entries[i : i + 5]) for i in range(0, len(entries), 5)]
    body = "\n".join(f"    {row}" for row in rows)
    return f"// {comment}\ninline constexpr CodePointRange {name}[] = {{\n{body}\n}};\n"


def rows(entries: list[str], per_row: int) -> str:
    return "\n".join(f"    {' '.join(entries[i : i + per_row])}" for i in range(0, len(entries), per_row))


def header() -> str:
    categories = rows([f"{{0x{first:04X}, 0x{last:04X}, k{name}}}," for first, last, name in category_runs()], 4)
    white_space = range_table("kWhiteSpace", "\\s: the White_Space property.", ranges(is_white_space))
    folds = "\n".join(f"    {{0x{code_point:04X}, '{letter}'}}," for code_point, letter in folds_to_ascii_letter())
    classes = rows([f"{{0x{first:04X}, 0x{last:04X}, {value}}}," for first, last, value in combining_class_runs()], 4)
    decompositions = canonical_decompositions()
    decomposition_rows = rows(
        [
            f"{{0x{code_point:04X}, 0x{pair[0]:04X}, 0x{pair[1] if len(pair) == 2 else 0:04X}}},"
            for code_point, pair in sorted(decompositions.items())
        ],
        4,
    )
    composition_rows = rows(
        [
            f"{{0x{first:04X}, 0x{second:04X}, 0x{composite:04X}}},"
            for first, second, composite in compositions(decompositions)
        ],
        4,
    )
    return f"""\
// Generated by make_unicode_tables.py from Python {sys.version_info.major}.{sys.version_info.minor}'s unicodedata \
(Unicode {unicodedata.unidata_version}); do not edit.
// Regenerate: python kiln/mobile/runtime/make_unicode_tables.py
#ifndef KILN_MOBILE_RUNTIME_UNICODE_TABLES_H_
#define KILN_MOBILE_RUNTIME_UNICODE_TABLES_H_

namespace kiln::unicode {{

struct CodePointRange {{
  char32_t first;
  char32_t last;
}};

enum GeneralCategory : unsigned char {{ {", ".join(f"k{category}" for category in CATEGORIES)} }};

struct CategoryRange {{
  char32_t first;
  char32_t last;
  GeneralCategory category;
}};

// The code points of the letter (L), mark (M) and number (N) categories, as runs of one category.
inline constexpr CategoryRange kCategories[] = {{
{categories}
}};

{white_space}
struct FoldToAsciiLetter {{
  char32_t code_point;
  char letter;
}};

// Characters beyond ASCII whose case folding is one ASCII (lowercase) letter.
inline constexpr FoldToAsciiLetter kFoldsToAsciiLetter[] = {{
{folds}
}};

struct CombiningClassRange {{
  char32_t first;
  char32_t last;
  unsigned char combining_class;
}};

// Canonical_Combining_Class other than 0 (Not_Reordered), as runs of one class.
inline constexpr CombiningClassRange kCombiningClasses[] = {{
{classes}
}};

struct Decomposition {{
  char32_t code_point;
  char32_t first;
  char32_t second;  // 0: a singleton, which decomposes to `first` alone
}};

// Canonical decompositions, one level deep (decompose `first` and `second` again), sorted by code
// point; Hangul syllables decompose by arithmetic and are not here.
inline constexpr Decomposition kDecompositions[] = {{
{decomposition_rows}
}};

struct Composition {{
  char32_t first;
  char32_t second;
  char32_t composite;
}};

// The pairs canonical composition joins (the primary composites), sorted by pair: the two-character
// decompositions less the full composition exclusions. Hangul syllables compose by arithmetic.
inline constexpr Composition kCompositions[] = {{
{composition_rows}
}};

}}  // namespace kiln::unicode

#endif  // KILN_MOBILE_RUNTIME_UNICODE_TABLES_H_
"""


if __name__ == "__main__":
    output = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("unicode_tables.h")
    output.write_text(header(), encoding="utf-8")
