"""SmolLM3: ChatML's turns after a system block that carries metadata and is closed by a blank line, not
`<|im_end|>` (HuggingFaceTB/SmolLM3-3B's template, when no tools are given)."""

from kiln.compile.chat_config.conv_family import ConvFamily

SMOLLM3 = ConvFamily(
    "smollm3",
    ("<|im_start|>", "Reasoning Mode"),
    "<|im_start|>system\n{system_message}\n\n",
    {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
    ("<|im_end|>\n",),
    "\n",
    "\n",
    ("<|im_end|>",),
)
