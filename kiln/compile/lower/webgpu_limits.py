"""What real WebGPU adapters grant, checked on the generated WGSL at build time.

A kernel over a limit compiles fine and fails only when a browser creates its pipeline, with an
adapter-specific message. Checking here names the kernel and the limit instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.targets import MAX_INVOCATIONS_PER_WORKGROUP, MAX_STORAGE_BUFFERS_PER_STAGE, MAX_WORKGROUP_STORAGE_BYTES

KERNEL_HEADER = re.compile(r"^// Function: (\S+)\n//-+\n", re.MULTILINE)
WORKGROUP_SIZE = re.compile(r"@workgroup_size\((\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?\)")
WORKGROUP_ARRAY = re.compile(r"var<workgroup>\s+\w+\s*:\s*array<(\w+)(?:<(\w+)>)?,\s*(\d+)>")
STORAGE_BINDING = re.compile(r"var<storage,")
SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2}
VECTOR_LANES = {"vec2": 2, "vec3": 4, "vec4": 4}


@dataclass(frozen=True)
class KernelUsage:
    name: str
    invocations: int
    workgroup_bytes: int
    storage_buffers: int


def kernel_usage(name: str, wgsl: str) -> KernelUsage:
    invocations = 0
    for size in WORKGROUP_SIZE.finditer(wgsl):
        x, y, z = (int(d) if d else 1 for d in size.groups())
        invocations = max(invocations, x * y * z)
    workgroup_bytes = 0
    for element, inner, count in WORKGROUP_ARRAY.findall(wgsl):
        scalar = inner or element
        workgroup_bytes += SCALAR_BYTES.get(scalar, 4) * VECTOR_LANES.get(element, 1) * int(count)
    return KernelUsage(name, invocations, workgroup_bytes, len(STORAGE_BINDING.findall(wgsl)))


def kernels(source: str) -> dict[str, str]:
    """TVM's WebGPU module source: each kernel behind a `// Function: name` header."""
    parts = KERNEL_HEADER.split(source)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        found[name] = found.get(name, "") + body
    return found


def check_webgpu_limits(source: str) -> list[KernelUsage]:
    usages = [kernel_usage(name, body) for name, body in kernels(source).items()]
    for usage in usages:
        for value, limit, what in (
            (usage.invocations, MAX_INVOCATIONS_PER_WORKGROUP, "invocations per workgroup"),
            (usage.workgroup_bytes, MAX_WORKGROUP_STORAGE_BYTES, "bytes of workgroup storage"),
            (usage.storage_buffers, MAX_STORAGE_BUFFERS_PER_STAGE, "storage buffers"),
        ):
            if value > limit:
                raise KilnError(f"WebGPU kernel {usage.name} uses {value} {what}; adapters grant {limit}")
    return usages
