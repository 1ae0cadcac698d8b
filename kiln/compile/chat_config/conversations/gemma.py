"""Gemma 2 and 3: `<start_of_turn>user` / `<start_of_turn>model`; Gemma 4: `<|turn>user` / `<|turn>model`."""

from kiln.compile.chat_config.conv_family import ConvFamily

# Gemma has no system role either: Gemma 3's template opens the first user turn with the system
# message and a blank line; Gemma 2's refuses system messages.
GEMMA = ConvFamily(
    "gemma",
    ("<start_of_turn>",),
    "<start_of_turn>user\n{system_message}\n\n",
    {"user": "<start_of_turn>user", "assistant": "<start_of_turn>model"},
    ("<end_of_turn>\n",),
    "\n",
    "\n",
    ("<end_of_turn>",),
    add_role_after_system_message=False,
)

# Gemma 4: `<|turn>user` / `<|turn>model`, a system role of its own; the generation prompt closes an
# empty thought channel (thinking off, the template's default).
GEMMA_4 = ConvFamily(
    "gemma-4",
    ("<|turn>",),
    "<|turn>system\n{system_message}<turn|>\n",
    {"user": "<|turn>user", "assistant": "<|turn>model"},
    ("<turn|>\n",),
    "\n",
    "\n<|channel>thought\n<channel|>",
    # A reply that calls a tool ends with `<|tool_response>` (an eos id in generation_config.json;
    # a GGUF names only `<eos>`).
    ("<turn|>", "<|tool_response>"),
)
