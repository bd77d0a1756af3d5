"""A stage call's label: ``name[tag]`` (``encode_corpus[zero-shot]``), or the name alone for an untagged
call. Made and read here only."""

from __future__ import annotations


def label(name: str, tag: str | None) -> str:
    return f"{name}[{tag}]" if tag else name


def stage_name(stage_label: str) -> str:
    """``encode_corpus[zero-shot]`` -> ``encode_corpus``."""
    return stage_label.split("[", 1)[0]


def tag(stage_label: str) -> str | None:
    """``encode_corpus[zero-shot]`` -> ``zero-shot``; None for an untagged label."""
    name, sep, rest = stage_label.partition("[")
    return rest[:-1] if sep and rest.endswith("]") else None


def matches(stage_label: str, wanted: str) -> bool:
    """Whether ``wanted`` (a label, or a stage name standing for all its calls) names ``stage_label``."""
    return stage_label == wanted or stage_name(stage_label) == wanted
