"""Gemma: `<start_of_turn>user` / `<start_of_turn>model`."""

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
