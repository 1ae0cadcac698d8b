"""The `conv_template` of mlc-chat-config.json: a chat laid out the way the jinja chat template lays it out.

Kiln's native engine renders the model's jinja chat template. The browser engine
(web/src/chat-format.js) and WebLLM render a conv_template instead: a system block, then each
message as role + role_content_sep + content + a separator, then the assistant's role
(`conv_template_pieces` below is the same rule). A conv_template is derived here in four steps:

- the template's family is picked by its markers from a registry of layouts (`conversations/`, one file each);
- what varies inside a family is read off the template by rendering it with probe messages: a BOS
  token it prints first (WebLLM's `system_prefix_token_ids`), text it puts in the system block
  (Llama 3.1's "Cutting Knowledge Date" lines), its default system message, and whether it shows a
  system block when the conversation has none;
- the result is checked by rendering the probe conversations both ways. A family that does not
  reproduce one user message, a system message and several turns is not the template's; when no
  family does, the build stops rather than let the browser format chats wrongly;
- then by token ids. WebLLM (and the browser engine) encode the prompt piece by piece: the system
  block, each message with its role and separator, the assistant's role, each its own
  `tokenizer.encode`. A SentencePiece tokenizer that prepends "▁" to every text it encodes (Llama 2,
  Mistral v0.2) encodes a piece that starts mid-text with a space (Mistral's " Fruit" after
  "[/INST]") as "▁▁Fruit" where the whole text has "▁Fruit". A family's `variants` put that space
  elsewhere or leave it to the tokenizer; the layout whose pieces give the template's token ids for
  the most probes is kept. The probes no layout gives the template's ids for are shapes a
  conv_template cannot express (Qwen3 shows a system block for an empty system message but none
  without one; Mistral's v3 templates put the system message into the last user turn; Llama 2 and
  Mistral v0.2 join the system message and the first user message in one text, which WebLLM encodes
  as two, "\n\n" and "▁Hello"): they are returned so the build can warn.

Some differences no conv_template can carry, and no probe sees: Llama 3 and Llama 2 templates trim
whitespace around each message; Qwen3's drops the `<think>` part of earlier assistant turns; a
template that prints today's date (Llama 3.2's `strftime_now`) leaves the build's date in the
conv_template while the native engine prints the day's; a template that refuses system messages
(`raise_exception`) makes the native engine refuse them while the browser lays them out in the
family's system block. Qwen3 renders as its template does by default, thinking on
(`enable_thinking` unset); WebLLM's `enable_thinking: false` appends the same empty think block
the template would.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import replace

from tokenizers import Tokenizer

from kiln.chat_template import ChatTemplate, ConversationRefused
from kiln.compile.chat_config.conv_family import ConvFamily
from kiln.compile.chat_config.conversations import CONV_FAMILIES
from kiln.errors import KilnError

# MLC's conv_template name for a model without a chat template: it completes raw text only.
RAW_COMPLETION = "LM"
SYSTEM_PLACEHOLDER = "{system_message}"


SYSTEM, USER, ASSISTANT, LAST_USER = "Kiln-probe-system", "Kiln-probe-user", "Kiln-probe-reply", "Kiln-probe-again"
BOS_STAND_IN = "Kiln-probe-bos"
PROBES = {
    "one user message": [{"role": "user", "content": USER}],
    "a system message": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
    "several turns": [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": ASSISTANT},
        {"role": "user", "content": LAST_USER},
    ],
    "a system message and several turns": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": ASSISTANT},
        {"role": "user", "content": LAST_USER},
    ],
    "an empty system message": [{"role": "system", "content": ""}, {"role": "user", "content": USER}],
}
REQUIRED_PROBES = ("one user message", "a system message", "several turns")


def conv_template_pieces(conv: dict, messages: list[dict]) -> list[str]:
    """The prompt for `messages` (ending with the assistant's turn opened) in the pieces WebLLM 0.2.86's
    Conversation.getPromptArray and web/src/chat-format.js build and encode one by one; the
    `system_prefix_token_ids` go before them as ids. For the fields Kiln writes."""
    system_message = conv["system_message"]
    if messages[0]["role"] == "system":
        system_message, messages = messages[0]["content"], messages[1:]
    shown = system_message != "" or conv["render_empty_system_message"]
    system = conv["system_template"].replace(SYSTEM_PLACEHOLDER, system_message, 1) if shown else ""
    pieces = [system] if system else []
    for index, message in enumerate(messages):
        opens_with_system = not conv["add_role_after_system_message"] and system != "" and index == 0
        role = "" if opens_with_system else conv["roles"][message["role"]] + conv["role_content_sep"]
        pieces.append(role + message["content"] + conv["seps"][index % len(conv["seps"])])
    return [*pieces, conv["roles"]["assistant"] + conv["role_empty_sep"]]


def render_conv_template(conv: dict, messages: list[dict]) -> str:
    """The prompt text for `messages`: its pieces joined."""
    return "".join(conv_template_pieces(conv, messages))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def piecewise_ids(tokenizer: Tokenizer, conv: dict, messages: list[dict]) -> list[int]:
    """The prompt's token ids as WebLLM and the browser engine encode it: piece by piece."""
    ids = list(conv["system_prefix_token_ids"])
    for piece in conv_template_pieces(conv, messages):
        ids += encode(tokenizer, piece)
    return ids


def rendered_or_none(template: ChatTemplate, messages: list[dict]) -> str | None:
    """The template's prompt, or None when the template refuses the messages (no system role, ...)."""
    try:
        return template.render(messages)
    except ConversationRefused:
        return None


def fitted_system_template(family: ConvFamily, rendered: str) -> str:
    """The system block as the template renders it (`rendered`: a probe with a system message):
    the family's, with any text the template adds before the message; "" when it drops system messages."""
    if SYSTEM not in rendered:
        return ""
    opening, closing = family.system_template.split(SYSTEM_PLACEHOLDER)
    head = rendered[: rendered.index(SYSTEM)]
    return head + SYSTEM_PLACEHOLDER + closing if head.startswith(opening) else family.system_template


def default_system_message(family: ConvFamily, system_template: str, rendered: str) -> str | None:
    """The system message the template shows when the conversation has none (`rendered`: a probe
    with one user message), "" for an empty block; None when it shows no system block."""
    if USER not in rendered or not system_template:
        return None
    user_turn = family.roles["user"] + family.role_content_sep
    head = rendered[: rendered.index(USER)]
    if head == user_turn:
        return None
    block = head.removesuffix(user_turn) if family.add_role_after_system_message else head
    opening, closing = system_template.split(SYSTEM_PLACEHOLDER)
    if len(block) < len(opening) + len(closing) or not (block.startswith(opening) and block.endswith(closing)):
        return None
    return block[len(opening) : len(block) - len(closing)]


def opens_with_bos_token(template: ChatTemplate) -> bool:
    """Whether the template prints `bos_token` before anything else. Rendered with a stand-in for it:
    a model's bos_token may be a token its layout uses anyway (SmolLM2's is <|im_start|>)."""
    stand_in = replace(template, special_tokens={**template.special_tokens, "bos_token": BOS_STAND_IN})
    return stand_in.render(PROBES["one user message"]).startswith(BOS_STAND_IN)


def fit(family: ConvFamily, template: ChatTemplate, opening_bos: str) -> tuple[dict, str]:
    """The family's conv_template fitted to the template (`opening_bos`: the BOS text it prints
    first, if it does), and the text WebLLM gets as `system_prefix_token_ids`."""
    prefix = "" if family.bos_in_roles else opening_bos
    one_user_message = template.render(PROBES["one user message"])
    with_system = rendered_or_none(template, PROBES["a system message"])
    system_template = (
        fitted_system_template(family, with_system.removeprefix(prefix))
        if with_system is not None
        else family.system_template
    )
    default = default_system_message(family, system_template, one_user_message.removeprefix(prefix))
    conv = {
        "name": family.name,
        "system_template": system_template,
        "system_message": default or "",
        "system_prefix_token_ids": [],
        "add_role_after_system_message": family.add_role_after_system_message,
        "render_empty_system_message": default is not None,
        "roles": dict(family.roles),
        "seps": list(family.seps),
        "role_content_sep": family.role_content_sep,
        "role_empty_sep": family.role_empty_sep,
        "stop_str": list(family.stop_str),
    }
    return conv, prefix


def differing_probes(template: ChatTemplate, conv: dict, prefix: str, names) -> list[tuple[str, str, str]]:
    """(probe, the template's prompt, the conv_template's) for each probe the template accepts and
    the conv_template renders differently."""
    differences = []
    for name in names:
        expected = rendered_or_none(template, PROBES[name])
        ours = prefix + render_conv_template(conv, PROBES[name])
        if expected is not None and expected != ours:
            differences.append((name, expected, ours))
    return differences


def first_difference(expected: str, ours: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a != b), min(len(expected), len(ours)))
    start = max(0, at - 20)
    return f"the template renders {expected[start : at + 30]!r} where that layout gives {ours[start : at + 30]!r}"


def probes_with_other_ids(template: ChatTemplate, tokenizer: Tokenizer, conv: dict) -> list[str]:
    """The probes the template accepts and the conv_template's pieces give other token ids for than
    the template's text, encoded whole as the native engine encodes it."""
    differing = []
    for name, messages in PROBES.items():
        expected = rendered_or_none(template, messages)
        if expected is not None and encode(tokenizer, expected) != piecewise_ids(tokenizer, conv, messages):
            differing.append(name)
    return differing


RAW_PROBES = ("Kiln-probe-text", " Kiln-probe-text", "Kiln probe\ntext ")


def text_encoding_ids(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text it encodes (a BOS, an EOS)."""
    plain = encode(tokenizer, RAW_PROBES[0])
    full = tokenizer.encode(RAW_PROBES[0], add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
    if not starts:
        raise KilnError("the post-processor of tokenizer.json changes the ids of the text it encodes")
    return full[: starts[0]], full[starts[0] + len(plain) :]


def raw_completion_template(stop_token_ids: list[int], prefix_ids: list[int]) -> dict:
    """MLC's conv_template for raw completion: a user message's text alone, after `prefix_ids` (the BOS
    the tokenizer adds, which WebLLM prefills only from `system_prefix_token_ids`)."""
    return {
        "name": RAW_COMPLETION,
        "system_template": SYSTEM_PLACEHOLDER,
        "system_message": "",
        "system_prefix_token_ids": list(prefix_ids),
        "add_role_after_system_message": True,
        "render_empty_system_message": False,
        "roles": {"user": "", "assistant": ""},
        "seps": [""],
        "role_content_sep": "",
        "role_empty_sep": "",
        "stop_str": [],
        "stop_token_ids": stop_token_ids,
    }


def derive_raw_completion_template(tokenizer: Tokenizer, stop_token_ids: list[int]) -> tuple[dict, list[str]]:
    """The raw-completion conv_template, and what of the native prompt (the text encoded with the
    tokenizer's special tokens) WebLLM's pieces cannot give: ids the post-processor appends."""
    prefix, suffix = text_encoding_ids(tokenizer)
    conv = raw_completion_template(stop_token_ids, prefix)
    differing = [
        text
        for text in RAW_PROBES
        if piecewise_ids(tokenizer, conv, [{"role": "user", "content": text}])
        != tokenizer.encode(text, add_special_tokens=True).ids
    ]
    if not differing:
        return conv, []
    appended = ", and the ids the tokenizer appends to it" if suffix else ""
    return conv, [f"a raw text ({differing[0]!r}{appended})"]


def derive_conv_template(
    template: ChatTemplate | None, tokenizer: Tokenizer, stop_token_ids: list[int]
) -> tuple[dict, list[str]]:
    """The conv_template that lays chats out as `template` does (RAW_COMPLETION without a template),
    and the probe conversations whose token ids it still gives differently (piece by piece, as WebLLM
    encodes) from the template's."""
    if template is None:
        return derive_raw_completion_template(tokenizer, stop_token_ids)
    candidates = [f for f in CONV_FAMILIES if all(marker in template.source for marker in f.markers)]
    if not candidates:
        raise KilnError(
            "the chat template is of no family Kiln can lay out for the browser (known: "
            + ", ".join(f.name for f in CONV_FAMILIES)
            + ")",
            template.path,
        )
    bos = template.special_tokens["bos_token"]
    opening_bos = bos if bos and opens_with_bos_token(template) else ""
    first_rejection = None
    for family in candidates:
        conv, prefix = fit(family, template, opening_bos)
        differences = differing_probes(template, conv, prefix, REQUIRED_PROBES)
        if not differences:
            break
        name, expected, ours = differences[0]
        first_rejection = first_rejection or f"for {name} {first_difference(expected, ours)} ({family.name})"
    else:
        raise KilnError(
            f"the chat template lays chats out in a way no known family reproduces: {first_rejection}", template.path
        )
    if prefix:
        bos_id = tokenizer.token_to_id(prefix)
        if bos_id is None:
            raise KilnError(
                f"the chat template opens with the bos_token {prefix!r}, which tokenizer.json does not have",
                template.path,
            )
        conv["system_prefix_token_ids"] = [bos_id]
    conv["stop_token_ids"] = stop_token_ids
    # The family's layout, or the variant whose pieces give the template's ids for the most probes.
    layouts = [conv] + [{**conv, **deepcopy(variant)} for variant in family.variants]
    differing = [probes_with_other_ids(template, tokenizer, layout) for layout in layouts]
    best = min(range(len(layouts)), key=lambda i: len(differing[i]))
    return layouts[best], differing[best]
