"""Config keys whose default follows another key: declared once per recipe, resolved before validation.

    class RocketQAConfig(SupervisedConfig):
        follows = (Follow("denoise.split", "train_split"),
                   Follow("dense.similarity", "dual_encoder.similarity"))

A recipe's config is composed of stage params, and some stage defaults only make sense relative to
another section: the split a denoiser reads is the recipe's labelled split, the evaluation encodes
with the similarity the dual encoder was trained with. A ``Follow`` says so: unless the config sets
``target``, it takes ``rule(*values of sources)``, where a source's value is what the config set or
else its own default (written once, in its params model). Follows are resolved in declaration
order on the raw config, so ``irflow config`` prints the resolved value and ``irflow config
--explain`` prints "= <what it follows>" as the default; what the user set always wins, and the
recipe's validators then check that the combination is allowed.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

MISSING = object()  # the raw config does not have the key


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Follow:
    """``target`` takes ``rule(*sources)`` when the raw config has one of ``unset`` there (absent, or
    null by default); ``says`` is how ``--explain`` names the rule (default: the source keys)."""

    target: str
    sources: str | tuple[str, ...]
    rule: Callable[..., Any] = _same
    unset: tuple[Any, ...] = (MISSING, None)
    says: str | None = None

    @property
    def source_keys(self) -> tuple[str, ...]:
        return (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)

    def explain(self) -> str:
        return "= " + (self.says or ", ".join(self.source_keys))


def resolve(cls: type[BaseModel], raw: dict, follows: tuple[Follow, ...]) -> dict:
    """A copy of ``raw`` with every unset follower filled in (sections created as needed; a section
    that is not a mapping is left for validation to report)."""
    raw = dict(raw)
    for f in follows:
        *path, key = f.target.split(".")
        section = _section(raw, path)
        if section is None:
            continue
        current = section.get(key, MISSING)
        if isinstance(current, (dict, list)) or current not in f.unset:
            continue  # set by the config: it wins
        values = [value(cls, raw, k) for k in f.source_keys]
        if any(v is MISSING for v in values):
            continue  # a source that cannot be read (a section that is not a mapping): validation says why
        section[key] = f.rule(*values)
    return raw


def _section(raw: dict, path: list[str]) -> dict | None:
    """The mutable (copied) section at ``path``, created empty where absent; None if not a mapping."""
    node = raw
    for part in path:
        child = node.get(part)
        if child is None:
            child = {}
        if not isinstance(child, dict):
            return None
        node[part] = child = dict(child)
        node = child
    return node


def value(cls: type[BaseModel], raw: dict, dotted: str) -> Any:
    """What the config says at ``dotted``: the raw value if given, else the default its model declares
    (for a section given in part, the default of the section's class -- for a discriminated union,
    of the member its tag selects)."""
    node: Any = raw
    model: Any = cls
    default: Any = MISSING
    for part in dotted.split("."):
        if default is not MISSING:  # below a section the config does not have: its default instance
            default = getattr(default, part)
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return MISSING
        given = node.get(part, MISSING) if isinstance(node, dict) else MISSING
        declared = field.get_default(call_default_factory=True)
        if given is MISSING or (given is None and isinstance(declared, BaseModel)):  # a null section: its default
            default = declared
            continue
        node, model = given, _member(field.annotation, given, declared)
    if default is not MISSING:
        return default.model_dump(mode="json") if isinstance(default, BaseModel) else default
    return node


def _member(annotation: Any, given: Any, default: Any) -> type[BaseModel] | None:
    """The model class a given section validates as (a union: the member whose tag it carries)."""
    members = _models(annotation)
    if len(members) <= 1 or not isinstance(given, dict):
        return members[0] if members else None
    for m in members:
        for name, f in m.model_fields.items():
            if typing.get_origin(f.annotation) is typing.Literal and given.get(name) in typing.get_args(f.annotation):
                return m
    return type(default) if isinstance(default, BaseModel) else None


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]
