"""ChatML: `<|im_start|>role` … `<|im_end|>` (Qwen, SmolLM, many fine-tunes)."""

from kiln.compile.chat_config.conv_family import ConvFamily

CHATML = ConvFamily(
    "chatml",
    ("<|im_start|>",),
    "<|im_start|>system\n{system_message}<|im_end|>\n",
    {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
    ("<|im_end|>\n",),
    "\n",
    "\n",
    ("<|im_end|>",),
)
