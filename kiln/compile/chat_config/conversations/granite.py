"""Granite: `<|start_of_role|>role<|end_of_role|>` … `<|end_of_text|>` (IBM Granite 3.x)."""

from kiln.compile.chat_config.conv_family import ConvFamily

GRANITE = ConvFamily(
    "granite",
    ("<|start_of_role|>",),
    "<|start_of_role|>system<|end_of_role|>{system_message}<|end_of_text|>\n",
    {"user": "<|start_of_role|>user", "assistant": "<|start_of_role|>assistant"},
    ("<|end_of_text|>\n",),
    "<|end_of_role|>",
    "<|end_of_role|>",
    ("<|end_of_text|>",),
)
