"""The wheel carries the served part of web/ (kiln/server/web_files.py says why), whatever builds it:
`pip install .`, `pip install git+…`, `pip wheel .`, `python -m build`. The rest is in pyproject.toml."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
WEB_DIR = ROOT / "web"


def web_files_module():
    """kiln/server/web_files.py, loaded by its path: Kiln's dependencies need not be installed yet."""
    sys.path.insert(0, str(ROOT))  # for kiln.errors, which it imports
    spec = importlib.util.spec_from_file_location("kiln_web_files", ROOT / "kiln" / "server" / "web_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install_web_packages(missing: str) -> None:
    npm = shutil.which("npm")
    if npm is None:
        sys.exit(
            f"{WEB_DIR / missing}: missing, and the wheel carries it: install Node.js and npm "
            f"(or run `npm ci` in {WEB_DIR} elsewhere and copy node_modules), then build again"
        )
    print(f"kiln: installing the web packages the wheel carries (npm ci --omit=dev in {WEB_DIR})", file=sys.stderr)
    subprocess.run([npm, "ci", "--omit=dev", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=WEB_DIR, check=True)


class BuildPyWithWebFiles(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install serves web/ itself
            return
        web_files = web_files_module()
        missing = web_files.missing_served_folders(WEB_DIR)
        if missing:
            install_web_packages(missing[0])
        web_files.copy_served_files(WEB_DIR, Path(self.build_lib) / "kiln" / "data" / "web")


setup(cmdclass={"build_py": BuildPyWithWebFiles})
