"""Kiln's CPU matmul schedule for prefill: the kernels it writes, and their numbers against numpy
(the family tests check whole models against transformers)."""

import re

import numpy as np
import pytest
import tvm
from tvm import te

from kiln.compile.cpu_schedule import weight_rows_per_tile
from kiln.compile.ingest import ingest
from kiln.compile.library import library_metadata, param_specs, scheduled_module
from kiln.compile.pipeline import config_file, quantized_model
from kiln.compile.quantization import quantization_named
from kiln.compile.quantization.group import GroupFormat
from kiln.compile.targets import TARGETS
from kiln.models import architecture_for
from kiln.models.layers import matmul_transposed

Q4F32 = GroupFormat(4, 32, "float32")
IN_FEATURES = 64


def prefill_matmul(out_features: int, target_name: str = "cpu") -> tvm.IRModule:
    """A q4f32_1 matmul of a symbolic number of input rows under the target's schedules."""
    rows = tvm.tirx.Var("n", "int64")
    x = te.placeholder((1, rows, IN_FEATURES), "float32", name="x")
    weight = te.placeholder((out_features, IN_FEATURES // 8), "uint32", name="weight")
    scale = te.placeholder((out_features, IN_FEATURES // 32), "float32", name="scale")
    y = matmul_transposed(x, Q4F32.dequantize_te(weight, scale, out_features, IN_FEATURES), "float32")
    module = tvm.IRModule({"main": te.create_prim_func([x, weight, scale, y]).with_attr("global_symbol", "main")})
    entry = TARGETS[target_name]
    with entry.target():
        return entry.schedules()(module)


@pytest.mark.parametrize("target_name", ["cpu", "wasm"])
@pytest.mark.parametrize("out_features", [96, 40, 20, 6])
def test_a_tile_is_the_most_weight_rows_that_divide_the_width_and_its_sums_stay_in_registers(target_name, out_features):
    target = TARGETS[target_name].target()
    tile = weight_rows_per_tile(target, out_features)
    assert out_features % tile == 0
    assert all(out_features % larger for larger in range(tile + 1, weight_rows_per_tile(target, 2**20) + 1))
    script = prefill_matmul(out_features, target_name)["main"].script()
    assert re.search(r'matmul_rf_local = T.sblock_alloc_buffer\(.*scope="local"\)', script)
    assert f"in T.unroll({tile}):" in script  # the tile's weight rows, each with its vector of sums


def test_prefill_gives_numpys_products_for_any_number_of_rows():
    out_features = 96
    library = tvm.tirx.build(prefill_matmul(out_features), target=TARGETS["cpu"].target())
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 2**32, (out_features, IN_FEATURES // 8), dtype=np.uint64).astype(np.uint32)
    scale = rng.random((out_features, IN_FEATURES // 32), dtype=np.float32)
    levels = (weight[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 15
    dequantized = (levels.reshape(out_features, IN_FEATURES).astype(np.float32) - 7) * np.repeat(scale, 32, axis=1)
    for rows in (1, 5, 13):
        x = rng.standard_normal((1, rows, IN_FEATURES), dtype=np.float32)
        out = tvm.runtime.tensor(np.zeros((1, rows, out_features), np.float32))
        library["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(weight), tvm.runtime.tensor(scale), out)
        np.testing.assert_allclose(out.numpy()[0], x[0] @ dequantized.T, rtol=1e-5, atol=1e-5)


def test_the_cpu_librarys_kernels_keep_their_alias_information(tiny_source, tmp_path):
    """TVM's LLVM code generator puts every load and store of a module in one alias set ("tvm-alias")
    when a kernel of TVM's KV cache is built without `tirx.noalias` (models/cache_kernels.py): prefill
    then ran at half speed, its partial sums stored to memory at every step."""
    scheme = quantization_named("q4f32_1")
    source = ingest(str(tiny_source), tmp_path)
    arch = architecture_for(source.config, config_file(source))
    model, _, _ = quantized_model(source, arch, arch.parse_config(source.config, config_file(source), {}), scheme)
    entry = TARGETS["cpu"]
    module = scheduled_module(model, entry, library_metadata(model, scheme.name, param_specs(model, entry)))
    llvm_ir = tvm.compile(module, entry.target(), relax_pipeline=None).mod.imports[0].inspect_source("ll")
    assert "!tbaa" in llvm_ir
    assert '"tvm-alias"' not in llvm_ir
