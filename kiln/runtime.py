"""A compiled model on the TVM runtime: load a model folder, run prefill and decode steps.

This is the thin layer over the Relax VM (one sequence, TVM's paged KV cache). The engine builds
generation, sampling and chat on top of it; parity checks use it directly.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor, wait
from itertools import groupby
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import psutil
import tvm
from tvm import relax
from tvm.runtime import ShapeTuple

import kiln
from kiln.errors import KilnError, one_line
from kiln.model_folder import read_json
from kiln.model_memory import PAGE_SIZE, RECURRENT_HISTORY, RECURRENT_SNAPSHOTS
from kiln.targets import NATIVE_TARGETS, TARGETS
from kiln.tensor_cache import records, verify_shards

SEQUENCE_ID = 0
# LLVM's CPU features that are instructions (x86 and ARM); the rest ("slow-lea", "prefer-256-bit",
# …) only tune code generation and are no requirement.
INSTRUCTION_SET = re.compile(
    r"(mmx|sse|ssse|avx|amx|fma|f16c|bmi|popcnt|lzcnt|movbe|aes|pclmul|vpclmul|gfni|sha|"
    r"cx16|neon|sve|fullfp16|fp16|dotprod|i8mm|bf16|crc)"
)


def default_cpu_threads() -> int:
    """The physical cores this process may run on. (TVM's own default takes half the logical CPUs,
    assuming two hardware threads per core: one thread on a 2-core machine, which decodes at 0.6×.)"""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable, psutil.cpu_count(logical=False) or usable))


# TVM gives each thread that runs a parallel kernel (or asks for the thread count) a thread pool of
# its own, which it never releases, and the server answers each request on a new thread: so every
# kernel runs on one long-lived thread of the process, with one pool.
_compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-compute")


def on_compute_thread(function, *args):
    """`function(*args)` on the compute thread. An interrupt (Ctrl-C) waits for it to finish first,
    as it would in the calling thread: a step stopped halfway would leave the KV cache undefined."""
    future = _compute.submit(function, *args)
    try:
        return future.result()
    except BaseException:
        wait([future])
        raise


def set_cpu_threads(threads: int | None = None) -> int:
    """How many threads the cpu library's kernels run on: `threads`, else TVM_NUM_THREADS if set,
    else `default_cpu_threads`. TVM makes its thread pool once, here if not before (a later call
    changes nothing). Returns the pool's thread count."""
    if threads is not None:
        if threads < 1:
            raise KilnError(f"the thread count must be at least 1, got {threads}")
        os.environ["TVM_NUM_THREADS"] = str(threads)
    os.environ.setdefault("TVM_NUM_THREADS", str(default_cpu_threads()))
    return int(on_compute_thread(tvm.get_global_func("runtime.NumThreads")))


def version_series(version: str | None) -> str | None:
    """major.minor of a version ("0.27" of "0.27.0.post1")."""
    return ".".join(version.split(".")[:2]) if isinstance(version, str) else None


def check_build_versions(build: dict, model_dir: Path) -> None:
    """Refuse a build of another Kiln major.minor (its files may mean something else) or of another
    TVM (its library was compiled against that TVM runtime). Every build record Kiln writes holds
    both versions, so a record without them is refused too. web/src/loader.js applies the same rule."""
    built_kiln, built_tvm = build.get("kiln_version"), build.get("versions", {}).get("tvm")
    if version_series(built_kiln) != version_series(kiln.__version__) or built_tvm != tvm.__version__:
        raise KilnError(
            f"built by Kiln {built_kiln or '(not recorded)'} with TVM {built_tvm or '(not recorded)'}, "
            f"but this is Kiln {kiln.__version__} with TVM {tvm.__version__}, which runs builds of Kiln "
            f"{version_series(kiln.__version__)}.x made with its TVM: rebuild the model with this "
            "kiln compile",
            model_dir,
        )


# Which of a cpu library's variants the native engine loads: unset, the first this machine's CPU
# runs (else the portable library); "portable", the portable one; a variant's name, that one.
CPU_VARIANT_ENV = "KILN_CPU_VARIANT"


def library_path(model_dir: Path, target: str) -> Path:
    build = read_json(model_dir / "kiln-build.json")
    check_build_versions(build, model_dir)
    entry = build.get("targets", {}).get(target)
    if entry is None or not (model_dir / entry["library"]).is_file():
        built = ", ".join(build.get("targets", {})) or "none"
        raise KilnError(
            f"no {target} library in this model folder (built for: {built}); "
            f"build it with: kiln compile {build.get('source', 'SOURCE')} "
            f"--quantization {build.get('quantization', 'Q')} --target {target}",
            model_dir,
        )
    if missing := missing_cpu_features(entry.get("mcpu")):
        raise KilnError(
            f"the {target} library was built for the {entry['mcpu']} CPU and this machine's lacks "
            f"{', '.join(missing)}; rebuild it with --cpu-tuning legacy (any x86-64) "
            "or host (this machine)",
            model_dir,
        )
    _, chosen = cpu_variant(entry, model_dir)
    return model_dir / chosen["library"]


def cpu_variant(entry: dict, model_dir: Path) -> tuple[str, dict]:
    """Which of a target's libraries to load: the name of a variant (its record's `variants`) and its
    record, or "portable" and the target's own record."""
    variants = entry.get("variants", {})
    wanted = os.environ.get(CPU_VARIANT_ENV)
    if wanted is None:
        runnable = (item for item in variants.items() if not missing_cpu_features(item[1]["mcpu"], item[1]["features"]))
        return next(runnable, ("portable", entry))
    if wanted == "portable":
        return wanted, entry
    if wanted not in variants:
        raise KilnError(
            f"{CPU_VARIANT_ENV}={wanted}: this library has no such variant "
            f"(it has: {', '.join(['portable', *variants])})",
            model_dir,
        )
    if missing := missing_cpu_features(variants[wanted]["mcpu"], variants[wanted]["features"]):
        raise KilnError(f"{CPU_VARIANT_ENV}={wanted}: this machine's CPU lacks {', '.join(missing)}", model_dir)
    return wanted, variants[wanted]


def missing_cpu_features(mcpu: str | None, features: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The instruction-set features a library built for `mcpu` (and `features`, LLVM's names) needs and
    this machine's CPU lacks (running it would end in an illegal instruction)."""
    if mcpu is None:
        return []

    def instruction_sets(cpu: str, added: tuple[str, ...] | list[str] = ()) -> set[str]:
        target = {"kind": "llvm", "mcpu": cpu, "mattr": [f"+{feature}" for feature in added]}
        features = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target(target))
        return {str(feature) for feature in features if INSTRUCTION_SET.match(str(feature))}

    return sorted(instruction_sets(mcpu, features) - instruction_sets(tvm.target.codegen.llvm_get_system_cpu()))


def reusable_prefix(cached: list[int], wanted: list[int]) -> int:
    """How many of `wanted`'s first tokens a cache holding `cached` can keep: their common prefix,
    short of `wanted`'s last token, which must run to give logits."""
    common = 0
    for held, token in zip(cached, wanted[:-1]):
        if held != token:
            break
        common += 1
    return common


MADV_HUGEPAGE = 14  # Linux's madvise(2) advice
HUGE_PAGE = 2 << 20
TENSOR_ALIGNMENT = 64  # what TVM's kernels (and its from_dlpack) ask of a tensor's data


def aligned(nbytes: int) -> int:
    return -(-nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


class HostWeights:
    """A CPU library's weights in one block of memory that starts on a 2 MiB boundary and asks Linux
    for transparent huge pages before its first write (the kernel picks a page at the first write).
    Decoding reads every weight once a token, and TVM's allocator gave each tensor small pages of its
    own: the Q4_K_M mix at Qwen2.5-0.5B's config decoded at 30–32 / 48 tokens/s (1 / 2 threads, a
    2-core EPYC VM) from them. Advising each tensor alone got 35–38 / 59–60, but only its whole 2 MiB
    pages could be huge, which left the 1–2 MiB matrices and the heap-served ones on small pages;
    one block leaves none. Where Linux gives no huge pages (THP off, another system), the block is
    plain memory."""

    def __init__(self, sizes: Iterable[int]):
        total = sum(aligned(n) for n in sizes)
        spare = np.empty(total + HUGE_PAGE, np.uint8)
        start = -spare.ctypes.data % HUGE_PAGE
        self.block = spare[start : start + total]
        if sys.platform == "linux" and total:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(self.block.ctypes.data), ctypes.c_size_t(total), MADV_HUGEPAGE)
        self.used = 0

    def tensor(self, array: np.ndarray) -> tvm.runtime.Tensor:
        """`array` copied into the block's next free bytes, as a tensor that holds the block."""
        place = self.block[self.used : self.used + array.nbytes].view(array.dtype).reshape(array.shape)
        place[...] = array
        self.used += aligned(array.nbytes)
        return tvm.runtime.from_dlpack(place)


def weight_placer(device: tvm.runtime.Device, sizes: list[int]) -> Callable[[np.ndarray], tvm.runtime.Tensor]:
    """How weights of these sizes go on the device: into one HostWeights block where the device is
    this machine's memory, one allocation each elsewhere."""
    if device.dlpack_device_type() == tvm.cpu().dlpack_device_type():
        return HostWeights(sizes).tensor
    return lambda array: tvm.runtime.tensor(array, device)


def load_params(model_dir: Path, device: tvm.runtime.Device, names: list[str]) -> list[tvm.runtime.Tensor]:
    """A library's parameters on the device (weight_placer), md5-checked, read one shard at a time (so
    the peak memory is the weights plus one shard, not twice the weights)."""
    verify_shards(model_dir)
    wanted = set(names)
    chosen = [r for r in records(model_dir) if r.name in wanted]
    missing = wanted - {r.name for r in chosen}
    if missing:
        first = next(name for name in names if name in missing)
        raise KilnError(f"the tensor cache lacks parameter {first!r}", model_dir / "tensor-cache.json")
    place = weight_placer(device, [r.nbytes for r in chosen])
    loaded = {}
    for shard, shard_records in groupby(chosen, key=lambda r: r.shard):
        data = shard.read_bytes()
        for r in shard_records:
            array = np.frombuffer(data, dtype=r.dtype, count=int(np.prod(r.shape)), offset=r.byte_offset)
            loaded[r.name] = place(array.reshape(r.shape))
    return [loaded[name] for name in names]


# What a library of the other kind of model says, by whether the runner wants an embedding model.
WRONG_KIND = {
    True: "a chat model, not an embedding model: run it with kiln chat, kiln generate or /v1/chat/completions",
    False: "an embedding model, not a chat model: run it with kiln embed, /v1/embeddings or engine.embeddings.create",
}


class CompiledLibrary:
    """A model folder's library for `target` in a Relax VM, its `_metadata` and its parameters. A
    subclass runs chat models, or embedding models (`embedding`); the other kind is refused before
    anything is loaded."""

    embedding = False

    def __init__(self, model_dir: Path, target: str):
        set_cpu_threads()
        self.model_dir = Path(model_dir)
        self.chat_config = read_json(self.model_dir / "mlc-chat-config.json")
        if ("embedding" in self.chat_config) != self.embedding:
            raise KilnError(WRONG_KIND[self.embedding], self.model_dir)
        if target not in NATIVE_TARGETS:
            raise KilnError(f"the native engine runs {', '.join(NATIVE_TARGETS)} libraries, not {target!r}")
        self.device = tvm.device(TARGETS[target].device, 0)
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(library_path(self.model_dir, target))), self.device)
        self.metadata = json.loads(str(self.vm["_metadata"]()))
        self.params = load_params(self.model_dir, self.device, [p["name"] for p in self.metadata["params"]])


class NativeModel(CompiledLibrary):
    """One compiled model with one sequence in its KV cache (and, a hybrid model's, in its recurrent
    state: `states` are what the step functions take after the embeddings)."""

    def __init__(self, model_dir: Path, target: str = "cpu"):
        super().__init__(model_dir, target)
        self.context_window_size = int(self.metadata["context_window_size"])
        self.prefill_chunk_size = int(self.metadata["prefill_chunk_size"])
        self.all_logits_chunk_size = int(self.metadata.get("all_logits_chunk_size", self.prefill_chunk_size))
        self.verify_rows = sorted(int(rows) for rows in self.metadata.get("verify_rows", []))
        self.vocab_size = int(self.chat_config["vocab_size"])
        self._kv_builtin = {
            name: tvm.get_global_func(f"vm.builtin.{name}")
            for name in (
                "kv_state_add_sequence",
                "kv_state_remove_sequence",
                "kv_state_begin_forward",
                "kv_state_end_forward",
                "kv_state_popn",
            )
        }
        self.sliding_window_size = int(self.metadata.get("sliding_window_size", -1))
        self.layer_window_size = int(self.metadata.get("layer_sliding_window_size", -1))
        self.layer_window_chunked_prefill = bool(self.metadata.get("layer_window_chunked_prefill", False))
        self.kv_cache = self.vm["create_tir_paged_kv_cache"](
            ShapeTuple([1]),
            ShapeTuple([self.context_window_size]),
            ShapeTuple([self.prefill_chunk_size]),
            ShapeTuple([PAGE_SIZE]),
            ShapeTuple([int(self.sliding_window_size > 0)]),
        )
        self.states = [self.kv_cache]
        self.recurrent = self.metadata.get("kv_state_kind") == "hybrid"
        if self.recurrent:
            self.states.append(self.vm["create_rnn_state"](ShapeTuple([1]), ShapeTuple([RECURRENT_HISTORY])))
        self._add_sequence()

    def _add_sequence(self) -> None:
        for state in self.states:
            self._kv_builtin["kv_state_add_sequence"](state, SEQUENCE_ID)
        if self.sliding_window_size > 0:
            tvm.get_global_func("vm.builtin.attention_kv_cache_enable_sliding_window_for_seq")(
                self.kv_cache, SEQUENCE_ID, self.sliding_window_size, 0
            )
        self.cached_tokens = 0
        self.undoable_steps = 0  # the recurrent state's
        self.snapshots: list[tuple[int, Any]] = []  # the recurrent state's: (cached tokens, copy)

    def reset(self) -> None:
        for state in self.states:
            self._kv_builtin["kv_state_remove_sequence"](state, SEQUENCE_ID)
        self._add_sequence()

    def rollback(self, count: int) -> int:
        """Forget the last `count` cached tokens; returns how many stay cached. Once a sliding
        window has dropped tokens, the ones before it cannot come back: then it forgets them all. A
        recurrent state undoes its last single-token steps; further back, it goes back to its latest
        snapshot at or before the point (the caller prefills the rest again), or else forgets all."""
        lost = self.sliding_window_size > 0 and self.cached_tokens > self.sliding_window_size
        if not count:
            return self.cached_tokens
        if lost:
            self.reset()
        elif not self.recurrent or count <= self.undoable_steps:
            for state in self.states:
                self._kv_builtin["kv_state_popn"](state, SEQUENCE_ID, count)
            self.cached_tokens -= count
            self.undoable_steps -= count
        else:
            on_compute_thread(self._restore_snapshot, self.cached_tokens - count)
        self.snapshots = [(kept, snapshot) for kept, snapshot in self.snapshots if kept <= self.cached_tokens]
        return self.cached_tokens

    def _take_snapshot(self) -> None:
        rnn_state = self.states[1]
        self._kv_builtin["kv_state_begin_forward"](rnn_state, ShapeTuple([SEQUENCE_ID]), ShapeTuple([1]))
        snapshot = self.vm["rnn_state_snapshot"](rnn_state)
        self.snapshots = [*self.snapshots, (self.cached_tokens, snapshot)][-RECURRENT_SNAPSHOTS:]

    def _restore_snapshot(self, point: int) -> None:
        """Back to the latest snapshot at or before `point` cached tokens: the KV cache pops to it, the
        recurrent state takes it as a step's result; with none, the sequence starts over."""
        kept, snapshot = next(((kept, s) for kept, s in reversed(self.snapshots) if kept <= point), (0, None))
        if snapshot is None:
            self.reset()
            return
        self._kv_builtin["kv_state_popn"](self.kv_cache, SEQUENCE_ID, self.cached_tokens - kept)
        rnn_state = self.states[1]
        self._kv_builtin["kv_state_begin_forward"](rnn_state, ShapeTuple([SEQUENCE_ID]), ShapeTuple([1]))
        self.vm["rnn_state_restore"](rnn_state, snapshot)
        self._kv_builtin["kv_state_end_forward"](rnn_state)
        self.cached_tokens, self.undoable_steps = kept, 0

    def speculation_room(self) -> int:
        """How many tokens a speculative pass may put into the cache now: as many as can still be
        rolled back (the context window's room, and under a sliding window only until it drops a
        token; none for a recurrent state, which cannot undo a step of several tokens), and no more
        than the library's longest verify function takes (a longer pass runs prefill's kernels:
        SmolLM2's 5 rows cost 1.8 decode steps a pass in `verify_5`, 13 rows 5.4 in prefill_all_logits)."""
        return min(self.rollback_room(), max(self.verify_rows, default=self.context_window_size))

    def rollback_room(self) -> int:
        """How many tokens may go into the cache now and still be rolled back."""
        if self.recurrent:
            return 0
        room = self.context_window_size - self.cached_tokens
        if self.sliding_window_size > 0:
            room = min(room, self.sliding_window_size - self.cached_tokens)
        return room

    def _chunk_size(self, longest: int | None = None) -> int:
        """Prefill chunk length, at most `longest` (default: the prefill chunk). TVM's sliding-window
        prefill lets every token of a chunk see the whole kept window, and its GPU kernels for
        per-layer windows go wrong once the window drops cached tokens from a chunk's view (Kiln
        fixes the CPU kernel: `_metadata` says which): past a window, tokens go one at a time there
        (exact, but decode-speed)."""
        longest = room = longest or self.prefill_chunk_size
        if self.sliding_window_size > 0:
            room = self.sliding_window_size + 1 - self.cached_tokens
        elif self.layer_window_size > 0 and self.cached_tokens and not self.layer_window_chunked_prefill:
            room = self.layer_window_size - self.cached_tokens
        return max(1, min(longest, room))

    def _chunks(self, token_ids: list[int], longest: int | None = None) -> Iterator[list[int]]:
        start = 0
        while start < len(token_ids):
            chunk = token_ids[start : start + self._chunk_size(longest)]
            start += len(chunk)
            yield chunk

    def _step(self, function: str, token_ids: list[int]) -> np.ndarray:
        return on_compute_thread(self._run_step, function, token_ids)

    def _run_step(self, function: str, token_ids: list[int]) -> np.ndarray:
        ids = tvm.runtime.tensor(np.asarray(token_ids, dtype="int32"), self.device)
        try:
            embeds = self.vm["embed"](ids, self.params)
            embeds = embeds._create_view((1, len(token_ids), embeds.shape[-1]))
            for state in self.states:
                self._kv_builtin["kv_state_begin_forward"](
                    state, ShapeTuple([SEQUENCE_ID]), ShapeTuple([len(token_ids)])
                )
            logits = self.vm[function](embeds, *self.states, self.params)[0]  # then the states, as passed
            for state in self.states:
                self._kv_builtin["kv_state_end_forward"](state)
        except Exception as e:  # a check that failed in TVM's runtime (its errors are Python's builtin types)
            raise KilnError(
                f"the model's {function} step failed in TVM: {one_line(e) or type(e).__name__}", self.model_dir
            ) from e
        self.cached_tokens += len(token_ids)
        self.undoable_steps = min(self.undoable_steps + 1, RECURRENT_HISTORY - 1) if len(token_ids) == 1 else 0
        return logits.numpy()[0]

    def _check_room(self, count: int) -> None:
        if self.cached_tokens + count > self.context_window_size:
            raise KilnError(
                f"{self.cached_tokens + count} tokens exceed the context window of {self.context_window_size}",
                self.model_dir,
            )

    def prefill(self, token_ids: list[int]) -> np.ndarray:
        """Append tokens to the sequence (in chunks); the logits after the last one, [vocab]."""
        if not token_ids:
            raise KilnError("nothing to prefill: the prompt has no tokens")
        self._check_room(len(token_ids))
        for chunk in self._chunks(token_ids):
            logits = self._step("prefill" if len(chunk) > 1 else "decode", chunk)
        if self.recurrent and len(token_ids) > 1:
            on_compute_thread(self._take_snapshot)
        return logits[-1]

    def decode(self, token_id: int) -> np.ndarray:
        self._check_room(1)
        return self._step("decode", [token_id])[-1]

    def all_logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every position, [len(token_ids), vocab] (forced decoding in one pass). As many
        tokens as a verify function takes go through the shortest that does, padded with the last
        token, whose rows are then rolled back."""
        self._check_room(len(token_ids))
        fitting = (rows for rows in self.verify_rows if len(token_ids) <= rows <= self.rollback_room())
        if token_ids and (rows := next(fitting, None)):
            padding = rows - len(token_ids)
            logits = self._step(f"verify_{rows}", token_ids + token_ids[-1:] * padding)
            self.rollback(padding)
            return logits[: len(token_ids)]
        chunks = self._chunks(token_ids, self.all_logits_chunk_size)
        return np.concatenate([self._step("prefill_all_logits", chunk) for chunk in chunks], axis=0)
