"""The recurrent state of a hybrid model's non-attention layers (LFM2's short convolutions, Qwen3.5's
Gated DeltaNet), beside the paged KV cache: TVM's runtime `RNNState` (`vm.builtin.rnn_state_*`),
which this TVM gives no Python interface.

The runtime keeps, for each recurrent layer and each of its states, a storage of shape
(sequences, max_history, *state shape). A step reads the state at the sequence's current history slot
and writes the next one, so the last `max_history - 1` single-token steps can be undone (`popn`); a
step of more than one token cannot be. The exported `create_rnn_state(max_batch_size, max_history)`
is what WebLLM calls for a model whose `_metadata.kv_state_kind` is "hybrid".
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.script import tirx as T


@dataclass(frozen=True)
class StateSpec:
    """One state each recurrent layer keeps per sequence."""

    shape: tuple[int, ...]
    dtype: str


class RecurrentState(nn.Object):
    """The state object a hybrid model's functions take and return, with the `specs` of its states
    (the model sets them). `set` moves this object on to the state the write returns, so the functions
    return the last write and every write stays ordered after the reads it depends on."""

    specs: list[StateSpec]

    @staticmethod
    def create(
        max_batch_size: tirx.Var, max_history: tirx.Var, num_layers: int, specs: list[StateSpec]
    ) -> RecurrentState:
        bb = rx.BlockBuilder.current()
        gets = [bb.add_func(state_copy(spec, write=False), f"rnn_state_get_{i}") for i, spec in enumerate(specs)]
        sets = [bb.add_func(state_copy(spec, write=True), f"rnn_state_set_{i}") for i, spec in enumerate(specs)]
        initial = [nn.op.zeros(spec.shape, spec.dtype)._expr for spec in specs]
        return RecurrentState(
            _expr=rx.call_pure_packed(
                "vm.builtin.rnn_state_create",
                rx.prim_value(num_layers),
                max_batch_size,
                max_history,
                gets,
                sets,
                initial,
                ty_args=rx.AnyType(),
            ),
            _name="rnn_state",
        )

    def get(self, layer: int, state: int, batch: int) -> nn.Tensor:
        """Recurrent layer `layer`'s state `state` for each of the step's `batch` sequences."""
        spec = self.specs[state]
        return nn.Tensor(
            _expr=rx.BlockBuilder.current().emit(
                rx.call_dps_packed(
                    "vm.builtin.rnn_state_get",
                    [self._expr, rx.prim_value(layer), rx.prim_value(state)],
                    out_ty=rx.TensorType((batch, *spec.shape), spec.dtype),
                )
            )
        )

    def set(self, layer: int, state: int, value: nn.Tensor) -> None:
        self._expr = rx.BlockBuilder.current().emit(
            rx.call_pure_packed(
                "vm.builtin.rnn_state_set",
                self._expr,
                rx.prim_value(layer),
                rx.prim_value(state),
                value._expr,
                ty_args=rx.AnyType(),
            ),
            "rnn_state",
        )


def state_copy(spec: StateSpec, write: bool) -> tirx.PrimFunc:
    """The runtime's getter (storage at each sequence's history slot → a batch of states) or setter
    (a batch of states → the next history slot) for states of `spec`."""
    axes = "S" * (len(spec.shape) + 1)

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def get(var_storage: T.handle, var_sequences: T.handle, var_history: T.handle, var_batch: T.handle):
        T.func_attr({"tirx.noalias": True})
        sequences, histories, batch_size = T.int64(), T.int64(), T.int32()
        storage = T.match_buffer(var_storage, (sequences, histories, *spec.shape), spec.dtype)
        sequence_slots = T.match_buffer(var_sequences, (batch_size,), "int32")
        history_slots = T.match_buffer(var_history, (batch_size,), "int32")
        batch = T.match_buffer(var_batch, (batch_size, *spec.shape), spec.dtype)
        for i in range(batch_size):
            for s in T.grid(*spec.shape):
                with T.sblock("get"):
                    vi, *vs = T.axis.remap(axes, [i, *s])
                    T.buffer_store(
                        batch, T.BufferLoad(storage, [sequence_slots[vi], history_slots[vi], *vs]), [vi, *vs]
                    )

    @T.prim_func(private=True, s_tir=True)
    def set(var_storage: T.handle, var_sequences: T.handle, var_history: T.handle, var_batch: T.handle):
        T.func_attr({"tirx.noalias": True})
        sequences, histories, batch_size = T.int64(), T.int64(), T.int32()
        storage = T.match_buffer(var_storage, (sequences, histories, *spec.shape), spec.dtype)
        sequence_slots = T.match_buffer(var_sequences, (batch_size,), "int32")
        history_slots = T.match_buffer(var_history, (batch_size,), "int32")
        batch = T.match_buffer(var_batch, (batch_size, *spec.shape), spec.dtype)
        for i in range(batch_size):
            for s in T.grid(*spec.shape):
                with T.sblock("set"):
                    vi, *vs = T.axis.remap(axes, [i, *s])
                    T.buffer_store(
                        storage,
                        T.BufferLoad(batch, [vi, *vs]),
                        [sequence_slots[vi], (history_slots[vi] + 1) % T.Cast("int32", histories), *vs],
                    )
    # fmt: on
    return set if write else get
