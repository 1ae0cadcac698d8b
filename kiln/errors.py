"""One error family for everything a user can get wrong: it names the file and the problem."""

from __future__ import annotations

from pathlib import Path


class KilnError(Exception):
    """An error the CLI prints as one line, naming the file (when there is one) and the problem."""

    def __init__(self, problem: str, path: str | Path | None = None):
        self.problem = problem
        self.path = Path(path) if path is not None else None
        super().__init__(f"{self.path}: {problem}" if self.path is not None else problem)


def one_line(text: object) -> str:
    """Another library's message (JSON, jinja, tokenizers), fit for a KilnError's one line."""
    return " ".join(str(text).split())
