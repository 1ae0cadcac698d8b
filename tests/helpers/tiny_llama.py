"""Tiny Llama checkpoints generated on the fly: a Hugging Face folder with random weights and a
small tokenizer trained on the bundled English text, with a ChatML template by default, or the
special tokens and the kind of tokenizer of another chat family."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from helpers.paths import TESTS_DATA

from kiln.bench.compile import DEFAULT_TEXT

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB_SIZE = 384


@dataclass(frozen=True)
class ChatTokens:
    """A chat family's special tokens (ids 0, 1, ... in this order) and its kind of tokenizer."""

    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str
    sentencepiece: bool = False  # SentencePiece-style (Llama 2, Mistral, Phi-3, Gemma), else byte-level BPE
    space_prefix: bool = True  # SentencePiece puts "▁" before each text (all but Gemma's)
    # Every printable ASCII character a token, as a real vocabulary has (Gemma 4's calls are
    # written with "{", ":" and "[", which the bundled text lacks).
    ascii_alphabet: bool = False

    def id(self, token: str | None) -> int | None:
        return self.special_tokens.index(token) if token in self.special_tokens else None


CHATML_TOKENS = ChatTokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>", "<|im_end|>")
# The special tokens of real chat families (their ids are not the real ones), and their real chat templates.
QWEN_TOKENS = ChatTokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>")
SMOLLM2_TOKENS = ChatTokens(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_start|>", "<|im_end|>")
LLAMA_3_TOKENS = ChatTokens(
    ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
    "<|begin_of_text|>",
    "<|eot_id|>",
)
PHI_3_TOKENS = ChatTokens(
    ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
    "<s>",
    "<|endoftext|>",
    sentencepiece=True,
)
LLAMA_2_TOKENS = ChatTokens(("<unk>", "<s>", "</s>"), "<s>", "</s>", sentencepiece=True)
MISTRAL_V3_TOKENS = ChatTokens(("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>", sentencepiece=True)
TEKKEN_TOKENS = ChatTokens(("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>")
# Mistral's v7 templates (Mistral Small 3.1 on, Ministral 3): the system prompt, tool and thinking tags too.
TEKKEN_V7_TOKENS = ChatTokens(
    (
        "<unk>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
        "[TOOL_CALLS]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[ARGS]",
        "[THINK]",
        "[/THINK]",
    ),
    "<s>",
    "</s>",
)
GEMMA_TOKENS = ChatTokens(
    ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    "<bos>",
    "<eos>",
    sentencepiece=True,
    space_prefix=False,
)
# Gemma 4: its turn, tool and thought-channel marks are special tokens, as in its released tokenizer.json.
GEMMA_4_TOKENS = ChatTokens(
    (
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<mask>",
        "<|turn>",
        "<turn|>",
        "<|channel>",
        "<channel|>",
        "<|tool>",
        "<tool|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
        '<|"|>',
        "<|think|>",
    ),
    "<bos>",
    "<eos>",
    sentencepiece=True,
    space_prefix=False,
    ascii_alphabet=True,
)
# Granite 3.x: one token is the BOS, the EOS and the end of each turn; its tokenizer adds no BOS.
GRANITE_TOKENS = ChatTokens(
    ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), "<|end_of_text|>", "<|end_of_text|>"
)
# SmolLM3: ChatML's tags; its tokenizer adds no BOS and its template prints none.
SMOLLM3_TOKENS = ChatTokens(("<|end_of_text|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>")
# OLMo 2: <|endoftext|> is the BOS, the EOS and the end of each assistant turn; its roles (<|user|>, …)
# are plain text to its tokenizer.
OLMO_2_TOKENS = ChatTokens(("<|endoftext|>", "<|pad|>"), "<|endoftext|>", "<|endoftext|>")
CHAT_TEMPLATES = TESTS_DATA / "chat_templates"
# Families whose real chat templates render tools: (tokens, template file under CHAT_TEMPLATES).
TOOL_FAMILIES = {
    "qwen": (QWEN_TOKENS, "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "llama3": (LLAMA_3_TOKENS, "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    "gemma4": (GEMMA_4_TOKENS, "google-gemma-4-31B-it.jinja"),
}
# Texts for raw completion (a model without a chat template), to encode with the tiny tokenizers.
RAW_TEXTS = ["The capital of France is", "  two spaces\nand a line", "ünïcödé 🎮 12345", "x"]


def trained_tokenizer(tokens: ChatTokens, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if tokens.sentencepiece:
        # Llama 2's tokenizer.json: "▁" for spaces and before each text, the BOS added on encoding.
        unknown = "<unk>" if "<unk>" in tokens.special_tokens else tokens.special_tokens[0]
        tokenizer = Tokenizer(models.BPE(unk_token=unknown))
        replace_spaces = normalizers.Replace(" ", "▁")
        to_spaces = decoders.Replace("▁", " ")
        if tokens.space_prefix:
            tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace_spaces])
            tokenizer.decoder = decoders.Sequence([to_spaces, decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        else:
            tokenizer.normalizer = replace_spaces
            tokenizer.decoder = decoders.Sequence([to_spaces, decoders.Fuse()])
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(tokens.special_tokens),
            initial_alphabet=[chr(c) for c in range(0x21, 0x7F)] if tokens.ascii_alphabet else [],
            show_progress=False,
        )
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(tokens.special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    tokenizer.train([str(DEFAULT_TEXT)], trainer)
    if tokens.sentencepiece:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens.bos_token} $A", special_tokens=[(tokens.bos_token, tokens.id(tokens.bos_token))]
        )
    return tokenizer


def write_tokenizer(
    folder: Path,
    tokens: ChatTokens = CHATML_TOKENS,
    chat_template: str | None = CHATML_TEMPLATE,
    vocab_size: int = VOCAB_SIZE,
) -> None:
    """tokenizer.json and tokenizer_config.json (with `chat_template` in it, when given)."""
    trained_tokenizer(tokens, vocab_size).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens.bos_token,
        "eos_token": tokens.eos_token,
        "pad_token": tokens.special_tokens[0],
        "add_bos_token": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_tiny_llama(
    folder: Path,
    *,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    num_layers: int = 2,
    tokens: ChatTokens = CHATML_TOKENS,
    chat_template: str | None = CHATML_TEMPLATE,
) -> Path:
    """Write a 2-layer Llama (hidden 64, GQA 4/2 heads) to `folder` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, tokens, chat_template)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokens.id(tokens.bos_token),
        eos_token_id=tokens.id(tokens.eos_token),
        pad_token_id=0,
        # Larger than the usual 0.02 so that logits are peaked and greedy choices are clear.
        initializer_range=0.15,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder
