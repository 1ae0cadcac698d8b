"""Functions the library exports besides the model: `_metadata` and WebLLM's sampling helpers.

WebLLM 0.2.86 looks these up by name when it loads a model and fails if any is missing, even
at temperature 0. Signatures follow its calls (in @mlc-ai/web-llm's lib/index.js). The in-place
logit processors are TIR kernels wrapped in `call_tir_inplace`, so they are VM functions like the rest.
Their blocks declare reads without the logits they update: each element reads only the value it
overwrites, and leaving it out lets the schedule bind the loops to GPU threads (TVM refuses to
bind a block whose declared reads and writes overlap).
"""

from __future__ import annotations

import functools
import json

import tvm
from tvm import relax as rx
from tvm import s_tir, tirx
from tvm.script import tirx as T

GPU_THREADS_PER_BLOCK = 256


def _shape(*names: str) -> list[tirx.Var]:
    return [tirx.Var(name, "int64") for name in names]


@functools.cache
def _apply_logit_bias() -> tirx.PrimFunc:
    """Adds `bias` to the logits of (`pos2seq`, `token_ids`)."""

    @T.prim_func(private=True, s_tir=True)
    def apply_logit_bias(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle, var_bias: T.handle):
        batch, vocab, num_token = T.int64(), T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32")
        pos2seq = T.match_buffer(var_pos2seq, (num_token,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_token,), "int32")
        bias = T.match_buffer(var_bias, (num_token,), "float32")
        for i in range(num_token):
            with T.sblock("logit_bias"):
                vi = T.axis.spatial(num_token, i)
                T.reads(pos2seq[vi], token_ids[vi], bias[vi])
                T.writes(logits[pos2seq[vi], token_ids[vi]])
                logits[pos2seq[vi], token_ids[vi]] = logits[pos2seq[vi], token_ids[vi]] + bias[vi]

    return apply_logit_bias


@functools.cache
def _apply_penalty() -> tirx.PrimFunc:
    """Presence, frequency and repetition penalties on the tokens each sequence has had."""

    @T.prim_func(private=True, s_tir=True)
    def apply_penalty(
        var_logits: T.handle,
        var_seq_ids: T.handle,
        var_pos2seq: T.handle,
        var_token_ids: T.handle,
        var_token_cnt: T.handle,
        var_penalties: T.handle,
    ):
        batch, vocab, num_seq, num_token = T.int64(), T.int64(), T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32")
        seq_ids = T.match_buffer(var_seq_ids, (num_seq,), "int32")
        pos2seq = T.match_buffer(var_pos2seq, (num_token,), "int32")
        token_ids = T.match_buffer(var_token_ids, (num_token,), "int32")
        token_cnt = T.match_buffer(var_token_cnt, (num_token,), "int32")
        # per sequence: presence, frequency, repetition
        penalties = T.match_buffer(var_penalties, (num_seq, 3), "float32")
        for i in range(num_token):
            with T.sblock("penalty"):
                vi = T.axis.spatial(num_token, i)
                T.reads(seq_ids[pos2seq[vi]], pos2seq[vi], token_ids[vi], token_cnt[vi], penalties[pos2seq[vi], 0:3])
                T.writes(logits[seq_ids[pos2seq[vi]], token_ids[vi]])
                row: T.let[T.int32] = seq_ids[pos2seq[vi]]
                seq: T.let[T.int32] = pos2seq[vi]
                shifted: T.let[T.float32] = (
                    logits[row, token_ids[vi]]
                    - penalties[seq, 0]
                    - T.Cast("float32", token_cnt[vi]) * penalties[seq, 1]
                )
                logits[row, token_ids[vi]] = T.if_then_else(
                    shifted > T.float32(0), shifted / penalties[seq, 2], shifted * penalties[seq, 2]
                )

    return apply_penalty


@functools.cache
def _apply_bitmask() -> tirx.PrimFunc:
    """The lowest float where a grammar's bitmask leaves a token out."""

    @T.prim_func(private=True, s_tir=True)
    def apply_bitmask(var_logits: T.handle, var_seq_ids: T.handle, var_bitmask: T.handle):
        batch, vocab, num_seq, words = T.int64(), T.int64(), T.int64(), T.int64()
        logits = T.match_buffer(var_logits, (batch, vocab), "float32")
        seq_ids = T.match_buffer(var_seq_ids, (num_seq,), "int32")
        bitmask = T.match_buffer(var_bitmask, (batch, words), "int32")
        for s, v in T.grid(num_seq, vocab):
            with T.sblock("bitmask"):
                vs, vv = T.axis.remap("SS", [s, v])
                T.reads(seq_ids[vs], bitmask[seq_ids[vs], vv // 32])
                T.writes(logits[seq_ids[vs], vv])
                logits[seq_ids[vs], vv] = T.if_then_else(
                    (bitmask[seq_ids[vs], vv // 32] >> T.Cast("int32", vv % 32)) & 1 == 1,
                    logits[seq_ids[vs], vv],
                    T.min_value("float32"),
                )

    return apply_bitmask


@functools.cache
def _bitonic_argsort_kernel(padded: int, gpu: bool) -> tirx.PrimFunc:
    """Sort each row of `keys` descending in place, carrying `values` along: a bitonic network of
    log2(padded) * (log2(padded) + 1) / 2 compare-exchange passes. TVM's GPU sort cannot be used:
    it launches on blockIdx.z, which WebGPU does not have."""
    log_n = padded.bit_length() - 1

    @T.macro
    def compare_exchange(keys, values, flat, p, q):
        row: T.let[T.int32] = flat // padded
        i: T.let[T.int32] = flat % padded
        partner: T.let[T.int32] = T.bitwise_xor(i, T.shift_left(1, p - q))
        if partner > i:
            descending: T.let[T.bool] = T.bitwise_and(i, T.shift_left(2, p)) == 0
            out_of_order: T.let[T.bool] = T.if_then_else(
                descending, keys[row, i] < keys[row, partner], keys[row, i] > keys[row, partner]
            )
            if out_of_order:
                key: T.let[T.float32] = keys[row, i]
                keys[row, i] = keys[row, partner]
                keys[row, partner] = key
                value: T.let[T.int32] = values[row, i]
                values[row, i] = values[row, partner]
                values[row, partner] = value

    if gpu:
        return _bitonic_argsort_gpu(padded, log_n, compare_exchange)
    return _bitonic_argsort_cpu(padded, log_n, compare_exchange)


def _bitonic_argsort_gpu(padded: int, log_n: int, compare_exchange) -> tirx.PrimFunc:
    @T.prim_func(private=True)
    def sort_gpu(var_keys: T.handle, var_values: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        batch = T.int64()
        keys = T.match_buffer(var_keys, (batch, padded), "float32")
        values = T.match_buffer(var_values, (batch, padded), "int32")
        for p in T.serial(T.int32(log_n)):
            for q in T.serial(p + 1):
                for bx in T.thread_binding(
                    T.Cast("int32", batch) * (padded // GPU_THREADS_PER_BLOCK), thread="blockIdx.x"
                ):
                    for tx in T.thread_binding(T.int32(GPU_THREADS_PER_BLOCK), thread="threadIdx.x"):
                        compare_exchange(keys, values, bx * GPU_THREADS_PER_BLOCK + tx, p, q)

    return sort_gpu


def _bitonic_argsort_cpu(padded: int, log_n: int, compare_exchange) -> tirx.PrimFunc:
    @T.prim_func(private=True)
    def sort_cpu(var_keys: T.handle, var_values: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        batch = T.int64()
        keys = T.match_buffer(var_keys, (batch, padded), "float32")
        values = T.match_buffer(var_values, (batch, padded), "int32")
        for p in T.serial(T.int32(log_n)):
            for q in T.serial(p + 1):
                for flat in T.serial(T.Cast("int32", batch) * padded):
                    compare_exchange(keys, values, flat, p, q)

    return sort_cpu


def _tensor(name: str, shape, dtype: str) -> rx.Var:
    return rx.Var(name, rx.TensorType(shape, dtype))


def _bind_to_gpu_threads(kernel: tirx.PrimFunc, block_name: str) -> tirx.PrimFunc:
    """One thread per element. dlight cannot do this for us: its rules refuse blocks that
    write the buffer they read, which is what an in-place update is."""
    sch = s_tir.Schedule(kernel)
    block = sch.get_sblock(block_name)
    fused = sch.fuse(*sch.get_loops(block))
    blocks, threads = sch.split(fused, [None, GPU_THREADS_PER_BLOCK])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _define(bb: rx.BlockBuilder, name: str, params: list[rx.Var], body) -> None:
    """A public Relax function whose body (emitted by `body()`) sits in a dataflow block, so
    operator fusion applies to it."""
    with bb.function(name, params):
        with bb.dataflow():
            output = bb.emit_output(body())
        bb.emit_func_output(output)


def _attach_inplace(bb: rx.BlockBuilder, name: str, kernel, block_name: str, params: list[rx.Var], gpu: bool) -> None:
    kernel_var = bb.add_func(_bind_to_gpu_threads(kernel, block_name) if gpu else kernel, f"{name}_kernel")
    _define(bb, name, params, lambda: rx.call_tir_inplace(kernel_var, params, inplace_indices=[0], out_ty=params[0].ty))


def _attach_argsort(bb: rx.BlockBuilder, vocab_size: int, gpu: bool) -> None:
    padded = max(GPU_THREADS_PER_BLOCK, 1 << (vocab_size - 1).bit_length())
    (batch,) = _shape("batch")
    probs = _tensor("probs", [batch, vocab_size], "float32")
    sort = bb.add_func(_bitonic_argsort_kernel(padded, gpu), "bitonic_argsort")
    op = rx.op

    def body():
        # Padding with -1 (below every probability) sorts to the end and is cut off again.
        padding = op.full([batch, padded - vocab_size], rx.const(-1.0, "float32"), "float32")
        keys = bb.emit(op.concat([probs, padding], axis=1)) if padded > vocab_size else probs
        values = bb.emit(op.broadcast_to(op.arange(0, padded, 1, "int32"), [batch, padded]))
        both = bb.emit(
            rx.call_tir_inplace(
                sort,
                [keys, values],
                inplace_indices=[0, 1],
                out_ty=[rx.TensorType([batch, padded], "float32"), rx.TensorType([batch, padded], "int32")],
            )
        )
        first = lambda x: op.strided_slice(x, axes=[1], begin=[0], end=[vocab_size])  # noqa: E731
        return rx.Tuple([bb.emit(first(rx.TupleGetItem(both, 0))), bb.emit(first(rx.TupleGetItem(both, 1)))])

    _define(bb, "argsort_probs", [probs], body)


def _attach_sampling(bb: rx.BlockBuilder, vocab_size: int, gpu: bool) -> None:
    op = rx.op
    num_seq, num_probs, vocab = _shape("num_seq", "num_probs", "vocab")
    logits = _tensor("logits", [num_seq, num_probs, vocab], "float32")
    temperature = _tensor("temperature", [num_seq], "float32")
    _define(
        bb,
        "softmax_with_temperature",
        [logits, temperature],
        lambda: op.nn.softmax(bb.emit(op.divide(logits, op.reshape(temperature, [num_seq, 1, 1]))), axis=-1),
    )

    _attach_argsort(bb, vocab_size, gpu)

    batch, vocab, num_samples = _shape("batch", "vocab", "num_samples")
    sorted_probs = _tensor("sorted_probs", [batch, vocab], "float32")
    sorted_indices = _tensor("sorted_indices", [batch, vocab], "int32")
    uniform = _tensor("uniform_samples", [num_samples], "float32")
    sample_rows = _tensor("sample_indices", [num_samples], "int32")
    top_p = _tensor("top_p", [batch], "float32")

    def sample():
        # Keep the shortest prefix of the sorted distribution whose mass reaches top_p, then
        # pick the first position whose cumulative mass passes u * (kept mass). Comparisons go
        # straight to int32: WGSL has no 8-bit storage for a materialized bool tensor.
        cumulative = bb.emit(op.cumsum(sorted_probs, axis=1))
        kept = bb.emit(
            op.astype(op.less(op.subtract(cumulative, sorted_probs), op.reshape(top_p, [batch, 1])), "int32")
        )
        kept_mass = bb.emit(op.sum(op.multiply(sorted_probs, op.astype(kept, "float32")), axis=[1]))
        kept_count = bb.emit(op.sum(kept, axis=[1]))
        row_cumulative = bb.emit(op.take(cumulative, sample_rows, axis=0, mode="clip"))
        threshold = bb.emit(op.multiply(uniform, op.take(kept_mass, sample_rows, axis=0, mode="clip")))
        below = bb.emit(op.astype(op.less(row_cumulative, op.reshape(threshold, [num_samples, 1])), "int32"))
        position = bb.emit(
            op.minimum(
                op.sum(below, axis=[1]),
                op.subtract(op.take(kept_count, sample_rows, axis=0, mode="clip"), rx.const(1, "int32")),
            )
        )
        row_indices = bb.emit(op.take(sorted_indices, sample_rows, axis=0, mode="clip"))
        token = bb.emit(op.gather_elements(row_indices, op.reshape(position, [num_samples, 1]), axis=1))
        return op.reshape(token, [num_samples])

    _define(bb, "sample_with_top_p", [sorted_probs, sorted_indices, uniform, sample_rows, top_p], sample)


def _attach_logit_processors(bb: rx.BlockBuilder, gpu: bool) -> None:
    batch, vocab, num_token = _shape("batch", "vocab", "num_token")
    _attach_inplace(
        bb,
        "apply_logit_bias_inplace",
        _apply_logit_bias(),
        "logit_bias",
        [
            _tensor("logits", [batch, vocab], "float32"),
            _tensor("pos2seq_id", [num_token], "int32"),
            _tensor("token_ids", [num_token], "int32"),
            _tensor("logit_bias", [num_token], "float32"),
        ],
        gpu,
    )
    batch, vocab, num_seq, num_token = _shape("batch", "vocab", "num_seq", "num_token")
    _attach_inplace(
        bb,
        "apply_penalty_inplace",
        _apply_penalty(),
        "penalty",
        [
            _tensor("logits", [batch, vocab], "float32"),
            _tensor("seq_ids", [num_seq], "int32"),
            _tensor("pos2seq_id", [num_token], "int32"),
            _tensor("token_ids", [num_token], "int32"),
            _tensor("token_cnt", [num_token], "int32"),
            _tensor("penalties", [num_seq, 3], "float32"),
        ],
        gpu,
    )
    batch, vocab, num_seq, words = _shape("batch", "vocab", "num_seq", "words")
    _attach_inplace(
        bb,
        "apply_bitmask_inplace",
        _apply_bitmask(),
        "bitmask",
        [
            _tensor("logits", [batch, vocab], "float32"),
            _tensor("seq_ids", [num_seq], "int32"),
            _tensor("bitmask", [batch, words], "int32"),
        ],
        gpu,
    )


def attach_metadata(mod, metadata: dict):
    """Return `mod` with `_metadata`, the JSON every engine reads first."""
    bb = rx.BlockBuilder(mod)
    with bb.function("_metadata", []):
        bb.emit_func_output(tvm.ir.StringImm(json.dumps(metadata, sort_keys=True)))
    return bb.finalize()


def attach_vm_functions(mod, metadata: dict, target: tvm.target.Target, vocab_size: int):
    """Return `mod` with `_metadata`, the sampling functions and the logit processors added."""
    bb = rx.BlockBuilder(attach_metadata(mod, metadata))
    gpu = "gpu" in target.keys
    _attach_sampling(bb, vocab_size, gpu)
    _attach_logit_processors(bb, gpu)
    return bb.finalize()
