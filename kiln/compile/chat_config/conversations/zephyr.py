"""Zephyr: Phi-3's roles, each turn closed by `</s>`."""

from kiln.compile.chat_config.conv_family import ConvFamily

ZEPHYR = ConvFamily(
    "zephyr",
    ("<|user|>",),
    "<|system|>\n{system_message}</s>\n",
    {"user": "<|user|>", "assistant": "<|assistant|>"},
    ("</s>\n",),
    "\n",
    "\n",
    ("</s>",),
)
