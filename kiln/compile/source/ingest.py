"""Ingest: read a model source into a `SourceModel`, the first stage of a build.

A source is one of
- a Hugging Face model folder: config.json, weights as model*.safetensors or
  pytorch_model*.bin (each optionally with its index), tokenizer files;
- a Hugging Face hub id ("org/name"): downloaded with `huggingface_hub` (which honours
  HF_ENDPOINT, HF_HUB_OFFLINE and the Hugging Face cache), then read as a folder;
- a GGUF file: read by kiln/compile/source/gguf_source.py, its tokenizer rebuilt into `work_dir`.

Every file read must lie inside the source's folder (a hub download: inside its repository's
folder in the Hugging Face cache, whose snapshots link into `blobs/`): git, zip and tar keep
symlinks, and a link out would carry a local file (a token, a key) into the compiled output.

Whatever the source, the result looks the same: a Hugging Face-style config, tensors under
Hugging Face names as float32 numpy arrays in Hugging Face layout, and a tokenizer folder.
Everything that can be checked cheaply (config, tokenizer, weight file headers) is checked
here, so a bad source fails before any long work.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError
from packaging.version import InvalidVersion, Version
from tqdm import tqdm

from kiln.chat_template import ChatTemplate
from kiln.compile.source.gguf_source import GGUFModel, model_name_from_gguf_path
from kiln.compile.source.containment import check_contained, contained_file, source_root
from kiln.compile.source.sentence_transformers import SIDE_FILES as SENTENCE_FILES, read_sentence_modules
from kiln.errors import KilnError, one_line
from kiln.models import SentenceEmbedding
from kiln.text import load_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# torch.load(weights_only=True) runs code from a crafted pickle before 2.10 (CVE-2025-32434 up to
# 2.5.1, CVE-2026-24747 up to 2.9).
SAFE_UNPICKLING_TORCH = Version("2.10")


@dataclass(frozen=True)
class IngestOptions:
    revision: str | None = None  # the hub commit, branch or tag to download (default: main)
    allow_pickle: bool = False  # read pytorch_model*.bin even with a torch older than 2.10
    hash_source: bool = True  # false: `source_hash` is "" (a compile process reading the source again)


class TensorReader(Protocol):
    def names(self) -> list[str]: ...

    def load(self, name: str) -> np.ndarray: ...


@dataclass
class SourceModel:
    """A model as read from its source, before any conversion."""

    name: str  # the default model id: folder name, hub name, or GGUF file stem without its quantization
    path: Path  # the file or folder that was read
    config: dict  # Hugging Face config.json content; always has "model_type"
    tokenizer_dir: Path  # tokenizer.json and/or tokenizer.model, tokenizer_config.json, ...
    source_hash: str  # see `hash_source_files`
    tensors: TensorReader = field(repr=False)
    revision: str | None = None  # the commit a hub download was made from
    # How a sentence-transformers checkpoint pools its hidden states into an embedding (modules.json).
    sentence_embedding: SentenceEmbedding | None = None

    def tensor_names(self) -> list[str]:
        return self.tensors.names()

    def load_tensor(self, name: str) -> np.ndarray:
        """float32, Hugging Face layout ([out, in] for a Linear)."""
        return self.tensors.load(name)


# ---- safetensors -----------------------------------------------------------------------------

SAFETENSORS_ITEM_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
SAFETENSORS_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    offset: int  # from the start of the file
    dtype: str
    shape: tuple[int, ...]


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys each appear once (json.loads would keep the last of a repeated key)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"{repeated!r} appears twice")
    return dict(pairs)


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_json(path: Path) -> tuple[dict, int]:
    """The header of a safetensors file (a JSON object) and where its data starts."""
    file_size = path.stat().st_size
    if file_size < 8:
        raise KilnError(f"truncated safetensors file: {file_size} bytes", path)
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        if header_size > file_size - 8:
            raise KilnError(f"truncated or corrupt safetensors file: a {header_size}-byte header does not fit", path)
        try:
            header = json.loads(file.read(header_size), object_pairs_hook=unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise KilnError(f"corrupt safetensors header ({one_line(error)})", path) from None
    if not isinstance(header, dict):
        raise KilnError("corrupt safetensors header (not a JSON object)", path)
    return header, 8 + header_size


def stored_tensor(path: Path, name: str, entry, data_start: int) -> tuple[StoredTensor, int]:
    """One header entry, checked: a known dtype, a shape and data offsets that agree, inside the file.
    Returns the tensor and the end of its data."""
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_ITEM_SIZES:
        raise KilnError(
            f"corrupt safetensors header entry for {name}: no known dtype ({', '.join(SAFETENSORS_ITEM_SIZES)})", path
        )
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(map(is_count, shape)):
        raise KilnError(f"corrupt safetensors header entry for {name}: shape {shape!r} is not a list of sizes", path)
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets)) and offsets[0] <= offsets[1]
    ):
        raise KilnError(
            f"corrupt safetensors header entry for {name}: data_offsets {offsets!r} are not [begin, end]", path
        )
    (begin, end), dtype = offsets, entry["dtype"]
    expected_size = math.prod(shape) * SAFETENSORS_ITEM_SIZES[dtype]
    if end - begin != expected_size:
        raise KilnError(f"tensor {name} takes {end - begin} bytes, its shape and dtype need {expected_size}", path)
    file_size = path.stat().st_size
    if data_start + end > file_size:
        raise KilnError(
            f"truncated safetensors file: tensor {name} ends at byte {data_start + end}, the file has {file_size}", path
        )
    return StoredTensor(path, data_start + begin, dtype, tuple(shape)), data_start + end


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, checked to lie inside the file, apart from each other."""
    header, data_start = read_safetensors_json(path)
    tensors, ends = {}, {}
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name], ends[name] = stored_tensor(path, name, entry, data_start)
    by_offset = sorted(tensors, key=lambda name: tensors[name].offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if ends[before] > tensors[after].offset:
            raise KilnError(f"corrupt safetensors header: tensors {before} and {after} overlap", path)
    return tensors


class SafetensorsTensors:
    def __init__(self, files: list[Path]):
        self._tensors = {}
        for file in files:
            for name, tensor in read_safetensors_header(file).items():
                if name in self._tensors:
                    raise KilnError(f"tensor {name} is also in {self._tensors[name].file.name}", file)
                self._tensors[name] = tensor

    def names(self) -> list[str]:
        return list(self._tensors)

    def load(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        count = math.prod(tensor.shape)
        if tensor.dtype == "BF16":
            values = read_bfloat16(tensor.file, tensor.offset, count)
        elif tensor.dtype in SAFETENSORS_FLOATS:
            raw = np.fromfile(tensor.file, dtype=SAFETENSORS_FLOATS[tensor.dtype], count=count, offset=tensor.offset)
            values = raw.astype(np.float32)
        else:
            raise KilnError(f"tensor {name} has dtype {tensor.dtype}; Kiln reads F64, F32, F16 and BF16", tensor.file)
        return values.reshape(tensor.shape)


BFLOAT16_CHUNK = 1 << 22  # values read at a time (8 MB)


def read_bfloat16(path: Path, offset: int, count: int) -> np.ndarray:
    """`count` bfloat16 values at `offset` as float32 (bfloat16 is the upper half of a float32), read
    in chunks into the result: the whole tensor is never held twice (a 4.7 GB table would take 14 GB)."""
    values = np.empty(count, np.float32)
    bits = values.view(np.uint32)
    with open(path, "rb") as file:
        for start in range(0, count, BFLOAT16_CHUNK):
            file.seek(offset + 2 * start)
            upper = np.fromfile(file, dtype="<u2", count=min(BFLOAT16_CHUNK, count - start))
            chunk = bits[start : start + len(upper)]
            chunk[:] = upper
            chunk <<= 16
    return values


# ---- PyTorch checkpoints ---------------------------------------------------------------------


def torch_unpickles_safely(torch_version: str) -> bool:
    """Whether this torch's `torch.load(weights_only=True)` has the fixes for loading a hostile
    pickle (a pre-release of 2.10 counts as older)."""
    try:
        return Version(torch_version) >= SAFE_UNPICKLING_TORCH
    except InvalidVersion:
        return False


def refuse_unsafe_pickle(path: Path | str, options: IngestOptions) -> None:
    """pytorch_model*.bin is a pickle: only with a torch that loads one safely, or --allow-pickle."""
    if options.allow_pickle:
        return
    try:
        import torch
    except ImportError:
        return  # PyTorchTensors says torch is needed
    if not torch_unpickles_safely(torch.__version__):
        raise KilnError(
            f"PyTorch weights (pytorch_model*.bin) are a pickle, and torch {torch.__version__} can run code "
            f"from a crafted one (CVE-2025-32434, CVE-2026-24747): install torch>={SAFE_UNPICKLING_TORCH}, "
            "convert the weights to safetensors, or pass --allow-pickle for a file you trust",
            path,
        )


class PyTorchTensors:
    def __init__(self, files: list[Path]):
        try:
            import torch  # optional: only old checkpoints need it
        except ImportError as error:
            raise KilnError("reading PyTorch weights needs torch (pip install torch)", files[0]) from error
        self._float32 = torch.float32
        self._tensors = {}
        for file in files:
            try:
                self._tensors.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
            except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as error:
                raise KilnError(f"cannot read PyTorch weights ({error})", file) from error

    def names(self) -> list[str]:
        return list(self._tensors)

    def load(self, name: str) -> np.ndarray:
        return self._tensors[name].to(self._float32).numpy()


# ---- Hugging Face folders --------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    index: str  # maps tensor names to shard files, when the weights are sharded
    shards: str  # glob for the weight files when there is no index
    reader: Callable[[list[Path]], TensorReader]
    pickled: bool = False  # read by unpickling (see `refuse_unsafe_pickle`)

    def shard_files(self, folder: Path) -> list[Path]:
        index_path = folder / self.index
        if not index_path.is_file():
            return sorted(folder.glob(self.shards))
        try:
            shard_names = sorted(set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise KilnError(f"malformed weight index ({one_line(repr(error))})", index_path) from error
        for shard_name in shard_names:
            if Path(shard_name).name != shard_name or shard_name in ("", ".", ".."):
                raise KilnError(f"the index lists {shard_name!r}, which is not a file name in its folder", index_path)
        shard_files = [folder / shard_name for shard_name in shard_names]
        for shard_file in shard_files:
            if not shard_file.is_file():
                raise KilnError(f"the index lists {shard_file.name}, which is missing", index_path)
        return shard_files


WEIGHT_FORMATS = (
    WeightFormat("model.safetensors.index.json", "model*.safetensors", SafetensorsTensors),
    WeightFormat("pytorch_model.bin.index.json", "pytorch_model*.bin", PyTorchTensors, pickled=True),
)


def read_config(path: Path) -> dict:
    if not path.is_file():
        raise KilnError("missing config.json", path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise KilnError(f"malformed JSON ({one_line(error)})", path) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise KilnError("no model_type", path)
    return config


FOLDER_FILES = (
    "config.json",
    *TOKENIZER_FILES,
    *TOKENIZER_SIDE_FILES,
    *(weight_format.index for weight_format in WEIGHT_FORMATS),
)


def folder_weights(folder: Path, options: IngestOptions, root: Path) -> tuple[TensorReader, list[Path]]:
    """A folder's weights (safetensors first) and the files they are read from, index included, each
    inside the source's `root`."""
    check_contained(folder, tuple(weight_format.index for weight_format in WEIGHT_FORMATS), root)
    for weight_format in WEIGHT_FORMATS:
        if shard_files := weight_format.shard_files(folder):
            break
    else:
        raise KilnError("no weights (model*.safetensors or pytorch_model*.bin)", folder)
    check_contained(folder, tuple(shard.name for shard in shard_files), root)
    if weight_format.pickled:
        refuse_unsafe_pickle(shard_files[0], options)
    index_files = [folder / weight_format.index] if (folder / weight_format.index).is_file() else []
    return weight_format.reader(shard_files), [*index_files, *shard_files]


@dataclass(frozen=True)
class JoinedTensors:
    """A checkpoint's transformer tensors, and each further module's under a prefix of its own (a
    sentence-transformers Dense module's "linear.weight" as "dense.0.linear.weight")."""

    main: TensorReader
    modules: dict[str, TensorReader]

    def names(self) -> list[str]:
        added = [prefix + name for prefix, reader in self.modules.items() for name in reader.names()]
        return [*self.main.names(), *added]

    def load(self, name: str) -> np.ndarray:
        prefix = next((prefix for prefix in self.modules if name.startswith(prefix)), None)
        return self.main.load(name) if prefix is None else self.modules[prefix].load(name.removeprefix(prefix))


def read_hf_folder(folder: Path, options: IngestOptions, name: str | None = None) -> SourceModel:
    check_contained(folder, FOLDER_FILES)
    config_path = folder / "config.json"
    config = read_config(config_path)
    if not (folder / "tokenizer.json").is_file():
        if (folder / "tokenizer.model").is_file():
            raise KilnError(
                "a SentencePiece model without tokenizer.json, which Kiln needs: write it with "
                "transformers (AutoTokenizer.from_pretrained(folder).save_pretrained(folder))",
                folder / "tokenizer.model",
            )
        raise KilnError("no tokenizer (tokenizer.json)", folder)
    check_tokenizer(folder)
    tokenizer_files = [
        folder / file_name for file_name in TOKENIZER_FILES + TOKENIZER_SIDE_FILES if (folder / file_name).is_file()
    ]
    tensors, weight_files = folder_weights(folder, options, source_root(folder))
    sentence_embedding, sentence_files = None, []
    if sentence := read_sentence_modules(folder):
        sentence_embedding, sentence_files = sentence.embedding, sentence.files
        dense = [folder_weights(dense, options, source_root(folder)) for dense in sentence.dense_folders]
        tensors = JoinedTensors(tensors, {f"dense.{i}.": reader for i, (reader, _) in enumerate(dense)})
        weight_files += [path for _, files in dense for path in files]
    read_files = [config_path, *tokenizer_files, *sentence_files, *weight_files]
    return SourceModel(
        name=name or folder.name,
        path=folder,
        config=config,
        tokenizer_dir=folder,
        source_hash=hash_source_files(folder, read_files) if options.hash_source else "",
        tensors=tensors,
        sentence_embedding=sentence_embedding,
    )


def check_tokenizer(folder: Path) -> None:
    """What later stages read of the tokenizer folder: tokenizer.json, the special tokens and the
    chat template (parsed here, rendered when the conv_template is derived)."""
    load_tokenizer(folder)
    if chat_template := ChatTemplate.find(folder):
        chat_template.compiled()


# ---- hub ids ---------------------------------------------------------------------------------


def names_a_local_path(source: str) -> bool:
    """Whether the source is a local path: it exists, or its first part does (a mistyped
    models/foo beside a models/ folder must not reach the hub)."""
    return Path(source).exists() or Path(source.split("/", 1)[0]).exists()


def looks_like_hub_id(source: str) -> bool:
    """org/name with one slash, not starting with ./ or /, whose org is no local file or folder."""
    return HUB_ID.fullmatch(source) is not None and not names_a_local_path(source)


def read_hub_model(repo_id: str, work_dir: Path, options: IngestOptions) -> SourceModel:
    """Download only what a build reads; safetensors first, PyTorch weights only when a repo has no
    safetensors (and `refuse_unsafe_pickle` allows them)."""
    sentence_modules = ["*_Pooling/config.json", "*_Dense/*"]
    wanted = ["config.json", *TOKENIZER_FILES, *TOKENIZER_SIDE_FILES, *SENTENCE_FILES, *sentence_modules]
    try:
        for weight_format in WEIGHT_FORMATS:
            if weight_format.pickled:
                refuse_unsafe_pickle(repo_id, options)
            patterns = [*wanted, weight_format.index, weight_format.shards]
            folder = Path(snapshot_download(repo_id, revision=options.revision, allow_patterns=patterns))
            if any(folder.glob(weight_format.shards)):
                break
    except (OSError, HFValidationError) as error:  # the hub's HTTP and cache errors are OSErrors
        first_line = next(iter(str(error).strip().splitlines()), type(error).__name__)
        raise KilnError(f"cannot get it from the Hugging Face hub: {first_line}", repo_id) from error
    model = read_hf_folder(folder, options, name=repo_id.split("/")[1])
    model.revision = folder.name  # a snapshot's folder is named by its commit
    return model


# ---- GGUF files ------------------------------------------------------------------------------


def is_gguf_file(source: str) -> bool:
    return Path(source).is_file() and Path(source).suffix.lower() == ".gguf"


def read_gguf_file(source: str, work_dir: Path, options: IngestOptions) -> SourceModel:
    path = Path(source)
    contained_file(path, source_root(path.parent))
    model = GGUFModel(path)
    tokenizer_dir = work_dir / "tokenizer"
    model.write_tokenizer_files(tokenizer_dir)
    check_tokenizer(tokenizer_dir)
    return SourceModel(
        name=model_name_from_gguf_path(path),
        path=path,
        config=model.config,
        tokenizer_dir=tokenizer_dir,
        source_hash=hash_source_files(path.parent, [path]) if options.hash_source else "",
        tensors=model,
    )


# ---- provenance ------------------------------------------------------------------------------


def hash_source_files(root: Path, files: list[Path]) -> str:
    """sha256 of a `sha256sum`-style manifest of the files ("<sha256>  <path relative to root>"
    lines, sorted by path): `cd ROOT && sha256sum FILES | sha256sum` gives the same."""
    files = sorted(files, key=lambda file: file.relative_to(root).as_posix())
    total_bytes = sum(file.stat().st_size for file in files)
    manifest = []
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="hashing source", leave=False, disable=None) as bar:
        for file in files:
            digest = hashlib.sha256()
            with open(file, "rb") as stream:
                while chunk := stream.read(1 << 24):
                    digest.update(chunk)
                    bar.update(len(chunk))
            manifest.append(f"{digest.hexdigest()}  {file.relative_to(root).as_posix()}\n")
    return hashlib.sha256("".join(manifest).encode()).hexdigest()


# ---- entry point -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceKind:
    matches: Callable[[str], bool]
    read: Callable[[str, Path, IngestOptions], SourceModel]
    downloaded: bool = False  # a `--revision` applies to it


SOURCE_KINDS: dict[str, SourceKind] = {
    "Hugging Face folder": SourceKind(
        lambda source: Path(source).is_dir(),
        lambda source, _work_dir, options: read_hf_folder(Path(source), options),
    ),
    "GGUF file": SourceKind(is_gguf_file, read_gguf_file),
    "Hugging Face hub id": SourceKind(looks_like_hub_id, read_hub_model, downloaded=True),
}


def ingest(source: str | Path, work_dir: Path, options: IngestOptions = IngestOptions()) -> SourceModel:
    """Read `source` (a folder, a .gguf file or a hub id); `work_dir` holds files made on the way."""
    source = str(source)
    for kind_name, kind in SOURCE_KINDS.items():
        if kind.matches(source):
            if options.revision is not None and not kind.downloaded:
                raise KilnError(f"--revision pins a hub download, and this is a {kind_name}", source)
            return kind.read(source, Path(work_dir), options)
    if Path(source).exists():
        raise KilnError(f"not a model source (expected one of: {', '.join(SOURCE_KINDS)})", source)
    if HUB_ID.fullmatch(source):
        local_folder = source.split("/", 1)[0]
        raise KilnError(f"no such file or folder (not a hub id: {local_folder} is a local path here)", source)
    raise KilnError("no such file or folder", source)
