"""Mistral's `[INST]` templates, one a tokenizer version (llama.cpp's names)."""

from kiln.compile.chat_config.conv_family import ConvFamily

# Mistral's templates (named after its tokenizer versions, as llama.cpp does) have no system
# role: they fold the system message into a user turn.
MISTRAL_V1 = ConvFamily(
    "mistral-v1",
    ("[INST]",),
    " [INST] {system_message}\n\n",
    {"user": " [INST]", "assistant": ""},
    (" [/INST]", "</s>"),
    " ",
    "",
    ("</s>",),
    add_role_after_system_message=False,
    variants=({"roles": {"user": " [INST] ", "assistant": ""}, "role_content_sep": ""},),
)

MISTRAL_V3 = ConvFamily(
    "mistral-v3",
    ("[INST]",),
    "[INST] {system_message}\n\n",
    {"user": "[INST]", "assistant": ""},
    ("[/INST]", "</s>"),
    " ",
    "",
    ("</s>",),
    add_role_after_system_message=False,
)

MISTRAL_V3_TEKKEN = ConvFamily(
    "mistral-v3-tekken",
    ("[INST]",),
    "[INST]{system_message}\n\n",
    {"user": "[INST]", "assistant": ""},
    ("[/INST]", "</s>"),
    "",
    "",
    ("</s>",),
    add_role_after_system_message=False,
)

# Mistral Small 3.1 and later, Ministral 3 (Mistral's "v7" templates): the system message in a block of
# its own, a default one when the chat has none.
MISTRAL_V7_TEKKEN = ConvFamily(
    "mistral-v7-tekken",
    ("[SYSTEM_PROMPT]", "[INST]"),
    "[SYSTEM_PROMPT]{system_message}[/SYSTEM_PROMPT]",
    {"user": "[INST]", "assistant": ""},
    ("[/INST]", "</s>"),
    "",
    "",
    ("</s>",),
)
