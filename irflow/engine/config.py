"""Config files: YAML, one section per stage, ``--set a.b=value`` overrides, validation messages.

``read`` gives the raw mapping (a YAML file, a dict or a config model) with the overrides applied:
they edit the raw YAML first, so ``--set`` is checked exactly like the file. ``validate`` checks it
against a recipe's config model (a ``Params`` tree) all at once: unknown keys at any depth, wrong
types, out-of-range and unknown enum values, and the recipe's cross-stage rules. Every problem is
reported by dotted path, with the value and what is allowed, before any work starts. Which recipe's
model that is (``flow:``) is decided in ``irflow.recipes.base`` (``load_config``).
"""

from __future__ import annotations

import copy
import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from irflow.engine.errors import ConfigError



class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping."""

    def __init__(self, key, line: int, first_line: int):
        self.line = line
        self.problem = (f"key {key!r} is given twice (first on line {first_line}); YAML keeps only one of them, "
                        "so irflow refuses it rather than drop a setting")
        super().__init__(f"line {line}: {self.problem}")


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping. YAML forbids it, but PyYAML
    keeps the last value silently: a section written twice (``train:`` near the top and again
    below), or a typo that turns ``rounds: 7`` into a second ``round:``, would drop settings
    without a word. Merge keys (``<<: *defaults``) still override as YAML says."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in first:
                        raise DuplicateKeyError(key, key_node.start_mark.line + 1, first[key])
                    first[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base class says so
                    continue
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str):
    """A YAML value (a config file, a ``--set`` value), with no key twice in a mapping."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: where, and what (PyYAML's own text spans several lines, with the
    stream's name as "<unicode string>")."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return " ".join(str(e).split())
    hint = " (YAML indents with spaces, not tabs)" if "\\t" in problem else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{hint}"


def load_raw(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = parse_yaml(path.read_text()) or {}
    except DuplicateKeyError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections with a 'flow' key (e.g. flow: baselines)")
    return raw


def apply_override(raw: dict, item: str) -> None:
    """``a.b.c=value`` (list items by index: ``mine.miners.1.model=...``); the value is parsed as YAML
    (numbers, lists, null...). Sections that do not exist yet are created; validation comes after."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value (e.g. dense.model=/path/to/model)")
    key, text = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"--set {item!r}: '{key}' is not a dotted key (e.g. train.lr)")
    try:
        value = parse_yaml(text)
    except DuplicateKeyError as e:  # {lr: 1, lr: 2}: not a string to keep as it is
        raise ConfigError(f"--set {item!r}: {e.problem}") from None
    except yaml.YAMLError:
        value = text
    node: Any = raw
    for i, p in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not p.isdigit() or int(p) >= len(node):
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i])} is a list of {len(node)} items "
                                  f"(0..{len(node) - 1}); no item {p!r}")
            node = node[int(p)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{'.'.join(parts[:i])}' is a value ({node!r}), not a section")
        if node.get(p) is None:
            node[p] = {}
        node = node[p]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"--set {key}: {'.'.join(parts[:-1])} is a list of {len(node)} items "
                              f"(0..{len(node) - 1}); no item {last!r}")
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"--set {key}: '{'.'.join(parts[:-1])}' is a value ({node!r}), not a section")


def read(config: str | Path | dict | BaseModel, overrides: list[str] | tuple[str, ...] | None = None
         ) -> tuple[dict, str]:
    """The raw config (from a YAML path, a dict, or a config model) with overrides applied, and how to
    name it in messages (the path, or "config", plus the ``--set`` items)."""
    if isinstance(config, BaseModel):
        raw, source = config.model_dump(mode="json"), "config"
    elif isinstance(config, dict):
        raw, source = copy.deepcopy(config), "config"
    else:
        raw, source = load_raw(config), str(config)
    for item in overrides or []:
        apply_override(raw, item)
    if overrides:
        source += " with " + " ".join(f"--set {o}" for o in overrides)
    return raw, source


def validate(cls: type[BaseModel], raw: dict, source: str):
    """``raw`` as a ``cls``; ConfigError listing every problem (by dotted path) otherwise."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(e, cls, raw, source)) from None


# ---- error messages ---------------------------------------------------------------------------
def _path(loc: tuple, raw: Any) -> tuple[str, Any]:
    """The dotted path of a pydantic error location in the user's terms, and the raw value there.

    Pydantic puts union tags and type names into locations (``teacher.fusion.wieghts``,
    ``scale.float``); the user wrote ``teacher.wieghts``. A location part is kept when it names a key
    (or index) of the raw input at that point, and dropped otherwise."""
    parts, node = [], raw
    for part in loc:
        if isinstance(node, dict) and part not in node and part in [v for v in node.values() if isinstance(v, str)]:
            continue  # a discriminated union's tag (teacher.fusion.weights): the user wrote teacher.type
        if isinstance(node, dict) and part in node:
            parts.append(str(part))
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            parts.append(str(part))
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and _looks_like_key(part):
            # a missing required key, or an unknown one nested below a value we cannot walk
            parts.append(part)
            node = None
        # else: a union tag or type name -- not something the user wrote
    return ".".join(parts), node


def _looks_like_key(part: str) -> bool:
    return part.replace("_", "").isalnum() and not part.startswith(("literal", "function"))


def _unwrap(ann) -> list[type[BaseModel]]:
    """The model classes an annotation can hold (Optional, unions, Annotated, lists unwrapped)."""
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(ann)[0])
    if origin in (list, tuple, typing.Union) or (origin is not None and str(origin) == "types.UnionType"):
        return [m for a in typing.get_args(ann) for m in _unwrap(a)]
    import types

    if isinstance(ann, types.UnionType):
        return [m for a in typing.get_args(ann) for m in _unwrap(a)]
    return [ann] if isinstance(ann, type) and issubclass(ann, BaseModel) else []


def _known_keys(cls: type[BaseModel], path: list[str], raw: Any) -> list[str]:
    """Field names allowed at ``path`` (the parent of an unknown key)."""
    classes = [cls]
    node = raw
    for part in path:
        nxt = []
        if isinstance(node, list):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
            continue  # list items: the same classes
        for c in classes:
            f = c.model_fields.get(part)
            if f is not None:
                nxt += _unwrap(f.annotation)
        node = node.get(part) if isinstance(node, dict) else None
        classes = nxt
    # a discriminated union: the member whose tag the user wrote
    if isinstance(node, dict) and len(classes) > 1:
        for c in classes:
            for name, f in c.model_fields.items():
                args = typing.get_args(f.annotation)
                if typing.get_origin(f.annotation) is typing.Literal and node.get(name) in args:
                    return sorted(c.model_fields)
    return sorted({k for c in classes for k in c.model_fields})


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_errors(err: ValidationError, cls: type[BaseModel], raw: dict, source: str) -> str:
    lines = []
    for e in err.errors(include_url=False):
        path, _ = _path(e["loc"], raw)
        kind, msg = e["type"], e["msg"]
        value = e.get("input")
        if kind == "extra_forbidden":
            parent, key = path.rpartition(".")[0], path.rpartition(".")[2]
            known = _known_keys(cls, parent.split(".") if parent else [], raw)
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            what = "unknown section" if not parent and isinstance(value, dict) else "unknown key"
            # the config model's hints for keys it no longer has (RecipeConfig.renamed_keys)
            hint = getattr(cls, "renamed_keys", {}).get(key) if key not in known else None
            if isinstance(hint, dict):
                hint = hint.get(parent.split(".")[0], hint[""])
            if hint:
                text = f"{what}; {hint}"
            elif close:
                text = f"{what} (did you mean '{close[0]}'?)"
            else:
                text = f"{what}; known: {', '.join(known)}"
        elif kind == "missing":
            text = "required, not given"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            text = f"expected a section (key: value pairs), got {_describe(value)}"
        elif kind in ("value_error", "assertion_error"):
            text = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            # A model validator names the field it is about, relative to its own section.
            if not path or re.match(r"^[A-Za-z_][\w.]*: ", text):
                lines.append(f"  {path + '.' if path else ''}{text}")
                continue
        elif kind == "union_tag_invalid":
            ctx = e.get("ctx", {})
            text = (f"{ctx.get('discriminator', 'kind')} {ctx.get('tag')!r} is not one of "
                    f"{ctx.get('expected_tags')}")
        elif kind == "union_tag_not_found":
            text = f"say which kind with {e.get('ctx', {}).get('discriminator', 'type')}: ..."
        else:
            text = f"{_describe(value)}: {msg[0].lower() + msg[1:]}"
        lines.append(f"  {path or '(top level)'}: {text}")
    # Unions try each member: several lines for one wrong value say the same thing; keep the first.
    # An error about a container whose item is already reported (variants.0) says nothing more.
    paths = [ln.split(":", 1)[0].strip() for ln in lines]
    seen, unique = set(), []
    for ln, key in zip(lines, paths):
        if key in seen and "unknown" not in ln:
            continue
        if "unknown" not in ln and any(p.startswith(key + ".") for p in paths):
            continue
        seen.add(key)
        unique.append(ln)
    n = len(unique)
    return f"{source}: {n} problem{'s' if n != 1 else ''}\n" + "\n".join(unique)
