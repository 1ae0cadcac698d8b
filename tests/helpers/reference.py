"""The reference a build's logits are held to: transformers on the same weights, on a few prompts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kiln.compile.quantization import QUANTIZATIONS
from kiln.compile.quantization.group import dequantize_group, quantize_group

LOGIT_TOLERANCE = 2e-3
PROMPTS = ([5, 17, 100, 42, 7, 250, 3], [300, 12, 12, 12, 9], list(range(40, 140, 3)))


def reference_model(source: Path, quantization: str | None = None) -> torch.nn.Module:
    """transformers on the source weights; with a quantization, on the weights after
    quantize → dequantize, so any remaining difference is the kernels'."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if quantization:
        fmt = QUANTIZATIONS[quantization].group_format
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and fmt.fits(module.weight.shape[1]):
                    weight = module.weight.numpy()
                    module.weight.copy_(torch.from_numpy(dequantize_group(*quantize_group(weight, fmt), fmt)))
    return model
