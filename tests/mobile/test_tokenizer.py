"""The mobile runtime's tokenizer (kiln/mobile/runtime/tokenizer.cc, built for this machine with the
driver tests/mobile/drivers/tokenize.cc) gives the ids and text of Hugging Face tokenizers for each
kind of tokenizer.json Kiln writes or ships, and refuses any other by naming what it lacks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
from helpers.assets import LLAMA_CPP_VOCABULARIES, llama_cpp_vocabulary, smollm2_gguf
from helpers.host_cpp import RUNTIME_SOURCES, DriverProcess, host_program
from helpers.tekken import tekken_reference, write_tekken_gguf, write_tekken_json
from helpers.tiny_llama import LLAMA_2_TOKENS, write_tokenizer
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from kiln.bench.compile import DEFAULT_TEXT
from kiln.compile.source.gguf_file import read_gguf
from kiln.compile.source.gguf_source import LLAMA3_SPLIT, QWEN2_SPLIT, GGUFMetadata, write_tokenizer_files

MORE_SCRIPTS = "Grüße aus Köln! Ça va? Привет, как дела? 你好，世界。こんにちは。مرحبا بالعالم שלום\n"
MORE_SCRIPTS += "In 2024, 1999 and 2000: 12345 + 678 = 13023, 3.14159, 100%, 42 42 42.\n"
SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|begin_of_text|>"]
SPECIAL_TEXTS += ["<|end|>", "<think>", "<mask>", "<start_of_turn>", "<0x41>", "<0xZZ>", "▁", "Ġ"]
TRICKY_TEXTS = [
    "",
    " ",
    "Hello world",
    " Hello  world \n\n\tdon't I'm we'll they've she'd IT'S it'ſa 'ſa",
    "12345678901234 3.14159 ١٢٣ ²³ ½",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <s>  </s> <unk>",
    "  <|end|>   after <mask> x   <mask>y <think>z",
    " KilnKilnKiln KilnKilnKiln",
    "emoji 😀👍🏽👨‍👩‍👧🇫🇷 and ZWJ\u200d and BOM\ufeff",
    "Grüße 你好 こんにちは مرحبا Привет שלום ñ é ü",
    "\r\n\r\n  \u00a0\u3000\u2028 \x00\x1c\x85",
    "▁ leading ▁▁ metaspace ▁",
    "a" * 301 + " " + "ab" * 200 + " aaa eee lll ooo sss ttt   ▁▁▁ 000",
]


def decomposing_or_combining() -> list[str]:
    """Each character with a canonical decomposition (Hangul syllables included) or a combining class."""
    return [
        c
        for c in map(chr, range(sys.maxunicode + 1))
        if unicodedata.combining(c) or not unicodedata.is_normalized("NFD", c)
    ]


DECOMPOSING_OR_COMBINING = decomposing_or_combining()


def nfc_differs_in_tokenizers() -> str:
    """The characters whose NFC tokenizers gives otherwise than Python (14): its normalizer's tables are
    of Unicode 9, so marks given a combining class since are starters to it (U+0C3C, U+1DFA), and it
    does not join U+11935 U+11930 into U+11938 (all three are here). Hangul, by arithmetic, agrees."""
    nfc = normalizers.NFC()
    differs = set()
    for c in DECOMPOSING_OR_COMBINING:
        if "\uac00" <= c <= "\ud7a3":
            continue
        if unicodedata.combining(c):
            # A mark of any class moves before U+0345 (240) or after U+0334 (1).
            probes = [f"a\u0345{c}", f"a{c}\u0334"]
            if any(nfc.normalize_str(probe) != unicodedata.normalize("NFC", probe) for probe in probes):
                differs.add(c)
        else:
            decomposed = unicodedata.normalize("NFD", c)
            if nfc.normalize_str(decomposed) != unicodedata.normalize("NFC", decomposed):
                differs.update(c + decomposed)
    return "".join(sorted(differs))


NFC_DIFFERS_IN_TOKENIZERS = nfc_differs_in_tokenizers()


def any_text() -> st.SearchStrategy[str]:
    # Cn is left out: Python's Unicode (14) leaves unassigned what tokenizers' newer one may call a letter.
    characters = st.characters(exclude_categories=("Cs", "Cn"), exclude_characters=NFC_DIFFERS_IN_TOKENIZERS)
    pieces = st.one_of(
        st.text(characters, max_size=12),
        st.text(st.sampled_from("abcXYZαβγабвж你好こんにちはمرحباשלום"), min_size=1, max_size=12),
        st.sampled_from([" ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000", "▁"]),
        st.from_regex(r"[0-9]{1,9}", fullmatch=True),
        st.sampled_from(["don't", "I'm", "we'll", "they've", "she'd", "it's", "YOU'RE", "'S", "'ſ", "'ll"]),
        st.sampled_from(["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "\u200d"]),
        st.sampled_from(SPECIAL_TEXTS),
    )
    return st.lists(pieces, max_size=8).map("".join)


# ---- the tokenizers ------------------------------------------------------------------------


def train(tokenizer: Tokenizer, folder: Path, vocab_size: int, special_tokens: list[str], **options) -> None:
    corpus = folder / "corpus.txt"
    corpus.write_text(DEFAULT_TEXT.read_text(encoding="utf-8") + MORE_SCRIPTS, encoding="utf-8")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False, **options)
    tokenizer.train([str(corpus)], trainer)


def save(tokenizer: Tokenizer, path: Path, edit=lambda data: None) -> Path:
    data = json.loads(tokenizer.to_str())
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def byte_level_bpe(folder: Path, pre_tokenizer, special_tokens: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    train(tokenizer, folder, 700, special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    return tokenizer


def gpt2(folder: Path) -> Path:
    """GPT-2's regex in ByteLevel, merges as "a b" strings, RoBERTa's lstrip <mask>."""
    tokenizer = byte_level_bpe(folder, pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"])
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)

    def string_merges(data):
        data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]

    return save(tokenizer, folder / "gpt2.json", string_merges)


def digits(folder: Path) -> Path:
    """SmolLM2's pre-tokenizer (each digit apart, then GPT-2's ByteLevel) over merges of digits."""
    tokenizer = byte_level_bpe(folder, pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return save(tokenizer, folder / "digits.json")


def split_then_bytes(pattern: str):
    """Llama 3's and Qwen2's pre-tokenizer, as Kiln (and their own tokenizer.json) write it."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )


def llama3(folder: Path) -> Path:
    """Llama 3's regex and ignore_merges, with tokens the merges never make: "ĠKilnKilnKiln", and
    "'ſ" ("'Å¿"), which the regex's case-insensitive 's takes whole from "'ſa"."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer = byte_level_bpe(folder, split_then_bytes(LLAMA3_SPLIT), special)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]),
        ]
    )

    def whole_word_token(data):
        vocab = data["model"]["vocab"]
        for whole_word in ("ĠKilnKilnKiln", "'Å¿"):
            vocab[whole_word] = max(vocab.values()) + 1
        data["model"]["ignore_merges"] = True

    return save(tokenizer, folder / "llama3.json", whole_word_token)


def qwen2(folder: Path) -> Path:
    """Qwen2's regex (Llama 3's with digits one by one), ChatML tokens and a plain added token."""
    tokenizer = byte_level_bpe(folder, split_then_bytes(QWEN2_SPLIT), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return save(tokenizer, folder / "qwen2.json")


def qwen3(folder: Path) -> Path:
    """Qwen2.5's and Qwen3's: Qwen2's with the NFC normalizer."""
    tokenizer = Tokenizer.from_file(str(qwen2(folder)))
    tokenizer.normalizer = normalizers.NFC()
    return save(tokenizer, folder / "qwen3.json")


SENTENCEPIECE_SPECIALS = ["<unk>", "<s>", "</s>"]


def sentencepiece_bpe(folder: Path, normalizer, pre_tokenizer, decoder, byte_fallback: bool = True) -> Tokenizer:
    """Llama 2's layout: <unk> <s> </s>, the 256 <0xNN> byte tokens, then pieces trained on words
    that start with "▁"; a small alphabet, so that byte fallback (or <unk>) is common."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    train(trained, folder, 400, SENTENCEPIECE_SPECIALS, limit_alphabet=60)
    pieces = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = [*SENTENCEPIECE_SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256))]
    tokens += [piece for piece, _ in pieces if piece not in SENTENCEPIECE_SPECIALS]
    merges = [tuple(pair) for pair in json.loads(trained.to_str())["model"]["merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=byte_fallback, fuse_unk=True))
    specials = [AddedToken(token, special=True, normalized=False) for token in SENTENCEPIECE_SPECIALS]
    tokenizer.add_special_tokens(specials)
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


def sentencepiece_decoder(strip_space: bool = True):
    """transformers' LlamaConverter decoder (as Kiln writes it for GGUF vocabularies)."""
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if strip_space else steps)


def llama2(folder: Path) -> Path:
    """Llama 2 and Mistral (and Kiln from a GGUF): "▁" put in by the normalizer; Phi-3's rstrip
    <|end|> and a normalized added token."""
    tokenizer = sentencepiece_bpe(
        folder,
        normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
        None,
        sentencepiece_decoder(),
    )
    tokenizer.add_special_tokens([AddedToken("<|end|>", rstrip=True, special=True, normalized=False)])
    tokenizer.add_tokens(["<think>"])
    return save(tokenizer, folder / "llama2.json")


def metaspace_first(folder: Path) -> Path:
    """transformers' LlamaConverter with legacy=False: a Metaspace pre-tokenizer, "▁" only first."""
    pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    return save(sentencepiece_bpe(folder, None, pre_tokenizer, sentencepiece_decoder()), folder / "first.json")


def metaspace_always(folder: Path) -> Path:
    """transformers' SpmConverter: Metaspace splitting words, and its decoder; runs of unknown
    characters fused into one <unk>, as before byte fallback."""
    tokenizer = sentencepiece_bpe(
        folder,
        None,
        pre_tokenizers.Metaspace(prepend_scheme="always", split=True),
        decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always")]),
        byte_fallback=False,
    )
    return save(tokenizer, folder / "always.json")


def gemma(folder: Path) -> Path:
    """transformers' GemmaConverter: spaces replaced, no "▁" put first, a literal Split."""
    tokenizer = sentencepiece_bpe(
        folder,
        normalizers.Replace(" ", "▁"),
        pre_tokenizers.Split(" ", "merged_with_previous"),
        sentencepiece_decoder(strip_space=False),
    )
    tokenizer.add_special_tokens([AddedToken("<start_of_turn>", special=True, normalized=False)])
    return save(tokenizer, folder / "gemma.json")


def tiny_llama2(folder: Path) -> Path:
    """The tokenizer of the tests' tiny Llama 2 models: <unk> for what the vocabulary lacks."""
    write_tokenizer(folder, LLAMA_2_TOKENS)
    return folder / "tokenizer.json"


def from_gguf(path: Path, folder: Path) -> Path:
    """The tokenizer.json Kiln writes for a GGUF's vocabulary."""
    write_tokenizer_files(GGUFMetadata(read_gguf(path).metadata, path), folder)
    return folder / "tokenizer.json"


def tekken(folder: Path) -> Path:
    """Mistral's tekken split (\\p{Lu}, \\p{Ll}, \\p{M}, ...), as Kiln writes it from a tekken GGUF."""
    reference = tekken_reference(write_tekken_json(folder))
    return from_gguf(write_tekken_gguf(reference, folder / "tekken.gguf"), folder)


def smollm2(folder: Path) -> Path:
    """The real SmolLM2-135M-Instruct's, as Kiln writes it from its GGUF (Digits, then GPT-2's ByteLevel)."""
    return from_gguf(smollm2_gguf(), folder)


KINDS = {
    "smollm2": smollm2,
    "gpt2": gpt2,
    "digits": digits,
    "llama3": llama3,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "tekken": tekken,
    "llama2": llama2,
    "metaspace_first": metaspace_first,
    "metaspace_always": metaspace_always,
    "gemma": gemma,
    "tiny_llama2": tiny_llama2,
}
# The real SmolLM2 is fetched (98 MB) on first use.
KIND_PARAMS = [pytest.param(kind, marks=pytest.mark.slow) if kind == "smollm2" else kind for kind in KINDS]


# ---- the driver ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return host_program(
        "tokenize.cc",
        ["tokenizer.cc", "tokenizer_regex.cc", "unicode_normalization.cc"],
        tmp_path_factory.mktemp("tokenize"),
    )


class Tokenizers:
    """Each kind's tokenizer.json, and the driver and Hugging Face's tokenizer on it, made on first use."""

    def __init__(self, program: Path, tmp_path_factory):
        self.program = program
        self.tmp_path_factory = tmp_path_factory
        self.paths: dict[str, Path] = {}
        self.running: dict[str, tuple[DriverProcess, Tokenizer]] = {}

    def path(self, kind: str) -> Path:
        if kind not in self.paths:
            self.paths[kind] = KINDS[kind](self.tmp_path_factory.mktemp(kind))
        return self.paths[kind]

    def __getitem__(self, kind: str) -> tuple[DriverProcess, Tokenizer]:
        if kind not in self.running:
            path = self.path(kind)
            self.running[kind] = (DriverProcess(self.program, path), Tokenizer.from_file(str(path)))
        return self.running[kind]

    def close(self) -> None:
        for process, _ in self.running.values():
            process.close()


@pytest.fixture(scope="module")
def tokenizers(program, tmp_path_factory):
    made = Tokenizers(program, tmp_path_factory)
    yield made
    made.close()


def about(program: Path, tokenizer_json: Path) -> dict:
    """The driver's --about: vocab_size, and the special tokens before and after a sequence."""
    return json.loads(subprocess.run([program, tokenizer_json, "--about"], capture_output=True, check=True).stdout)


def assert_same(process: DriverProcess, reference: Tokenizer, text: str) -> None:
    ids = reference.encode(text, add_special_tokens=False).ids
    assert process.ask(text) == {"ids": ids, "text": reference.decode(ids, skip_special_tokens=False)}, text


# ---- agreement -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_tricky_texts_as_tokenizers(kind, tokenizers):
    for text in TRICKY_TEXTS:
        assert_same(*tokenizers[kind], text)


@pytest.mark.parametrize("kind", KIND_PARAMS)
@settings(max_examples=150, deadline=None)
@given(text=any_text())
def test_any_text_as_tokenizers(kind, text, tokenizers):
    assert_same(*tokenizers[kind], text)


@pytest.mark.slow
@pytest.mark.parametrize("vocabulary", LLAMA_CPP_VOCABULARIES)
def test_llama_cpp_vocabularies_as_tokenizers(vocabulary, program, tmp_path):
    """Real vocabularies (GPT-2, Llama 3, Llama 2, Phi-3, Qwen2, Refact as Granite's GGUFs name theirs) on
    llama.cpp's own test texts."""
    path = llama_cpp_vocabulary(vocabulary)
    tokenizer_json = from_gguf(path, tmp_path)
    reference = Tokenizer.from_file(str(tokenizer_json))
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    process = DriverProcess(program, tokenizer_json)
    try:
        for text in texts + TRICKY_TEXTS:
            assert_same(process, reference, text)
    finally:
        process.close()


@pytest.mark.parametrize("behavior", ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"])
@pytest.mark.parametrize("invert", [False, True])
def test_split_behaviors_as_tokenizers(behavior, invert, program, tokenizers, tmp_path):
    reference = Tokenizer.from_file(str(tokenizers.path("gpt2")))
    split = pre_tokenizers.Split(Regex(r"\s+|\p{N}"), behavior, invert=invert)
    reference.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(False, use_regex=False)])
    process = DriverProcess(program, save(reference, tmp_path / "tokenizer.json"))
    try:
        for text in TRICKY_TEXTS:
            assert_same(process, reference, text)
    finally:
        process.close()


@pytest.mark.parametrize("kind", KIND_PARAMS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_ids_decode_as_tokenizers(kind, data, tokenizers):
    """Also ids no text encodes to: lone <0xNN> bytes, broken UTF-8, ids past the vocabulary."""
    process, reference = tokenizers[kind]
    ids = data.draw(st.lists(st.integers(0, reference.get_vocab_size() + 2), max_size=12))
    assert process.ask(ids) == {"text": reference.decode(ids, skip_special_tokens=False)}


def test_ignore_merges_takes_a_whole_word_token(tokenizers):
    process, reference = tokenizers["llama3"]
    assert process.ask(" KilnKilnKiln")["ids"] == [reference.token_to_id("ĠKilnKilnKiln")]


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_vocab_size_and_token_ids_as_tokenizers(kind, program, tokenizers):
    process, reference = tokenizers[kind]
    assert about(program, tokenizers.path(kind))["vocab_size"] == reference.get_vocab_size()
    for token in [*SPECIAL_TEXTS, "a", "Ġthe", "▁the", "not a token"]:
        assert process.ask({"token": token}) == {"id": reference.token_to_id(token)}, token


POST_PROCESSORS = {
    "template": processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)]
    ),
    "bert": processors.BertProcessing(("</s>", 2), ("<s>", 1)),
    "roberta": processors.RobertaProcessing(("</s>", 2), ("<s>", 1)),
    "sequence": processors.Sequence(
        [processors.ByteLevel(), processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])]
    ),
    "none": None,
}


@pytest.mark.parametrize("post_processor", POST_PROCESSORS)
def test_special_tokens_around_as_tokenizers(post_processor, program, tokenizers, tmp_path):
    reference = Tokenizer.from_file(str(tokenizers.path("llama2")))
    reference.post_processor = POST_PROCESSORS[post_processor]
    around = about(program, save(reference, tmp_path / "tokenizer.json"))
    text = "Hello there"
    bare = reference.encode(text, add_special_tokens=False).ids
    assert around["before"] + bare + around["after"] == reference.encode(text).ids


def test_encoding_100_kb_takes_well_under_a_second(tokenizers):
    """Linear work: the whole text is one word for Llama 2's BPE, and hash maps are the lookups."""
    text = (DEFAULT_TEXT.read_text(encoding="utf-8") + MORE_SCRIPTS) * 23
    for kind in ("digits", "llama2"):
        process, reference = tokenizers[kind]
        start = time.perf_counter()
        ids = process.ask(text)["ids"]
        assert time.perf_counter() - start < 1.0, kind
        assert ids == reference.encode(text, add_special_tokens=False).ids


# ---- NFC ------------------------------------------------------------------------------------


def nfc_text() -> st.SearchStrategy[str]:
    """Marks on letters in any order, Hangul jamo and syllables, Latin and Vietnamese precomposed and
    decomposed, singletons (ANGSTROM SIGN, OHM SIGN, CJK compatibility ideographs) and the composition
    exclusions (U+0958, U+2ADC, non-starter decompositions such as U+0344 and U+0F73)."""
    marks = "\u0300\u0301\u0302\u0303\u0306\u0308\u0309\u030a\u031b\u0323\u0327\u0328\u0334\u0338"
    marks += "\u0345\u0591\u05b0\u093c\u0f72\u0f74\u302a\u3099"
    letters = "aeiouyAEOUnNcCsSzZ<=>αωΑΩиИеЕkKक"
    jamo = "".join(map(chr, [*range(0x1100, 0x1113), *range(0x1161, 0x1176), *range(0x11A7, 0x11C3)]))
    syllables = st.integers(0xAC00, 0xD7A3).map(chr)
    vietnamese = "Tiếng Việt có dấu: ắằẳẵặ ấầẩẫậ ếềểễệ ốồổỗộ ớờởỡợ ứừửữự ỹỷỳý"
    singletons = "\u212b\u2126\u212a\u0340\u0341\u0343\u0374\u037e\u0387\u1f71\uf900\ufa10\U0002f800"
    excluded = "\u0344\u0958\u095f\u09dc\u0a33\u0b5c\u0f43\u0f73\u0f75\u0f81\ufb1d\ufb2a\u2adc\U0001d15e"
    pieces = st.one_of(
        st.text(st.sampled_from(letters + marks + jamo), min_size=1, max_size=12),
        syllables,
        st.sampled_from(vietnamese.split(" ")),
        st.sampled_from(vietnamese.split(" ")).map(lambda word: unicodedata.normalize("NFD", word)),
        st.text(st.sampled_from(singletons + excluded + marks), min_size=1, max_size=4),
        st.sampled_from(DECOMPOSING_OR_COMBINING),
        st.sampled_from(NFC_DIFFERS_IN_TOKENIZERS),
        any_text(),
    )
    return st.lists(pieces, max_size=10).map("".join)


def without_nfc_differences(text: str) -> str:
    return "".join(c for c in text if c not in NFC_DIFFERS_IN_TOKENIZERS)


def nfc_between_added_tokens(text: str, reference: Tokenizer) -> str:
    """NFC as a tokenizer applies it: tokenizers first splits the text on its added tokens that match
    unnormalized, then normalizes what lies between them, so a mark after `<|im_start|>` does not
    compose with its `>`."""
    unnormalized = [t.content for t in reference.get_added_tokens_decoder().values() if not t.normalized]
    if not unnormalized:
        return unicodedata.normalize("NFC", text)
    pieces = re.split("(" + "|".join(map(re.escape, sorted(unnormalized, key=len, reverse=True))) + ")", text)
    return "".join(piece if i % 2 else unicodedata.normalize("NFC", piece) for i, piece in enumerate(pieces))


@settings(max_examples=300, deadline=None)
@given(text=nfc_text())
@example(text="<|im_start|>\u0338")  # hypothesis found it: a COMBINING LONG SOLIDUS OVERLAY after a special token
def test_nfc_as_unicodedata_and_tokenizers(text, tokenizers):
    process, reference = tokenizers["qwen3"]
    assert process.ask(text)["text"] == nfc_between_added_tokens(text, reference)
    assert_same(process, reference, without_nfc_differences(text))


def test_nfc_of_each_character_that_decomposes_or_combines(tokenizers):
    """Each alone, decomposed, and as a mark between two others (U+0334 of class 1, U+0345 of 240)."""
    process, reference = tokenizers["qwen3"]
    characters = DECOMPOSING_OR_COMBINING
    for start in range(0, len(characters), 500):
        some = characters[start : start + 500]
        text = " ".join(f"{c} {unicodedata.normalize('NFD', c)} a\u0345{c}\u0334" for c in some)
        assert process.ask(text)["text"] == unicodedata.normalize("NFC", text), some
        assert_same(process, reference, without_nfc_differences(text))


def test_nfc_keeps_ascii_as_it_is(tokenizers):
    process, _ = tokenizers["qwen3"]
    ascii_text = "".join(map(chr, range(128)))
    assert process.ask(ascii_text)["text"] == ascii_text


# ---- refusals ------------------------------------------------------------------------------


def replace_in(path: Path, section: str, value) -> str:
    data = json.loads(path.read_text(encoding="utf-8"))
    data[section] = value
    return json.dumps(data)


REFUSED = {
    "wordpiece": (
        lambda _: Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str(),
        "tokenizer.json: the model WordPiece is not supported",
    ),
    "whitespace": (
        lambda path: replace_in(path, "pre_tokenizer", {"type": "Whitespace"}),
        "tokenizer.json: the pre_tokenizer Whitespace is not supported",
    ),
    "nfd": (
        lambda path: replace_in(path, "normalizer", {"type": "Sequence", "normalizers": [{"type": "NFD"}]}),
        "tokenizer.json: the normalizer NFD is not supported",
    ),
    "nfkc": (
        lambda path: replace_in(path, "normalizer", {"type": "NFKC"}),
        "tokenizer.json: the normalizer NFKC is not supported",
    ),
    "wordpiece_decoder": (
        lambda path: replace_in(path, "decoder", {"type": "WordPiece", "prefix": "##", "cleanup": True}),
        "tokenizer.json: the decoder WordPiece is not supported",
    ),
    "regex": (
        lambda path: replace_in(path, "pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{Sc}+"}}),
        'tokenizer.json: the pre_tokenizer Split\'s regex "\\p{Sc}+" is not supported: a \\p{...} other than',
    ),
    "single_word": (
        lambda path: replace_in(
            path, "added_tokens", [{"id": 0, "content": "<unk>", "single_word": True, "normalized": False}]
        ),
        'tokenizer.json: the added token "<unk>"\'s single_word is not supported',
    ),
    "malformed": (lambda path: path.read_text(encoding="utf-8")[:-20], "tokenizer.json is not valid JSON"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refuses_what_it_does_not_support_by_name(case, program, tokenizers, tmp_path):
    make_text, message = REFUSED[case]
    path = tmp_path / "tokenizer.json"
    path.write_text(make_text(tokenizers.path("llama2")), encoding="utf-8")
    result = subprocess.run([program, path], input="", capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(message), result.stderr


def test_unicode_tables_are_what_the_script_makes_now(tmp_path):
    generated = tmp_path / "unicode_tables.h"
    subprocess.run([sys.executable, RUNTIME_SOURCES / "make_unicode_tables.py", generated], check=True)
    assert generated.read_text() == (RUNTIME_SOURCES / "unicode_tables.h").read_text()
