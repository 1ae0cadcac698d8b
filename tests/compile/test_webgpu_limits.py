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
