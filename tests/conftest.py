"""Shared fixtures: tiny generated Llamas and SmolLM2, each built at most once per test session, most
of them before a test asks (helpers/session_builds.py).

Set KILN_TEST_DIST to a folder to keep builds between runs (a developer's inner loop); by default
they go to pytest's temporary folder. Builds add targets to one model folder as tests ask for
them, which also exercises the pipeline's weight reuse. With pytest-xdist workers (`make test
TEST_WORKERS=2`; the browser tests all on one) they share the builds' folder, and a model is built
under a lock, by whichever worker asks first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest

# The helpers hold asserts of the tests (assert_clean_failure, ...): pytest rewrites them as it does
# the tests' own, for the same failure reports, if told before they are first imported (below).
# ruff: noqa: E402
pytest.register_assert_rewrite("helpers")

from helpers.embedding_models import MINILM
from helpers.failures import CommandResult
from helpers.session_builds import SMOLLM2, SessionBuilds, SessionSources, building_ahead, built_for
from helpers.tiny_llama import CHAT_TEMPLATES, TOOL_FAMILIES, make_tiny_llama

from kiln.cli import main


# A test that uses one of these compiles a model (or runs `kiln compile`), and every test of the mobile
# runtime compiles C or C++: they are slow, whatever their own markers say, so that `make test-fast`
# runs no compiler.
COMPILING_FIXTURES = {"builds", "run_compile"}
COMPILING_FOLDERS = {"mobile"}


def pytest_collection_modifyitems(items):
    for item in items:
        if COMPILING_FIXTURES & set(item.fixturenames) or item.path.parent.name in COMPILING_FOLDERS:
            item.add_marker(pytest.mark.slow)
        # SwiftShader takes both cores: two browser tests side by side would each run at half speed
        # (past their timeouts), so one pytest-xdist worker runs them all, the other the rest.
        if item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.xdist_group("browser"))


def session_folder(tmp_path_factory, name: str) -> Path:
    """A folder of the session's; with pytest-xdist workers, one they share (each worker's temporary
    folder is a subfolder of the run's: it goes next to them)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.getbasetemp() / name
    return tmp_path_factory.getbasetemp().parent / name


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> SessionSources:
    """The session's generated models by name (helpers/session_builds.py MADE_SOURCES)."""
    return SessionSources(session_folder(tmp_path_factory, "sources"))


@pytest.fixture(scope="session")
def builds(request, tmp_path_factory, sources) -> Iterator[SessionBuilds]:
    """The session's builds, which a build-ahead process makes before the tests ask for them."""
    kept = os.environ.get("KILN_TEST_DIST")
    session_builds = SessionBuilds(Path(kept) if kept else session_folder(tmp_path_factory, "dist"))
    ahead = built_for([item.fixturenames for item in request.session.items])
    with building_ahead(session_builds, sources, ahead):
        yield session_builds


@pytest.fixture(scope="session")
def tiny_source(sources) -> Path:
    """A 2-layer Llama with tied embeddings, as a Hugging Face folder."""
    return sources.path("tiny-llama")


@pytest.fixture(scope="session")
def tiny_untied_source(sources) -> Path:
    return sources.path("tiny-llama-untied")


@pytest.fixture(scope="session")
def tiny_build(builds, tiny_source):
    """tiny_build(quantization, targets) → model folder of the tiny Llama."""
    return lambda quantization, targets=("cpu",): builds.model_dir(
        tiny_source, "tiny-llama", quantization, list(targets)
    )


@pytest.fixture(scope="session")
def mixed_gguf(sources):
    """A tiny Llama as a GGUF holding every block type Kiln compiles (helpers.tiny_families)."""
    return sources.path("tiny-mixed")


@pytest.fixture(scope="session")
def mixed_build(builds, mixed_gguf):
    """mixed_build(quantization, targets) → model folder of the mixed-blocks GGUF."""
    return lambda quantization, targets=("cpu",): builds.model_dir(
        mixed_gguf, "tiny-mixed", quantization, list(targets)
    )


@pytest.fixture(scope="session")
def family_source(sources):
    """family_source(name) → a tiny model of that family (helpers.tiny_families), as a Hugging Face folder."""
    return sources.path


@pytest.fixture(scope="session")
def family_build(builds, family_source):
    """family_build(name, quantization, targets) → model folder of the family's tiny model."""
    return lambda name, quantization, targets=("cpu",): builds.model_dir(
        family_source(name), f"tiny-{name}", quantization, list(targets)
    )


@pytest.fixture(scope="session")
def smollm2_source(sources) -> Path:
    return sources.path(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_build(builds, smollm2_source):
    """smollm2_build(quantization, targets) → model folder of SmolLM2-135M-Instruct."""
    return lambda quantization, targets=("cpu",): builds.model_dir(smollm2_source, SMOLLM2, quantization, list(targets))


@pytest.fixture(scope="session")
def embedder_build(builds, sources):
    """embedder_build(name, quantization, targets) → model folder of a tiny embedding model (helpers.embedding_models):
    tiny-bert (mean pooling, normalized), tiny-bert-cls (CLS pooling, not normalized), tiny-qwen3-embedder
    (last-token pooling) or tiny-qwen2-embedder (mean pooling)."""
    return lambda name, quantization, targets=("cpu",): builds.model_dir(
        sources.path(name), name, quantization, list(targets)
    )


@pytest.fixture(scope="session")
def minilm_build(builds, sources):
    """minilm_build(targets, quantization) → model folder of all-MiniLM-L6-v2 (from PyPI), at q0f32 unless asked."""
    return lambda targets=("cpu",), quantization="q0f32": builds.model_dir(
        sources.path(MINILM), MINILM, quantization, list(targets)
    )


@pytest.fixture(scope="session")
def tool_build(builds, tiny_build, tmp_path_factory):
    """tool_build(targets) → the dist folder holding tiny Llamas with Qwen2.5's and Llama 3.1's chat
    templates (tools-qwen, tools-llama3: names apart from the families' tiny models) and the ChatML one (no
    tools), each with `targets`."""
    sources = tmp_path_factory.mktemp("tool-sources")
    families = {}
    for name, (tokens, template) in TOOL_FAMILIES.items():
        source = make_tiny_llama(sources / name, tokens=tokens, chat_template=(CHAT_TEMPLATES / template).read_text())
        # Tool definitions take some 800 of the tiny tokenizer's tokens: a longer window than its 512.
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
        families[name] = source

    def build(targets: list[str]) -> Path:
        for name, source in families.items():
            builds.model_dir(source, f"tools-{name}", "q4f32_1", targets)
        tiny_build("q4f32_1", targets)
        return builds.dist

    return build


@pytest.fixture(scope="session")
def tool_models(tool_build):
    """The tool models with their cpu libraries, served; yields (dist, base URL). Browser tests add
    the wasm libraries with `tool_build` (the served app config lists what is there per request)."""
    from helpers.web import served

    dist = tool_build(["cpu"])
    with served(dist) as base:
        yield dist, base


@pytest.fixture(scope="session")
def driver():
    """One Playwright driver for the whole session (a second sync driver cannot start while one
    runs): every browser test launches its Chromium from it."""
    from helpers.web import playwright_driver, require_web_packages

    require_web_packages()
    with playwright_driver() as running:
        yield running


@pytest.fixture(scope="module")
def tiny_dir(tiny_build) -> Path:
    """The tiny Llama at q4f32_1 with every library the server and the browser use."""
    return tiny_build("q4f32_1", ["cpu", "webgpu", "webgpu-subgroups", "wasm"])


@pytest.fixture(scope="module")
def url(tiny_dir) -> str:
    """`kiln serve` over the folder holding the tiny model."""
    from helpers.web import served

    with served(tiny_dir.parent) as base:
        yield base


@pytest.fixture
def run_compile(capsys):
    """Runs `kiln compile … -q q4f32_1 -t cpu --model-id broken` in-process (as the CLI does)."""

    def run(source: Path | str, output: Path, *extra: str) -> CommandResult:
        args = ["compile", str(source), "-q", "q4f32_1", "-t", "cpu", "-o", str(output), "--model-id", "broken", *extra]
        capsys.readouterr()
        code = main(args)
        return CommandResult(code, capsys.readouterr().err)

    return run
