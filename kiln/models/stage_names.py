"""The names of the compute stages the model and quantization code write, which the schedules
(kiln/compile/lower) find kernels' blocks by: one place for both sides."""

MATMUL = "matmul"  # a linear layer's product (kiln/models/layers.py, a factored decode's row sums)
DEQUANTIZE = "dequantize"  # a quantized weight unpacked to floats
GATHERED_ROWS, GATHERED_ROW_SCALES = "rows", "row_scales"  # an embedding's rows (and their scales) for the ids
GROUP_STAGES = ("group_scale", "group_offset")  # a GGUF block type's shared parameters, per group of weights
LANE_DOTS = "lane_dots"  # a factored decode GEMV's per-lane dot products
ATTENTION_SCORES, ATTENTION_VALUES = "attention_scores", "attention_values"  # an encoder's q·k and p·v products
MASKED_SCORES = "masked_scores"  # an encoder's scaled scores, padding (and what a query does not see) masked
