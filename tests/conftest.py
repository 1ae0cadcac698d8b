"""Shared fixtures: tiny generated Llamas and SmolLM2, each built at most once per test session.

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

import pytest
from filelock import FileLock

# The helpers hold asserts of the tests (assert_clean_failure, ...): pytest rewrites them as it does
# the tests' own, for the same failure reports, if told before they are first imported (below).
# ruff: noqa: E402
pytest.register_assert_rewrite("helpers")

from helpers.assets import smollm2_gguf
from helpers.failures import CommandResult
from helpers.tiny_families import make_tiny_family
from helpers.tiny_llama import CHAT_TEMPLATES, TOOL_FAMILIES, make_tiny_llama

from kiln.cli import main
from kiln.compile.pipeline import BuildRequest, build, kiln_code_digest


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


# The targets the session's tests ask of a model, one or two at a time: built together when the first
# of them is asked for, they compile side by side (kiln/compile/side_by_side.py).
BROWSER_TARGETS = ("cpu", "webgpu", "webgpu-subgroups", "wasm")
MOBILE_TARGETS = ("android", "iphone", "metal")
BUILT_TOGETHER = {
    "tiny-llama-q4f32_1": (*BROWSER_TARGETS, "android", "iphone", "arm64-linux", "android-cpu", "iphone-cpu"),
    "tiny-llama-q4f16_1": ("cpu", *MOBILE_TARGETS),
    "SmolLM2-135M-Instruct-q4f32_1": (*BROWSER_TARGETS, "arm64-linux"),
    "SmolLM2-135M-Instruct-q4f16_1": ("webgpu", *MOBILE_TARGETS),
    "SmolLM2-135M-Instruct-q0f32": ("cpu", "webgpu", "wasm"),
    **{
        f"tiny-{family}-q4f32_1": ("cpu", "webgpu", "wasm", "arm64-linux")
        for family in (
            "qwen2",
            "phi3",
            "mistral",
            "gemma2",
            "gemma3",
            "granite",
            "smollm3",
            "olmo2",
            "olmo3",
            "ministral3",
        )
    },
}


class SessionBuilds:
    """Builds (source, quantization) → model folder, adding targets on demand (and rebuilding
    them all when a kept build was made by other Kiln code). Models whose compile is one made
    before (the tests' tiny Llamas with other chat templates) get its library from a library cache."""

    def __init__(self, dist: Path):
        self.dist = dist
        self.library_cache = dist.with_name(f"{dist.name}-libraries")

    def model_dir(self, source: Path, name: str, quantization: str, targets: list[str], **overrides) -> Path:
        """`overrides`: BuildRequest's (context_window_size, …), for a build under a name of its own."""
        model_id = f"{name}-{quantization}"
        model_dir = self.dist / model_id
        record = model_dir / "kiln-build.json"
        with FileLock(self.dist / f".{model_id}.lock"):
            previous = json.loads(record.read_text()) if record.exists() else {}
            current = previous.get("kiln_code_digest") == kiln_code_digest()
            wanted = [*targets, *(t for t in BUILT_TOGETHER.get(model_id, ()) if t not in targets)]
            missing = [t for t in wanted if not current or t not in previous.get("targets", {})]
            if set(missing) & set(targets):
                build(
                    BuildRequest(
                        source=str(source),
                        quantization=quantization,
                        targets=missing,
                        output=self.dist,
                        model_id=model_id,
                        library_cache=self.library_cache,
                        **overrides,
                    )
                )
        return model_dir


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> SessionBuilds:
    kept = os.environ.get("KILN_TEST_DIST")
    if kept:
        return SessionBuilds(Path(kept))
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return SessionBuilds(tmp_path_factory.mktemp("dist"))
    # Each worker's temporary folder is a subfolder of the run's: the builds go next to them.
    shared = tmp_path_factory.getbasetemp().parent / "dist"
    shared.mkdir(exist_ok=True)
    return SessionBuilds(shared)


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory) -> Path:
    """A 2-layer Llama with tied embeddings, as a Hugging Face folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("sources") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_untied_source(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("sources") / "tiny-llama-untied", seed=1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_build(builds, tiny_source):
    """tiny_build(quantization, targets) → model folder of the tiny Llama."""
    return lambda quantization, targets=("cpu",): builds.model_dir(
        tiny_source, "tiny-llama", quantization, list(targets)
    )


@pytest.fixture(scope="session")
def family_source(tmp_path_factory):
    """family_source(name) → a tiny model of that family (helpers.tiny_families), as a Hugging Face folder."""
    made = {}

    def source(name: str):
        if name not in made:
            made[name] = make_tiny_family(name, tmp_path_factory.mktemp("families") / name)
        return made[name]

    return source


@pytest.fixture(scope="session")
def family_build(builds, family_source):
    """family_build(name, quantization, targets) → model folder of the family's tiny model."""
    return lambda name, quantization, targets=("cpu",): builds.model_dir(
        family_source(name), f"tiny-{name}", quantization, list(targets)
    )


@pytest.fixture(scope="session")
def smollm2_source() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_build(builds, smollm2_source):
    """smollm2_build(quantization, targets) → model folder of SmolLM2-135M-Instruct."""
    return lambda quantization, targets=("cpu",): builds.model_dir(
        smollm2_source, "SmolLM2-135M-Instruct", quantization, list(targets)
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
