"""A causal depthwise convolution over the last inputs of a sequence (LFM2's short convolutions, Qwen3.5's
before its Gated DeltaNet), its past inputs kept in the recurrent state (kiln/models/recurrent_state.py)."""

from __future__ import annotations

import functools
import operator

from tvm import te, tirx
from tvm.relax.frontend import nn

from .layers import add_bias
from .recurrent_state import RecurrentState


def causal_conv(x: te.Tensor, past: te.Tensor, weight: te.Tensor) -> te.Tensor:
    """y[t] = Σ_k weight[k] · u[t + k] over u = the past inputs (one fewer than the taps), then x:
    depthwise, in float32. The few taps are summed in one expression, not a reduction: a GPU schedule
    gives each output a thread (as a reduction, a workgroup summed 4 products: 60 % of Qwen3.5's
    prefill on WebGPU)."""
    kept = past.shape[1]

    def u(b, t, c):
        return tirx.if_then_else(t < kept, past[b, t, c], x[b, t - kept, c]).astype("float32")

    def output(b, t, c):
        terms = [weight[c, 0, k].astype("float32") * u(b, t + k, c) for k in range(int(weight.shape[2]))]
        return functools.reduce(operator.add, terms).astype(x.dtype)

    return te.compute(x.shape, output, name="short_conv")


def last_inputs(x: te.Tensor, past: te.Tensor) -> te.Tensor:
    """The state after the step: the last inputs of past, then x, as many as past holds."""
    seq_len, kept = x.shape[1], past.shape[1]
    return te.compute(
        past.shape,
        lambda b, j, c: tirx.if_then_else(seq_len + j < kept, past[b, seq_len + j, c], x[b, seq_len + j - kept, c]),
        name="conv_state",
    )


class DepthwiseConv(nn.Module):
    """A causal depthwise convolution's taps (torch's Conv1d weight, [channels, 1, taps]) and bias; its
    past inputs are state `state_id` of its layer in the recurrent state (`conv_state`)."""

    def __init__(self, channels: int, taps: int, dtype: str, bias: bool):
        self.weight = nn.Parameter((channels, 1, taps), dtype)
        self.bias = nn.Parameter((channels,), dtype) if bias else None

    def forward(self, x: nn.Tensor, states: RecurrentState, layer: int, state_id: int) -> nn.Tensor:
        past = states.get(layer, state_id, x.shape[0])
        states.set(layer, state_id, nn.op.tensor_expr_op(last_inputs, "conv_state", [x, past]))
        return add_bias(nn.op.tensor_expr_op(causal_conv, "short_conv", [x, past, self.weight]), self.bias)


def conv_state(channels: int, taps: int) -> tuple[tuple[int, ...], None]:
    """The recurrent state of a DepthwiseConv: its last `taps - 1` inputs, in the model's dtype."""
    return (taps - 1, channels), None
