"""One version for the Python package, the npm package and the build record; the native engine
refuses a build of another Kiln major.minor or another TVM (the web engine's refusal is in
tests/web/test_web_units.py)."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import tvm

from helpers.paths import CHECKOUT, WEB_DIR
from helpers.web import run_node_module

import kiln
from kiln.errors import KilnError
from kiln.runtime import NativeModel, version_series


def test_the_python_package_the_npm_package_and_a_build_carry_one_version(tiny_build):
    pyproject = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    package = json.loads((WEB_DIR / "package.json").read_text())
    engine = run_node_module(
        """
        import { KILN_VERSION, TVM_SERIES } from "./src/version.js";
        console.log(JSON.stringify({ kiln: KILN_VERSION, tvm: TVM_SERIES }));
    """,
        None,
    )
    build = json.loads((tiny_build("q4f32_1") / "kiln-build.json").read_text())
    assert pyproject["version"] == package["version"] == kiln.__version__ == engine["kiln"] == build["kiln_version"]
    assert build["versions"]["tvm"] == tvm.__version__
    assert (
        engine["tvm"]
        == version_series(tvm.__version__)
        == version_series(package["dependencies"]["@mlc-ai/web-runtime"])
    )


@pytest.fixture(scope="module")
def tiny_cpu_dir(tiny_build) -> Path:
    return tiny_build("q4f32_1")


def with_record(model_dir: Path, folder: Path, change) -> Path:
    shutil.copytree(model_dir, folder)
    record = json.loads((folder / "kiln-build.json").read_text())
    (folder / "kiln-build.json").write_text(json.dumps(change(record)))
    return folder


def test_a_build_of_another_kiln_patch_release_loads(tiny_cpu_dir, tmp_path):
    major, minor, _ = kiln.__version__.split(".")
    folder = with_record(tiny_cpu_dir, tmp_path / "patch", lambda r: {**r, "kiln_version": f"{major}.{minor}.99"})
    assert NativeModel(folder).vocab_size > 0


@pytest.mark.parametrize(
    "name, change, built",
    [
        ("another-minor", lambda r: {**r, "kiln_version": "0.99.0"}, f"Kiln 0.99.0 with TVM {tvm.__version__}"),
        (
            "another-tvm",
            lambda r: {**r, "versions": {**r["versions"], "tvm": "0.27.1"}},
            f"Kiln {kiln.__version__} with TVM 0.27.1",
        ),
        ("unrecorded", lambda r: {k: v for k, v in r.items() if k != "kiln_version"}, "Kiln (not recorded)"),
    ],
)
def test_a_build_of_another_kiln_series_or_tvm_is_refused(tiny_cpu_dir, tmp_path, name, change, built):
    folder = with_record(tiny_cpu_dir, tmp_path / name, change)
    with pytest.raises(KilnError) as refused:
        NativeModel(folder)
    message = str(refused.value)
    assert f"built by {built}" in message
    assert f"this is Kiln {kiln.__version__} with TVM {tvm.__version__}" in message
    assert "rebuild the model with this kiln compile" in message and str(folder) in message
