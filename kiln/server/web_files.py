"""Where `kiln serve` finds the web files it serves (the harness, the engine, its npm packages).

In a checkout it serves web/ itself: the engine as it is edited, the npm packages as `npm ci`
installed them. An installed wheel cannot reach web/, so it carries a copy of exactly the served
part of it, which setup.py's build step writes into the wheel's kiln/data/web, whatever builds it.
Copying the packages' dist files (some 12 MB, mostly the tokenizers' inlined wasm) rather than
asking for npm at run time keeps `pip install` the one install step, and pins the packages to
web/package-lock.json.

setup.py loads this file by its path, before Kiln's dependencies are installed: it imports only the
standard library and kiln.errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kiln.errors import KilnError

CHECKOUT_WEB_DIR = Path(__file__).resolve().parents[2] / "web"
PACKAGED_WEB_DIR = Path(__file__).resolve().parents[1] / "data" / "web"

# The only parts of web/ the page loads; node_modules holds much else that is not for serving.
WEB_PREFIXES = (
    "src/",
    "harness/",
    "node_modules/@mlc-ai/web-runtime/lib/",
    "node_modules/@mlc-ai/web-tokenizers/lib/",
    "node_modules/@mlc-ai/web-xgrammar/lib/",
    "node_modules/@huggingface/jinja/dist/",
    "node_modules/@mlc-ai/web-llm/lib/",
)


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


def missing_served_folders(web_dir: Path) -> list[str]:
    return [folder for folder in served_folders(web_dir) if not (web_dir / folder).is_dir()]


def copy_served_files(web_dir: Path, dest: Path) -> None:
    """Replace `dest` with the served folders of `web_dir`, laid out as in it."""
    shutil.rmtree(dest, ignore_errors=True)
    for folder in served_folders(web_dir):
        if not (web_dir / folder).is_dir():
            raise KilnError(f"missing: run `npm ci` in {web_dir}", web_dir / folder)
        shutil.copytree(web_dir / folder, dest / folder)
