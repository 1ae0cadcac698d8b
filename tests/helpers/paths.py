"""Where the tests find the checkout, their data, the web package, and where they leave artifacts."""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
TESTS_DATA = CHECKOUT / "tests" / "data"
WEB_DIR = CHECKOUT / "web"
ARTIFACTS_DIR = CHECKOUT / "test-artifacts"
