"""A Kiln model folder's JSON files (kiln-build.json, mlc-chat-config.json, …), read with errors that
name the file."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import KilnError


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError("missing: not a Kiln model folder", path) from None
    except json.JSONDecodeError as e:
        raise KilnError(f"malformed JSON: {e}", path) from None
