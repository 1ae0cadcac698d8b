"""The test session's models: their sources, made once under a lock, and their builds, made at most once
per session (tests/conftest.py's `builds`) and ahead of the tests that ask for them.

A test asks for a build and waits for it; the machine's cores are otherwise a third idle over the suite
(a one-target compile, qemu and Node use one of two, a Python test none). A build-ahead process, at the
lowest CPU priority so that it takes only what the tests leave, builds the models the session's tests
will ask for in the order they will ask. A test that asks for a model the process is building waits for
it under the model's lock, as it would for another test's build; one it has not reached yet the test
builds itself.

`python -m helpers.session_builds DIST SOURCES ROWS` is that process (run from tests/).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock

from helpers.assets import smollm2_gguf
from helpers.embedding_models import MINILM, make_tiny_bert, make_tiny_decoder_embedder, unpack_minilm
from helpers.paths import CHECKOUT
from helpers.real_sizes import REAL_SIZES, make_real_sized
from helpers.tiny_families import (
    BROWSER_FAMILIES,
    GGUF_FAMILIES,
    MADE_FAMILIES,
    TINY_FAMILIES,
    YARN_FAMILIES,
    make_tiny_family,
    write_family_gguf,
    write_mixed_blocks_gguf,
)
from helpers.tiny_llama import make_tiny_llama

from kiln.compile.pipeline import BuildRequest, build, kiln_code_digest
from kiln.compile.side_by_side import follow_the_build

SMOLLM2 = "SmolLM2-135M-Instruct"

# The targets the session's tests ask of a model, one or two at a time: built together when the first
# of them is asked for, they compile side by side (kiln/compile/side_by_side.py).
BROWSER_TARGETS = ("cpu", "webgpu", "webgpu-subgroups", "wasm")
MOBILE_TARGETS = ("android", "iphone", "metal")
BUILT_TOGETHER = {
    "tiny-llama-q4f32_1": (*BROWSER_TARGETS, "android", "iphone", "arm64-linux", "android-cpu", "iphone-cpu"),
    "tiny-llama-q4f16_1": ("cpu", *MOBILE_TARGETS),
    f"{SMOLLM2}-q4f32_1": (*BROWSER_TARGETS, "arm64-linux"),
    f"{SMOLLM2}-q4f16_1": ("webgpu", *MOBILE_TARGETS),
    f"{SMOLLM2}-q0f32": ("cpu", "webgpu", "wasm"),
    **{f"tiny-{family}-q4f32_1": ("cpu", "webgpu", "wasm", "arm64-linux") for family in BROWSER_FAMILIES},
    **{f"tiny-{name}-q0f32": ("cpu", "wasm", "webgpu") for name in ("gemma2-all-local", "gemma3-all-local")},
    "tiny-mixed-gguf_f32": ("cpu", "webgpu", "wasm"),
    **{f"{name}-sized-q4f32_1": ("cpu", "wasm", "webgpu") for name in REAL_SIZES},
    "tiny-bert-q0f32": ("cpu", "wasm", "webgpu"),
    "tiny-qwen3-embedder-q0f32": ("cpu", "wasm"),
    "tiny-gemma3-embedder-q0f32": ("cpu", "wasm"),
    f"{MINILM}-q0f32": ("cpu", "wasm", "webgpu"),
    f"{MINILM}-q8_0_i8": ("cpu", "wasm"),
}


def mixed_blocks_gguf(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return write_mixed_blocks_gguf(folder / "tiny-mixed.Q4_K_M.gguf")


def family_gguf(family: str, hf_folder: Path, folder: Path) -> Path:
    """The family's tiny model (the weights of its Hugging Face folder) as a float32 GGUF."""
    folder.mkdir(parents=True)
    return write_family_gguf(family, hf_folder, folder / f"tiny-{family}.F32.gguf")


# What each source is made by: a function of an empty folder, giving the file or folder to build from.
MADE_SOURCES: dict[str, Callable[[Path], Path]] = {
    "tiny-llama": make_tiny_llama,
    "tiny-llama-untied": partial(make_tiny_llama, seed=1, tie_word_embeddings=False),
    **{name: partial(make_tiny_family, name) for name in MADE_FAMILIES},
    "tiny-mixed": mixed_blocks_gguf,
    **{name: partial(make_real_sized, name) for name in REAL_SIZES},
    "tiny-bert": make_tiny_bert,
    "tiny-bert-cls": partial(make_tiny_bert, seed=1, pooling="cls", normalize=False),
    MINILM: unpack_minilm,
    "tiny-qwen3-embedder": make_tiny_decoder_embedder,
    "tiny-qwen2-embedder": partial(make_tiny_decoder_embedder, family="qwen2", seed=1, pooling="mean"),
    "tiny-gemma3-embedder": partial(
        make_tiny_decoder_embedder, family="gemma3", seed=2, pooling="mean", bidirectional=True, dense=(128, 64)
    ),
}

# Sources read by one build only, which makes every target the session asks of them: removed once it is
# made (a real size's bfloat16 weights are 0.5–1.4 GB; the suite's disk is shared), made again if asked.
DISCARDED_ONCE_BUILT = set(REAL_SIZES)

# Sources written from another source: name → (that source, a function of its path and an empty folder).
WRITTEN_FROM: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    f"{family}-gguf": (family, partial(family_gguf, family)) for family in GGUF_FAMILIES
}

# The builds a test asks for through each fixture, (source, model name, quantization), in the order the
# suite first asks for them.
BUILT_FOR_FIXTURE: dict[str, list[tuple[str, str, str]]] = {
    "tiny_source": [("tiny-llama", "tiny-llama", q) for q in ("q4f32_1", "q0f32", "q4f16_1", "q8_0_i8")],
    "tiny_untied_source": [("tiny-llama-untied", "tiny-untied", "q0f32")],
    "mixed_build": [("tiny-mixed", "tiny-mixed", q) for q in ("q0f32", "gguf_f32", "gguf_f16", "q0f16", "gguf_i8")],
    "smollm2_source": [(SMOLLM2, SMOLLM2, q) for q in ("q0f32", "q4f16_1", "q4f32_1", "gguf_f32", "gguf_i8")],
    "family_source": [
        *((family, f"tiny-{family}", "q4f32_1") for family in BROWSER_FAMILIES),
        *((family, f"tiny-{family}", "q0f32") for family in sorted(TINY_FAMILIES)),
        *((f"{family}-gguf", f"tiny-{family}-gguf", "q0f32") for family in GGUF_FAMILIES),
        *((family, f"tiny-{family}", "q0f32") for family in sorted(YARN_FAMILIES)),
    ],
    "all_local_models": [(name, f"tiny-{name}", "q0f32") for name in ("gemma2-all-local", "gemma3-all-local")],
    "real_size": [(name, f"{name}-sized", "q4f32_1") for name in REAL_SIZES],
    "embedder_build": [
        *(("tiny-bert", "tiny-bert", q) for q in ("q0f32", "q8f32_1", "q4f32_1", "q8_0_i8")),
        ("tiny-bert-cls", "tiny-bert-cls", "q0f32"),
        *(
            (name, name, q)
            for name in ("tiny-qwen3-embedder", "tiny-qwen2-embedder", "tiny-gemma3-embedder")
            for q in ("q0f32", "q8f32_1", "q8_0_i8")
        ),
    ],
    "minilm_build": [(MINILM, MINILM, q) for q in ("q0f32", "q8_0_i8")],
}


class SessionSources:
    """Sources by name (MADE_SOURCES, WRITTEN_FROM, and SmolLM2's GGUF), each made once into `folder`."""

    def __init__(self, folder: Path):
        self.folder = folder

    def path(self, name: str) -> Path:
        if name == SMOLLM2:
            return smollm2_gguf()
        self.folder.mkdir(parents=True, exist_ok=True)
        made, inside = self.folder / name, self.folder / f".{name}.inside"
        with FileLock(self.folder / f".{name}.lock"):
            if not made.exists():
                # Made aside and renamed into place: a source is whole or absent.
                work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.folder)) / "source"
                inside.write_text(str(self.maker(name)(work).relative_to(work)))
                os.rename(work, made)
                work.parent.rmdir()
        return made / inside.read_text()

    def discard(self, name: str) -> None:
        """Removes a made source (a later `path` makes it again)."""
        with FileLock(self.folder / f".{name}.lock"):
            shutil.rmtree(self.folder / name, ignore_errors=True)

    def maker(self, name: str) -> Callable[[Path], Path]:
        if name in WRITTEN_FROM:
            base, write = WRITTEN_FROM[name]
            return partial(write, self.path(base))
        return MADE_SOURCES[name]


class SessionBuilds:
    """Builds (source, quantization) → model folder, adding targets on demand (and rebuilding
    them all when a kept build was made by other Kiln code). Models whose compile is one made
    before (the tests' tiny Llamas with other chat templates) get its library from a library cache."""

    def __init__(self, dist: Path):
        self.dist = dist
        self.library_cache = dist.with_name(f"{dist.name}-libraries")

    def model_dir(
        self, source: Path | Callable[[], Path], name: str, quantization: str, targets: list[str], **overrides
    ) -> Path:
        """`source`: its path, or what makes it when a build is needed. `overrides`: BuildRequest's
        (context_window_size, …), for a build under a name of its own."""
        model_id = f"{name}-{quantization}"
        model_dir = self.dist / model_id
        record = model_dir / "kiln-build.json"
        self.dist.mkdir(parents=True, exist_ok=True)
        with FileLock(self.dist / f".{model_id}.lock"):
            previous = json.loads(record.read_text()) if record.exists() else {}
            current = previous.get("kiln_code_digest") == kiln_code_digest()
            wanted = [*targets, *(t for t in BUILT_TOGETHER.get(model_id, ()) if t not in targets)]
            missing = [t for t in wanted if not current or t not in previous.get("targets", {})]
            if set(missing) & set(targets):
                build(
                    BuildRequest(
                        source=str(source() if callable(source) else source),
                        quantization=quantization,
                        targets=missing,
                        output=self.dist,
                        model_id=model_id,
                        library_cache=self.library_cache,
                        **overrides,
                    )
                )
        return model_dir


def built_for(fixtures_of_tests: list[list[str]]) -> list[tuple[str, str, str]]:
    """The builds tests with these fixtures ask for, in the order they first ask."""
    rows = []
    for fixtures in fixtures_of_tests:
        for fixture in fixtures:
            rows.extend(row for row in BUILT_FOR_FIXTURE.get(fixture, ()) if row not in rows)
    return rows


@contextmanager
def building_ahead(builds: SessionBuilds, sources: SessionSources, rows: list[tuple[str, str, str]]) -> Iterator[None]:
    """The build-ahead process for the block (its output in `<dist>-ahead.log`)."""
    if not rows:
        yield
        return
    command = [sys.executable, "-m", "helpers.session_builds", str(builds.dist), str(sources.folder), json.dumps(rows)]
    with open(builds.dist.with_name(f"{builds.dist.name}-ahead.log"), "w") as log:
        process = subprocess.Popen(
            command, cwd=CHECKOUT / "tests", stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19)
        )
    try:
        yield
    finally:
        process.kill()
        process.wait()


def built_from_made_source(
    builds: SessionBuilds, sources: SessionSources, source: str, name: str, quantization: str, targets: list[str]
) -> Path:
    """The build of a made source, which is made only if the build is needed; a source in
    DISCARDED_ONCE_BUILT is removed after it."""
    model_dir = builds.model_dir(partial(sources.path, source), name, quantization, targets)
    if source in DISCARDED_ONCE_BUILT:
        sources.discard(source)
    return model_dir


def build_ahead(dist: Path, sources_folder: Path, rows: list[list[str]]) -> None:
    builds, sources = SessionBuilds(dist), SessionSources(sources_folder)
    for source, name, quantization in rows:
        targets = list(BUILT_TOGETHER.get(f"{name}-{quantization}", ("cpu",)))
        try:
            built_from_made_source(builds, sources, source, name, quantization, targets)
        except Exception:  # the test that asks for it builds it again, and fails with the error
            traceback.print_exc()


if __name__ == "__main__":
    follow_the_build(os.getppid())  # ends with the test session
    build_ahead(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
