"""Kiln's CPU matmul schedule for prefill: the kernels it writes, and their numbers against numpy
(the family tests check whole models against transformers)."""

import re

import gguf
import numpy as np
import pytest
import tvm
from tvm import te, topi

from helpers.random_blocks import random_blocks

from kiln.compile.lower import cpu_prefetch, schedules_for
from kiln.compile.lower.cpu_schedule import (
    FEWEST_CHUNKS,
    REGISTER_ROWS,
    TILE_BYTES,
    reduction_span,
    register_lanes,
    register_tile,
    summed_columns,
    weight_rows_per_tile,
)
from kiln.compile.lower.library import library_metadata, param_specs, scheduled_module
from kiln.compile.pipeline import config_file, quantized_model
from kiln.compile.quantization import factored_decode, quantization_named
from kiln.compile.quantization.ggml_blocks import BLOCK_TYPES, Levels
from kiln.compile.quantization.group import GroupFormat
from kiln.compile.source.ingest import ingest
from kiln.runtime import missing_cpu_features
from kiln.models import architecture_for
from kiln.models.embedding import MASKED_SCORE, masked_scores
from kiln.models.layers import matmul_transposed
from kiln.targets import TARGETS

Q4F32 = GroupFormat(4, 32, "float32")
IN_FEATURES = 64


def unscheduled_prefill_matmul(out_features: int, in_features: int = IN_FEATURES) -> tvm.IRModule:
    """A q4f32_1 matmul of a symbolic number of input rows."""
    rows = tvm.tirx.Var("n", "int64")
    x = te.placeholder((1, rows, in_features), "float32", name="x")
    weight = te.placeholder((out_features, in_features // 8), "uint32", name="weight")
    scale = te.placeholder((out_features, in_features // 32), "float32", name="scale")
    y = matmul_transposed(x, Q4F32.dequantize_te(weight, scale, out_features, in_features), "float32")
    return tvm.IRModule({"main": te.create_prim_func([x, weight, scale, y]).with_attr("global_symbol", "main")})


def prefill_matmul(out_features: int, target_name: str = "cpu", in_features: int = IN_FEATURES) -> tvm.IRModule:
    """`unscheduled_prefill_matmul` under the target's schedules."""
    entry = TARGETS[target_name]
    with entry.target():
        return schedules_for(entry)(unscheduled_prefill_matmul(out_features, in_features))


@pytest.mark.parametrize("target_name", ["wasm", "arm64-linux"])
@pytest.mark.parametrize("out_features", [96, 40, 20, 6])
def test_a_tile_is_the_most_weight_rows_that_divide_the_width_and_its_sums_stay_in_registers(target_name, out_features):
    target = TARGETS[target_name].target()
    tile = weight_rows_per_tile(target, out_features)
    assert out_features % tile == 0
    assert all(out_features % larger for larger in range(tile + 1, weight_rows_per_tile(target, 2**20) + 1))
    script = prefill_matmul(out_features, target_name)["main"].script()
    assert re.search(r'matmul_rf_local = T.sblock_alloc_buffer\(.*scope="local"\)', script)
    assert f"in T.unroll({tile}):" in script  # the tile's weight rows, each with its vector of sums


def test_a_wide_tile_meets_the_inputs_a_span_of_columns_at_a_time():
    """Its weights beyond TILE_BYTES would stream from L2 for every input row; a span's fit half."""
    tile = weight_rows_per_tile(TARGETS["arm64-linux"].target(), WIDE_OUT_FEATURES)
    span = reduction_span(tile, WIDE_IN_FEATURES)
    assert span < WIDE_IN_FEATURES and WIDE_IN_FEATURES % span == 0 and span % 32 == 0
    assert tile * span * 4 <= TILE_BYTES // 2 < tile * 2 * span * 4
    assert reduction_span(tile, IN_FEATURES) == IN_FEATURES
    script = prefill_matmul(WIDE_OUT_FEATURES, "arm64-linux", WIDE_IN_FEATURES)["main"].script()
    assert f"T.grid({tile}, {span // 32}, 4)" in script  # a tile's span unpacked, in vectors of 8 weights


WIDE_OUT_FEATURES, WIDE_IN_FEATURES = 24, 2048
AVX512 = {"kind": "llvm", "mcpu": "x86-64-v4", "mattr": ["+avx512vnni", "+avx512vbmi"]}  # CPU_VARIANTS' row


@pytest.mark.parametrize(
    "tvm_target, out_features, vectors, lanes",
    [
        (TARGETS["cpu"].tvm_target(), 96, 2, 8),
        (TARGETS["cpu"].tvm_target(), 40, 1, 8),
        (AVX512, 96, 2, 16),
        (AVX512, 40, 1, 8),
    ],
)
def test_an_x86_prefill_keeps_six_input_rows_by_two_vectors_of_outputs_in_registers(
    tvm_target, out_features, vectors, lanes
):
    """Each column of a tile's weights is one vector load (they are unpacked transposed), met by a
    broadcast input per row; the rows are padded to whole steps, so no test sits in the inner loop."""
    target = tvm.target.Target(tvm_target)
    assert register_tile(target, out_features) == (vectors, lanes)
    with target:
        script = schedules_for(TARGETS["cpu"])(unscheduled_prefill_matmul(out_features))["main"].script()
    assert f"dequantize = T.sblock_alloc_buffer(({IN_FEATURES}, {out_features}))" in script  # column-major
    for sums in ("matmul_pad_rf_local", "matmul_pad_local"):  # a chunk's sums, the totals
        assert re.search(rf'{sums} = T.sblock_alloc_buffer\(.*scope="local"\)', script)
    chunk = script[script.index("for k_1 in range") : script.index('T.sblock("matmul_rf_update")')]
    assert f"T.unroll(T.int64({REGISTER_ROWS}))" in chunk and f"T.vectorized({lanes})" in chunk
    assert (
        "T.where"
        not in script[script.index('T.sblock("matmul_rf_update")') : script.index('T.sblock("matmul_pad_local")')]
    )


@pytest.mark.parametrize(
    "width, columns", [(4864, 128), (896, 128), (576, 72), (384, 48), (128, 16), (64, 8), (20, 20)]
)
def test_a_register_tile_sums_chunks_of_whole_vectors_that_leave_no_loop_of_a_few_chunks(width, columns):
    assert summed_columns(width) == columns
    assert width % columns == 0 and (columns == width or width // columns >= FEWEST_CHUNKS)


def test_other_cpus_keep_the_tiles_of_weight_rows():
    assert register_lanes(TARGETS["wasm"].target()) is None
    assert register_lanes(TARGETS["arm64-linux"].target()) is None
    assert register_lanes(tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v2"})) is None  # no AVX2


def runnable(tvm_target: dict) -> tvm.target.Target:
    """`tvm_target`, skipping where this machine's CPU cannot run its code."""
    if missing_cpu_features(tvm_target["mcpu"], [a.lstrip("+") for a in tvm_target.get("mattr", [])]):
        pytest.skip(f"this machine's CPU cannot run {tvm_target['mcpu']}")
    return tvm.target.Target(tvm_target)


def built(module: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Module:
    with target:
        return tvm.tirx.build(schedules_for(TARGETS["cpu"])(module), target=target)


def assert_float32_sums_of(out: np.ndarray, x: np.ndarray, weights: np.ndarray) -> None:
    """float32 sums in any order: within a few roundings of the products' magnitudes."""
    magnitudes = np.abs(x).astype(np.float64) @ np.abs(weights.T).astype(np.float64)
    error = np.abs(out - x.astype(np.float64) @ weights.T.astype(np.float64))
    assert (error <= 1e-6 * magnitudes + 1e-6).all(), (error / magnitudes).max()


X86_LEVELS = [TARGETS["cpu"].tvm_target(), AVX512]


@pytest.mark.parametrize("tvm_target", X86_LEVELS, ids=["avx2", "avx512"])
@pytest.mark.parametrize("out_features, in_features", [(96, IN_FEATURES), (WIDE_OUT_FEATURES, WIDE_IN_FEATURES)])
def test_prefill_gives_numpys_products_for_any_number_of_rows(tvm_target, out_features, in_features):
    library = built(unscheduled_prefill_matmul(out_features, in_features), runnable(tvm_target))
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 2**32, (out_features, in_features // 8), dtype=np.uint64).astype(np.uint32)
    scale = rng.random((out_features, in_features // 32), dtype=np.float32)
    levels = (weight[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15
    dequantized = (levels.reshape(out_features, in_features).astype(np.float32) - 7) * np.repeat(scale, 32, axis=1)
    for rows in (1, 5, 6, 13):
        x = rng.standard_normal((1, rows, in_features), dtype=np.float32)
        out = tvm.runtime.tensor(np.zeros((1, rows, out_features), np.float32))
        library["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(weight), tvm.runtime.tensor(scale), out)
        assert_float32_sums_of(out.numpy()[0], x[0], dequantized)


@pytest.mark.parametrize("tvm_target", X86_LEVELS, ids=["avx2", "avx512"])
def test_prefill_of_float_weights_over_a_batch_of_inputs_with_a_bias_gives_numpys_products(tvm_target):
    """An embedding model's matmul (kiln/models/embedding.py): weights stored as floats are copied
    transposed into the tile, rows in two symbolic axes, a bias added after the sums."""
    batch, rows = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    x = te.placeholder((batch, rows, IN_FEATURES), "float32", name="x")
    weight = te.placeholder((96, IN_FEATURES), "float32", name="weight")
    bias = te.placeholder((96,), "float32", name="bias")
    y = matmul_transposed(x, weight, "float32")
    z = te.compute(y.shape, lambda b, r, o: y[b, r, o] + bias[o], name="T_add")
    module = tvm.IRModule({"main": te.create_prim_func([x, weight, bias, z]).with_attr("global_symbol", "main")})
    library = built(module, runnable(tvm_target))
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, IN_FEATURES), dtype=np.float32)
    b = rng.standard_normal(96, dtype=np.float32)
    for shape in ((1, 1), (3, 5), (2, 13)):
        xs = rng.standard_normal((*shape, IN_FEATURES), dtype=np.float32)
        out = tvm.runtime.tensor(np.zeros((*shape, 96), np.float32))
        library["main"](*[tvm.runtime.tensor(a) for a in (xs, w, b)], out)
        assert_float32_sums_of(out.numpy().reshape(-1, 96) - b, xs.reshape(-1, IN_FEATURES), w)


@pytest.mark.slow  # it compiles a model
def test_the_cpu_librarys_kernels_keep_their_alias_information(tiny_source, tmp_path):
    """TVM's LLVM code generator puts every load and store of a module in one alias set ("tvm-alias")
    when a kernel of TVM's KV cache is built without `tirx.noalias` (kiln/models/kv_cache/cache_kernels.py): prefill
    then ran at half speed, its partial sums stored to memory at every step."""
    scheme = quantization_named("q4f32_1")
    source = ingest(str(tiny_source), tmp_path)
    arch = architecture_for(source.config, config_file(source))
    model, _, _ = quantized_model(source, arch, arch.parse_config(source.config, config_file(source), {}), scheme)
    entry = TARGETS["cpu"]
    module = scheduled_module(model, entry, library_metadata(model, scheme.name, param_specs(model)))
    llvm_ir = tvm.compile(module, entry.target(), relax_pipeline=None).mod.imports[0].inspect_source("ll")
    assert "!tbaa" in llvm_ir
    assert '"tvm-alias"' not in llvm_ir


DECODE_IN_FEATURES = 512  # two K-quant blocks, eight 64-column blocks of MLC's 4-bit words
DECODE_OUT_FEATURES = 38  # not a multiple of the rows a step takes


def decode_library(args: list[te.Tensor], y: te.Tensor) -> tuple[tvm.runtime.Module, str]:
    """The cpu library of a one-row matmul under Kiln's schedules, and its scheduled TIR."""
    module = tvm.IRModule({"main": te.create_prim_func([*args, y]).with_attr("global_symbol", "main")})
    entry = TARGETS["cpu"]
    with entry.target():
        module = schedules_for(entry)(module)
    return tvm.tirx.build(module, target=entry.target()), module["main"].script()


def assert_scales_stay_out_of_the_lane_dots(script: str) -> None:
    reads = re.search(r'T.sblock\("lane_dots_update"\):.*?T.reads\((.*?)\)\n', script, re.S)
    assert reads, script
    assert "scale" not in reads.group(1) and "offset" not in reads.group(1)


def run_decode(library, x: np.ndarray, *weights: np.ndarray) -> np.ndarray:
    """The products of `x`'s [1, inputs, columns] rows, [inputs, out]."""
    out = tvm.runtime.tensor(np.zeros((1, x.shape[1], DECODE_OUT_FEATURES), np.float32))
    library["main"](*[tvm.runtime.tensor(a) for a in (x, *weights)], out)
    return out.numpy()[0]


def mlc_decode(fmt: GroupFormat, inputs: int = 1) -> tuple[tvm.runtime.Module, str]:
    rows, cols = DECODE_OUT_FEATURES, DECODE_IN_FEATURES
    x = te.placeholder((1, inputs, cols), fmt.dtype, name="x")
    weight = te.placeholder((rows, cols // fmt.values_per_word), "uint32", name="weight")
    scale = te.placeholder((rows, cols // 32), fmt.dtype, name="scale")
    with TARGETS["cpu"].target():
        y = fmt.matmul_te(x, weight, scale, rows, cols, fmt.dtype)
    return decode_library([x, weight, scale], y)


@pytest.mark.parametrize("inputs", [1, 2, 5])  # a decode step, verify passes (speculative decoding)
@pytest.mark.parametrize("bits", [4, 8])
def test_decode_of_mlc_groups_gives_numpys_products_with_the_scales_out_of_the_loop_over_weights(bits, inputs):
    fmt = GroupFormat(bits, 32, "float32")
    rows, cols = DECODE_OUT_FEATURES, DECODE_IN_FEATURES
    library, script = mlc_decode(fmt, inputs)
    assert_scales_stay_out_of_the_lane_dots(script)
    rng = np.random.default_rng(bits)
    words = rng.integers(0, 2**32, (rows, cols // fmt.values_per_word), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(0.01, 0.1, (rows, cols // 32)).astype(np.float32)
    x = rng.standard_normal((1, inputs, cols)).astype(np.float32)
    shifts = np.arange(fmt.values_per_word, dtype=np.uint32) * bits
    levels = ((words[:, :, None] >> shifts) & (2**bits - 1)).reshape(rows, cols).astype(np.float64) - fmt.max_q
    expected = x[0].astype(np.float64) @ (levels * np.repeat(scales.astype(np.float64), 32, axis=1)).T
    np.testing.assert_allclose(run_decode(library, x, words, scales), expected, rtol=1e-5, atol=1e-5)


def test_a_few_input_rows_meet_each_unpacked_vector_of_weights_while_it_is_in_registers():
    """A verify pass's rows (speculative decoding) take decode's kernel with the rows inside each step
    over a block's weights, so its words are read and unpacked once for all of them; more rows than
    factored_decode.MOST_ROWS take prefill's."""
    script = mlc_decode(GroupFormat(4, 32, "float32"), 5)[1]
    assert f"T.parallel({DECODE_OUT_FEATURES})" in script, script
    steps, rows, lanes = r"T.unroll\(8\):\s+", r"for \w+ in T.unroll\(5\):\s+", r"for \w+ in T.vectorized\(8\):\s+"
    nest = steps + rows + lanes + r'with T.sblock\("lane_dots_update"\)'
    assert re.search(nest, script), script
    assert "lane_dots" not in mlc_decode(GroupFormat(4, 32, "float32"), factored_decode.MOST_ROWS + 1)[1]


def test_a_float16_models_decode_rounds_each_weight_to_float16_before_the_products():
    """As its GPU kernels and MLC do: factoring the scales out would skip that rounding (on the tiny
    Gemma 3 in q4f16_1 it moved the logits 0.12 from transformers on the same weights)."""
    assert "lane_dots" not in mlc_decode(GroupFormat(4, 32, "float16"))[1]


QUANTIZED_BLOCK_TYPES = [name for name, block_type in BLOCK_TYPES.items() if isinstance(block_type.read, Levels)]


def gguf_decode(name: str, inputs: int = 1) -> tuple[tvm.runtime.Module, str]:
    block_type = BLOCK_TYPES[name]
    rows, cols = DECODE_OUT_FEATURES, DECODE_IN_FEATURES
    x = te.placeholder((1, inputs, cols), "float32", name="x")
    stored = te.placeholder((rows, block_type.row_words(cols) * 4), "uint8", name="blocks")
    with TARGETS["cpu"].target():
        y = block_type.matmul_te(x, stored, rows, cols, "float32", "float32")
    return decode_library([x, stored], y)


@pytest.mark.parametrize("inputs", [1, 3])
@pytest.mark.parametrize("name", QUANTIZED_BLOCK_TYPES)
def test_decode_of_gguf_blocks_gives_gguf_pys_products_with_the_scales_out_of_the_loop_over_weights(name, inputs):
    block_type = BLOCK_TYPES[name]
    rows, cols = DECODE_OUT_FEATURES, DECODE_IN_FEATURES
    library, script = gguf_decode(name, inputs)
    assert_scales_stay_out_of_the_lane_dots(script)
    rng = np.random.default_rng(len(name))
    blocks = random_blocks(name, rows, cols, rng)
    padded = np.pad(blocks, ((0, 0), (0, block_type.row_words(cols) * 4 - blocks.shape[1])))
    weights = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, name)).astype(np.float64)
    x = rng.standard_normal((1, inputs, cols)).astype(np.float32)
    expected = x[0].astype(np.float64) @ weights.T
    np.testing.assert_allclose(run_decode(library, x, padded), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_decode_reads_one_weight_row_per_parallel_step_and_a_blocks_own_scale_where_it_is_used(name):
    """Each thread's rows then stream from memory as one ascending run (two rows interleaved, with
    the scales read in place, streamed a Q8_0 matrix 3× slower). A K-quant's groups of one stored
    block are unrolled together, so its packed scales are unpacked at constant offsets where they
    are used (a stage of them per row cost a Q6_K decode a third of its speed)."""
    block_type = BLOCK_TYPES[name]
    script = gguf_decode(name)[1]
    assert f"T.parallel({DECODE_OUT_FEATURES})" in script, script
    assert "group_scale" not in script
    groups_per_block = (block_type.unrolled_weights or block_type.elements) // block_type.read.group
    assert (f"T.unroll({groups_per_block})" in script) == (groups_per_block > 1), script


def test_a_decode_asks_for_its_rows_weights_and_scales_ahead_where_the_target_can():
    """Each loop over a row's blocks first asks for the weights cpu_prefetch.AHEAD bytes on, and for
    the scales as many rows on (a quarter of that for q4f32_1): matrices larger than the caches
    stream faster (kiln/compile/lower/cpu_prefetch.py). Wasm has no prefetch."""
    library, script = mlc_decode(Q4F32)
    assert "llvm.prefetch" in library.inspect_source("ll")
    # the bytes asked for at the first of each row's blocks, by matrix (a float32 scale per 32 weights)
    asked = re.findall(r"T.address_of\((\w+)\[\w+, (.*?)\]\)", script)
    first = {matrix: eval(index, {}, {"block": 0}) * 4 for matrix, index in asked}
    assert first == {"weight": cpu_prefetch.AHEAD, "scale": cpu_prefetch.AHEAD // 4}, asked
    x = te.placeholder((1, 1, DECODE_IN_FEATURES), "float32", name="x")
    weight = te.placeholder((DECODE_OUT_FEATURES, DECODE_IN_FEATURES // 8), "uint32", name="weight")
    scale = te.placeholder((DECODE_OUT_FEATURES, DECODE_IN_FEATURES // 32), "float32", name="scale")
    with TARGETS["wasm"].target():
        y = Q4F32.matmul_te(x, weight, scale, DECODE_OUT_FEATURES, DECODE_IN_FEATURES, "float32")
        module = tvm.IRModule({"main": te.create_prim_func([x, weight, scale, y]).with_attr("global_symbol", "main")})
        script = schedules_for(TARGETS["wasm"])(module)["main"].script()
    assert "lane_dots" in script and "prefetch" not in script


def swiglu_script(rows) -> str:
    """SwiGLU's elementwise kernel (the gate/up output split in halves, SiLU of one times the other)
    over `rows` rows under the cpu schedules."""
    x = te.placeholder((1, rows, 2 * 64), "float32", name="gate_up")
    gate = te.compute((1, rows, 64), lambda b, r, i: x[b, r, i], name="T_split_sections")
    up = te.compute((1, rows, 64), lambda b, r, i: x[b, r, 64 + i], name="T_split_sections_1")
    y = te.compute(
        (1, rows, 64), lambda b, r, i: gate[b, r, i] * te.sigmoid(gate[b, r, i]) * up[b, r, i], name="T_multiply"
    )
    module = tvm.IRModule({"main": te.create_prim_func([x, y]).with_attr("global_symbol", "main")})
    entry = TARGETS["cpu"]
    with entry.target():
        return schedules_for(entry)(module)["main"].script()


def test_a_prefills_elementwise_kernel_runs_its_rows_in_parallel_with_its_producers_inlined():
    script = swiglu_script(tvm.tirx.Var("n", "int64"))
    assert "T.parallel" in script and "T.vectorized" in script
    assert "T_split_sections" not in script  # the halves are read where they are used, not copied out
    assert "sigmoid" not in script and "T.exp" not in script  # written out (cpu_exponential.py)
    assert "T.parallel" not in swiglu_script(1)  # a decode step's row is not worth a parallel launch


def scores_module(heads: int, kv_heads: int, head_dim: int, causal: bool) -> tvm.IRModule:
    """An encoder's attention scores (kiln/models/embedding.py masked_scores) over a symbolic batch of
    symbolic length, grouped-query where kv_heads < heads, causal as a decoder embedder's."""
    batch, length = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    fused_heads, head_dim = (tvm.tirx.IntImm("int64", n) for n in (heads + 2 * kv_heads, head_dim))
    x = te.placeholder((batch, length, fused_heads, head_dim), "float32", name="qkv")
    mask = te.placeholder((batch, length), "int32", name="mask")
    sees = (lambda i, j: j <= i) if causal else None
    scores = masked_scores(x, mask, heads, heads // kv_heads, int(head_dim) ** -0.5, sees)
    return tvm.IRModule({"main": te.create_prim_func([x, mask, scores]).with_attr("global_symbol", "main")})


@pytest.mark.parametrize("tvm_target", X86_LEVELS, ids=["avx2", "avx512"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, causal", [(4, 4, 32, False), (4, 2, 20, True)])
def test_encoder_attention_scores_give_numpys_products_where_seen_in_vectors_of_partial_sums(
    tvm_target, heads, kv_heads, head_dim, causal
):
    module = scores_module(heads, kv_heads, head_dim, causal)
    with TARGETS["cpu"].target():
        script = schedules_for(TARGETS["cpu"])(module).script()
    assert "T.parallel" in script and "T.vectorized" in script and "attention_scores_rf" in script
    library = built(module, runnable(tvm_target))
    rng = np.random.default_rng(2)
    for batch, length in ((1, 1), (3, 5), (2, 13)):
        qkv = rng.standard_normal((batch, length, heads + 2 * kv_heads, head_dim), dtype=np.float32)
        mask = (rng.random((batch, length)) < 0.8).astype(np.int32)
        out = tvm.runtime.tensor(np.zeros((batch, heads, length, length), np.float32))
        library["main"](tvm.runtime.tensor(qkv), tvm.runtime.tensor(mask), out)
        q = qkv[:, :, :heads].astype(np.float64)
        k = np.repeat(qkv[:, :, heads : heads + kv_heads], heads // kv_heads, axis=2).astype(np.float64)
        expected = np.einsum("bihd,bjhd->bhij", q, k) * head_dim**-0.5
        magnitudes = np.einsum("bihd,bjhd->bhij", np.abs(q), np.abs(k)) * head_dim**-0.5
        seen = np.broadcast_to(mask[:, None, None, :] > 0, expected.shape)
        if causal:
            seen = seen & np.tri(length, dtype=bool)
        got = out.numpy()
        assert (got[~seen] == np.float32(MASKED_SCORE)).all()
        assert (np.abs(got - expected)[seen] <= 1e-6 * magnitudes[seen] + 1e-6).all()


def softmax_module(rows) -> tvm.IRModule:
    x = te.placeholder((rows, 3, 40), "float32", name="scores")
    return tvm.IRModule({"main": te.create_prim_func([x, topi.nn.softmax(x)]).with_attr("global_symbol", "main")})


def test_a_softmax_over_symbolic_rows_runs_them_in_parallel_and_gives_numpys_probabilities():
    module = softmax_module(tvm.tirx.Var("n", "int64"))
    with TARGETS["cpu"].target():
        script = schedules_for(TARGETS["cpu"])(module).script()
        static_script = schedules_for(TARGETS["cpu"])(softmax_module(1)).script()
    assert script.count("T.parallel") == 1 and "T.vectorized" not in script  # LLVM vectorizes the passes
    assert "T.vectorized" in static_script  # static rows stay dlight's
    library = built(module, runnable(TARGETS["cpu"].tvm_target()))
    scores = np.random.default_rng(3).standard_normal((5, 3, 40), dtype=np.float32) * 8
    scores[1, :, 7:] = MASKED_SCORE
    out = tvm.runtime.tensor(np.zeros_like(scores))
    library["main"](tvm.runtime.tensor(scores), out)
    exp = np.exp(scores.astype(np.float64) - scores.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), exp / exp.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert (out.numpy()[1, :, 7:] == 0).all()
