"""Phi-3: `<|user|>` … `<|end|>`."""

from kiln.compile.chat_config.conv_family import ConvFamily

PHI_3 = ConvFamily(
    "phi-3",
    ("<|user|>", "<|end|>"),
    "<|system|>\n{system_message}<|end|>\n",
    {"user": "<|user|>", "assistant": "<|assistant|>"},
    ("<|end|>\n",),
    "\n",
    "\n",
    ("<|end|>",),
)
