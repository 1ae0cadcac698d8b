"""The attention soft-cap Kiln writes into TVM's paged KV cache kernels (kiln/models/kv_cache/attention_softcap.py):
where it goes in every kernel the cache adds, for the CPU and for WebGPU, and in Kiln's own CPU decode
kernel; and the refusals of kernels Kiln does not know. Numerics (soft-cap, Kiln's decode kernel, the
prefill fix) are checked against transformers in test_families.py, natively and in the browser."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace_cpu
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

from kiln.errors import KilnError
from kiln.models.kv_cache.attention_softcap import is_attention_kernel, soft_cap_attention_kernels, soft_capped
from kiln.models.kv_cache.cpu_decode_attention import decode_attention
from kiln.models.kv_cache.paged_prefill_fix import fixed

TARGETS = {"cpu": "llvm", "webgpu": tvm.target.Target("webgpu", host="llvm")}


def cache_kernels(target: str, cap: float) -> tuple[dict[str, tirx.PrimFunc], dict[str, tirx.PrimFunc]]:
    """The kernels of a two-layer cache, one layer windowed (Gemma 2's kinds of layers), as the cache
    adds them and after they are soft-capped at `cap`."""
    builder = rx.BlockBuilder()
    size = lambda name: tirx.Var(name, "int64")  # noqa: E731
    with tvm.target.Target(TARGETS[target]), builder.function("main", []):
        TIRPagedKVCache(
            attn_kind=["mha_sliding", "mha"],
            max_batch_size=size("batch"),
            max_total_seq_len=size("total"),
            prefill_chunk_size=size("chunk"),
            page_size=size("page"),
            support_sliding_window=size("sliding"),
            layer_sliding_window_size=16,
            layer_partition=rx.ShapeExpr([0, 2]),
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            qk_head_dim=32,
            v_head_dim=32,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE,
            rope_scale=1,
            rope_theta=10000,
            rope_scaling={},
            rope_ext_factors=rx.prim_value(0),
            rotary_dim=32,
            enable_disaggregation=False,
            dtype="float32",
            target=tvm.target.Target.current(),
        )
        plain = kernels(builder)
        soft_cap_attention_kernels(cap)
        builder.emit_func_output(rx.Tuple([]))
    return plain, kernels(builder)


def kernels(builder: rx.BlockBuilder) -> dict[str, tirx.PrimFunc]:
    return {gvar.name_hint: func for gvar, func in builder.get().functions_items() if isinstance(func, tirx.PrimFunc)}


@pytest.mark.parametrize("target", TARGETS)
def test_every_attention_kernel_caps_its_scores_in_one_place_and_nothing_else_changes(target):
    plain, capped = cache_kernels(target, 3.0)
    attention = sorted(name for name in plain if is_attention_kernel(name))
    # decode, prefill and their windowed kinds, ragged prefill, and the two tree-mask prefills
    assert len(attention) == 7, attention
    for name in attention:
        assert "T.tanh(" not in plain[name].script(), name
        assert capped[name].script().count("T.tanh(") == 1, name
    for name in plain.keys() - set(attention):
        tvm.ir.assert_structural_equal(plain[name], capped[name])


def test_a_kernel_that_stores_no_score_kiln_knows_stops_the_build():
    with pytest.raises(KilnError, match="tir_attention_odd stores its scores in 0 places"):
        soft_capped(_merge_state_inplace_cpu("float32"), "tir_attention_odd", 3.0)


def test_kilns_cpu_decode_kernel_takes_the_soft_cap_too():
    kernel = decode_attention(num_kv_heads=2, num_qo_heads=4, head_dim=32, dtype="float32")
    assert "T.tanh(" not in kernel.script()
    assert soft_capped(kernel, "tir_attention_decode_cpu", 3.0).script().count("T.tanh(") == 1


def test_a_prefill_kernel_without_the_running_maximum_kiln_fixes_stops_the_build():
    with pytest.raises(KilnError, match="tir_attention_odd is not the one Kiln fixes .it has no new_m"):
        fixed(_merge_state_inplace_cpu("float32"), "tir_attention_odd")
