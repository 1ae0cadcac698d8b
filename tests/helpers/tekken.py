"""A tiny Mistral tekken vocabulary (Mistral Nemo, Mistral Small 3, Ministral 3): its `tekken.json`,
the tokenizer transformers converts it to (the reference), and the GGUF vocabulary llama.cpp's converter
writes from that tokenizer (tokenizer.ggml.pre "tekken")."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import gguf
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

# Mistral's own pre-tokenizer regex, as tekken.json carries it.
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
NUM_SPECIAL_TOKENS = 10  # the rest are "<SPECIAL_i>" fillers, as in Mistral's files
TEKKEN_CORPUS = [
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! McDonald's O'Neil iPhone",
    "Ünïcödé façade naïve Straße ÉCOLE école Ελληνικά ΑΘΗΝΑ Привет МИР 日本語のテキスト 한국어",
    "Numbers 1234567890 3.14159 1,000,000 and symbols // ::= => <tag/> \n\n\r\n tabs\t\tend",
    "ǅemal ǈubljana ʰaspirated ˈstress e\u0301 combining a\u0308 Ɓig Ǳ camelCaseWords snake_case_words",
]


def write_tekken_json(folder: Path, vocab_size: int = 400) -> Path:
    """tekken.json for a byte-level BPE trained on TEKKEN_CORPUS with Mistral's split: its ranks are the
    merges' order, after the 256 bytes."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(TEKKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trained.train_from_iterator(TEKKEN_CORPUS * 20, trainer)
    as_bytes = {char: byte for byte, char in enumerate(bytes_to_unicode_chars())}
    ranked = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    vocab = [
        {"rank": rank, "token_bytes": base64.b64encode(bytes(as_bytes[c] for c in token)).decode(), "token_str": None}
        for rank, (token, _) in enumerate(ranked)
    ]
    special = [{"rank": rank, "token_str": token, "is_control": True} for rank, token in enumerate(SPECIAL_TOKENS)]
    config = {
        "pattern": TEKKEN_PATTERN,
        "num_vocab_tokens": len(vocab),
        "default_vocab_size": len(vocab) + NUM_SPECIAL_TOKENS,
        "default_num_special_tokens": NUM_SPECIAL_TOKENS,
        "version": "v7",
    }
    path = folder / "tekken.json"
    path.write_text(json.dumps({"config": config, "vocab": vocab, "special_tokens": special}))
    return path


def bytes_to_unicode_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[byte] for byte in range(256)]


def tekken_reference(tekken_json: Path) -> Tokenizer:
    """transformers' tokenizer for a tekken.json (transformers.integrations.mistral)."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    return MistralConverter(vocab_file=str(tekken_json)).converted()


def write_tekken_gguf(reference: Tokenizer, path: Path) -> Path:
    """A vocabulary-only GGUF of `reference` as llama.cpp's converter writes a tekken one: the tokens by
    id, the merges, the special tokens as control tokens, no add_bos_token (llama.cpp then adds a BOS)."""
    saved = json.loads(reference.to_str())
    vocab = saved["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {token["content"] for token in saved["added_tokens"] if token["special"]}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in saved["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<unk>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path
