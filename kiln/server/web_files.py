"""Where `kiln serve` finds the web files it serves (the harness, the engine, its npm packages).

In a checkout it serves web/ itself: the engine as it is edited, the npm packages as `npm ci`
installed them. An installed wheel cannot reach web/, so it carries a copy of exactly the served
part of it, which `make wheel` writes into kiln/data/web before building. Copying the packages'
dist files (some 12 MB, mostly the tokenizers' inlined wasm) rather than asking for npm at run
time keeps `pip install` the one install step, and pins the packages to web/package-lock.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kiln
from kiln.errors import KilnError

from .artifacts import WEB_PREFIXES

CHECKOUT_WEB_DIR = Path(__file__).resolve().parents[2] / "web"
PACKAGED_WEB_DIR = Path(kiln.__file__).resolve().parent / "data" / "web"


def default_web_dir() -> Path:
    return CHECKOUT_WEB_DIR if (CHECKOUT_WEB_DIR / "package.json").is_file() else PACKAGED_WEB_DIR


def served_folders(web_dir: Path) -> list[str]:
    """The served folders of web/, leaving out the dev packages' (WebLLM's, for the tests)."""
    runtime = json.loads((web_dir / "package.json").read_text())["dependencies"]
    # A package's prefix is node_modules/@scope/name/<its dist folder>/.
    return [
        prefix
        for prefix in WEB_PREFIXES
        if not prefix.startswith("node_modules/") or "/".join(prefix.split("/")[1:3]) in runtime
    ]


def copy_served_files(web_dir: Path, dest: Path) -> None:
    """Replace `dest` with the served folders of `web_dir`, laid out as in it."""
    shutil.rmtree(dest, ignore_errors=True)
    for folder in served_folders(web_dir):
        if not (web_dir / folder).is_dir():
            raise KilnError(f"missing: run `npm ci` in {web_dir}", web_dir / folder)
        shutil.copytree(web_dir / folder, dest / folder)
