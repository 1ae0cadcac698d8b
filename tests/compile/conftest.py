"""Fixtures of the compiler's tests of untrusted inputs and sources: a tiny valid Hugging Face folder
to break, written once per test module, copied for each test."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers.untrusted import write_hf_folder


@pytest.fixture(scope="module")
def valid_folder(tmp_path_factory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("untrusted") / "tiny")


@pytest.fixture
def folder(valid_folder, tmp_path) -> Path:
    return Path(shutil.copytree(valid_folder, tmp_path / "tiny"))
