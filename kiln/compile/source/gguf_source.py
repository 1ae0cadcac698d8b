"""A GGUF file (llama.cpp's format) read as a Hugging Face model.

A GGUF holds the weights (often quantized), the architecture's hyperparameters and the
tokenizer as metadata. With the `GGUFMapping` of the model family that names the architecture
(models/<family>.py), `GGUFModel` turns them into what Kiln expects from every source: a
config.json-like dict, float32 tensors under Hugging Face names in Hugging Face layout, and
(`write_tokenizer_files`) a folder with tokenizer.json, tokenizer_config.json,
special_tokens_map.json and generation_config.json built with the `tokenizers` library.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import GenericAlias
from typing import Any, Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kiln.compile.source.gguf_file import GGUFTensor, read_gguf
from kiln.errors import KilnError
from kiln.models import MODELS, GGUFMapping, GGUFTensors

# Tensor types dequantized here (by `gguf.quants.dequantize`, in numpy). Integer tensors, the
# i-quants and the ternary types are refused until a model that needs them comes along.
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLType.F32,
        GGMLType.F16,
        GGMLType.BF16,
        GGMLType.Q4_0,
        GGMLType.Q4_1,
        GGMLType.Q5_0,
        GGMLType.Q5_1,
        GGMLType.Q8_0,
        GGMLType.Q2_K,
        GGMLType.Q3_K,
        GGMLType.Q4_K,
        GGMLType.Q5_K,
        GGMLType.Q6_K,
    }
)

QUANTIZATION_SUFFIX = re.compile(r"[._-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)")  # parts may have a dot: LFM2's "shortconv.conv"
GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def model_name_from_gguf_path(path: Path) -> str:
    """ "SmolLM2-135M-Instruct.Q4_1.gguf" → "SmolLM2-135M-Instruct"."""
    return QUANTIZATION_SUFFIX.sub("", path.stem)


# The numpy dtype kinds a GGUF array of each item kind may hold: an int is a float too, a bool is no number.
ARRAY_DTYPE_KINDS = {int: "iu", float: "iuf", bool: "b"}


def is_kind(value: Any, kind: type | GenericAlias | None) -> bool:
    """`value` is a `kind`: `list[str]` a list of str, `list[int]`/`list[float]`/`list[bool]` a numpy
    array of such numbers (how GGUFFile keeps numeric arrays); an int is a float too, a bool is no number."""
    if kind is None:
        return True
    if isinstance(kind, GenericAlias):
        item_kind = kind.__args__[0]
        if isinstance(value, np.ndarray):
            return value.dtype.kind in ARRAY_DTYPE_KINDS.get(item_kind, "")
        return isinstance(value, list) and all(is_kind(item, item_kind) for item in value)
    if kind is list:
        return isinstance(value, (list, np.ndarray))
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


class GGUFMetadata:
    """The key/value metadata of a GGUF file; a missing required key or a value of the wrong kind is
    an error naming the file."""

    def __init__(self, values: dict[str, Any], path: Path):
        self.path = path
        self._values = values

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None, kind: type | GenericAlias | None = None) -> Any:
        """The value of `key`, checked to be a `kind`. A numeric array is a numpy array when `kind`
        asks for a list of numbers, Python values when no kind is asked (a family's small arrays)."""
        if key not in self._values:
            return default
        value = self._values[key]
        if kind is None and isinstance(value, np.ndarray):
            return value.tolist()
        if not is_kind(value, kind):
            shown = f"a list of {len(value)}" if isinstance(value, (list, np.ndarray)) else repr(value)
            kind_name = kind if isinstance(kind, GenericAlias) else kind.__name__
            raise KilnError(f"GGUF metadata {key} should be {kind_name}, got {shown}", self.path)
        return value

    def require(self, key: str, kind: type | GenericAlias | None = None) -> Any:
        if key not in self._values:
            raise KilnError(f"GGUF metadata has no {key}", self.path)
        return self.get(key, kind=kind)

    def size(self, key: str, default: int | None = None) -> int:
        """A dimension or a count: a positive int."""
        value = self.require(key, int) if default is None else self.get(key, default, int)
        if value <= 0:
            raise KilnError(f"GGUF metadata {key} should be positive, got {value}", self.path)
        return value


GGUF_MAPPINGS: dict[str, GGUFMapping] = {arch.gguf.architecture: arch.gguf for arch in MODELS.values() if arch.gguf}


@dataclass(frozen=True)
class GGUFTensorBlocks:
    """One GGUF tensor as the file stores it: its type and its [rows, row bytes] blocks, rows in
    Hugging Face order (`read` reads them)."""

    gguf_name: str
    type_name: str  # ggml's name: "Q4_K", "F32", ...
    rows: int
    cols: int
    read: Callable[[], np.ndarray]


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    values = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    # GGUF lists dimensions innermost first (ggml's ne order): numpy's shape is the reverse.
    return values.reshape(tuple(reversed(tensor.shape)))


class GGUFModel:
    """Config and tensors of a GGUF file, checked up front: architecture, tensor types and names."""

    def __init__(self, path: Path):
        self.path = path
        gguf_file = read_gguf(path)
        self.metadata = GGUFMetadata(gguf_file.metadata, path)
        architecture_name = self.metadata.require("general.architecture", str)
        if architecture_name not in GGUF_MAPPINGS:
            raise KilnError(
                f"unsupported GGUF architecture {architecture_name!r} (supported: {', '.join(GGUF_MAPPINGS)})", path
            )
        self._architecture = GGUF_MAPPINGS[architecture_name]
        for tensor in gguf_file.tensors:
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
                raise KilnError(
                    f"tensor {tensor.name} has type {tensor.tensor_type.name}, which Kiln does not read "
                    f"(supported: {supported})",
                    path,
                )
        by_name = {tensor.name: tensor for tensor in gguf_file.tensors}
        tensors = GGUFTensors(set(by_name), lambda name: dequantized(by_name[name]))
        self.config = self._architecture.config(self.metadata, tensors)
        self._tensors = {
            self._hf_name(name): tensor
            for name, tensor in by_name.items()
            if name not in self._architecture.config_tensors
        }

    def _hf_name(self, gguf_name: str) -> str:
        if match := LAYER_TENSOR.fullmatch(gguf_name):
            layer, part, kind = match.groups()
            if part in self._architecture.layer_tensors:
                hf_part = self._architecture.layer_tensors[part]
                if hf_part in self._architecture.unsuffixed_parts:
                    return f"model.layers.{layer}.{hf_part}"
                return f"model.layers.{layer}.{hf_part}.{kind}"
        elif match := GLOBAL_TENSOR.fullmatch(gguf_name):
            part, kind = match.groups()
            if part in self._architecture.global_tensors:
                return f"{self._architecture.global_tensors[part]}.{kind}"
        raise KilnError(f"tensor {gguf_name} has no Hugging Face counterpart in this architecture", self.path)

    def names(self) -> list[str]:
        return list(self._tensors)

    def load(self, name: str) -> np.ndarray:
        values = dequantized(self._tensors[name])
        if restore := self._architecture.restore_layout:
            values = restore(name, values, self.config)
        if restore := self._architecture.restore_values:
            values = restore(name, values)
        return values

    def blocks(self, name: str) -> GGUFTensorBlocks:
        tensor = self._tensors[name]
        *outer, cols = reversed(tensor.shape)
        rows = math.prod(outer)

        def read() -> np.ndarray:
            data = np.asarray(tensor.data).view(np.uint8)
            if data.size % rows:
                raise KilnError(f"tensor {tensor.name} holds {data.size} bytes, not whole rows of its shape", self.path)
            data = data.reshape(rows, -1)
            restore = self._architecture.restore_layout
            return restore(name, data, self.config) if restore else data

        return GGUFTensorBlocks(tensor.name, tensor.tensor_type.name, rows, cols, read)

    def write_tokenizer_files(self, folder: Path) -> None:
        write_tokenizer_files(self.metadata, folder)


# ---- tokenizer -----------------------------------------------------------------------------

LLAMA3_PRE_NAMES = ("llama-bpe", "llama3", "llama-v3")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (also Qwen2.5's and Qwen3's): Llama 3's, with digits split one by one.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's tekken vocabularies (Mistral Nemo, Mistral Small 3, Ministral 3): words split at case changes.
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The longest token of GPT-2's, Llama 3's and Qwen2's vocabularies has 128 characters (Llama 2's
# and Phi-3's: 16); 8x that leaves room for any real vocabulary and bounds the work per token
# (the SentencePiece merges try every cut of a token).
MAX_TOKEN_CHARS = 1024


def check_token_lengths(key: str, values: list[str], longest: int, path: Path) -> None:
    if values and (length := max(map(len, values))) > longest:
        raise KilnError(
            f"GGUF metadata {key} holds an entry of {length} characters (at most {longest}: real tokens are short)",
            path,
        )


@dataclass(frozen=True)
class GGUFVocabulary:
    """The tokenizer a GGUF describes, as read from its tokenizer.* metadata."""

    model: str
    pre: str
    tokens: list[str]
    token_types: np.ndarray  # int, one per token
    scores: np.ndarray | None  # float, one per token
    merges: list[str] | None
    special_ids: dict[str, int]  # "bos_token"/"eos_token"/"unk_token"/"pad_token" → id, when present
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def read(cls, metadata: GGUFMetadata) -> GGUFVocabulary:
        model = metadata.require("tokenizer.ggml.model", str)
        pre = metadata.get("tokenizer.ggml.pre", "default", str)
        tokens = metadata.require("tokenizer.ggml.tokens", list[str])
        check_token_lengths("tokenizer.ggml.tokens", tokens, MAX_TOKEN_CHARS, metadata.path)
        merges = metadata.get("tokenizer.ggml.merges", kind=list[str])
        check_token_lengths("tokenizer.ggml.merges", merges, 2 * MAX_TOKEN_CHARS + 1, metadata.path)  # "left right"
        token_types = metadata.get(
            "tokenizer.ggml.token_type", np.full(len(tokens), TokenType.NORMAL, np.int32), list[int]
        )
        scores = metadata.get("tokenizer.ggml.scores", kind=list[float])
        for key, values in (("tokenizer.ggml.token_type", token_types), ("tokenizer.ggml.scores", scores)):
            if values is not None and len(values) != len(tokens):
                raise KilnError(
                    f"GGUF metadata {key} has {len(values)} entries for {len(tokens)} tokens", metadata.path
                )
        special_ids = {
            name: metadata.get(f"tokenizer.ggml.{key}", kind=int)
            for name, key in (
                ("bos_token", "bos_token_id"),
                ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"),
            )
        }
        # llama.cpp's defaults when the file does not say: SentencePiece vocabularies (Gemma 4's too)
        # and some BPE ones (Llama 3's, tekken) add BOS, and SentencePiece puts a space before the text.
        bpe_adds_bos = pre in BYTE_PRE_TOKENIZERS and BYTE_PRE_TOKENIZERS[pre].adds_bos
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=token_types,
            scores=scores,
            merges=merges,
            special_ids={name: i for name, i in special_ids.items() if i is not None and 0 <= i < len(tokens)},
            add_bos=metadata.get("tokenizer.ggml.add_bos_token", model in ("llama", "gemma4") or bpe_adds_bos, bool),
            add_eos=metadata.get("tokenizer.ggml.add_eos_token", False, bool),
            add_space_prefix=metadata.get("tokenizer.ggml.add_space_prefix", model == "llama", bool),
            chat_template=metadata.get("tokenizer.chat_template", kind=str),
        )

    def special_token(self, name: str) -> str | None:
        return self.tokens[self.special_ids[name]] if name in self.special_ids else None


def gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2_pre_tokenizer()])


def regex_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Words cut out by the vocabulary's own regular expression, then spelled as bytes."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass(frozen=True)
class BytePreTokenizer:
    """How a byte-level BPE vocabulary (named by tokenizer.ggml.pre) splits text before merging."""

    build: Callable[[], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)
    adds_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


BYTE_PRE_TOKENIZERS: dict[str, BytePreTokenizer] = {
    "default": BytePreTokenizer(gpt2_pre_tokenizer),
    "gpt-2": BytePreTokenizer(gpt2_pre_tokenizer),
    "smollm": BytePreTokenizer(smollm_pre_tokenizer),
    "refact": BytePreTokenizer(smollm_pre_tokenizer),  # the name Granite GGUFs carry; split as SmolLM's
    **{
        name: BytePreTokenizer(partial(regex_pre_tokenizer, LLAMA3_SPLIT), ignore_merges=True, adds_bos=True)
        for name in LLAMA3_PRE_NAMES
    },
    "qwen2": BytePreTokenizer(partial(regex_pre_tokenizer, QWEN2_SPLIT)),
    "tekken": BytePreTokenizer(partial(regex_pre_tokenizer, TEKKEN_SPLIT), ignore_merges=True, adds_bos=True),
}


def bpe_model(path: Path, **options: Any) -> models.BPE:
    try:
        return models.BPE(**options)
    except Exception as error:  # the tokenizers library raises bare Exceptions for bad vocabularies
        raise KilnError(f"cannot build a tokenizer from the GGUF vocabulary ({error})", path) from error


def file_merges(vocabulary: GGUFVocabulary) -> list[tuple[str, str]]:
    return [tuple(merge.split(" ", 1)) for merge in vocabulary.merges]


def byte_level_bpe(vocabulary: GGUFVocabulary, path: Path) -> Tokenizer:
    """GPT-2-style BPE over bytes spelled as printable characters (tokenizer.ggml.model "gpt2")."""
    if vocabulary.pre not in BYTE_PRE_TOKENIZERS:
        supported = ", ".join(BYTE_PRE_TOKENIZERS)
        raise KilnError(f"unsupported GGUF pre-tokenizer {vocabulary.pre!r} (supported: {supported})", path)
    if vocabulary.merges is None:
        raise KilnError("GGUF metadata has no tokenizer.ggml.merges for its BPE tokenizer", path)
    pre = BYTE_PRE_TOKENIZERS[vocabulary.pre]
    tokenizer = Tokenizer(
        bpe_model(
            path,
            vocab={token: index for index, token in enumerate(vocabulary.tokens)},
            merges=file_merges(vocabulary),
            ignore_merges=pre.ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = pre.build()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_merges(vocabulary: GGUFVocabulary) -> list[tuple[str, str]]:
    """SentencePiece BPE joins the adjacent pair whose joined piece scores highest. As ranked BPE
    merges that is every split of a piece into two pieces, best-scoring joined piece first.

    Trying every cut costs len(piece)^2 per piece (each cut copies the piece): MAX_TOKEN_CHARS
    bounds it (an 80,000-character token took 1.6 s)."""
    pieces = {
        token: (score, index)
        for index, (token, score, token_type) in enumerate(
            zip(vocabulary.tokens, vocabulary.scores.tolist(), vocabulary.token_types.tolist())
        )
        if token_type == TokenType.NORMAL
    }
    ranked = []
    for piece, (score, index) in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_bpe(vocabulary: GGUFVocabulary, path: Path, merges: list[tuple[str, str]]) -> Tokenizer:
    """SentencePiece-style BPE: merges over characters, "▁" for a space, <0xXX> byte fallback."""
    tokenizer = Tokenizer(
        bpe_model(
            path,
            vocab={token: index for index, token in enumerate(vocabulary.tokens)},
            merges=merges,
            unk_token=vocabulary.special_token("unk_token"),
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    # A normalizer, not a Metaspace pre-tokenizer: like SentencePiece and llama.cpp it puts "▁"
    # before every stretch of text (also after a special token), even one that starts with a space.
    spaces = [normalizers.Replace(" ", "▁")]
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocabulary.add_space_prefix:
        spaces.insert(0, normalizers.Prepend("▁"))
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(spaces)
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def scored_sentencepiece_bpe(vocabulary: GGUFVocabulary, path: Path) -> Tokenizer:
    """tokenizer.ggml.model "llama": the merges follow from the pieces' scores, as llama.cpp runs it."""
    if vocabulary.scores is None:
        raise KilnError("GGUF metadata has no tokenizer.ggml.scores for its SentencePiece tokenizer", path)
    return sentencepiece_bpe(vocabulary, path, sentencepiece_merges(vocabulary))


def gemma4_bpe(vocabulary: GGUFVocabulary, path: Path) -> Tokenizer:
    """tokenizer.ggml.model "gemma4": the file's ranked merges, no space prefix (transformers'
    GemmaTokenizer). llama.cpp also cuts the text at runs of newlines; no merge of Gemma 4's joins a
    newline to anything else, so that cut changes nothing and is left out."""
    if vocabulary.merges is None:
        raise KilnError("GGUF metadata has no tokenizer.ggml.merges for its Gemma 4 tokenizer", path)
    return sentencepiece_bpe(vocabulary, path, file_merges(vocabulary))


TOKENIZER_BUILDERS: dict[str, Callable[[GGUFVocabulary, Path], Tokenizer]] = {
    "gpt2": byte_level_bpe,
    "llama": scored_sentencepiece_bpe,
    "gemma4": gemma4_bpe,
}


def special_tokens_processor(vocabulary: GGUFVocabulary) -> processors.PostProcessor | None:
    """BOS/EOS around the text, when the GGUF asks for them."""
    before = ["bos_token"] if vocabulary.add_bos and "bos_token" in vocabulary.special_ids else []
    after = ["eos_token"] if vocabulary.add_eos and "eos_token" in vocabulary.special_ids else []
    if not before and not after:
        return None
    first = [vocabulary.special_token(name) for name in before]
    last = [vocabulary.special_token(name) for name in after]
    return processors.TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, *(f"{token}:1" for token in first), "$B:1", *(f"{token}:1" for token in last)],
        special_tokens=[(vocabulary.special_token(name), vocabulary.special_ids[name]) for name in before + after],
    )


def build_tokenizer(vocabulary: GGUFVocabulary, path: Path) -> Tokenizer:
    if vocabulary.model not in TOKENIZER_BUILDERS:
        supported = ", ".join(TOKENIZER_BUILDERS)
        raise KilnError(f"unsupported GGUF tokenizer model {vocabulary.model!r} (supported: {supported})", path)
    tokenizer = TOKENIZER_BUILDERS[vocabulary.model](vocabulary, path)
    # Control tokens (and the unknown token) are special; user-defined ones are not, but like
    # them they are matched whole in the text instead of being cut up by the merges.
    typed = list(zip(vocabulary.tokens, vocabulary.token_types.tolist()))
    special = [token for token, kind in typed if kind in (TokenType.CONTROL, TokenType.UNKNOWN)]
    user_defined = [token for token, kind in typed if kind == TokenType.USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user_defined])
    tokenizer.post_processor = special_tokens_processor(vocabulary)
    return tokenizer


def write_tokenizer_files(metadata: GGUFMetadata, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    vocabulary = GGUFVocabulary.read(metadata)
    tokenizer = build_tokenizer(vocabulary, metadata.path)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))

    special_tokens = {name: vocabulary.special_token(name) for name in vocabulary.special_ids}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "add_bos_token": vocabulary.add_bos,
        "add_eos_token": vocabulary.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if vocabulary.chat_template is not None:
        tokenizer_config["chat_template"] = vocabulary.chat_template
    generation_config = {
        f"{name.removesuffix('_token')}_token_id": vocabulary.special_ids[name]
        for name in ("bos_token", "eos_token", "pad_token")
        if name in vocabulary.special_ids
    }
    for name, content in (
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens),
        ("generation_config.json", generation_config),
    ):
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
