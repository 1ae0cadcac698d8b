"""Functions the library exports besides the model: `_metadata` and WebLLM's sampling helpers.

WebLLM 0.2.86 looks these up by name when it loads a model and fails if any is missing, even
at temperature 0. Signatures follow its calls (see DESIGN.md). The in-place logit processors
are TIR kernels wrapped in `call_tir_inplace`, so they are VM functions like the rest; on GPU
targets dlight's fallback rule binds their loops to threads.
"""

from __future__ import annotations

import json

from tvm import relax as rx
from tvm import tirx
from tvm.script import tirx as T


def _shape(*names: str) -> list[tirx.Var]:
    return [tirx.Var(name, "int64") for name in names]


@T.prim_func(private=True, s_tir=True)
def _apply_logit_bias(var_logits: T.handle, var_pos2seq: T.handle, var_token_ids: T.handle, var_bias: T.handle):
    batch, vocab, num_token = T.int64(), T.int64(), T.int64()
    logits = T.match_buffer(var_logits, (batch, vocab), "float32")
    pos2seq = T.match_buffer(var_pos2seq, (num_token,), "int32")
    token_ids = T.match_buffer(var_token_ids, (num_token,), "int32")
    bias = T.match_buffer(var_bias, (num_token,), "float32")
    for i in range(num_token):
        with T.sblock("logit_bias"):
            vi = T.axis.spatial(num_token, i)
            logits[pos2seq[vi], token_ids[vi]] = logits[pos2seq[vi], token_ids[vi]] + bias[vi]


@T.prim_func(private=True, s_tir=True)
def _apply_penalty(var_logits: T.handle, var_seq_ids: T.handle, var_pos2seq: T.handle,
                   var_token_ids: T.handle, var_token_cnt: T.handle, var_penalties: T.handle):
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


@T.prim_func(private=True, s_tir=True)
def _apply_bitmask(var_logits: T.handle, var_seq_ids: T.handle, var_bitmask: T.handle):
    batch, vocab, num_seq, words = T.int64(), T.int64(), T.int64(), T.int64()
    logits = T.match_buffer(var_logits, (batch, vocab), "float32")
    seq_ids = T.match_buffer(var_seq_ids, (num_seq,), "int32")
    bitmask = T.match_buffer(var_bitmask, (batch, words), "int32")
    for s, v in T.grid(num_seq, vocab):
        with T.sblock("bitmask"):
            vs, vv = T.axis.remap("SS", [s, v])
            logits[seq_ids[vs], vv] = T.if_then_else(
                (bitmask[seq_ids[vs], vv // 32] >> T.Cast("int32", vv % 32)) & 1 == 1,
                logits[seq_ids[vs], vv],
                T.min_value("float32"),
            )


def _tensor(name: str, shape, dtype: str) -> rx.Var:
    return rx.Var(name, rx.TensorType(shape, dtype))


def _attach_inplace(bb: rx.BlockBuilder, name: str, kernel, params: list[rx.Var]) -> None:
    with bb.function(name, params):
        kernel_var = bb.add_func(kernel, f"{name}_kernel")
        logits = params[0]
        out = bb.emit(rx.call_tir_inplace(kernel_var, params, inplace_indices=[0], out_ty=logits.struct_info))
        bb.emit_func_output(out)


def _attach_sampling(bb: rx.BlockBuilder) -> None:
    num_seq, num_probs, vocab = _shape("num_seq", "num_probs", "vocab")
    logits = _tensor("logits", [num_seq, num_probs, vocab], "float32")
    temperature = _tensor("temperature", [num_seq], "float32")
    with bb.function("softmax_with_temperature", [logits, temperature]):
        scaled = bb.emit(rx.op.divide(logits, rx.op.reshape(temperature, [num_seq, 1, 1])))
        bb.emit_func_output(bb.emit(rx.op.nn.softmax(scaled, axis=-1)))

    batch, vocab = _shape("batch", "vocab")
    probs = _tensor("probs", [batch, vocab], "float32")
    with bb.function("argsort_probs", [probs]):
        order = bb.emit(rx.op.argsort(probs, axis=-1, descending=True, dtype="int32"))
        sorted_probs = bb.emit(rx.op.gather_elements(probs, order, axis=-1))
        bb.emit_func_output(rx.Tuple([sorted_probs, order]))

    batch, vocab, num_samples = _shape("batch", "vocab", "num_samples")
    sorted_probs = _tensor("sorted_probs", [batch, vocab], "float32")
    sorted_indices = _tensor("sorted_indices", [batch, vocab], "int32")
    uniform = _tensor("uniform_samples", [num_samples], "float32")
    sample_rows = _tensor("sample_indices", [num_samples], "int32")
    top_p = _tensor("top_p", [batch], "float32")
    with bb.function("sample_with_top_p", [sorted_probs, sorted_indices, uniform, sample_rows, top_p]):
        # Keep the shortest prefix of the sorted distribution whose mass reaches top_p, then
        # pick the first position whose cumulative mass passes u * (kept mass).
        op = rx.op
        cumulative = bb.emit(op.cumsum(sorted_probs, axis=1))
        kept = bb.emit(op.less(op.subtract(cumulative, sorted_probs), op.reshape(top_p, [batch, 1])))
        kept_mass = bb.emit(op.sum(op.where(kept, sorted_probs, op.zeros_like(sorted_probs)), axis=[1]))
        kept_count = bb.emit(op.sum(op.astype(kept, "int32"), axis=[1]))
        row_cumulative = bb.emit(op.take(cumulative, sample_rows, axis=0))
        threshold = bb.emit(op.multiply(uniform, op.take(kept_mass, sample_rows, axis=0)))
        below = bb.emit(op.less(row_cumulative, op.reshape(threshold, [num_samples, 1])))
        position = bb.emit(op.minimum(
            op.sum(op.astype(below, "int32"), axis=[1]),
            op.subtract(op.take(kept_count, sample_rows, axis=0), rx.const(1, "int32")),
        ))
        row_indices = bb.emit(op.take(sorted_indices, sample_rows, axis=0))
        token = bb.emit(op.gather_elements(row_indices, op.reshape(position, [num_samples, 1]), axis=1))
        bb.emit_func_output(bb.emit(op.reshape(token, [num_samples])))


def _attach_logit_processors(bb: rx.BlockBuilder) -> None:
    batch, vocab, num_token = _shape("batch", "vocab", "num_token")
    _attach_inplace(bb, "apply_logit_bias_inplace", _apply_logit_bias, [
        _tensor("logits", [batch, vocab], "float32"),
        _tensor("pos2seq_id", [num_token], "int32"),
        _tensor("token_ids", [num_token], "int32"),
        _tensor("logit_bias", [num_token], "float32"),
    ])
    batch, vocab, num_seq, num_token = _shape("batch", "vocab", "num_seq", "num_token")
    _attach_inplace(bb, "apply_penalty_inplace", _apply_penalty, [
        _tensor("logits", [batch, vocab], "float32"),
        _tensor("seq_ids", [num_seq], "int32"),
        _tensor("pos2seq_id", [num_token], "int32"),
        _tensor("token_ids", [num_token], "int32"),
        _tensor("token_cnt", [num_token], "int32"),
        _tensor("penalties", [num_seq, 3], "float32"),
    ])
    batch, vocab, num_seq, words = _shape("batch", "vocab", "num_seq", "words")
    _attach_inplace(bb, "apply_bitmask_inplace", _apply_bitmask, [
        _tensor("logits", [batch, vocab], "float32"),
        _tensor("seq_ids", [num_seq], "int32"),
        _tensor("bitmask", [batch, words], "int32"),
    ])


def attach_vm_functions(mod, metadata: dict):
    """Return `mod` with `_metadata`, the sampling functions and the logit processors added."""
    bb = rx.BlockBuilder(mod)
    with bb.function("_metadata", []):
        bb.emit_func_output(rx.StringImm(json.dumps(metadata, sort_keys=True)))
    _attach_sampling(bb)
    _attach_logit_processors(bb)
    return bb.finalize()
