"""A conversation family: one layout of chat prompts, in the fields of MLC's conv_template."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConvFamily:
    """One layout of chat prompts, in conv_template fields."""

    name: str
    markers: tuple[str, ...]  # a template of this family contains every one of them
    system_template: str  # "{system_message}" stands for the system message
    roles: dict[str, str]
    seps: tuple[str, ...]  # after the 1st, 2nd, ... message, cycled
    role_content_sep: str
    role_empty_sep: str
    stop_str: tuple[str, ...]
    add_role_after_system_message: bool = True  # False: the system block opens the first user turn
    bos_in_roles: bool = False  # the BOS token opens every user turn, so it stays in the text
    # Other layouts of the same turns (conv_template fields that replace the family's), tried when
    # encoding WebLLM's pieces one by one gives other ids than the whole text (see the module doc).
    variants: tuple[dict, ...] = ()
