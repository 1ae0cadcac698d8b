"""The configure stage: `mlc-chat-config.json`, the tokenizer files and the conversation template.

Kiln's native engine renders prompts with the model's jinja chat template, which this stage writes
into the output tokenizer_config.json wherever the source kept it (chat_template.jinja, ...);
the browser engine and WebLLM read the `conv_template` derived from it (compile/conv_template.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from kiln.chat_template import ChatTemplate, read_json_object
from kiln.engine import load_tokenizer
from kiln.models import DecoderConfig

from .conv_template import derive_conv_template
from .library import kv_cache_window

CHAT_CONFIG_VERSION = "0.1.0"
COPIED_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def write_tokenizer_config(tokenizer_dir: Path, out_dir: Path, chat_template: ChatTemplate | None) -> None:
    """The source's tokenizer_config.json with the chat template in it, where the native engine,
    `transformers` and transformers.js all look."""
    source = tokenizer_dir / "tokenizer_config.json"
    config = read_json_object(source) if source.is_file() else {}
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template.source
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def warn_unexpressed(chat_template: ChatTemplate, conversations: list[str]) -> None:
    print(
        f"kiln: warning: {chat_template.path}: the browser and WebLLM lay out a conversation with "
        f"{' or '.join(conversations)} differently from this chat template (the conv_template of "
        "mlc-chat-config.json cannot express it); Kiln's native engine follows the template",
        file=sys.stderr,
        flush=True,
    )


def token_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


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
    copied = []
    for name in COPIED_TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
            copied.append(name)
    chat_template = ChatTemplate.find(tokenizer_dir)
    write_tokenizer_config(tokenizer_dir, out_dir, chat_template)
    generation_path = tokenizer_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    eos_ids = token_ids(generation.get("eos_token_id", config.extra.get("eos_token_id")))
    bos_ids = token_ids(generation.get("bos_token_id", config.extra.get("bos_token_id")))
    pad_ids = token_ids(generation.get("pad_token_id", config.extra.get("pad_token_id")))
    model_config = {k: v for k, v in asdict(config).items() if k != "extra"}
    conv_template, unexpressed = derive_conv_template(chat_template, load_tokenizer(tokenizer_dir), eos_ids)
    if unexpressed:
        warn_unexpressed(chat_template, unexpressed)
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
        "temperature": float(generation.get("temperature", 1.0)),
        "top_p": float(generation.get("top_p", 1.0)),
        "repetition_penalty": float(generation.get("repetition_penalty", 1.0)),
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
    (out_dir / "mlc-chat-config.json").write_text(json.dumps(chat_config, indent=2))
    return chat_config
