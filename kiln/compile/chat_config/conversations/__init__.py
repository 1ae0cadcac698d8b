"""The conversation families a chat template is matched against (kiln/compile/chat_config/conv_template.py),
one file a family, as MLC keeps its conversation templates. The registry's order is the order they
are tried in."""

from kiln.compile.chat_config.conversations.chatml import CHATML
from kiln.compile.chat_config.conversations.gemma import GEMMA, GEMMA_4
from kiln.compile.chat_config.conversations.granite import GRANITE
from kiln.compile.chat_config.conversations.llama import LLAMA_2, LLAMA_3
from kiln.compile.chat_config.conversations.mistral import MISTRAL_V1, MISTRAL_V3, MISTRAL_V3_TEKKEN, MISTRAL_V7_TEKKEN
from kiln.compile.chat_config.conversations.olmo import OLMO_2
from kiln.compile.chat_config.conversations.phi3 import PHI_3
from kiln.compile.chat_config.conversations.smollm3 import SMOLLM3
from kiln.compile.chat_config.conversations.zephyr import ZEPHYR

CONV_FAMILIES = (
    CHATML,
    LLAMA_3,
    PHI_3,
    ZEPHYR,
    LLAMA_2,
    MISTRAL_V1,
    MISTRAL_V3,
    GEMMA,
    GEMMA_4,
    MISTRAL_V3_TEKKEN,
    MISTRAL_V7_TEKKEN,
    GRANITE,
    SMOLLM3,
    OLMO_2,
)
