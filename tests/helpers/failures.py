"""How a refused `kiln compile` ends: exit code, one `kiln: error:` line, nothing left behind."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class CommandResult:
    returncode: int
    stderr: str


def assert_clean_failure(result: CommandResult, output: Path, *mentions: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("kiln: error: "), result.stderr
    for text in mentions:
        assert text in lines[-1], (text, lines[-1])
    assert not (output / "broken").exists()
    assert not list(output.glob(".kiln-build-*"))
