"""`kiln parity` from the tests: its JSON report, and the contract a build's report must meet."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from helpers.paths import TESTS_DATA

from kiln.cli import main

PROMPTS = TESTS_DATA / "parity-prompts.txt"


def parity(model_dir: Path, *args: str) -> tuple[int, dict]:
    """`kiln parity MODEL_DIR --json ARGS` run in this process (no second start of Python and TVM);
    its Chromium comes from the session's Playwright driver when one runs."""
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = main(["parity", str(model_dir), "--json", *args])
    assert report.getvalue(), f"kiln parity exited {code} without a report"
    return code, json.loads(report.getvalue())


def assert_contract_holds(code: int, report: dict, prompts: int, max_tokens: int) -> None:
    """The report passes, and each figure is within the contract it names: float flavors' 1e-2, or for
    8-bit activations the share of the largest logit they state (`ParityContract.of`)."""
    assert report["failures"] == [] and report["passed"] and code == 0
    assert len(report["prompts"]) == prompts
    contract = report["contract"]
    assert contract["max_last_logit_abs_diff"] == 1e-2 and contract["min_forced_top1_agreement"] == 0.99
    for prompt in report["prompts"]:
        assert len(prompt["native_tokens"]) == max_tokens
        assert prompt["tokenization_identical"] and prompt["non_finite"] == []
        assert prompt["greedy_ok"] and prompt["failures"] == []
        assert prompt["forced_top1_agreement"] >= 0.99
        allowed = max(1e-2, contract["max_last_logit_rel_diff"] * prompt["last_logit_largest"])
        assert prompt["last_logit_abs_diff"] <= allowed
    assert report["forced_top1_agreement"] >= 0.99
