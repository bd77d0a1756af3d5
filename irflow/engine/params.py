"""Typed parameters: what every stage computes from, and what recipe configs are made of.

``Params`` is the base of every stage's params model and of every config section:

- unknown keys are an error (``extra="forbid"``): a typo never silently becomes a default;
- instances are frozen: a stage cannot change what its cache key was made of;
- every field has a description (checked when the class is defined): the description is the
  documentation, shown by ``irflow config --explain``.

A stage's cache key holds ``params.key_dump()``: ``params.model_dump(mode="json")``, less the fields
marked ``KEYED_WHEN_SET`` that hold their default (see ``KEYED_WHEN_SET``); its defaults are written
once, in its params model. A config section that feeds a stage inherits that stage's params (or a part of
them) and adds what only the recipe knows (which model, which variants); ``section.to(StageParams,
**per_call)`` projects it onto one call's params.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

P = TypeVar("P", bound="Params")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        undocumented = [name for name, f in cls.model_fields.items() if not f.description]
        if undocumented:
            raise TypeError(f"{cls.__qualname__}: every field needs a description; missing for {undocumented}")

    def to(self, cls: type[P], **fields: Any) -> P:
        """The params of one stage call: this section's values for the fields ``cls`` declares,
        plus ``fields`` (what differs per call: a variant, a system name, a split)."""
        own = {k: getattr(self, k) for k in cls.model_fields if k in type(self).model_fields and k not in fields}
        return cls(**own, **fields)

    def key_dump(self) -> dict:
        """What a cache key holds: the JSON dump of every field, less ``KEYED_WHEN_SET`` fields at
        their default (at any depth)."""
        return _drop_unset(self, self.model_dump(mode="json"))


class _KeyedWhenSet:
    """Marks a field that enters cache keys only when it differs from its default."""

    def __repr__(self) -> str:
        return "KEYED_WHEN_SET"


#: A field added to a stage's params after stores were made with it, whose default is what the
#: stage computed before the field existed (``quantization: none``): left out of the key while it
#: holds its default, so that adding it keeps every existing cache key (a store made before
#: recomputes nothing), and keyed as soon as it is set to anything else. It goes in the field's
#: ``Annotated`` metadata: ``x: Annotated[Literal[...], KEYED_WHEN_SET] = Field(default, description=...)``.
KEYED_WHEN_SET = _KeyedWhenSet()

#: Quantisation of the model an inference stage runs (``irflow.learn.onnx_inference``): lossy, so keyed;
#: ``none`` (exact) is what these stages computed before the field existed, so it is not keyed.
Quantization = Annotated[Literal["none", "int8"], KEYED_WHEN_SET]
QUANTIZATION_DOC = ("none: the model as it is (fp32; runtime.backend picks torch or ONNX Runtime, same result); "
                    "int8: ONNX Runtime's dynamic int8 quantisation of the exported model (per-channel weights; "
                    "runs on the CPU with onnxruntime whatever runtime.backend says; lossy, so keyed: its "
                    "outputs are stored apart from the exact ones)")


def _drop_unset(obj: Any, dumped: Any) -> Any:
    """``dumped`` (obj's JSON dump) without the KEYED_WHEN_SET fields that hold their default."""
    if isinstance(obj, BaseModel) and isinstance(dumped, dict):
        for name, info in type(obj).model_fields.items():
            if name not in dumped:
                continue
            value = getattr(obj, name)
            if any(m is KEYED_WHEN_SET for m in info.metadata) and \
                    value == info.get_default(call_default_factory=True):
                del dumped[name]
            else:
                _drop_unset(value, dumped[name])
    elif isinstance(obj, (list, tuple)) and isinstance(dumped, list):
        for o, d in zip(obj, dumped):
            _drop_unset(o, d)
    elif isinstance(obj, dict) and isinstance(dumped, dict):
        for k, o in obj.items():
            if str(k) in dumped:
                _drop_unset(o, dumped[str(k)])
    return dumped


class NoParams(Params):
    """For stages whose output depends on their inputs only."""


class _ModelMarker:
    """Marks a str field that names a model: a hub id, a local directory, or a stored model id."""

    def __repr__(self) -> str:
        return "ModelName"


MODEL = _ModelMarker()

#: A model named in a config. Recipes turn it into an input ref (``run.model(...)``): the model's
#: content identity, not its name or path, enters the cache keys of the stages that read it.
ModelName = Annotated[str, Field(min_length=1), MODEL]


class _CrossEncoderMarker:
    """Marks a model field whose model must already be a cross-encoder (checked before any stage)."""

    def __repr__(self) -> str:
        return "CrossEncoderName"


CROSS_ENCODER = _CrossEncoderMarker()

#: A model named in a config that is used as a cross-encoder as it is (not trained from): a
#: sentence-transformers bi-encoder or a plain encoder there is refused before any stage runs.
CrossEncoderName = Annotated[str, Field(min_length=1), MODEL, CROSS_ENCODER]


def model_fields(obj: BaseModel, prefix: str = "", marker=MODEL) -> Iterator[tuple[str, str]]:
    """(dotted path, value) of every ``ModelName`` field set in a config, at any depth (with
    ``marker=CROSS_ENCODER``: only those that must be cross-encoders)."""
    for name, info in type(obj).model_fields.items():
        value = getattr(obj, name)
        path = f"{prefix}{name}"
        if value is None:
            continue
        if any(m is marker for m in info.metadata) and isinstance(value, str):
            yield path, value
        elif isinstance(value, BaseModel):
            yield from model_fields(value, path + ".", marker)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from model_fields(item, f"{path}.{i}.", marker)


def explain(cls: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) of every field of a config model, sections expanded."""
    out = []
    for name, info in cls.model_fields.items():
        path = f"{prefix}{name}"
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.append((path, "", info.description or ""))
            out += explain(ann, path + ".")
        else:
            default = "" if info.is_required() else repr(info.get_default(call_default_factory=True))
            out.append((path, default, info.description or ""))
    return out
