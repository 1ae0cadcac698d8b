"""OLMo 2: Tülu 3's `<|user|>\n` … `\n<|assistant|>\n` … `<|endoftext|>\n`, opened by the BOS token
(allenai/OLMo-2 instruct models; `<|endoftext|>` is their BOS and EOS)."""

from kiln.compile.chat_config.conv_family import ConvFamily

OLMO_2 = ConvFamily(
    "olmo-2",
    ("<|user|>", "<|assistant|>", "eos_token"),
    "<|system|>\n{system_message}\n",
    {"user": "<|user|>", "assistant": "<|assistant|>"},
    ("\n", "<|endoftext|>\n"),
    "\n",
    "\n",
    ("<|endoftext|>",),
)
