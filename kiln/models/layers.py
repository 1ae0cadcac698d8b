"""Layers every decoder shares. Weights keep the checkpoint layout [out, in]: the matmul reads
them transposed inside one kernel, so no weight is ever transposed at run time."""

from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn

from .stage_names import MATMUL


def matmul_transposed(x: te.Tensor, weight: te.Tensor, out_dtype: str) -> te.Tensor:
    """y[..., o] = sum_k x[..., k] * weight[o, k], accumulated in `out_dtype`."""
    *batch, in_features = x.shape
    out_features = weight.shape[0]
    k = te.reduce_axis((0, in_features), name="k")
    return te.compute(
        (*batch, out_features),
        lambda *idx: te.sum(x[(*idx[:-1], k)].astype(out_dtype) * weight[idx[-1], k].astype(out_dtype), axis=k),
        name=MATMUL,
    )


def add_bias(y: nn.Tensor, bias: nn.Parameter | None) -> nn.Tensor:
    """The bias, when there is one, as an elementwise add the compiler fuses into the matmul."""
    return y if bias is None else y + bias


class Linear(nn.Module):
    """A linear layer over a float weight [out_features, in_features], with an optional bias
    (a quantized linear keeps the bias in the float dtype)."""

    def __init__(self, in_features: int, out_features: int, dtype: str, bias: bool = False):
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = nn.op.tensor_expr_op(lambda x, w: matmul_transposed(x, w, x.dtype), "matmul", [x, self.weight])
        return add_bias(y, self.bias)


class Embedding(nn.Module):
    """Token embedding; `project` reuses the table as the output head of tied models."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: str):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter((vocab_size, hidden_size), dtype)

    def forward(self, token_ids: nn.Tensor) -> nn.Tensor:
        return nn.op.take(self.weight, token_ids, axis=0)

    def project(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.tensor_expr_op(lambda x, w: matmul_transposed(x, w, "float32"), "lm_head", [x, self.weight])


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: str):
        self.eps = eps
        self.weight = nn.Parameter((hidden_size,), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.rms_norm(x, self.weight, axes=[-1], epsilon=self.eps)


def last_position(hidden: nn.Tensor) -> nn.Tensor:
    """hidden[:, -1:, :] for a symbolic sequence length."""

    def take_last(x: te.Tensor) -> te.Tensor:
        batch, seq_len, width = x.shape
        return te.compute((batch, 1, width), lambda b, _, d: x[b, seq_len - 1, d], name="last")

    return nn.op.tensor_expr_op(take_last, "take_last_position", [hidden])


def gather_positions(hidden: nn.Tensor, positions: nn.Tensor) -> nn.Tensor:
    """hidden[:, positions, :] — the logit positions of a batched prefill."""

    def gather(x: te.Tensor, pos: te.Tensor) -> te.Tensor:
        batch_size = pos.shape[0]
        return te.compute(
            (1, batch_size, x.shape[2]),
            lambda _, i, d: x[0, tirx.Cast("int64", pos[i]), d],
            name="gather",
        )

    return nn.op.tensor_expr_op(gather, "gather_logit_positions", [hidden, positions])
