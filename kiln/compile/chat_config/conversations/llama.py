"""Llama 3's header tokens and Llama 2's `[INST]` with a `<<SYS>>` block."""

from kiln.compile.chat_config.conv_family import ConvFamily

LLAMA_3 = ConvFamily(
    "llama-3",
    ("<|start_header_id|>",),
    "<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
    {"user": "<|start_header_id|>user", "assistant": "<|start_header_id|>assistant"},
    ("<|eot_id|>",),
    "<|end_header_id|>\n\n",
    "<|end_header_id|>\n\n",
    ("<|eot_id|>",),
)

# Llama 2's and Mistral v0.2's variant: a reply's piece drops the space after "[/INST]" (role_content_sep
# "", the user's role keeps its space), the "▁" the tokenizer prepends stands for it.
LLAMA_2 = ConvFamily(
    "llama-2",
    ("[INST]", "<<SYS>>"),
    "<s>[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n",
    {"user": "<s>[INST]", "assistant": ""},
    (" [/INST]", " </s>"),
    " ",
    "",
    ("</s>",),
    add_role_after_system_message=False,
    bos_in_roles=True,
    variants=({"roles": {"user": "<s>[INST] ", "assistant": ""}, "role_content_sep": ""},),
)
