"""The configure stage: `mlc-chat-config.json`, the tokenizer files and the conversation template.

Kiln's own engines render prompts with the model's jinja chat template; WebLLM needs a
`conv_template` instead, derived here from the chat template's family (one registry entry per
family) and the template's own default system message.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from kiln.chat_template import compile_chat_template, render_chat_template, template_source
from kiln.errors import KilnError
from kiln.models import DecoderConfig

CHAT_CONFIG_VERSION = "0.1.0"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "added_tokens.json")


@dataclass(frozen=True)
class ConvFamily:
    name: str
    marker: str  # a string only this family's chat template contains
    system_template: str
    roles: dict[str, str]
    seps: list[str]
    role_content_sep: str
    role_empty_sep: str
    stop_str: list[str]


CONV_FAMILIES = (
    ConvFamily("chatml", "<|im_start|>", "<|im_start|>system\n{system_message}<|im_end|>\n",
               {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
               ["<|im_end|>\n"], "\n", "\n", ["<|im_end|>"]),
    ConvFamily("llama-3", "<|start_header_id|>",
               "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
               {"user": "<|start_header_id|>user", "assistant": "<|start_header_id|>assistant"},
               ["<|eot_id|>"], "<|end_header_id|>\n\n", "<|end_header_id|>\n\n", ["<|eot_id|>"]),
    ConvFamily("llama-2", "[INST]", "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n",
               {"user": "[INST]", "assistant": "[/INST]"}, [" ", " </s>"], " ", " ", ["[INST]"]),
    ConvFamily("zephyr", "<|user|>", "<|system|>\n{system_message}</s>\n",
               {"user": "<|user|>", "assistant": "<|assistant|>"}, ["</s>\n"], "\n", "\n", ["</s>"]),
)
SENTINEL = "\x00KILN_USER\x00"


def default_system_message(chat_template: str, family: ConvFamily, special_tokens: dict, path: Path) -> str:
    """The system message the template inserts when the conversation has none (or "")."""
    rendered = render_chat_template(compile_chat_template(chat_template, path), path,
                                    messages=[{"role": "user", "content": SENTINEL}],
                                    add_generation_prompt=True, **special_tokens)
    prefix, _, _ = family.system_template.partition("{system_message}")
    suffix = family.system_template.partition("{system_message}")[2]
    start = rendered.find(prefix)
    if start < 0 or start > rendered.find(SENTINEL):
        return ""
    body = rendered[start + len(prefix):]
    return body[: body.find(suffix)] if suffix and suffix in body else ""


def conv_template(tokenizer_config: dict, stop_token_ids: list[int], path: Path) -> dict:
    chat_template = template_source(tokenizer_config)
    if not chat_template:
        raise KilnError("tokenizer_config.json has no chat_template: Kiln needs it to format chats", path)
    family = next((f for f in CONV_FAMILIES if f.marker in chat_template), None)
    if family is None:
        raise KilnError("the chat_template is of no known family (supported: "
                        + ", ".join(f.name for f in CONV_FAMILIES) + ")", path)
    special = {k: tokenizer_config[k] for k in ("bos_token", "eos_token") if isinstance(tokenizer_config.get(k), str)}
    system_message = default_system_message(chat_template, family, special, path)
    return {
        "name": family.name,
        "system_template": family.system_template,
        "system_message": system_message,
        "roles": family.roles,
        "seps": family.seps,
        "role_content_sep": family.role_content_sep,
        "role_empty_sep": family.role_empty_sep,
        "stop_str": family.stop_str,
        "stop_token_ids": stop_token_ids,
        "system_prefix_token_ids": [],
        "add_role_after_system_message": True,
    }


def token_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def tokenizer_info(tokenizer_dir: Path) -> dict:
    """How WebLLM post-processes the token table: byte-level BPE or SentencePiece byte fallback."""
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    decoder = json.loads(tokenizer_json.read_text()).get("decoder") or {} if tokenizer_json.exists() else {}
    decoders = [decoder, *decoder.get("decoders", [])]
    byte_level = any(d.get("type") == "ByteLevel" for d in decoders)
    return {
        "token_postproc_method": "byte_level" if byte_level else "byte_fallback",
        "prepend_space_in_encode": False,
        "strip_space_in_decode": False,
    }


def write_chat_config(
    out_dir: Path, tokenizer_dir: Path, model_type: str, quantization: str, config: DecoderConfig,
) -> dict:
    """Copy the tokenizer files next to the weights and write `mlc-chat-config.json`."""
    copied = []
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
            copied.append(name)
    tokenizer_config_path = tokenizer_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text()) if tokenizer_config_path.exists() else {}
    generation_path = tokenizer_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    eos_ids = token_ids(generation.get("eos_token_id", config.extra.get("eos_token_id")))
    bos_ids = token_ids(generation.get("bos_token_id", config.extra.get("bos_token_id")))
    pad_ids = token_ids(generation.get("pad_token_id", config.extra.get("pad_token_id")))
    model_config = {k: v for k, v in asdict(config).items() if k != "extra"}
    chat_config = {
        "version": CHAT_CONFIG_VERSION,
        "model_type": model_type,
        "quantization": quantization,
        "model_config": model_config,
        "vocab_size": config.vocab_size,
        "context_window_size": config.context_window_size,
        "sliding_window_size": -1,
        "attention_sink_size": -1,
        "prefill_chunk_size": config.prefill_chunk_size,
        "tensor_parallel_shards": 1,
        "temperature": float(generation.get("temperature", 1.0)),
        "top_p": float(generation.get("top_p", 1.0)),
        "repetition_penalty": float(generation.get("repetition_penalty", 1.0)),
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "tokenizer_files": [n for n in copied if n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")],
        "tokenizer_info": tokenizer_info(tokenizer_dir),
        "conv_template": conv_template(tokenizer_config, eos_ids, tokenizer_config_path),
        "bos_token_id": bos_ids[0] if bos_ids else None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_ids[0] if pad_ids else 0,
    }
    (out_dir / "mlc-chat-config.json").write_text(json.dumps(chat_config, indent=2))
    return chat_config
