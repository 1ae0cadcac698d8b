"""The configure stage: `mlc-chat-config.json`, the tokenizer files and the conversation template.

Kiln's native engine renders prompts with the model's jinja chat template, which this stage writes
into the output tokenizer_config.json wherever the source kept it (chat_template.jinja, ...);
the browser engine and WebLLM read the `conv_template` derived from it (kiln/compile/chat_config/conv_template.py).

What goes into the output from the source is read from inside the source only (kiln/compile/source/ingest.py's
containment); its JSON files are parsed, checked and written anew, never copied.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from kiln.chat_template import ChatTemplate, read_json_object
from kiln.compile.chat_config.conv_template import derive_conv_template
from kiln.errors import KilnError, one_line
from kiln.models import DecoderConfig, EncoderConfig
from kiln.text import load_tokenizer
from tokenizers import Tokenizer
from kiln.compile.source.containment import check_contained, contained_file, source_root
from kiln.compile.source.ingest import TOKENIZER_FILES, TOKENIZER_SIDE_FILES
from kiln.compile.lower.library import kv_cache_window

CHAT_CONFIG_VERSION = "0.1.0"
# Copied byte for byte: tokenizer.json has been read as a tokenizer at ingest, tokenizer.model is
# SentencePiece's binary model.
COPIED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
JSON_SIDE_FILES = ("generation_config.json", "special_tokens_map.json", "added_tokens.json")
SAMPLE_TEXT = "kiln"  # a text that finds where a tokenizer's post-processor adds its special tokens


def copy_source_file(source: Path, target: Path) -> None:
    """Byte for byte, from inside the source, refusing a link that would lead out of it."""
    resolved = contained_file(source, source_root(source.parent))
    with open(os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW), "rb") as stream, open(target, "wb") as copy:
        shutil.copyfileobj(stream, copy)


def non_finite_number(value) -> str | None:
    """Where a JSON value holds NaN or an infinity (json reads NaN, Infinity and 1e999 as floats),
    as "key.key[index]"; None when it holds none."""
    pending = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where or "the value"
        if isinstance(item, dict):
            pending += [(f"{where}.{key}" if where else str(key), v) for key, v in item.items()]
        elif isinstance(item, list):
            pending += [(f"{where}[{i}]", v) for i, v in enumerate(item)]
    return None


def read_side_file(path: Path) -> dict:
    """A JSON object of the source that is written into the output: no number JSON cannot carry."""
    try:
        content = read_json_object(path)
    except ValueError as error:  # an integer of more digits than Python converts
        raise KilnError(f"malformed JSON ({one_line(error)})", path) from None
    if where := non_finite_number(content):
        raise KilnError(f"{where} is not a finite number (JSON has no NaN or infinity)", path)
    return content


def write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8")


# ---- generation_config.json ------------------------------------------------------------------


def finite_number(value) -> float | None:
    """A JSON number (not a bool) as a finite float, else None (an int of 400 digits is no float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class SamplingDefault:
    """A sampling setting of generation_config.json that becomes the model's default."""

    default: float  # when the file does not set it (or sets it to null)
    allowed: Callable[[float], bool]
    expected: str


SAMPLING_DEFAULTS: dict[str, SamplingDefault] = {
    "temperature": SamplingDefault(1.0, lambda v: v >= 0, "a finite number >= 0"),
    # 0 keeps no token: refused here rather than written as a default every request would fail with.
    "top_p": SamplingDefault(1.0, lambda v: 0 < v <= 1, "a number in (0, 1] (1 turns it off)"),
    "repetition_penalty": SamplingDefault(1.0, lambda v: v > 0, "a finite number > 0 (1 turns it off)"),
}


def sampling_default(generation: dict, name: str, path: Path) -> float:
    setting, value = SAMPLING_DEFAULTS[name], generation.get(name)
    if value is None:
        return setting.default
    number = finite_number(value)
    if number is None or not setting.allowed(number):
        raise KilnError(f"{name} should be {setting.expected}, got {value!r}", path)
    return number


NO_TOKEN = -1  # what configs of 2023 wrote for a token the model has none of (often pad_token_id)


def token_ids(value, name: str, vocab_size: int, path: Path | None) -> list[int]:
    """A token id field (an id, a list of ids or null), each id in the vocabulary; -1 is none."""
    if value is None or value == NO_TOKEN:
        return []
    ids = value if isinstance(value, list) else [value]
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise KilnError(
                f"{name} should be a token id (0 to {vocab_size - 1}) or a list of them, got {value!r}", path
            )
    return ids


def write_tokenizer_config(tokenizer_dir: Path, out_dir: Path, chat_template: ChatTemplate | None) -> None:
    """The source's tokenizer_config.json with the chat template in it, where the native engine,
    `transformers` and transformers.js all look."""
    source = tokenizer_dir / "tokenizer_config.json"
    config = read_side_file(source) if source.is_file() else {}
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template.source
    write_json(out_dir / "tokenizer_config.json", config)


def warn_unexpressed(path: Path, conversations: list[str]) -> None:
    """`path`: the chat template (for a base model, the tokenizer) Kiln's native engine follows."""
    print(
        f"kiln: warning: {path}: the browser and WebLLM lay out a conversation with "
        f"{' or '.join(conversations)} differently from this file (the conv_template of "
        "mlc-chat-config.json cannot express it); Kiln's native engine follows the file",
        file=sys.stderr,
        flush=True,
    )


def flattened(component: dict | None) -> list[dict]:
    """A tokenizer.json component (decoder, normalizer, pre_tokenizer) and the parts of its Sequence."""
    if not isinstance(component, dict):
        return []
    parts = component.get(next((k for k in ("decoders", "normalizers", "pretokenizers") if k in component), ""), [])
    return [component, *(p for p in parts if isinstance(p, dict))]


def metaspace_prepends(part: dict) -> bool:
    scheme = part.get("prepend_scheme", "always" if part.get("add_prefix_space", True) else "never")
    return part.get("type") == "Metaspace" and scheme in ("first", "always")


def tokenizer_info(tokenizer_dir: Path) -> dict:
    """How to read the token table (WebLLM's and XGrammar's grammar masks need it): byte-level BPE or
    SentencePiece with byte fallback, and whether encoding prepends "▁" and decoding strips it."""
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    tokenizer = json.loads(tokenizer_json.read_text()) if tokenizer_json.exists() else {}
    decoders = flattened(tokenizer.get("decoder"))
    normalizers = flattened(tokenizer.get("normalizer"))
    pre_tokenizers = flattened(tokenizer.get("pre_tokenizer"))
    byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
    prepends = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in normalizers) or any(
        metaspace_prepends(p) for p in pre_tokenizers
    )
    strips = any(d.get("type") == "Strip" and d.get("start", 0) > 0 for d in decoders) or any(
        metaspace_prepends(d) for d in decoders
    )
    return {
        "token_postproc_method": "byte_level" if byte_level else "byte_fallback",
        "prepend_space_in_encode": not byte_level and prepends,
        "strip_space_in_decode": not byte_level and strips,
    }


def webllm_context_window(config: DecoderConfig) -> int:
    """The context window WebLLM gets. It takes either a context window or a sliding window (then -1
    for the context). With per-layer windows (Gemma's local layers) it gets the window: WebLLM
    prefills in chunks of prefill_chunk_size, and TVM's paged prefill kernels (WebLLM's WebGPU ones)
    give wrong logits once a chunk's window drops cached tokens (Kiln's engines go one token at a
    time there on GPUs)."""
    if config.sliding_window_size:
        return -1
    return config.layer_window_size if config.windowed_layers else config.context_window_size


def write_chat_config(
    out_dir: Path,
    tokenizer_dir: Path,
    model_type: str,
    quantization: str,
    config: DecoderConfig,
) -> dict:
    """Copy the tokenizer files next to the weights and write `mlc-chat-config.json`."""
    check_contained(tokenizer_dir, TOKENIZER_FILES + TOKENIZER_SIDE_FILES)
    copied = []
    for name in COPIED_TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            copy_source_file(tokenizer_dir / name, out_dir / name)
            copied.append(name)
    side_files = {
        name: read_side_file(tokenizer_dir / name) for name in JSON_SIDE_FILES if (tokenizer_dir / name).is_file()
    }
    for name, content in side_files.items():
        write_json(out_dir / name, content)
    chat_template = ChatTemplate.find(tokenizer_dir)
    write_tokenizer_config(tokenizer_dir, out_dir, chat_template)
    generation_path = tokenizer_dir / "generation_config.json"
    generation = side_files.get("generation_config.json", {})
    config_path = tokenizer_dir / "config.json" if (tokenizer_dir / "config.json").is_file() else None

    def ids(name: str) -> list[int]:
        if name in generation:
            return token_ids(generation[name], name, config.vocab_size, generation_path)
        return token_ids(config.extra.get(name), name, config.vocab_size, config_path)

    eos_ids, bos_ids, pad_ids = ids("eos_token_id"), ids("bos_token_id"), ids("pad_token_id")
    model_config = {k: v for k, v in asdict(config).items() if k != "extra"}
    conv_template, unexpressed = derive_conv_template(chat_template, load_tokenizer(tokenizer_dir), eos_ids)
    if unexpressed:
        warn_unexpressed(chat_template.path if chat_template else tokenizer_dir / "tokenizer.json", unexpressed)
    chat_config = {
        "version": CHAT_CONFIG_VERSION,
        "model_type": model_type,
        "quantization": quantization,
        "model_config": model_config,
        "vocab_size": config.vocab_size,
        "context_window_size": webllm_context_window(config),
        "sliding_window_size": kv_cache_window(config),
        "attention_sink_size": 0 if config.sliding_window_size else -1,
        "prefill_chunk_size": config.prefill_chunk_size,
        "tensor_parallel_shards": 1,
        **{name: sampling_default(generation, name, generation_path) for name in SAMPLING_DEFAULTS},
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "tokenizer_files": [
            *(n for n in copied if n in ("tokenizer.json", "tokenizer.model")),
            "tokenizer_config.json",
        ],
        "tokenizer_info": tokenizer_info(tokenizer_dir),
        "conv_template": conv_template,
        "bos_token_id": bos_ids[0] if bos_ids else None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_ids[0] if pad_ids else 0,
    }
    (out_dir / "mlc-chat-config.json").write_text(json.dumps(chat_config, indent=2, allow_nan=False))
    return chat_config


def special_token_ids(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a single text ([CLS] … [SEP])."""
    plain = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False).ids
    full = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=True).ids
    start = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    return full[:start], full[start + len(plain) :]


def write_embedding_config(
    out_dir: Path,
    tokenizer_dir: Path,
    model_type: str,
    quantization: str,
    config: EncoderConfig,
) -> dict:
    """An embedding model's `mlc-chat-config.json` (no conversation: the `embedding` section says how
    inputs are tokenized, truncated and pooled) and its tokenizer files. tokenizer.json is written
    without the truncation and padding a checkpoint may keep in it: the engines truncate to the
    model's longest input and pad batches themselves, alike natively and in the browser."""
    check_contained(tokenizer_dir, TOKENIZER_FILES + TOKENIZER_SIDE_FILES)
    tokenizer_json = read_side_file(contained_file(tokenizer_dir / "tokenizer.json", source_root(tokenizer_dir)))
    write_json(out_dir / "tokenizer.json", {**tokenizer_json, "truncation": None, "padding": None})
    write_tokenizer_config(tokenizer_dir, out_dir, chat_template=None)
    tokenizer = load_tokenizer(out_dir)
    before, after = special_token_ids(tokenizer)
    embedding = config.embedding
    if config.max_sequence_length <= len(before) + len(after):
        raise KilnError(
            f"inputs of at most {config.max_sequence_length} tokens leave no room for text beside the "
            f"{len(before) + len(after)} special tokens",
            tokenizer_dir / "tokenizer.json",
        )
    model_config = {k: v for k, v in asdict(config).items() if k not in ("extra", "embedding")}
    chat_config = {
        "version": CHAT_CONFIG_VERSION,
        "model_type": model_type,
        "quantization": quantization,
        "model_config": model_config,
        "vocab_size": config.vocab_size,
        "context_window_size": config.max_sequence_length,
        "tokenizer_files": ["tokenizer.json", "tokenizer_config.json"],
        "embedding": {
            "pooling": embedding.pooling,
            "normalize": embedding.normalize,
            "dimensions": config.embedding_width,
            "matryoshka_dimensions": list(embedding.dimensions),
            "max_sequence_length": config.max_sequence_length,
            "max_batch_size": config.max_batch_size,
            "truncation_side": "right",
            "prefix_token_ids": before,
            "suffix_token_ids": after,
        },
    }
    (out_dir / "mlc-chat-config.json").write_text(json.dumps(chat_config, indent=2, allow_nan=False))
    return chat_config
