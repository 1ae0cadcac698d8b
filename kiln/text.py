"""A model folder's tokenizer, and token ids to text as it streams: pieces that never split a
character, and stop strings."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from kiln.errors import KilnError

# Decoding a new token together with the few before it gives the text a full decode would,
# for decoders that treat the first token specially (SentencePiece drops its leading space).
DETOKENIZE_CONTEXT_TOKENS = 4


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise KilnError("missing tokenizer.json: the native engine needs it", path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
        raise KilnError(f"cannot read the tokenizer: {e}", path) from None


class TextStream:
    """Turns token ids into text pieces; a piece is held back while it ends in an incomplete
    multi-byte character (byte-level tokens can split one)."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self.emitted_from = 0
        self.unread_from = len(self.ids)

    def _decoded_window(self) -> tuple[str, str]:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return decode(self.ids[self.emitted_from : self.unread_from]), decode(self.ids[self.emitted_from :])

    def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = self._decoded_window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.emitted_from, self.unread_from = self.unread_from, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """What is left at the end, incomplete characters as U+FFFD."""
        before, after = self._decoded_window()
        self.emitted_from = self.unread_from = len(self.ids)
        return after[len(before) :]


class StopStrings:
    """Cuts the text at the first stop string; holds back a tail that could still become one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string was reached)."""
        self.held += text
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            safe, self.held = self.held[: min(hits)], ""
            return safe, True
        keep = self._partial_match_length()
        safe, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return safe, False

    def _partial_match_length(self) -> int:
        """The length of the longest tail of the held text that begins a stop string."""
        longest = min(len(self.held), max((len(s) for s in self.stops), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = self.held[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return length
        return 0

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
