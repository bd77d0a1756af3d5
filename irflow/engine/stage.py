"""Stages, declared: plain functions of (params, runtime, input refs), cached on what they read.

    @stage("bm25_search", version="2", outputs=Output("run", "run"))
    def bm25_search(p: BM25SearchParams, rt: StageRuntime, *, bm25_index: DatasetRef,
                    queries: DatasetRef) -> pa.Table: ...

The first argument's type is the stage's params model (a ``irflow.engine.params.Params``); the keyword-only
arguments are its inputs, by role (a default of None makes an input optional). A declaration says what
the stage reads and writes (outputs, their contracts), its code version, the kind of work it does on a
device and how it shards; its cache key is its params, its inputs' ids and its version. Running it is
the runner's (``irflow.engine.runner``: key, lookup, lock, compute, validate, publish, record).

Calling a stage inside a recipe, ``bm25_search(run, params, tag="flat", bm25_index=..., queries=...)``,
runs it as a Prefect task and returns its refs (``irflow.engine.runner.call``); ``stage.run(run, params, ...)``
runs it without Prefect (same caching); ``stage.fn(params, StageRuntime(), ...)`` is the plain function.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from irflow.engine.cache import hash_payload, key_payload
from irflow.engine.labels import label as make_label
from irflow.engine.params import Params
from irflow.engine.store import DatasetRef
from irflow.engine.worker import torch_threads, warnings_logged


@dataclass(frozen=True)
class Output:
    """What a stage output is: a table under a contract, or a directory (model / index)."""

    name: str
    contract: str | None = None  # tables
    kind: str = "table"  # "table" | "model" | "index"
    check: Callable[[Path], None] | None = None  # directories: called before publishing


PENDING = "pending"  # kind of a placeholder ref in a dry run: "this would be recomputed"


def _as_list(v) -> list[DatasetRef]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


#: The stage that exports a model for the stages declared with ``onnx=`` (and its params model):
#: ``irflow.stages.export_onnx`` registers itself here when ``irflow.stages`` is imported.
ONNX_EXPORT: dict[str, Any] = {}


class Stage:
    """A declared stage (see the module doc)."""

    def __init__(self, fn: Callable, name: str, version: str, outputs: list[Output], work: str | None,
                 resumable: bool, shard: str | None = None, shard_when: Callable[[Params], bool] | None = None,
                 shard_align: Callable[[Params], int] | None = None,
                 onnx: Callable[[Params], dict[str, tuple[str, str]]] | None = None, rows=None):
        self.fn = fn
        self.rows = rows
        self.onnx = onnx
        self.shard = shard
        self.shard_when = shard_when
        self.shard_align = shard_align
        self.name = name
        self.version = version
        self.outputs = outputs
        self.work = work
        self.resumable = resumable
        self.__doc__ = fn.__doc__
        self._task = None
        hints = typing.get_type_hints(fn, include_extras=True)  # keep union discriminators
        params = list(inspect.signature(fn).parameters.values())
        if len(params) < 2 or params[0].kind is inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"stage {name}: signature must be (params, rt, *, inputs...)")
        # A Params model, or a discriminated union of them (a field that selects a kind: a source, a teacher).
        self.params_type = hints.get(params[0].name)
        self.params_members = _params_members(self.params_type)
        if not self.params_members:
            raise TypeError(f"stage {name}: its first argument must be annotated with a Params model (or a union)")
        self._adapter = None
        kw = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        self.required_inputs = {p.name for p in kw if p.default is inspect.Parameter.empty}
        self.optional_inputs = {p.name for p in kw if p.default is not inspect.Parameter.empty}
        if shard is not None and (shard not in self.required_inputs or any(o.kind != "table" for o in outputs)):
            raise TypeError(f"stage {name}: shard= names a required input of a stage whose outputs are tables")
        if shard is None and (shard_when or shard_align):
            raise TypeError(f"stage {name}: shard_when= and shard_align= need shard=")
        if onnx is not None and work is None:
            raise TypeError(f"stage {name}: onnx= is for stages that run models (work encode or score)")
        if rows is not None and (shard is None or set(rows.owners) != {o.name for o in outputs}):
            raise TypeError(f"stage {name}: rows= is for sharded stages and names the owner of every output")

    def run_name(self, tag: str | None) -> str:
        """The name of one call in a run: ``bm25_search[flat]`` (the tag tells calls apart)."""
        return make_label(self.name, tag)

    def _check(self, params, inputs: dict) -> tuple[Params, dict]:
        # Exactly a member class: a config section that subclasses one (and adds recipe-level fields,
        # like the model to load) must be projected with `.to(...)`, or its extra fields would be keyed.
        if type(params) not in self.params_members:
            if self._adapter is None:
                from pydantic import TypeAdapter

                self._adapter = TypeAdapter(self.params_type)
            params = self._adapter.validate_python(params.model_dump() if isinstance(params, Params) else params)
        unknown = set(inputs) - self.required_inputs - self.optional_inputs
        if unknown:
            raise TypeError(f"stage {self.name}: unknown input(s) {sorted(unknown)}; it reads "
                            f"{sorted(self.required_inputs | self.optional_inputs)}")
        inputs = {k: v for k, v in inputs.items() if v is not None}
        missing = self.required_inputs - set(inputs)
        if missing:
            raise TypeError(f"stage {self.name}: missing input(s) {sorted(missing)}")
        return params, inputs

    def key(self, params: Params, inputs: dict[str, Any]) -> str:
        """Its cache key for ``params`` and ``inputs``: the hash of ``key_payload``."""
        return hash_payload(self.key_payload(params, inputs))

    def key_payload(self, params: Params, inputs: dict[str, Any]) -> dict:
        """What its cache key hashes: its name and code version, the keyed params, the inputs' ids."""
        return key_payload(self.name, self.version, params.key_dump(), {k: _as_list(v) for k, v in inputs.items()})

    def sharded(self, params: Params) -> bool:
        """Whether these params are computed in shards (``shard``, and ``shard_when`` says yes)."""
        return bool(self.shard) and (self.shard_when is None or bool(self.shard_when(params)))

    # -- running it is the runner's, through the run (irflow.engine.runner.Run) ---------------------------
    def runtime(self, config, workdir: Path | None = None, resume_dir: Path | None = None, *,
                onnx_models: dict[str, str] | None = None, threads: int | None = None):
        """What one call of it computes with (``irflow.engine.runtime.stage_runtime``): the run's ``config`` for
        its kind of work and its backend; ``threads``: a shard's, when it is given fewer than the run."""
        from dataclasses import replace

        from irflow.engine.runtime import stage_runtime

        rt = stage_runtime(config, self.work, workdir, resume_dir, onnx_capable=self.onnx is not None,
                           onnx_models=onnx_models)
        return replace(rt, threads=threads) if threads else rt

    def compute(self, params: Params, rt, inputs: dict) -> tuple[dict[str, Any], list[str]]:
        """One call of the stage's function, the unit the runner (a whole stage) and a shard (its rows) both
        run: on ``rt.threads`` torch threads if it computes with torch, its warnings collected; a Ctrl-C
        swallowed inside checked after. Returns (output name -> value, every declared output there; the
        warnings)."""
        import contextlib

        from irflow.engine.processes import check_interrupted

        with torch_threads(rt.threads) if self.work else contextlib.nullcontext(), warnings_logged() as warned:
            result = self.fn(params, rt, **inputs)
        check_interrupted()  # a Ctrl-C swallowed during the computation: publish nothing
        if len(self.outputs) == 1 and not isinstance(result, dict):
            result = {self.outputs[0].name: result}
        missing = [o.name for o in self.outputs if o.name not in result]
        if missing:
            raise RuntimeError(f"stage {self.name} did not return outputs {missing}")
        return result, list(warned)

    def run(self, run, params: Params | dict, /, *, tag: str | None = None, **inputs) -> Any:
        """Run it without Prefect (same caching); its output ref (or a dict of them)."""
        return run.execute_stage(self, params, tag, inputs)[0]

    def execute(self, run, params: Params | dict, tag: str | None, inputs: dict, *, needed: bool = False):
        """(output refs, status): ``irflow.engine.runner.execute``."""
        return run.execute_stage(self, params, tag, inputs, needed=needed)

    def __call__(self, run, params: Params | dict, /, *, tag: str | None = None, **inputs):
        return run.call_stage(self, params, tag, inputs)


def _params_members(ann) -> tuple[type, ...]:
    if isinstance(ann, type):
        return (ann,) if issubclass(ann, Params) else ()
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Annotated:
        return _params_members(args[0])
    members = tuple(m for a in args for m in _params_members(a))
    return members if args and len(members) == len(args) else ()


def stage(name: str, version: str, outputs: list[Output] | Output, *, work: str | None = None,
          resumable: bool = False, shard: str | None = None, shard_when: Callable[[Params], bool] | None = None,
          shard_align: Callable[[Params], int] | None = None,
          onnx: Callable[[Params], dict[str, tuple[str, str]]] | None = None, rows=None) -> Callable[[Callable], Stage]:
    """Declare a stage: ``@stage("bm25_search", version="1", outputs=Output("run", "run"))``.

    ``work`` is the kind of work it does on a device (encode, score, generate, train; None for
    CPU-only stages): it picks the runtime's device and precision. ``resumable`` gives it a
    ``rt.resume_dir`` that survives a crash. Bump ``version`` whenever a change to the code changes
    what the stage outputs. ``shard`` names the input it maps over, row range by row range
    (``irflow.engine.shards``): each output's rows for input rows [a, b) must depend on no other row of that
    input and come in its order (a shard's slice still says where it starts and how many rows the whole
    input has: ``DatasetRef.row_offset``, ``DatasetRef.total_rows``). Every output of a sharded stage is
    a table; each shard writes one part per output. ``shard_when(params)``: whether these params are
    sharded (False: the stage is computed whole, e.g. a source that does not read that input);
    ``shard_align(params)``: shards start at multiples of that many rows (``runtime.shard_rows`` is
    rounded up to one), e.g. the stage's batch size when a batch's result depends on the batch.
    ``onnx(params)``: the model inputs the stage runs inference with, ``{role: (task, quantization)}``
    (task embed: a bi-encoder, score: a cross-encoder; quantization: the params' none | int8): the runner
    exports those it runs on ONNX Runtime (``runtime.backend: onnx``, or int8) before computing, and the
    stage finds them with ``rt.onnx_model(model)`` (``irflow.learn.onnx_inference``).
    ``rows``: an ``irflow.engine.row_reuse.RowMap`` (sharded stages): which input row each output row belongs
    to, so that a later call on a changed input computes only its new and changed rows.
    """
    outs = [outputs] if isinstance(outputs, Output) else list(outputs)

    def wrap(fn: Callable) -> Stage:
        return Stage(fn, name, version, outs, work, resumable, shard, shard_when, shard_align, onnx, rows)

    return wrap
