"""OpenCL kernels checked without a phone, on PoCL (the CPU OpenCL driver, Debian `pocl-opencl-icd`,
through `pyopencl`): every kernel of an Android build must compile as OpenCL C, and a kernel run
on PoCL must compute what the same TIR function computes on the CPU. PoCL's CPU device has no
half precision, so f16 builds are checked by clang's OpenCL C front end for a SPIR device instead
(every optional extension on; the front end PoCL itself uses).

TVM's OpenCL source holds one self-contained program per kernel function, each behind a
`// Function: <name>` line; the TVM runtime builds them one by one, and so does this check.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

import numpy as np
import tvm
import tvm.sym
import tvm_ffi

from kiln.compile.toolchain.system_lib import llvm_tool
from kiln.errors import KilnError

POCL_FIX = "apt-get install -y pocl-opencl-icd && pip install pyopencl"
# OpenCL C 1.2 (what TVM's OpenCL code generator writes) for a SPIR device, which offers every
# optional extension; the builtins' declarations as an OpenCL compiler has them; no output.
CLANG_OPENCL_FLAGS = [
    "-x",
    "cl",
    "-cl-std=CL1.2",
    "-target",
    "spir64",
    "-Xclang",
    "-finclude-default-header",
    "-fsyntax-only",
]
FUNCTION_HEADER = re.compile(r"^// Function: (\S+)\n", re.MULTILINE)
HALF_PRECISION = re.compile(r"\bhalf\d*\b")
LOG_LINES = 20
THREAD_AXES = {"blockIdx": 0, "threadIdx": 1}
AXIS_INDEX = {"x": 0, "y": 1, "z": 2}


def kernel_programs(source: str) -> dict[str, str]:
    """TVM's OpenCL module source → {kernel function: its program}."""
    parts = FUNCTION_HEADER.split(source)
    return dict(zip(parts[1::2], parts[2::2]))


def pocl_context():
    """A context on PoCL's CPU device."""
    try:
        import pyopencl as cl
    except ImportError:
        raise KilnError(f"pyopencl is missing; fix: {POCL_FIX}") from None
    try:
        platforms = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name]
    except cl.LogicError:
        platforms = []
    if not platforms:
        raise KilnError(f"no PoCL OpenCL platform; fix: {POCL_FIX}")
    return cl.Context(platforms[0].get_devices())


@dataclass(frozen=True)
class KernelBuild:
    name: str
    log: str | None  # the compiler's log when the build failed


def compile_kernels(source: str, context) -> list[KernelBuild]:
    """Build every kernel program of `source` on the context's device."""
    import pyopencl as cl

    (device,) = context.devices
    programs = kernel_programs(source)
    if not programs:
        raise KilnError("no OpenCL kernels found (expected '// Function: <name>' sections)")
    if "cl_khr_fp16" not in device.extensions:
        uses_half = sorted(name for name, program in programs.items() if HALF_PRECISION.search(program))
        if uses_half:
            raise KilnError(
                f"{len(uses_half)} kernels use half precision (cl_khr_fp16), which {device.name} does "
                f"not offer (e.g. {uses_half[0]}): check them with check_opencl_c"
            )
    builds = []
    for name, program in programs.items():
        try:
            cl.Program(context, program).build()
            builds.append(KernelBuild(name, None))
        except cl.RuntimeError as error:
            builds.append(KernelBuild(name, str(error)))
    return builds


def clang_kernel_builds(source: str) -> list[KernelBuild]:
    """Check every kernel program with clang's OpenCL C front end for a SPIR device."""
    clang = llvm_tool("clang", "clang")
    builds = []
    for name, program in kernel_programs(source).items():
        result = subprocess.run([clang, *CLANG_OPENCL_FLAGS, "-"], input=program, capture_output=True, text=True)
        builds.append(KernelBuild(name, result.stderr if result.returncode else None))
    return builds


def passed(builds: list[KernelBuild], compiler: str) -> int:
    """How many kernels compiled; a KilnError with the build logs of those that did not."""
    failed = [b for b in builds if b.log is not None]
    if failed:
        logs = "\n".join(f"--- {b.name}\n" + "\n".join(b.log.splitlines()[-LOG_LINES:]) for b in failed)
        raise KilnError(
            f"{len(failed)} of {len(builds)} OpenCL kernels do not compile with {compiler} "
            f"({', '.join(b.name for b in failed)}):\n{logs}"
        )
    return len(builds)


def check_opencl_kernels(source: str) -> int:
    """Compile every kernel on PoCL; returns how many compiled (a KilnError shows failures' logs)."""
    return passed(compile_kernels(source, pocl_context()), "PoCL")


def check_opencl_c(source: str) -> int:
    """Check every kernel, half precision included, with clang's OpenCL C front end."""
    return passed(clang_kernel_builds(source), "clang (OpenCL C for SPIR)")


@dataclass(frozen=True)
class BufferArgument:
    index: int  # of the PrimFunc parameter whose buffer the kernel takes


@dataclass(frozen=True)
class KernelLaunch:
    name: str
    args: list  # per kernel parameter: a BufferArgument or a numpy scalar
    global_size: tuple[int, int, int]
    local_size: tuple[int, int, int]


def shape_values(func: tvm.tirx.PrimFunc, args: list) -> dict[str, int]:
    """The values of `func`'s symbolic shape variables (and scalar parameters) for one call."""
    values = {}
    for param, arg in zip(func.params, args):
        if isinstance(param, tvm.tirx.Buffer):
            values |= {
                str(dim.name): size for dim, size in zip(param.shape, arg.shape) if isinstance(dim, tvm.ir.expr.Var)
            }
        else:
            values[str(param.name)] = int(arg)
    return values


def evaluate(expr, values: dict[str, int], bindings: dict[str, object], where: str) -> int:
    """`expr` as a number, given the shape values and the host code's `let` bindings."""
    analyzer = tvm.sym.Analyzer()
    free = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.Var, free.append), order="post")
    for var in free:
        name = str(var.name)
        if name in values:
            value = values[name]
        elif name in bindings:
            value = evaluate(bindings[name], values, bindings, where)
        else:
            raise KilnError(f"{where}: {expr} depends on {name}, which no argument gives")
        analyzer.bind(var, tvm.tirx.const(value, str(var.ty.dtype)))
    result = analyzer.simplify(expr)
    if not isinstance(result, tvm.tirx.expr.IntImm):
        raise KilnError(f"{where}: cannot evaluate {expr}")
    return result.value


def kernel_launches(func: tvm.tirx.PrimFunc, target: tvm.target.Target, args: list) -> list[KernelLaunch]:
    """The kernels `func` launches for `args`, in order, read from TVM's own lowering: the host
    code's `call_ffi_kernel(name, kernel arguments..., launch extents...)`."""
    mod = tvm.tirx.transform.BindTarget(target)(tvm.IRModule({"main": func}))
    pipeline, _, _ = tvm.tirx.get_default_tir_pipeline(target)
    lowered = pipeline(mod)
    buffer_index = {str(p.name): i for i, p in enumerate(func.params) if isinstance(p, tvm.tirx.Buffer)}
    values = shape_values(func, args)
    kernels = {
        gv.name_hint: f
        for gv, f in lowered.functions.items()
        if f.attrs is not None and "tirx.kernel_launch_params" in f.attrs
    }
    calls, bindings = [], {}
    for gv, f in lowered.functions.items():
        if gv.name_hint not in kernels:
            tvm_ffi.structural_walk(
                f.body,
                (tvm.ir.expr.Call, lambda c: c.op.name == "tirx.call_ffi_kernel" and calls.append(c)),
                order="post",
            )
            tvm_ffi.structural_walk(
                f.body, (tvm.tirx.stmt.Bind, lambda b: bindings.update({str(b.var.name): b.value})), order="post"
            )
    launches = []
    for call in calls:
        name = str(call.args[0].value)
        params = kernels[name].params
        kernel_args = []
        for arg, param in zip(call.args[1:], params):
            if isinstance(arg, tvm.ir.expr.Call) and arg.op.name == "tirx.buffer_data":
                kernel_args.append(BufferArgument(buffer_index[str(arg.args[0].name)]))
            else:
                kernel_args.append(np.dtype(str(param.ty.dtype)).type(evaluate(arg, values, bindings, name)))
        grid, block = [1, 1, 1], [1, 1, 1]
        for tag, extent in zip(call.attrs.launch_params, call.args[1 + len(params) :]):
            axis, _, dim = str(tag).partition(".")
            if axis not in THREAD_AXES:
                raise KilnError(f"{name}: launch parameter {tag} is not supported here")
            (grid, block)[THREAD_AXES[axis]][AXIS_INDEX[dim]] = evaluate(extent, values, bindings, name)
        launches.append(KernelLaunch(name, kernel_args, tuple(g * b for g, b in zip(grid, block)), tuple(block)))
    return launches


def run_on_opencl(func: tvm.tirx.PrimFunc, target: tvm.target.Target, args: list, context) -> list:
    """Run a scheduled PrimFunc's kernels on `context` with `args` (numpy arrays and ints, in the
    function's parameter order); returns the arrays after the run."""
    import pyopencl as cl

    from kiln.compile.lower.library import device_source

    func = func.with_attr("global_symbol", "main")
    library = tvm.tirx.build(tvm.IRModule({"main": func}), target)
    launches = kernel_launches(func, target, args)
    programs = kernel_programs(device_source(library, "opencl"))
    queue = cl.CommandQueue(context)
    buffers = {
        i: cl.Buffer(context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=arg)
        for i, arg in enumerate(args)
        if isinstance(arg, np.ndarray)
    }
    for launch in launches:
        kernel = getattr(cl.Program(context, programs[launch.name]).build(), launch.name)
        kernel.set_args(*[buffers[a.index] if isinstance(a, BufferArgument) else a for a in launch.args])
        cl.enqueue_nd_range_kernel(queue, kernel, launch.global_size, launch.local_size)
    results = []
    for i, arg in enumerate(args):
        if isinstance(arg, np.ndarray):
            out = np.empty_like(arg)
            cl.enqueue_copy(queue, out, buffers[i])
            results.append(out)
        else:
            results.append(arg)
    queue.finish()
    return results


def pocl_status():
    """The `kiln doctor` line for PoCL, which checks Android's OpenCL kernels."""
    from kiln.compile.toolchain.wasm_toolchain import ToolStatus

    try:
        (device,) = pocl_context().devices
    except KilnError as error:
        return ToolStatus("PoCL (OpenCL check)", False, error.problem.split(";")[0], POCL_FIX, optional=True)
    return ToolStatus("PoCL (OpenCL check)", True, f"{device.version} on {device.name}", optional=True)
