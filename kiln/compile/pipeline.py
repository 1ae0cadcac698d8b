"""The build, as a straight line: ingest → quantize → convert → configure → compile → package.

Everything is built in a hidden temporary folder next to the output and renamed into place at
the end, so a failed build leaves no `DIR/<model-id>/` behind (and never damages an existing one).
A rebuild of the same source and quantization for another target reuses the converted weights.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import tvm

import kiln
from kiln.compile.chat_config.configure import write_chat_config, write_embedding_config
from kiln.compile.digests import file_digests
from kiln.compile.library_cache import LibraryCache
from kiln.compile.quantization.convert import convert_weights
from kiln.compile.source.ingest import IngestOptions, SourceModel, ingest, looks_like_hub_id
from kiln.errors import KilnError, one_line
from kiln.model_memory import MemoryNeeds, memory_needs
from kiln.models.embedding import BATCH_BUFFER_BYTES
from kiln.models import (
    EMBEDDER_FAMILIES,
    Architecture,
    DecoderConfig,
    DecoderModel,
    EncoderConfig,
    SentenceEmbedding,
    architecture_for,
)
from kiln.compile.lower.library import (
    check_memory_limits,
    compile_library,
    library_metadata,
    param_specs,
    prepare_toolchains,
    target_metadata,
)
from kiln.compile.quantization import Scheme, quantization_named
from kiln.compile.source.source_weights import SourceWeights
from kiln.compile import side_by_side
from kiln.compile.side_by_side import default_jobs
from kiln.compile.staging import staging_folder, temporary_files_in
from kiln.compile.toolchain.system_lib import llvm_tool_version, static_archive_path, system_lib_prefix
from kiln.targets import CPU_VARIANTS, TargetEntry, cpu_variants_of, target_named

BUILD_RECORD = "kiln-build.json"
WEIGHT_FILES_GLOB = ("tensor-cache.json", "params_shard_*.bin")
STAGED_MODEL_FILES = ("mlc-chat-config.json", "tensor-cache.json")  # what the memory accounting reads
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class BuildRequest:
    source: str
    quantization: str
    targets: list[str]
    output: Path = Path("dist")
    model_id: str | None = None
    context_window_size: int | None = None
    prefill_chunk_size: int | None = None
    cpu_tuning: str = "portable"
    revision: str | None = None  # of a hub id
    allow_pickle: bool = False  # read pytorch_model*.bin with a torch older than 2.10
    jobs: int | None = None  # targets compiled side by side (default: one per core, at most one per target)
    library_cache: Path | None = None  # libraries compiled before, reused (kiln/compile/library_cache.py)
    # An embedding model's shorter lengths it was trained to give (Matryoshka), which requests may ask for.
    matryoshka_dimensions: tuple[int, ...] = ()

    def ingest_options(self) -> IngestOptions:
        return IngestOptions(revision=self.revision, allow_pickle=self.allow_pickle)

    def overrides(self) -> dict[str, int]:
        return {
            k: v
            for k, v in (
                ("context_window_size", self.context_window_size),
                ("prefill_chunk_size", self.prefill_chunk_size),
            )
            if v
        }


@dataclass
class BuildResult:
    model_id: str
    model_dir: Path
    libraries: dict[str, Path]
    timings: dict[str, float] = field(default_factory=dict)
    reused_weights: bool = False


class StageClock:
    """Times each stage and tells the user what is running (builds take minutes)."""

    def __init__(self):
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        """A stage; an exception from outside Kiln (TVM's, a library's) escapes it as a KilnError
        naming the stage, so the CLI prints one line (`--debug` still shows the traceback)."""
        self.started(name)
        start = time.perf_counter()
        with self.failing_as(name):
            yield
        self.finished(name, time.perf_counter() - start)

    def started(self, name: str, aside: str = "") -> None:
        print(f"kiln: {name} …{aside}", file=sys.stderr, flush=True)

    def finished(self, name: str, seconds: float, aside: str = "") -> None:
        self.timings[name] = round(seconds, 3)
        print(f"kiln: {name} done in {seconds:.1f} s{aside}", file=sys.stderr, flush=True)

    @staticmethod
    @contextmanager
    def failing_as(name: str):
        try:
            yield
        except KilnError:
            raise
        except Exception as e:
            named = underlying(e)
            raise KilnError(
                f"the {name} stage failed: {type(named).__name__}: {one_line(named) or 'no message'}"
            ) from e


def underlying(error: BaseException) -> BaseException:
    """The exception to name: TVMScript's parser reports one raised while it parses a kernel (TVM's
    KeyError 'beta_fast' for a YaRN without betas) as a DiagnosticError quoting the kernel's source."""
    if isinstance(error, tvm.error.DiagnosticError) and error.__context__ is not None:
        return underlying(error.__context__)
    return error


CODE_SUFFIXES = {".py", ".cc", ".h"}  # Kiln's Python, and the C++ it compiles into the web runtime


def kiln_code_digest() -> str:
    """sha256 over the Kiln code that shapes a build's files (model families, build stages, the
    tensor cache format): finer than the version number while Kiln is developed."""
    import kiln.compile
    import kiln.models
    import kiln.targets
    import kiln.tensor_cache

    files = [Path(kiln.tensor_cache.__file__), Path(kiln.targets.__file__)]
    for package in (kiln.models, kiln.compile):
        files += sorted(p for p in Path(package.__file__).parent.rglob("*") if p.suffix in CODE_SUFFIXES)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def config_file(source: SourceModel) -> Path:
    return source.path / "config.json" if source.path.is_dir() else source.path


def model_config(
    arch: Architecture, source: SourceModel, overrides: dict[str, int], matryoshka_dimensions: tuple[int, ...]
) -> DecoderConfig | EncoderConfig:
    """The family's config; an embedding model's with its pooling (sentence-transformers' files, else
    mean pooling, sentence-transformers' default for a plain checkpoint)."""
    config = arch.parse_config(source.config, config_file(source), overrides)
    if not isinstance(config, EncoderConfig):
        if source.sentence_embedding or matryoshka_dimensions:
            raise KilnError(
                f"an embedding checkpoint of the {arch.model_type} family: Kiln compiles {arch.model_type} "
                f"models for chat only (embedding models: bert, and the {', '.join(EMBEDDER_FAMILIES)} families)",
                source.path,
            )
        if config.bidirectional:
            raise KilnError(
                "use_bidirectional_attention: an embedding model (its attention runs both ways); compile its "
                "sentence-transformers folder (with modules.json) to embed with it",
                config_file(source),
            )
        return config
    embedding = source.sentence_embedding or SentenceEmbedding()
    config.embedding = replace(embedding, dimensions=tuple(sorted(set(matryoshka_dimensions), reverse=True)))
    if embedding.dense and embedding.dense[0].in_features != config.hidden_size:
        raise KilnError(
            f"the first Dense module takes {embedding.dense[0].in_features} features; the model gives "
            f"{config.hidden_size}",
            source.path,
        )
    for width in matryoshka_dimensions:
        if not 0 < width < config.embedding_width:
            raise KilnError(
                f"--matryoshka-dimensions: {width} is no shorter length of a {config.embedding_width}-wide embedding"
            )
    positions = config.max_position_embeddings
    checkpoint_longest = min(embedding.max_sequence_length or positions, positions)
    if config.max_sequence_length < checkpoint_longest:
        print(
            f"kiln: inputs are cut at {config.max_sequence_length} tokens, not the checkpoint's {checkpoint_longest}: "
            f"a longer one's attention scores or feed-forward activations would pass {BATCH_BUFFER_BYTES >> 20} MiB",
            file=sys.stderr,
        )
    return config


def reusable_build(model_dir: Path, source: SourceModel, request: BuildRequest, code_digest: str) -> dict | None:
    """The previous build record if its weights were made from the same source the same way."""
    try:
        record = json.loads((model_dir / BUILD_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = (
        record.get("source_hash") == source.source_hash
        and record.get("quantization") == request.quantization
        and record.get("overrides") == request.overrides()
        and record.get("kiln_code_digest") == code_digest
    )
    return record if same else None


def carry_over(previous_dir: Path, staging: Path, names: list[str]) -> None:
    """Hard-link (or copy) files of the previous build into the new one. Only files the build
    will not write again: a rewrite through a shared inode would change the previous build too."""
    for name in names:
        for path in previous_dir.glob(name):
            target = staging / path.relative_to(previous_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.stat().st_dev == staging.stat().st_dev:
                os.link(path, target)
            else:
                shutil.copy2(path, target)


def target_files(record: dict) -> list[str]:
    """The files a target's entry in the build record names."""
    variants = [variant["library"] for variant in record.get("variants", {}).values()]
    return [record[key] for key in ("library", "static_library", "kernel_source") if key in record] + variants


def variant_library(library: Path, variant: str) -> Path:
    return library.with_name(f"{library.stem}-{variant}{library.suffix}")


def compile_with_variants(
    model: DecoderModel,
    entry: TargetEntry,
    variants: dict[str, TargetEntry],
    metadata: dict,
    library: Path,
    model_id: str,
    library_cache: LibraryCache | None,
) -> tuple[dict[str, list[int]], bool]:
    """compile_library for `entry`, then for each of its CPU variants (`cpu_variants_of`) beside it;
    whether the library cache had them all."""
    planned, cached = compile_library(model, entry, metadata, library, model_id, library_cache)
    for name, variant in variants.items():
        _, variant_cached = compile_library(
            model, variant, metadata, variant_library(library, name), model_id, library_cache
        )
        cached = cached and variant_cached
    return planned, cached


def public_source_name(source: str) -> str:
    """A hub id as it is; a local file or folder by its name only: the record is served with the
    model, and the user's directories are nobody's business."""
    return source if looks_like_hub_id(source) else Path(source).name


def checked_model_id(model_id: str) -> str:
    if not MODEL_ID.fullmatch(model_id):
        raise KilnError(f"model id {model_id!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
    return model_id


def emscripten_version() -> str:
    from kiln.compile.toolchain.wasm_toolchain import emcc_version

    return emcc_version()


# The tools a build runs besides TVM, each with the targets it runs for and its version.
TOOL_VERSIONS: dict[str, tuple[Callable[[TargetEntry], bool], Callable[[], str]]] = {
    "emscripten": (lambda entry: entry.extension == "wasm", emscripten_version),
    "llvm-ar": (lambda entry: entry.system_lib, lambda: llvm_tool_version("llvm-ar")),
}


def toolchain_versions(entries: list[TargetEntry]) -> dict[str, str]:
    versions = {"kiln": kiln.__version__, "tvm": tvm.__version__, "python": platform.python_version()}
    for tool, (runs_for, version) in TOOL_VERSIONS.items():
        if any(runs_for(entry) for entry in entries):
            versions[tool] = version()
    return versions


def compile_salt(entry: TargetEntry, code_digest: str, versions: dict[str, str]) -> str:
    """What compiles a target's library besides the model: Kiln's code and, of the build's `versions`,
    those of the tools that run for the target."""
    own = {tool: v for tool, v in versions.items() if tool not in TOOL_VERSIONS or TOOL_VERSIONS[tool][0](entry)}
    return json.dumps({"kiln_code": code_digest, "versions": own}, sort_keys=True)


def staged_model_needs(staging: Path, planned_storage: dict[str, list[int]]) -> MemoryNeeds:
    """The memory the model being built takes, run by a library with `planned_storage`."""
    chat_config, tensor_cache = (json.loads((staging / name).read_text()) for name in STAGED_MODEL_FILES)
    return memory_needs(chat_config, tensor_cache, planned_storage)


def quantized_model(
    source: SourceModel, arch: Architecture, config: DecoderConfig, scheme: Scheme
) -> tuple[DecoderModel, SourceWeights, list[str]]:
    """The family's module with the scheme's stored weights, the source they are read from, and
    the names of the float weights they stand for."""
    names = source.tensor_names()
    weights = SourceWeights(source, arch.fused_sources(config), arch.decoder_prefix(names), arch.head_prefix(names))
    model = arch.build(config, scheme.model_dtype)
    float_names = [name for name, _ in model.named_parameters()]
    return scheme.quantize_model(model, weights), weights, float_names


@dataclass(frozen=True)
class TargetCompile:
    """One target's compile, as a compile process runs it (kiln/compile/side_by_side.py)."""

    source: Path  # the file or folder the build read (a hub download's snapshot)
    ingest_options: IngestOptions  # for that file or folder: no revision, no hash
    quantization: str
    overrides: dict[str, int]
    target: str
    cpu_tuning: str
    metadata: dict
    library: Path
    model_id: str
    library_cache: LibraryCache | None
    matryoshka_dimensions: tuple[int, ...]
    # A folder of the build's staging folder for the files the compile makes on the way (the
    # ingested source's, TVM's objects): they go with the build's own, also where the compile
    # process is killed (kiln/compile/staging.py).
    work: Path

    def run(self) -> tuple[dict[str, list[int]], bool, float]:
        """The library's `planned_storage`, whether the library cache had it, and the compile's seconds.
        An exception from outside Kiln becomes a KilnError here, where it still has its context (the
        build gets a pickled copy)."""
        with StageClock.failing_as(f"compile {self.target}"), temporary_files_in(self.work):
            source = ingest(self.source, self.work, self.ingest_options)
            arch = architecture_for(source.config, config_file(source), source.sentence_embedding is not None)
            config = model_config(arch, source, self.overrides, self.matryoshka_dimensions)
            scheme = quantization_named(self.quantization)
            model, _, _ = quantized_model(source, arch, config, scheme)
            start = time.perf_counter()
            entry = target_named(self.target, self.cpu_tuning)
            variants = cpu_variants_of(entry, self.cpu_tuning, scheme.cpu_variants)
            planned, cached = compile_with_variants(
                model, entry, variants, self.metadata, self.library, self.model_id, self.library_cache
            )
        return planned, cached, time.perf_counter() - start


def compiles_side_by_side(
    request: BuildRequest,
    source: SourceModel,
    model: DecoderModel,
    metadata: dict,
    libraries: dict[str, Path],
    model_id: str,
    library_cache: LibraryCache | None,
    clock: StageClock,
    work: Path,
) -> dict[str, Future]:
    """The targets' compiles started in compile processes, when there are two or more and jobs for
    them (none: the build compiles its one target itself, after converting the weights)."""
    jobs = min(request.jobs or default_jobs(len(request.targets)), len(request.targets))
    if jobs < 2:
        return {}
    prepare_toolchains([target_named(name, request.cpu_tuning) for name in request.targets])
    compiles = {}
    for name in request.targets:
        entry = target_named(name, request.cpu_tuning)
        job = TargetCompile(
            source=source.path,
            ingest_options=replace(request.ingest_options(), revision=None, hash_source=False),
            quantization=request.quantization,
            overrides=request.overrides(),
            target=name,
            cpu_tuning=request.cpu_tuning,
            metadata=target_metadata(model, metadata, entry),
            library=libraries[name],
            model_id=model_id,
            library_cache=library_cache,
            matryoshka_dimensions=request.matryoshka_dimensions,
            work=work / f"compile-{name}",
        )
        compiles[name] = side_by_side.submit(jobs, job.run)
    clock.started(f"compile {', '.join(compiles)}", f" ({jobs} side by side, while the build goes on)")
    return compiles


@contextmanager
def cancelled_on_failure(futures):
    """A failing build cancels its side-by-side compiles; one already running ends with its process."""
    try:
        yield
    except BaseException:
        running = [future for future in futures if not future.cancel() and not future.done()]
        if running:
            side_by_side.stop()
        raise


def build(request: BuildRequest) -> BuildResult:
    if request.jobs is not None and request.jobs < 1:
        raise KilnError(f"--jobs must be at least 1, got {request.jobs}")
    quantization = quantization_named(request.quantization)
    entries = [target_named(name, request.cpu_tuning) for name in request.targets]
    variants = {entry.name: cpu_variants_of(entry, request.cpu_tuning, quantization.cpu_variants) for entry in entries}
    code_digest = kiln_code_digest()
    request.output.mkdir(parents=True, exist_ok=True)
    clock = StageClock()
    with staging_folder(request.output, ".kiln-build-") as tmp:
        staging = tmp / "model"
        (staging / "libs").mkdir(parents=True)

        with clock.stage("ingest"):
            source = ingest(request.source, tmp / "work", request.ingest_options())
            arch = architecture_for(source.config, config_file(source), source.sentence_embedding is not None)
            config = model_config(arch, source, request.overrides(), request.matryoshka_dimensions)

        with clock.stage("quantize"):
            model, weights, float_names = quantized_model(source, arch, config, quantization)
            params = param_specs(model)

        model_id = checked_model_id(request.model_id or f"{source.name}-{quantization.name}")
        model_dir = request.output / model_id
        metadata = library_metadata(model, quantization.name, params)
        libraries = {entry.name: staging / "libs" / f"{model_id}-{entry.name}.{entry.extension}" for entry in entries}
        versions = toolchain_versions(entries)
        library_cache = (
            LibraryCache(
                request.library_cache, {entry.name: compile_salt(entry, code_digest, versions) for entry in entries}
            )
            if request.library_cache
            else None
        )
        compiles = compiles_side_by_side(
            request, source, model, metadata, libraries, model_id, library_cache, clock, tmp / "work"
        )
        with cancelled_on_failure(compiles.values()):
            previous = reusable_build(model_dir, source, request, code_digest)
            kept_targets = {
                name: target
                for name, target in (previous or {}).get("targets", {}).items()
                if name not in request.targets
            }
            if previous:
                kept_files = [f for t in kept_targets.values() for f in target_files(t)]
                carry_over(model_dir, staging, [*WEIGHT_FILES_GLOB, *kept_files])
            else:
                with clock.stage("convert"):
                    convert_weights(weights, arch, quantization, float_names, params, staging)
            with clock.stage("configure"):
                write_config = write_embedding_config if isinstance(config, EncoderConfig) else write_chat_config
                write_config(staging, source.tokenizer_dir, arch.model_type, quantization.name, config)

            planned, cached = {}, set()
            for entry in entries:
                stage = f"compile {entry.name}"
                if entry.name in compiles:
                    with clock.failing_as(stage):
                        planned[entry.name], from_cache, seconds = compiles[entry.name].result()
                else:
                    clock.started(stage)
                    start = time.perf_counter()
                    with clock.failing_as(stage):
                        metadata_for_target = target_metadata(model, metadata, entry)
                        planned[entry.name], from_cache = compile_with_variants(
                            model,
                            entry,
                            variants[entry.name],
                            metadata_for_target,
                            libraries[entry.name],
                            model_id,
                            library_cache,
                        )
                    seconds = time.perf_counter() - start
                if from_cache:
                    cached.add(entry.name)
                clock.finished(stage, seconds, " (from the library cache)" if from_cache else "")
                check_memory_limits(entry, staged_model_needs(staging, planned[entry.name]))

        built_targets = dict(kept_targets)
        for entry in entries:
            built_targets[entry.name] = {
                "library": f"libs/{libraries[entry.name].name}",
                "seconds": clock.timings[f"compile {entry.name}"],
                # the storage blocks each function's memory plan allocates (kiln/model_memory.py)
                "planned_storage": planned[entry.name],
            }
            if entry.name in cached:
                built_targets[entry.name]["from_library_cache"] = True
            if entry.tunes_cpu:
                built_targets[entry.name] |= {"mcpu": entry.tvm_target()["mcpu"], "cpu_tuning": request.cpu_tuning}
            if variants[entry.name]:
                # the native engine's choice among them: kiln/runtime.py's library_path
                built_targets[entry.name]["variants"] = {
                    name: {
                        "library": f"libs/{variant_library(libraries[entry.name], name).name}",
                        "mcpu": CPU_VARIANTS[name].mcpu,
                        "features": list(CPU_VARIANTS[name].features),
                    }
                    for name in variants[entry.name]
                }
            if entry.system_lib:
                built_targets[entry.name] |= {
                    "static_library": f"libs/{static_archive_path(libraries[entry.name]).name}",
                    "system_lib_prefix": system_lib_prefix(model_id),
                }
            if entry.kernel_source:
                kernel_source = entry.kernel_source_path(libraries[entry.name])
                built_targets[entry.name]["kernel_source"] = f"libs/{kernel_source.name}"
        record = {
            "model_id": model_id,
            "source": public_source_name(request.source),
            "source_hash": source.source_hash,
            **({"source_revision": source.revision} if source.revision else {}),
            "model_type": arch.model_type,
            # "embedding" (kiln embed, /v1/embeddings, engine.embeddings.create), else "chat"
            "kind": "embedding" if isinstance(config, EncoderConfig) else "chat",
            "quantization": quantization.name,
            "overrides": request.overrides(),
            "targets": built_targets,
            # the tools of the libraries kept from the previous build too
            "versions": {**(previous or {}).get("versions", {}), **versions},
            "kiln_version": kiln.__version__,
            "kiln_code_digest": code_digest,
            "timings": clock.timings,
            "reused_weights": bool(previous),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        record["files"] = file_digests(staging)  # last: every file but the record itself
        (staging / BUILD_RECORD).write_text(json.dumps(record, indent=2))

        if model_dir.exists():
            model_dir.rename(tmp / "previous")
        staging.rename(model_dir)

    return BuildResult(
        model_id,
        model_dir,
        {t: model_dir / "libs" / p.name for t, p in libraries.items()},
        clock.timings,
        bool(previous),
    )
