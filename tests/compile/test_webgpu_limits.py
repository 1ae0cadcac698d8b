"""The static check of generated WGSL against what WebGPU adapters grant."""

import pytest

from kiln.compile.lower.webgpu_limits import check_webgpu_limits
from kiln.errors import KilnError

KERNEL = """// Function: {name}
//----------------------------------------
@group(0) @binding(0) var<storage, read> a : array<f32>;
{extra}
var<workgroup> red_buf : array<f32, {shared}>;
@compute @workgroup_size({size})
fn {name}() {{}}
"""


def kernel(name="k", shared=64, size="256, 1, 1", extra=""):
    return KERNEL.format(name=name, shared=shared, size=size, extra=extra)


def test_kernels_within_the_limits_pass_and_are_measured():
    (usage,) = check_webgpu_limits(kernel(shared=1024, size="32, 4, 2"))
    assert (usage.invocations, usage.workgroup_bytes, usage.storage_buffers) == (256, 4096, 1)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (kernel(name="wide", size="32, 16, 1"), "wide uses 512 invocations per workgroup"),
        (kernel(name="greedy", shared=8193), "greedy uses 32772 bytes of workgroup storage"),
        (
            kernel(
                name="buffers",
                extra="\n".join(
                    f"@group(0) @binding({i}) var<storage, read_write> b{i} : array<f32>;" for i in range(1, 11)
                ),
            ),
            "buffers uses 11 storage buffers",
        ),
    ],
)
def test_a_kernel_over_a_limit_is_a_build_error_naming_it(source, message):
    with pytest.raises(KilnError, match=message):
        check_webgpu_limits(kernel(name="fine") + source)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_prefill_attention_is_tiled_within_webgpus_workgroup_memory_for_every_head_size(head_dim, dtype):
    """TVM's own tiling where its schedule takes it; a narrower one for Gemma 4's 512-wide heads,
    where TVM's is refused. Either fits WebGPU's workgroup memory."""
    import tvm
    from tvm.relax.frontend.nn.llm._kernel_common import _is_prefill_kernel_config_legal

    from kiln.targets import MAX_WORKGROUP_STORAGE_BYTES
    from kiln.models.kv_cache.gpu_wide_heads import TVM_CONFIG, wide_head_config, workgroup_bytes
    from kiln.targets import webgpu_target

    target = tvm.target.Target(webgpu_target())
    config = wide_head_config(1, 8, head_dim, dtype, target)
    _, load_vec, _, threads, groups, rows, _, keys = config
    assert _is_prefill_kernel_config_legal(rows, head_dim, keys, head_dim, load_vec, threads, groups, False)
    assert workgroup_bytes(rows, keys, head_dim, dtype) <= MAX_WORKGROUP_STORAGE_BYTES
    if head_dim < 512:
        assert config == TVM_CONFIG(1, 8, head_dim, dtype, target)
