"""The wheel works outside the checkout: built by a plain `pip wheel` of the sources (as `pip install
git+…` builds it), installed into a fresh venv that reaches the checkout's dependencies but not the
checkout, its commands run from another folder."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.paths import CHECKOUT

import kiln

pytestmark = pytest.mark.slow

CHECKOUT_SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "node_modules",
    "build",
    "dist",
    "test-artifacts",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "*.egg-info",
)
# Outside the checkout, and without the variables that would lead Python back into it.
ENV = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run(command: list, cwd: Path, timeout: float = 600) -> str:
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def sources(tmp: Path) -> Path:
    """The checkout's sources, without what `npm ci` and builds add."""
    shutil.copytree(CHECKOUT, tmp / "source", ignore=NOT_SOURCES)
    return tmp / "source"


def pip_wheel(source: Path, wheel_dir: Path, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheel_dir, source]
    return subprocess.run([str(part) for part in command], env=env, capture_output=True, text=True, timeout=600)


def build_wheel(source: Path, wheel_dir: Path) -> Path:
    result = pip_wheel(source, wheel_dir, ENV)
    assert result.returncode == 0, result.stderr
    [wheel] = wheel_dir.glob("kiln_llm-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a fresh venv holding the wheel; its other packages are the checkout venv's."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = sources(tmp)
    (source / "web" / "node_modules").symlink_to(CHECKOUT / "web" / "node_modules")
    wheel = build_wheel(source, tmp / "wheel")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel], cwd=tmp)
    # A path in a .pth file joins sys.path without its own .pth files running, so the editable
    # install's finder (which maps `kiln` to the checkout) stays out.
    site_packages = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip()
    )
    (site_packages / "checkout-dependencies.pth").write_text(f"{CHECKOUT_SITE_PACKAGES}\n")
    return venv / "bin"


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    return tmp_path


def test_the_installed_kiln_is_the_wheel_not_the_checkout(installed, elsewhere):
    report = json.loads(
        run(
            [
                installed / "python",
                "-c",
                "import json, sys, kiln, kiln.server, kiln.compile, kiln.models; "
                "print(json.dumps({'files': [m.__file__ for m in (kiln, kiln.server, kiln.compile, "
                "kiln.models)], 'path': sys.path, 'finders': [repr(f) for f in sys.meta_path], "
                "'version': kiln.__version__}))",
            ],
            cwd=elsewhere,
        )
    )
    venv = installed.parent
    assert all(Path(file).is_relative_to(venv) for file in report["files"]), report["files"]
    inside_checkout = [p for p in report["path"] if (elsewhere / p).resolve().is_relative_to(CHECKOUT)]
    assert inside_checkout == [str(CHECKOUT_SITE_PACKAGES)]
    assert not [f for f in report["finders"] if "editable" in f]
    assert report["version"] == kiln.__version__


def test_the_wheel_carries_the_served_web_files_and_no_dev_package(installed, elsewhere):
    listing = (
        "import json; from kiln.server import web_files as w; "
        "print(json.dumps({p: (w.PACKAGED_WEB_DIR / p).is_dir() for p in w.WEB_PREFIXES}))"
    )
    carried = json.loads(run([installed / "python", "-c", listing], cwd=elsewhere))
    assert carried == {prefix: "web-llm" not in prefix for prefix in carried}


def test_the_wheel_carries_the_mobile_runtimes_sources(installed, elsewhere):
    listing = (
        "import json; from kiln.mobile.package import JAVA_SOURCES; "
        "from kiln.compile.toolchain.mobile_runtime import KILN_SOURCES_DIR; "
        "print(json.dumps([sorted(str(p.relative_to(d)) for p in d.rglob('*.*')) "
        "for d in (KILN_SOURCES_DIR, JAVA_SOURCES)]))"
    )
    runtime, java = json.loads(run([installed / "python", "-c", listing], cwd=elsewhere))
    checkout = CHECKOUT / "kiln" / "mobile"
    assert runtime == sorted(p.name for p in (checkout / "runtime").iterdir() if p.suffix in (".h", ".cc"))
    assert java == sorted(str(p.relative_to(checkout / "java")) for p in (checkout / "java").rglob("*.*"))


def test_a_wheel_without_the_web_packages_and_npm_is_one_clear_error(tmp_path):
    source = sources(tmp_path)
    no_npm = {**ENV, "PATH": str(Path(sys.executable).parent)}
    result = pip_wheel(source, tmp_path / "wheel", no_npm)
    assert result.returncode != 0
    runtime = source / "web" / "node_modules" / "@mlc-ai" / "web-runtime" / "lib"
    assert f"{runtime}: missing, and the wheel carries it" in result.stderr
    assert not list((tmp_path / "wheel").glob("*.whl"))


def test_doctor(installed, elsewhere):
    assert "ok  TVM web runtime" in run([installed / "kiln", "doctor"], cwd=elsewhere)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def test_compile_then_serve_the_harness_engine_and_model(installed, elsewhere, tiny_source):
    run(
        [
            installed / "kiln",
            "compile",
            tiny_source,
            "-q",
            "q4f32_1",
            "-t",
            "cpu",
            "-o",
            "dist",
            "--model-id",
            "tiny-wheel",
        ],
        cwd=elsewhere,
    )
    record = json.loads((elsewhere / "dist" / "tiny-wheel" / "kiln-build.json").read_text())
    assert record["kiln_version"] == kiln.__version__
    # The wasm target compiles Kiln's thread pool into the web runtime: its source ships in the wheel.
    pool_source = "from kiln.compile.toolchain import wasm_toolchain as w; print(w.THREAD_POOL_SOURCE.is_file())"
    assert run([installed / "python", "-c", pool_source], cwd=elsewhere).strip() == "True"

    port = free_port()
    server = subprocess.Popen(
        [installed / "kiln", "serve", "--dist", "dist", "--port", str(port)],
        cwd=elsewhere,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                health = json.loads(fetch(f"{base}/health"))
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "kiln serve did not start"
                time.sleep(0.5)
        assert health["models"] == ["tiny-wheel"]
        assert b"<title>Kiln chat</title>" in fetch(f"{base}/")
        assert b"createEngine" in fetch(f"{base}/web/src/index.js")
        assert b"serveEngine" in fetch(f"{base}/web/src/worker.js")
        assert b"tvmjs" in fetch(f"{base}/web/node_modules/@mlc-ai/web-runtime/lib/index.js")
        assert json.loads(fetch(f"{base}/models/tiny-wheel/mlc-chat-config.json"))["model_type"] == "llama"
        assert "model_list" in json.loads(fetch(f"{base}/api/app-config.json"))
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "warning" not in server.stderr.read()


def test_bench_compile_reads_its_text_from_the_package(installed, elsewhere, tiny_source):
    source = elsewhere / "tiny-long"
    shutil.copytree(tiny_source, source)
    # The bundled text is some 2,150 tokens of the tiny tokenizer: a window longer than its 512.
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    report = json.loads(
        run([installed / "kiln", "bench", "compile", source, "-q", "q4f32_1", "-t", "cpu", "--json"], cwd=elsewhere)
    )
    assert Path(report["text"]).is_relative_to(installed.parent)
    assert report["tokens"] > 2000
    assert set(report["perplexity"]) == {"q0f32", "q4f32_1"}
