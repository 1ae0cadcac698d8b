"""The mobile runtime's error codes (kiln/mobile/runtime/errors.h) are the browser engine's
(ERROR_CODES in web/src/errors.js), in the same order: a code's integer, which the C API returns,
is its place in that list from 1 on."""

from __future__ import annotations

import re
import subprocess

from helpers.host_cpp import host_program
from helpers.paths import WEB_DIR


def browser_error_codes() -> list[str]:
    errors_js = (WEB_DIR / "src" / "errors.js").read_text()
    listing = re.search(r"export const ERROR_CODES = \[(.*?)\];", errors_js, re.S)
    return re.findall(r'^\s*"([a-z-]+)",', listing.group(1), re.M)


def test_error_codes_are_the_browser_engines_in_its_order(tmp_path):
    program = host_program("errors.cc", [], tmp_path)
    lines = subprocess.run([program], capture_output=True, text=True, check=True).stdout.splitlines()
    codes = [line.split(" ") for line in lines if not line.startswith("thrown ")]
    assert [name for _, name in codes] == browser_error_codes()
    assert [int(value) for value, _ in codes] == list(range(1, len(codes) + 1))
    assert lines[-1] == "thrown no-chat-template no template"
