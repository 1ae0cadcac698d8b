"""The SHA-256 of every file of a model folder, for the build record's `files`.

The browser engine checks each file it loads (downloaded or read from its cache) against these
digests and refuses a file that has none, so the record is the one thing a page must trust: it
can pin the record itself by its SHA-256 (`kiln_build_sha256` in the model's app-config record).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digests(model_dir: Path) -> dict[str, str]:
    """Path relative to `model_dir` (with '/') → SHA-256 hex, for every file under it, sorted."""
    return {
        path.relative_to(model_dir).as_posix(): sha256_of(path)
        for path in sorted(model_dir.rglob("*"))
        if path.is_file()
    }
