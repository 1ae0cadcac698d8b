"""Ingest: GGUF files, Hugging Face folders and hub ids all read into the same SourceModel.

References are independent of the code under test: `transformers`' own GGUF loader and
tokenizer conversion, llama.cpp's tokenizer test ids, tokenizers trained here, and weights
written here with `gguf.GGUFWriter` in llama.cpp's layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf import GGMLQuantizationType as GGMLType
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers.assets import LLAMA_CPP_VOCABULARIES, llama_cpp_vocabulary, smollm2_gguf
from helpers.hub import FAKE_COMMIT, fake_hub
from helpers.tekken import TEKKEN_CORPUS, tekken_reference, write_tekken_gguf, write_tekken_json

from kiln.compile.source.gguf_source import model_name_from_gguf_path
from kiln.compile.source.ingest import ingest
from kiln.errors import KilnError

VARIED_TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say we've done it, isn't it?",
    "def square(x):\n    return x ** 2  # fast\n\n\nprint(square(12))\n",
    "for (int i = 0; i < n; ++i) { total += a[i] * b[i]; }",
    "Prices: 3.14159, 1,000,000 and 20251129; call +1-555-0100.",
    "naïve café — Größe, 日本語のテキスト, Ελληνικά, русский, עברית, हिन्दी",
    "emoji 🦙🔥👍🏽👨‍👩‍👧 done",
    "tabs\t\tand   spaces     then\n\n\n\nnewlines  \n ",
    "   leading and trailing   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello there.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers like 12345 and 3.14 appear in text; so do dates such as 2024-11-29.",
    "Ein schöner Tag in München. Une journée à Paris. Un día en Madrid.",
] * 20

# ---- tiny models written here --------------------------------------------------------------

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256, "context": 128}
HEAD_DIM = TINY["hidden"] // TINY["heads"]
# GGUF name → Hugging Face name, per layer, and the GGUF type each is stored as in the tiny file.
TINY_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm", GGMLType.F32),
    "attn_q": ("self_attn.q_proj", GGMLType.Q8_0),
    "attn_k": ("self_attn.k_proj", GGMLType.Q4_0),
    "attn_v": ("self_attn.v_proj", GGMLType.Q4_1),
    "attn_output": ("self_attn.o_proj", GGMLType.Q5_0),
    "ffn_norm": ("post_attention_layernorm", GGMLType.F32),
    "ffn_gate": ("mlp.gate_proj", GGMLType.Q5_1),
    "ffn_up": ("mlp.up_proj", GGMLType.F16),
    "ffn_down": ("mlp.down_proj", GGMLType.Q6_K),
}


def llama_cpp_rope_permutation(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Hugging Face Q and K weights."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def random_q6_k_blocks(rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q6_K data (gguf cannot quantize to it): random quants, a finite f16 scale per block."""
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(
    path: Path, vocabulary: dict, architecture: str = "llama", extra_tensors: tuple = ()
) -> dict[str, np.ndarray]:
    """A 2-layer Llama in llama.cpp's layout; returns the Hugging Face tensors a reader should give back."""
    rng = np.random.default_rng(0)
    vocab_size = len(vocabulary["tokens"])
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["intermediate"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model(vocabulary["model"])
    writer.add_tokenizer_pre(vocabulary["pre"])
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    if "merges" in vocabulary:
        writer.add_token_merges(vocabulary["merges"])
    if "scores" in vocabulary:
        writer.add_token_scores(vocabulary["scores"])
    writer.add_bos_token_id(vocabulary["bos"])
    writer.add_eos_token_id(vocabulary["eos"])
    writer.add_add_bos_token(vocabulary["add_bos"])
    writer.add_chat_template(CHAT_TEMPLATE)

    expected = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], kind: GGMLType, permute_heads: int = 0) -> None:
        if kind == GGMLType.Q6_K:
            stored = random_q6_k_blocks(*shape, rng)
            expected[hf_name] = gguf.quants.dequantize(stored, kind)
        else:
            weight = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            # Quantization works row by row, so it commutes with llama.cpp's row permutation.
            expected[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(weight, kind), kind)
            if permute_heads:
                weight = llama_cpp_rope_permutation(weight, permute_heads)
            stored = gguf.quants.quantize(weight, kind)
        writer.add_tensor(gguf_name, stored, raw_dtype=kind)

    hidden, intermediate, kv_width = TINY["hidden"], TINY["intermediate"], TINY["kv_heads"] * HEAD_DIM
    add("token_embd.weight", "model.embed_tokens.weight", (vocab_size, hidden), GGMLType.Q8_0)
    for layer in range(TINY["layers"]):
        shapes = {
            "attn_norm": (hidden,),
            "attn_q": (hidden, hidden),
            "attn_k": (kv_width, hidden),
            "attn_v": (kv_width, hidden),
            "attn_output": (hidden, hidden),
            "ffn_norm": (hidden,),
            "ffn_gate": (intermediate, hidden),
            "ffn_up": (intermediate, hidden),
            "ffn_down": (hidden, intermediate),
        }
        permuted = {"attn_q": TINY["heads"], "attn_k": TINY["kv_heads"]}
        for part, (hf_part, kind) in TINY_LAYER_TENSORS.items():
            add(
                f"blk.{layer}.{part}.weight",
                f"model.layers.{layer}.{hf_part}.weight",
                shapes[part],
                kind,
                permuted.get(part, 0),
            )
    add("output_norm.weight", "model.norm.weight", (hidden,), GGMLType.F32)
    add("output.weight", "lm_head.weight", (vocab_size, hidden), GGMLType.BF16)
    for name, data, kind in extra_tensors:
        writer.add_tensor(name, data, raw_dtype=kind)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="session")
def trained_tokenizer() -> Tokenizer:
    """A small byte-level BPE tokenizer, trained like GPT-2's."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return tokenizer


@pytest.fixture(scope="session")
def byte_level_vocabulary(trained_tokenizer: Tokenizer) -> dict:
    """The trained tokenizer as llama.cpp's converter stores it in a GGUF."""
    ids = trained_tokenizer.get_vocab()
    tokens = sorted(ids, key=ids.get)
    merges = json.loads(trained_tokenizer.to_str())["model"]["merges"]
    return {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": tokens,
        "types": [3 if token in SPECIAL_TOKENS else 1 for token in tokens],
        "merges": [" ".join(merge) if isinstance(merge, list) else merge for merge in merges],
        "bos": ids["<|im_start|>"],
        "eos": ids["<|im_end|>"],
        "add_bos": False,
    }


@pytest.fixture
def tiny_gguf(tmp_path: Path, byte_level_vocabulary: dict) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    return path, write_tiny_gguf(path, byte_level_vocabulary)


# ---- GGUF ----------------------------------------------------------------------------------


def test_tiny_gguf_reads_back_the_dequantized_tensors(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    model = ingest(path, tmp_path / "work")

    assert model.name == "tiny-llama"
    assert model.path == path
    assert model.config["model_type"] == "llama"
    assert model.config["hidden_size"] == TINY["hidden"]
    assert model.config["num_hidden_layers"] == TINY["layers"]
    assert model.config["num_key_value_heads"] == TINY["kv_heads"]
    assert model.config["tie_word_embeddings"] is False
    assert sorted(model.tensor_names()) == sorted(expected)
    for name, values in expected.items():
        loaded = model.load_tensor(name)
        assert loaded.dtype == np.float32 and loaded.shape == values.shape, name
        assert np.abs(loaded - values).max() <= 1e-6, name


def test_gguf_source_hash_is_the_sha256_of_its_manifest(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    manifest = f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    assert ingest(path, tmp_path / "work").source_hash == hashlib.sha256(manifest.encode()).hexdigest()


@pytest.mark.parametrize(
    "data, kind",
    [
        (np.arange(64, dtype=np.int32).reshape(2, 32), GGMLType.I32),
        (np.zeros((2, 66), dtype=np.uint8), GGMLType.IQ2_XXS),
    ],
    ids=["I32", "IQ2_XXS"],
)
def test_gguf_tensor_of_an_unsupported_type_is_refused(tmp_path, byte_level_vocabulary, data, kind):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, byte_level_vocabulary, extra_tensors=(("blk.0.attn_q.bias", data, kind),))
    with pytest.raises(KilnError) as error:
        ingest(path, tmp_path / "work")
    assert str(path) in str(error.value)
    assert "blk.0.attn_q.bias" in str(error.value)
    assert kind.name in str(error.value)


def test_gguf_errors_name_the_file_and_the_problem(tmp_path, byte_level_vocabulary):
    cases = {
        "architecture": (dict(architecture="mamba"), "unsupported GGUF architecture 'mamba'"),
        "tensor name": (
            dict(extra_tensors=(("blk.0.ffn_gate_inp.weight", np.ones((2, 8), dtype=np.float32), GGMLType.F32),)),
            "tensor blk.0.ffn_gate_inp.weight has no Hugging Face counterpart",
        ),
        "tokenizer model": (
            dict(vocabulary={**byte_level_vocabulary, "model": "bert"}),
            "unsupported GGUF tokenizer model 'bert'",
        ),
        "pre-tokenizer": (
            dict(vocabulary={**byte_level_vocabulary, "pre": "deepseek-llm"}),
            "unsupported GGUF pre-tokenizer 'deepseek-llm'",
        ),
    }
    for case, (changes, problem) in cases.items():
        path = tmp_path / f"{case.replace(' ', '-')}.gguf"
        write_tiny_gguf(path, **{"vocabulary": byte_level_vocabulary, **changes})
        with pytest.raises(KilnError) as error:
            ingest(path, tmp_path / "work")
        assert str(path) in str(error.value) and problem in str(error.value), case


def test_truncated_gguf_is_an_error_naming_the_file(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(KilnError, match="not a readable GGUF file: truncated") as error:
        ingest(path, tmp_path / "work")
    assert str(path) in str(error.value)


def test_gguf_tokenizer_gives_the_ids_of_the_tokenizer_it_was_made_from(tiny_gguf, tmp_path, trained_tokenizer):
    path, _ = tiny_gguf
    model = ingest(path, tmp_path / "work")
    rebuilt = Tokenizer.from_file(str(model.tokenizer_dir / "tokenizer.json"))
    for text in VARIED_TEXT:
        ids = rebuilt.encode(text).ids
        assert ids == trained_tokenizer.encode(text).ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == text

    tokenizer_config = json.loads((model.tokenizer_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer_config["add_bos_token"] is False
    generation_config = json.loads((model.tokenizer_dir / "generation_config.json").read_text())
    assert generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    special_tokens = json.loads((model.tokenizer_dir / "special_tokens_map.json").read_text())
    assert special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_sentencepiece_gguf_tokenizer(tmp_path):
    """A hand-made SentencePiece vocabulary: merges by score, "▁" prefix, byte fallback, BOS."""
    pieces = {"▁t": -1, "he": -2, "▁the": -3, "▁a": -4, "ll": -5, "▁he": -6, "llo": -7, "▁hello": -8}
    pieces.update({character: -100.0 - index for index, character in enumerate("▁thealo")})
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    vocabulary = {
        "model": "llama",
        "pre": "default",
        "tokens": tokens,
        "types": [2, 3, 3, *[6] * 256, *[1] * len(pieces)],
        "scores": [0.0] * 259 + [float(score) for score in pieces.values()],
        "bos": 1,
        "eos": 2,
        "add_bos": True,
    }
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, vocabulary)
    tokenizer = Tokenizer.from_file(str(ingest(path, tmp_path / "work").tokenizer_dir / "tokenizer.json"))
    index = {token: position for position, token in enumerate(tokens)}.__getitem__
    expected = {
        "the hello": ["<s>", "▁the", "▁hello"],
        " a": ["<s>", "▁", "▁a"],  # like llama.cpp and SentencePiece: "▁" before a leading space too
        "ox": ["<s>", "▁", "o", "<0x78>"],
        "é": ["<s>", "▁", "<0xC3>", "<0xA9>"],
        "</s>the": ["<s>", "</s>", "▁the"],
    }
    for text, pieces_expected in expected.items():
        ids = tokenizer.encode(text).ids
        assert ids == [index(piece) for piece in pieces_expected], text
        assert tokenizer.decode(ids) == text.replace("</s>", "")


@pytest.mark.parametrize(
    "file_name, model_name",
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("llama-2-7b.Q4_K_M.gguf", "llama-2-7b"),
        ("Qwen2-0.5B-Instruct-IQ4_XS.gguf", "Qwen2-0.5B-Instruct"),
        ("model-f16.gguf", "model"),
        ("TinyStories-15M.gguf", "TinyStories-15M"),
    ],
)
def test_gguf_model_name_drops_the_quantization_suffix(file_name, model_name):
    assert model_name_from_gguf_path(Path(file_name)) == model_name


@pytest.mark.slow
@pytest.mark.parametrize("vocabulary", LLAMA_CPP_VOCABULARIES)
def test_gguf_tokenizer_matches_llama_cpp_reference_ids(vocabulary, tmp_path):
    from kiln.compile.source.gguf_file import read_gguf
    from kiln.compile.source.gguf_source import GGUFMetadata, write_tokenizer_files

    path = llama_cpp_vocabulary(vocabulary)
    write_tokenizer_files(GGUFMetadata(read_gguf(path).metadata, path), tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    reference_ids = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    assert len(texts) > 40
    for text, ids in zip(texts, reference_ids):
        assert tokenizer.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()], text


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(exclude_categories=["Cs", "Cn"])))
def test_a_tekken_gguf_tokenizer_gives_transformers_ids(tekken, text):
    """Ministral 3's and Mistral Small 3's GGUFs (tokenizer.ggml.pre "tekken"): against transformers'
    conversion of the tekken.json the GGUF's vocabulary was written from."""
    reference, ours = tekken
    assert ours.encode(text, add_special_tokens=False).ids == reference.encode(text).ids, text


def test_a_tekken_gguf_tokenizer_adds_the_bos_as_llama_cpp_does(tekken):
    reference, ours = tekken
    for text in [*VARIED_TEXT, *TEKKEN_CORPUS, "[INST]Hello[/INST]"]:
        assert ours.encode(text).ids == [reference.token_to_id("<s>"), *reference.encode(text).ids], text


@pytest.fixture(scope="module")
def tekken(tmp_path_factory):
    from kiln.compile.source.gguf_file import read_gguf
    from kiln.compile.source.gguf_source import GGUFMetadata, write_tokenizer_files

    folder = tmp_path_factory.mktemp("tekken")
    reference = tekken_reference(write_tekken_json(folder))
    path = write_tekken_gguf(reference, folder / "tekken.gguf")
    write_tokenizer_files(GGUFMetadata(read_gguf(path).metadata, path), folder)
    return reference, Tokenizer.from_file(str(folder / "tokenizer.json"))


GEMMA4_CHAT = "<|turn>system\nBe brief.<turn|>\n<|turn>user\nWeather in Köln?<turn|>\n<|turn>model\n"
GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Köln<|"|>}<tool_call|>'


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(exclude_categories=["Cs", "Cn"])))
def test_a_gemma4_gguf_tokenizer_gives_transformers_ids(gemma4_tokenizers, text):
    """Gemma 4's real vocabulary (tokenizer.ggml.model "gemma4": 262,144 tokens, 514,906 merges) against
    transformers' GemmaTokenizer over the same tokens and merges; the GGUF asks for the BOS."""
    reference, ours = gemma4_tokenizers
    assert ours.encode(text).ids == [2, *reference(text, add_special_tokens=False).input_ids], text


@pytest.mark.slow
def test_a_gemma4_gguf_tokenizer_reads_its_chat_and_tool_tokens_whole(gemma4_tokenizers):
    reference, ours = gemma4_tokenizers
    for text in [*VARIED_TEXT, GEMMA4_CHAT, GEMMA4_CALL, "<|channel>thought\n<channel|>The answer"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode(GEMMA4_CALL, add_special_tokens=False).tokens[:3] == ["<|tool_call>", "call", ":"]


@pytest.fixture(scope="module")
def gemma4_tokenizers(tmp_path_factory):
    from transformers import GemmaTokenizer

    from kiln.compile.source.gguf_file import read_gguf
    from kiln.compile.source.gguf_source import GGUFMetadata, GGUFVocabulary, write_tokenizer_files

    path = llama_cpp_vocabulary("gemma-4")
    metadata = GGUFMetadata(read_gguf(path).metadata, path)
    vocabulary = GGUFVocabulary.read(metadata)
    reference = GemmaTokenizer(
        vocab={token: i for i, token in enumerate(vocabulary.tokens)},
        merges=[tuple(merge.split(" ", 1)) for merge in vocabulary.merges],
    )
    # The released tokenizer.json lists the turn, tool and channel tokens as added tokens.
    added = (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    reference.add_tokens([t for t, kind in zip(vocabulary.tokens, vocabulary.token_types.tolist()) if kind in added])
    folder = tmp_path_factory.mktemp("gemma4-vocabulary")
    write_tokenizer_files(metadata, folder)
    return reference, Tokenizer.from_file(str(folder / "tokenizer.json"))


# ---- SmolLM2 against transformers' own GGUF loader -------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_gguf()
    return path, ingest(path, tmp_path_factory.mktemp("smollm2"))


@pytest.mark.slow
def test_smollm2_gguf_config(smollm2):
    _, model = smollm2
    assert model.name == "SmolLM2-135M-Instruct"
    assert model.config == {
        **model.config,
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert model.config["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.mark.slow
def test_smollm2_gguf_tensors_equal_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    path, model = smollm2
    reference = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    # transformers lists the tied lm_head.weight (the embedding) too
    assert set(reference) - set(model.tensor_names()) == {"lm_head.weight"}
    for name in model.tensor_names():
        assert np.abs(model.load_tensor(name) - reference[name].numpy()).max() <= 1e-6, name

    # The Q/K un-permutation is what made them equal: the file's own row order differs.
    stored = gguf.GGUFReader(path).tensors
    (stored_q,) = [tensor for tensor in stored if tensor.name == "blk.0.attn_q.weight"]
    raw = gguf.quants.dequantize(stored_q.data, stored_q.tensor_type)
    assert np.abs(raw - reference["model.layers.0.self_attn.q_proj.weight"].numpy()).max() > 0.01


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_equals_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    path, model = smollm2
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_file(str(model.tokenizer_dir / "tokenizer.json"))
    for text in VARIED_TEXT:
        assert ours.encode(text).ids == reference(text)["input_ids"], text

    tokenizer_config = json.loads((model.tokenizer_dir / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = transformers.AutoTokenizer.from_pretrained(model.tokenizer_dir).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert prompt == reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


# ---- Hugging Face folders ------------------------------------------------------------------


def save_tiny_llama(
    folder: Path, tokenizer: Tokenizer, dtype: str = "float32", **save_options
) -> dict[str, np.ndarray]:
    """A small random Llama saved by transformers; returns its tensors as float32 numpy."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder, **save_options)
    tokenizer.save(str(folder / "tokenizer.json"))
    return {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory, trained_tokenizer) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    return folder, save_tiny_llama(folder, trained_tokenizer)


@pytest.fixture
def hf_folder_copy(tiny_hf_folder, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_hf_folder[0], tmp_path / "tiny-llama"))


def assert_same_tensors(model, expected: dict[str, np.ndarray]) -> None:
    assert sorted(model.tensor_names()) == sorted(expected)
    for name, values in expected.items():
        loaded = model.load_tensor(name)
        assert loaded.dtype == np.float32, name
        np.testing.assert_array_equal(loaded, values, err_msg=name)


def test_hf_folder_tensors_equal_the_saved_model(tiny_hf_folder, tmp_path):
    folder, expected = tiny_hf_folder
    model = ingest(folder, tmp_path / "work")
    assert model.name == "tiny-llama"
    assert model.config["model_type"] == "llama"
    assert model.tokenizer_dir == folder
    assert_same_tensors(model, expected)


def test_hf_folder_source_hash_covers_its_files(tiny_hf_folder, tmp_path):
    folder, _ = tiny_hf_folder
    read = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(path.name for path in folder.iterdir()) == read
    manifest = "".join(f"{hashlib.sha256((folder / name).read_bytes()).hexdigest()}  {name}\n" for name in read)
    assert ingest(folder, tmp_path / "work").source_hash == hashlib.sha256(manifest.encode()).hexdigest()


def test_hf_folder_bf16_sharded_with_index(tmp_path, trained_tokenizer):
    folder = tmp_path / "tiny-bf16"
    expected = save_tiny_llama(folder, trained_tokenizer, dtype="bfloat16", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    assert_same_tensors(ingest(folder, tmp_path / "work"), expected)


def test_hf_folder_with_pytorch_weights(tiny_hf_folder, hf_folder_copy, tmp_path):
    torch = pytest.importorskip("torch")
    _, expected = tiny_hf_folder
    (hf_folder_copy / "model.safetensors").unlink()
    state_dict = {name: torch.from_numpy(values) for name, values in expected.items()}
    torch.save(state_dict, hf_folder_copy / "pytorch_model.bin")
    assert_same_tensors(ingest(hf_folder_copy, tmp_path / "work"), expected)


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def oversized_header(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])


@pytest.mark.parametrize(
    "break_folder, named_file, problem",
    [
        (lambda folder: (folder / "config.json").unlink(), "config.json", "missing config.json"),
        (lambda folder: (folder / "config.json").write_text('{"model_type": '), "config.json", "malformed JSON"),
        (lambda folder: (folder / "config.json").write_text('{"hidden_size": 64}'), "config.json", "no model_type"),
        (lambda folder: cut_in_half(folder / "model.safetensors"), "model.safetensors", "truncated safetensors file"),
        (lambda folder: oversized_header(folder / "model.safetensors"), "model.safetensors", "does not fit"),
        (lambda folder: (folder / "tokenizer.json").unlink(), "", "no tokenizer (tokenizer.json)"),
        (
            lambda folder: (folder / "tokenizer.json").rename(folder / "tokenizer.model"),
            "tokenizer.model",
            "a SentencePiece model without tokenizer.json",
        ),
        (lambda folder: (folder / "model.safetensors").unlink(), "", "no weights"),
    ],
    ids=[
        "no-config",
        "malformed-config",
        "no-model-type",
        "truncated-weights",
        "corrupt-header",
        "no-tokenizer",
        "sentencepiece-only",
        "no-weights",
    ],
)
def test_hf_folder_errors_name_the_file_and_the_problem(hf_folder_copy, tmp_path, break_folder, named_file, problem):
    break_folder(hf_folder_copy)
    with pytest.raises(KilnError) as error:
        ingest(hf_folder_copy, tmp_path / "work")
    assert str(error.value).startswith(f"{hf_folder_copy / named_file}: ")
    assert problem in str(error.value)


def test_a_source_that_is_not_there_or_not_a_model(tmp_path):
    with pytest.raises(KilnError, match="no such file or folder"):
        ingest(tmp_path / "missing.gguf", tmp_path / "work")
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    with pytest.raises(KilnError, match="not a model source"):
        ingest(text_file, tmp_path / "work")


# ---- hub ids, against a fake hub on 127.0.0.1 ----------------------------------------------

INGEST_IN_SUBPROCESS = """
import json, sys
from pathlib import Path
import numpy as np
from kiln.compile.source.ingest import ingest
from kiln.errors import KilnError
try:
    model = ingest(sys.argv[1], Path(sys.argv[2]))
except KilnError as error:
    print(error)
    sys.exit(3)
np.savez(sys.argv[3], **{name: model.load_tensor(name) for name in model.tensor_names()})
print(json.dumps({"name": model.name, "path": str(model.path), "source_hash": model.source_hash}))
"""


@pytest.fixture
def hub_endpoint(tiny_hf_folder, tmp_path):
    """org/tiny: the tiny folder plus files a build does not need; org/tiny-bin: PyTorch weights only."""
    from werkzeug.serving import make_server

    torch = pytest.importorskip("torch")
    folder, expected = tiny_hf_folder
    extras = tmp_path / "hub-extras"
    extras.mkdir()
    (extras / "README.md").write_text("# tiny\n")
    torch.save({name: torch.from_numpy(values) for name, values in expected.items()}, extras / "pytorch_model.bin")
    hf_files = {path.name: path for path in folder.iterdir()}
    repositories = {
        "org/tiny": {**hf_files, "README.md": extras / "README.md", "pytorch_model.bin": extras / "pytorch_model.bin"},
        "org/tiny-bin": {
            **{name: path for name, path in hf_files.items() if name != "model.safetensors"},
            "pytorch_model.bin": extras / "pytorch_model.bin",
        },
    }
    server = make_server("127.0.0.1", 0, fake_hub(repositories), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def hub_environment(**hub_variables: str) -> dict[str, str]:
    """The hub client reads HF_* variables when imported, so each setting gets a fresh process."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    return {**environment, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **hub_variables}


def ingest_in_subprocess(source: str, tmp_path: Path, **hub_variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", INGEST_IN_SUBPROCESS, source, str(tmp_path / "work"), str(tmp_path / "tensors.npz")],
        env=hub_environment(**hub_variables),
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_saved_tensors(npz_path: Path, expected: dict[str, np.ndarray]) -> None:
    with np.load(npz_path) as tensors:
        assert sorted(tensors.files) == sorted(expected)
        for name, values in expected.items():
            np.testing.assert_array_equal(tensors[name], values, err_msg=name)


@pytest.mark.slow
def test_hub_id_is_downloaded_then_read_offline_from_the_cache(hub_endpoint, tiny_hf_folder, tmp_path):
    folder, expected = tiny_hf_folder
    hub_home = str(tmp_path / "hf-home")

    online = ingest_in_subprocess("org/tiny", tmp_path, HF_ENDPOINT=hub_endpoint, HF_HOME=hub_home)
    assert online.returncode == 0, online.stdout + online.stderr
    summary = json.loads(online.stdout.strip().splitlines()[-1])
    assert summary["name"] == "tiny"
    assert summary["source_hash"] == ingest(folder, tmp_path / "work").source_hash
    # only what a build reads: no README, no second copy of the weights
    saved = sorted(path.name for path in Path(summary["path"]).iterdir())
    assert saved == sorted(path.name for path in folder.iterdir())
    assert_saved_tensors(tmp_path / "tensors.npz", expected)

    # Offline, with nothing listening at the endpoint: served from the cache.
    offline = ingest_in_subprocess(
        "org/tiny", tmp_path, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=hub_home, HF_HUB_OFFLINE="1"
    )
    assert offline.returncode == 0, offline.stdout + offline.stderr
    assert json.loads(offline.stdout.strip().splitlines()[-1]) == summary


@pytest.mark.slow
def test_a_hub_build_at_a_revision_compiles_its_targets_side_by_side(hub_endpoint, tmp_path):
    """The compile processes read the build's download (its snapshot folder), not the hub id again."""
    command = [
        "compile",
        "org/tiny",
        "--revision",
        "main",
        "-q",
        "q0f32",
        "-t",
        "cpu,wasm",
        "-j",
        "2",
        "-o",
        str(tmp_path),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli", *command, "--model-id", "hub"],
        env=hub_environment(HF_ENDPOINT=hub_endpoint, HF_HOME=str(tmp_path / "hf")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kiln: compile cpu, wasm … (2 side by side" in result.stderr
    record = json.loads((tmp_path / "hub" / "kiln-build.json").read_text())
    assert record["source_revision"] == FAKE_COMMIT and sorted(record["targets"]) == ["cpu", "wasm"]


@pytest.mark.slow
def test_hub_id_with_pytorch_weights_only(hub_endpoint, tiny_hf_folder, tmp_path):
    _, expected = tiny_hf_folder
    result = ingest_in_subprocess("org/tiny-bin", tmp_path, HF_ENDPOINT=hub_endpoint, HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert_saved_tensors(tmp_path / "tensors.npz", expected)


@pytest.mark.slow
def test_hub_id_offline_with_an_empty_cache_is_an_error(tmp_path):
    result = ingest_in_subprocess(
        "org/tiny", tmp_path, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1"
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.startswith("org/tiny: cannot get it from the Hugging Face hub")


@pytest.mark.slow
def test_hub_id_unknown_to_the_hub_is_an_error(hub_endpoint, tmp_path):
    result = ingest_in_subprocess("org/missing", tmp_path, HF_ENDPOINT=hub_endpoint, HF_HOME=str(tmp_path / "hf-home"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.startswith("org/missing: cannot get it from the Hugging Face hub")
