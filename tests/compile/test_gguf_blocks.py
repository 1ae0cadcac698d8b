"""`gguf_f32` and `gguf_f16` end to end, on a tiny Llama stored as a llama.cpp Q4_K_M file stores
one (tiny_families.write_mixed_blocks_gguf: every block type Kiln keeps, fused weights whose parts
differ in type): the blocks compiled as they are give the logits of the same GGUF dequantized by
gguf-py (its q0f32 build), natively, in the browser and in WebLLM; bad input is refused cleanly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers.failures import assert_clean_failure
from helpers.parity import assert_contract_holds, parity
from helpers.reference import LOGIT_TOLERANCE, PROMPTS
from helpers.tiny_families import MIXED_BLOCK_TYPES, mixed_blocks_config, permute_for_llama_cpp, write_mixed_blocks_gguf
from helpers.webllm import assert_kiln_replies_the_same, webllm_replies

from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES
from kiln.compile.source.gguf_source import GGUFModel
from kiln.runtime import NativeModel
from kiln.tensor_cache import read_index, records

# float16 activations and KV cache against float32 ones, on logits up to about ±15 (q0f16 of
# the same file differs from q0f32 by 0.175 at most).
F16_LOGIT_TOLERANCE = 0.25
GREEDY_TOKENS = 16


def greedy(model: NativeModel, ids: list[int], steps: int = GREEDY_TOKENS) -> tuple[list[int], list[float]]:
    """Greedy tokens after `ids` and the top-2 logit gap of each step."""
    model.reset()
    logits, tokens, gaps = model.prefill(ids), [], []
    for _ in range(steps):
        top2 = np.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        tokens.append(int(logits.argmax()))
        logits = model.decode(tokens[-1])
    return tokens, gaps


def assert_same_greedy_tokens(model: NativeModel, reference: NativeModel, tolerance: float) -> None:
    """The design's contract: the same tokens up to a step where the reference's top-2 gap is
    within the logit tolerance (after it the two may part, not compared)."""
    for ids in PROMPTS:
        (tokens, _), (expected, gaps) = greedy(model, ids), greedy(reference, ids)
        close = next((step for step, gap in enumerate(gaps) if gap <= 2 * tolerance), len(gaps))
        assert tokens[: close + 1] == expected[: close + 1], (ids, tokens, expected)


def max_logit_difference(model: NativeModel, reference: NativeModel) -> float:
    differences = []
    for ids in PROMPTS:
        model.reset()
        reference.reset()
        differences.append(np.abs(model.all_logits(ids) - reference.all_logits(ids)).max())
    return float(max(differences))


@pytest.mark.slow
def test_the_mixed_gguf_is_a_model_worth_comparing(mixed_build, mixed_gguf):
    """Its q0f32 build (gguf-py's dequantization) is transformers' reading of the same file, and
    its greedy continuations are varied, its logits peaked."""
    from transformers import AutoModelForCausalLM

    native = NativeModel(mixed_build("q0f32"))
    reference = AutoModelForCausalLM.from_pretrained(
        mixed_gguf.parent, gguf_file=mixed_gguf.name, dtype=torch.float32
    ).eval()
    all_gaps = []
    for ids in PROMPTS:
        native.reset()
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(native.all_logits(ids) - expected).max() <= LOGIT_TOLERANCE
        assert expected.std() >= 1.5
        tokens, gaps = greedy(native, ids)
        print(f"greedy {tokens}, top-2 gaps from {min(gaps):.3f}, median {np.median(gaps):.3f}")
        assert len(set(tokens)) >= GREEDY_TOKENS // 2, tokens
        all_gaps += gaps
    # float32 builds are compared on every greedy token; float16 ones up to their first close call.
    assert min(all_gaps) > 2 * LOGIT_TOLERANCE and np.median(all_gaps) >= 2 * F16_LOGIT_TOLERANCE


def test_gguf_f32_gives_the_logits_of_the_gguf_dequantized_by_gguf_py(mixed_build):
    blocks, floats = NativeModel(mixed_build("gguf_f32")), NativeModel(mixed_build("q0f32"))
    difference = max_logit_difference(blocks, floats)
    print(f"gguf_f32 vs q0f32: all-position logits max |Δ| {difference:.2e}")
    assert difference <= LOGIT_TOLERANCE
    assert_same_greedy_tokens(blocks, floats, LOGIT_TOLERANCE)


@pytest.mark.slow
def test_gguf_f16_gives_the_logits_of_the_gguf_dequantized_by_gguf_py(mixed_build):
    """Close to q0f32 as float16 activations allow, and the logits of q0f16 (float16 weights and
    activations): the blocks' kernels add no error of their own."""
    blocks = NativeModel(mixed_build("gguf_f16"))
    f32, f16 = NativeModel(mixed_build("q0f32")), NativeModel(mixed_build("q0f16"))
    from_f32, from_f16 = max_logit_difference(blocks, f32), max_logit_difference(blocks, f16)
    print(f"gguf_f16: all-position logits max |Δ| {from_f32:.2e} from q0f32, {from_f16:.2e} from q0f16")
    assert from_f32 <= F16_LOGIT_TOLERANCE
    assert from_f16 <= LOGIT_TOLERANCE
    assert_same_greedy_tokens(blocks, f32, F16_LOGIT_TOLERANCE)


def stored_parts(cache: dict, module: str) -> list[tuple[str, list[int]]]:
    """(ggml type, [rows, cols]) of each stored part of a Linear, in order."""
    parts, index = [], 0
    while (record := cache.get(f"{module}.parts.{index}.blocks")) is not None:
        parts.append((record["gguf_type"], record["gguf_shape"]))
        index += 1
    return parts


def test_the_tensor_cache_holds_the_ggufs_blocks(mixed_build, mixed_gguf):
    model_dir = mixed_build("gguf_f32")
    index = read_index(model_dir)[1]
    cache = {r["name"]: r for shard in index["records"] for r in shard["records"]}
    assert {r["gguf_type"] for r in cache.values() if "gguf_type" in r} == set(BLOCK_TYPES)
    # Norms are plain float32; every Linear and Embedding weight is blocks.
    assert all(("gguf_type" in r) == name.endswith(".blocks") for name, r in cache.items())
    assert all(r["dtype"] == "uint32" for name, r in cache.items() if name.endswith(".blocks"))
    assert (cache["model.embed_tokens.blocks"]["gguf_type"], cache["model.embed_tokens.blocks"]["gguf_shape"]) == (
        "Q8_0",
        [384, 256],
    )
    assert stored_parts(cache, "lm_head") == [("Q6_K", [384, 256])]

    # A run of parts of one type is one matmul; parts of different types are separate ones.
    layer = "model.layers.{}.{}"
    assert stored_parts(cache, layer.format(0, "self_attn.qkv_proj")) == [("Q4_K", [384, 256]), ("Q6_K", [128, 256])]
    assert stored_parts(cache, layer.format(0, "mlp.gate_up_proj")) == [("Q4_K", [1024, 256])]
    assert stored_parts(cache, layer.format(1, "self_attn.qkv_proj")) == [
        ("Q4_0", [256, 256]),
        ("Q4_1", [128, 256]),
        ("Q5_1", [128, 256]),
    ]
    assert stored_parts(cache, layer.format(1, "mlp.gate_up_proj")) == [("F16", [512, 256]), ("BF16", [512, 256])]
    assert stored_parts(cache, layer.format(2, "self_attn.qkv_proj")) == [("Q5_K", [512, 256])]
    assert stored_parts(cache, layer.format(1, "mlp.down_proj")) == [("F32", [256, 512])]

    reader = gguf.GGUFReader(mixed_gguf)
    gguf_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    shard_bytes = sum(shard["nbytes"] for shard in index["records"])
    print(
        f"weight shards {shard_bytes} bytes, GGUF tensor data {gguf_bytes} bytes ({shard_bytes / gguf_bytes - 1:+.2%})"
    )
    assert abs(shard_bytes / gguf_bytes - 1) <= 0.05


def test_the_blocks_are_the_files_bytes_with_q_and_k_rows_put_back(mixed_build, mixed_gguf):
    """The stored rows are the GGUF's bytes (padded to whole uint32 words); Q and K rows of blocks
    are back in Hugging Face order."""
    model_dir = mixed_build("gguf_f32")
    tensors = {t.name: t for t in gguf.GGUFReader(mixed_gguf).tensors}
    config = mixed_blocks_config()

    def hf_rows(name: str, heads: int | None = None) -> np.ndarray:
        tensor = tensors[name]
        rows = np.asarray(tensor.data).view(np.uint8).reshape(int(tensor.shape[1]), -1)
        if heads is None:
            return rows
        # llama.cpp's converter puts Hugging Face row p[i] at row i of the file.
        unpermuted = np.empty_like(rows)
        unpermuted[permute_for_llama_cpp(np.arange(len(rows)), heads)] = rows
        return unpermuted

    def stored_rows(name: str, row_bytes: int) -> np.ndarray:
        record = next(r for r in records(model_dir) if r.name == name)
        with record.shard.open("rb") as shard:
            shard.seek(record.byte_offset)
            rows = np.frombuffer(shard.read(record.nbytes), dtype=np.uint8).reshape(record.shape[0], -1)
        assert not rows[:, row_bytes:].any()
        return rows[:, :row_bytes]

    output = hf_rows("output.weight")  # Q6_K: rows of 210 bytes, stored in 53 words
    np.testing.assert_array_equal(stored_rows("lm_head.parts.0.blocks", output.shape[1]), output)
    qk = np.concatenate(
        [
            hf_rows("blk.0.attn_q.weight", config.num_attention_heads),
            hf_rows("blk.0.attn_k.weight", config.num_key_value_heads),
        ]
    )
    np.testing.assert_array_equal(stored_rows("model.layers.0.self_attn.qkv_proj.parts.0.blocks", qk.shape[1]), qk)


def test_gguf_f32_on_a_hugging_face_folder_is_refused(tiny_source, tmp_path, run_compile):
    result = run_compile(tiny_source, tmp_path / "out", "-q", "gguf_f32")
    assert_clean_failure(result, tmp_path / "out", str(tiny_source), "gguf_f32", ".gguf")


@pytest.mark.parametrize(
    "tensor, hf_name, kind",
    [
        ("blk.1.ffn_down", "model.layers.1.mlp.down_proj", "Q2_K"),
        ("blk.0.attn_v", "model.layers.0.self_attn.v_proj", "Q3_K"),
    ],
)
def test_a_block_type_gguf_f32_does_not_compile_is_refused_naming_the_tensor(
    tensor, hf_name, kind, tmp_path, run_compile
):
    path = write_mixed_blocks_gguf(tmp_path / f"with-{kind}.gguf", {**MIXED_BLOCK_TYPES, tensor: kind})
    # The schemes that dequantize read it; gguf_f32 has no kernel for it.
    assert np.all(GGUFModel(path).load(f"{hf_name}.weight") == 0)
    result = run_compile(path, tmp_path / "out", "-q", "gguf_f32")
    assert_clean_failure(result, tmp_path / "out", path.name, f"{tensor}.weight", kind)


def test_a_gguf_cut_in_the_middle_of_a_block_is_refused(mixed_gguf, tmp_path, run_compile):
    last = gguf.GGUFReader(mixed_gguf).tensors[-1]  # output.weight: Q6_K blocks of 210 bytes
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mixed_gguf.read_bytes()[: last.data_offset + 192 * 210 + 7])
    result = run_compile(cut, tmp_path / "out", "-q", "gguf_f32")
    assert_clean_failure(result, tmp_path / "out", "cut.gguf", "not a readable GGUF file")


@pytest.fixture(scope="session")
def mixed_browser_dir(mixed_build):
    return mixed_build("gguf_f32", ["cpu", "webgpu", "wasm"])


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["webgpu", "wasm"])
def test_browser_parity_on_the_mixed_blocks(backend, mixed_browser_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "The history of the city is long and full of stories about the river\n"
        "In the morning the people of the town walk to the harbour\n"
    )
    code, report = parity(mixed_browser_dir, "--prompts", str(prompts), "--max-tokens", "8", "--target", backend)
    print({k: v for k, v in report.items() if k != "prompts"})
    assert report["browser"] == backend
    assert_contract_holds(code, report, prompts=2, max_tokens=8)


@pytest.mark.browser
def test_webllm_generates_what_kiln_generates_on_the_mixed_blocks(driver, mixed_browser_dir, tmp_path):
    conversations = [[{"role": "user", "content": "Tell me about the history of the city"}]]
    replies = webllm_replies(driver, tmp_path / "profile", mixed_browser_dir, conversations)
    assert replies[0]["text"]
    assert_kiln_replies_the_same(mixed_browser_dir, conversations, replies)


def test_bench_times_every_matrix_type_a_decode_step_reads(mixed_build):
    """`kiln bench native`'s census: a GEMV per type and shape over the model's own blocks, every
    type the mixed file stores (its untied embedding only gathered, so not counted), its bytes once."""
    from kiln.bench.matrices import time_matrix_types
    from kiln.tensor_cache import records

    model_dir = mixed_build("gguf_f32")
    types = time_matrix_types(model_dir, bandwidth=1e10)
    read = {name: kind for name, kind in MIXED_BLOCK_TYPES.items() if name != "token_embd"}
    assert sorted(t["kind"] for t in types) == sorted(set(read.values()))
    stored = [r for r in records(model_dir) if "gguf_type" in r.layout and "embed_tokens" not in r.name]
    assert sum(t["bytes"] for t in types) == sum(r.nbytes for r in stored)
    for t in types:
        assert t["ms"] > 0 and t["gb_per_s"] == pytest.approx(t["bytes"] / t["ms"] / 1e6), t
