"""Recipes: one typed config model and one body that reads like the method's figure.

    @recipe("gpl", GPLConfig)
    def gpl(c: GPLConfig, run: Run) -> Made:
        data = ingest(run, c.dataset)
        ...
        return evaluate_systems(run, c.evaluate, data, systems)

The body wires stages together (each call is a cached stage run, a Prefect task inside a flow) and
returns what it made (``Made``: its evaluations, what they measured, the dense models a selection may
pick and the one training started from); the engine records the run in the catalog, selects the model
to ship, reports the metrics and returns the result.
With an executor that runs stages at once (ray), stage calls return at once and the stages that do not
read each other's outputs run at the same time (``irflow.engine.branches``); the body reads top-down
either way.
``Recipe.flow`` is the recipe as a Prefect flow (what ``irflow run``, ``irflow serve`` and the
deployments in prefect.yaml run), so Prefect's UI shows the recipe's own task runs.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, Field, model_validator

from irflow.decide.promotion import PromoteConfig
from irflow.engine import config as config_files
from irflow.engine import executors, labels
from irflow.engine.branches import branches_for
from irflow.engine.branches import resolve as resolve_deferred
from irflow.engine.errors import ConfigError
from irflow.engine.follows import Follow, resolve
from irflow.engine.orchestration import configure
from irflow.engine.params import Params, explain
from irflow.engine.processes import check_interrupted, interrupted, older_objects_frozen
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig
from irflow.recipes.renamed import RENAMED_KEYS

log = logging.getLogger("irflow")

# recipe name (a config's `flow:`) -> the recipe; each registers itself where it is defined (@recipe)
_REGISTRY: dict[str, "Recipe"] = {}
RECIPES_PACKAGE = "irflow.recipes"  # every module in it is imported to find the recipes (``recipe_names``)


class RecipeConfig(Params):
    """Base of every recipe's config: ``flow`` picks the recipe, ``runtime`` and ``promote`` are never keyed.

    ``follows`` declares the keys whose default is another key's value (see ``irflow.engine.follows``)."""

    follows: ClassVar[tuple[Follow, ...]] = ()
    # whether the recipe has a teacher that judges a held-out part of a query log (dataset.proxy.queries: log)
    judges_queries: ClassVar[bool] = False
    # keys configs had before they were typed -> where they went (said instead of "unknown key")
    renamed_keys: ClassVar[dict] = RENAMED_KEYS

    flow: str = Field(description="which recipe this config is for")
    runtime: RuntimeConfig = Field(RuntimeConfig(), description="where and how stages run (never part of a key)")
    promote: PromoteConfig = Field(PromoteConfig(), description="after the run: promote its selected model to a "
                                   "named alias if it beats the alias's current model on the run's evaluation "
                                   "(irflow.decide.promotion; off unless promote.alias is set; never part of a key)")

    @model_validator(mode="after")
    def _promotion_needs_an_evaluation(self):
        d = getattr(self, "dataset", None)
        if self.promote.alias is not None and d is not None and getattr(d, "own", False) and not d.labelled \
                and d.proxy is None:
            raise ValueError("promote.alias: promotion compares models on the run's evaluation, and dataset.proxy: "
                             "null evaluates nothing (give the proxy back, or labels)")
        proxy = getattr(d, "evaluation_proxy", None)
        if proxy is not None and proxy.judged and not self.judges_queries:
            raise ValueError(f"dataset.proxy.queries.source: log has the held-out queries judged by the run's "
                             f"teacher; recipe {self.flow} has none (gpl has): use ict, crop or t5")
        return self

    @model_validator(mode="before")
    @classmethod
    def _resolve_follows(cls, data):
        return resolve(cls, data, cls.follows) if isinstance(data, dict) else data

    @classmethod
    def explain(cls) -> list[tuple[str, str, str]]:
        """(dotted key, default, description) of every key; a follower's default names what it follows."""
        follows = {f.target: f.explain() for f in cls.follows}
        return [(key, follows.get(key, default), doc) for key, default, doc in explain(cls)]

    def advice(self) -> list[str]:
        """Warnings about settings that run but were *measured* to give a model worse than the recipe's
        starting point, each naming the measurement and what to use instead. Shown before a run starts
        (``irflow run``, ``status``, ``config``); never an error: the user may want exactly that run."""
        return []

    def required_cross_encoders(self) -> list[tuple[str, str]]:
        """(config key, model) of models that must already be cross-encoders: checked before any stage
        runs (a bi-encoder or a plain encoder would load with a random head and score nonsense)."""
        from irflow.engine.params import CROSS_ENCODER, model_fields

        return list(model_fields(self, marker=CROSS_ENCODER))


@dataclass
class StageResult:
    name: str  # stage label, e.g. bm25_search[flat]
    status: str  # computed | cached
    outputs: dict[str, str]  # output name -> dataset id
    seconds: float
    runtime: dict | None = None  # device/precision/threads of a computed stage
    # a computed sharded stage's shards: {index, rows: [start, stop), host, pid, device, seconds, status}
    shards: list[dict] = field(default_factory=list)
    started: str | None = None  # when it started (UTC, ISO 8601): with seconds, which stages overlapped
    # a computed map stage (irflow.engine.row_reuse): {input, computed, reused[, reused_from: {run: rows}]} rows
    rows: dict | None = None

    @property
    def dataset_id(self) -> str | None:
        """The id of its only output (None for multi-output stages)."""
        return next(iter(self.outputs.values())) if len(self.outputs) == 1 else None


def _passages(catalog, corpus_id: str) -> dict[str, int]:
    """A stored corpus's passage id -> a hash of its title and text."""
    t = catalog.ref(corpus_id).table(columns=["doc_id", "title", "text"])
    return {i: hash((a, b)) for i, a, b in zip(*(t.column(c).to_pylist() for c in ("doc_id", "title", "text")))}


@dataclass
class RunResult:
    run_id: str
    recipe: str
    store: str
    status: str
    seconds: float
    stages: list[StageResult] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)  # one dict per (system, dataset, split)
    prefect_flow_run_id: str | None = None
    skipped: list[str] = field(default_factory=list)  # stage labels left out by --to (not run, not recorded)
    # the dense model to ship (irflow.decide.selection; None: the run evaluated no dense model): system, model_id,
    # the metric and why; and what the metrics were measured on (labelled, or a proxy and how it was made)
    selected: dict | None = None
    evaluation: str = "labelled"
    # with promote.alias: whether the selected model took the alias (irflow.decide.promotion): decision (promoted |
    # kept), alias, model_id (the candidate), previous (the alias's model before), current, the numbers, reason
    promotion: dict | None = None
    # irflow's warnings during the run (the recipe's advice, a stage's "the teacher is at chance"), each once,
    # in order; api.run fills it from this process's log records (Ray workers' are relayed here, and a
    # cached stage says again what its computation warned about, from the catalog)
    warnings: list[str] = field(default_factory=list)

    @property
    def computed(self) -> set[str]:
        return {s.name for s in self.stages if s.status == "computed"}

    @property
    def cached(self) -> set[str]:
        return {s.name for s in self.stages if s.status == "cached"}

    def corpus_changes(self) -> str | None:
        """What changed in the corpus since the run whose rows this one reused (irflow.engine.row_reuse), counted
        from the two runs' ingested corpora: "N of M passages new or changed since run X (, K removed)", with
        what the largest ``encode_corpus`` computed and reused; None when no stage reused rows."""
        reusing = [s for s in self.stages if s.rows and s.rows.get("reused")]
        if not reusing:
            return None
        encodes = [s for s in reusing if labels.stage_name(s.name) == "encode_corpus"] or reusing
        big = max(encodes, key=lambda s: s.rows["input"])
        done = f"{big.name}: {big.rows['computed']:,} encoded, {big.rows['reused']:,} reused"
        earlier = {r for s in reusing for r in (s.rows.get("reused_from") or {}) if r != self.run_id}
        ingested = next((s for s in self.stages if labels.stage_name(s.name) in ("ingest_corpus", "ingest")), None)
        if not earlier or ingested is None or "corpus" not in ingested.outputs:
            return f"{done} of {big.rows['input']:,} passages (from this run's other encodings)"
        from irflow.engine.catalog import Catalog

        catalog = Catalog(Path(self.store) / "catalog.duckdb")
        previous = max(earlier, key=lambda r: str((catalog.run(r) or {}).get("started_at") or ""))
        before = next((s["outputs"].get("corpus") for s in catalog.stage_runs(previous)
                       if labels.stage_name(s["name"]) in ("ingest_corpus", "ingest")), None)
        if before is None:
            return f"{done} of {big.rows['input']:,} passages"
        now, then = _passages(catalog, ingested.outputs["corpus"]), _passages(catalog, before)
        changed = sum(1 for k, v in now.items() if then.get(k) != v)
        removed = len(then.keys() - now.keys())
        return (f"{changed:,} of {len(now):,} passages new or changed since run {previous}"
                + (f", {removed:,} removed" if removed else "") + f" ({done})")

    def stage(self, name: str) -> StageResult:
        return next(s for s in self.stages if s.name == name)

    def metric(self, system: str, metric: str = "ndcg@10") -> float:
        return next(m[metric] for m in self.metrics if m["system"] == system)

    def to_dict(self) -> dict:
        d = asdict(self)
        for s in d["stages"]:
            s["dataset_id"] = s["outputs"] if len(s["outputs"]) != 1 else next(iter(s["outputs"].values()))
        return d


@dataclass(frozen=True)
class Made:
    """What a recipe body hands back to its run (``irflow.recipes.common.evaluate_systems`` makes it): the
    evaluate stages' outputs; what they measured (labelled, a proxy and how it was made, or nothing); the
    dense systems a selection may pick (system -> model ref) and the one training started from (the
    selection's baseline; None: nothing to select); and why the evaluation cannot tell a trained model from
    that start (None: it can), in which case the start is kept and the reason says this."""

    evaluations: list[dict]
    evaluation: str = "labelled"
    models: dict[str, Any] = field(default_factory=dict)
    start: str | None = None
    caveat: str | None = None
    units: str = "documents"  # a proxy's independent unit: documents (queries of one passage share it) or queries


@dataclass
class Recipe:
    name: str
    config_cls: type[RecipeConfig]
    body: Callable[[Any, Run], Made]
    _flow: Any = None

    @property
    def flow(self):
        """The recipe as a Prefect flow (built on first use: importing Prefect is not free)."""
        if self._flow is None:
            from prefect import flow

            name = self.name

            def entry(config: Any, overrides: list[str] | None = None, store: str = "store",
                      force: list[str] | None = None, run_id: str | None = None,
                      to: list[str] | None = None) -> RunResult:
                """Run the recipe on a config (a YAML path or a mapping) in a store (``to``: only the
                stages these stages need, as ``--to``)."""
                configure(store)
                c = load_config(config, overrides)
                if c.flow != name:
                    raise ConfigError(f"config is for flow '{c.flow}', not '{name}'")
                # the package's recipe, even when Prefect loaded this flow from the file as a script
                return execute(get_recipe(name), c, store, force=set(force or ()), run_id=run_id,
                               config_path=config if isinstance(config, str) else None, to=set(to or ()))

            entry.__name__ = f"{self.name}_flow"
            self._flow = flow(name=self.name, log_prints=True, validate_parameters=False, persist_result=False)(entry)
        return self._flow


def recipe(name: str, config_cls: type[RecipeConfig]) -> Callable[[Callable], Recipe]:
    """Declare a recipe: ``@recipe("gpl", GPLConfig)`` over its body ``(config, run) -> Made``. It
    registers itself (``get_recipe``), and its module gets ``<name>_flow``, the Prefect flow that a
    deployment's entrypoint names (``irflow/recipes/gpl.py:gpl_flow``)."""

    def wrap(body: Callable) -> Recipe:
        module = body.__globals__
        if getattr(module.get("annotations"), "compiler_flag", None):  # `from __future__ import annotations`
            raise TypeError(f"recipe {name} ({body.__module__}): drop `from __future__ import annotations`: "
                            "Prefect loads a deployment's entrypoint file as a module outside sys.modules, "
                            "where pydantic cannot resolve string annotations of the config models")
        canonical = _canonical_module(body)
        if body.__module__ != canonical:
            # Prefect loads a deployment's entrypoint file as a fresh module: the package module's recipe
            # (one set of config classes for isinstance checks) serves it
            importlib.import_module(canonical)
            r = _REGISTRY[name]
        else:
            r = Recipe(name, config_cls, body)
            _REGISTRY.setdefault(name, r)
        module.setdefault("__getattr__", flow_getattr(r))
        return r

    return wrap


def _canonical_module(body: Callable) -> str:
    """The importable name of the module that defines ``body``: ``irflow.recipes.<file>`` for a file of
    irflow's recipes package, however it was loaded; else the module's own name."""
    import inspect

    recipes_folder = Path(__file__).resolve().parent
    file = Path(inspect.getfile(body)).resolve()
    return f"{RECIPES_PACKAGE}.{file.stem}" if file.parent == recipes_folder else body.__module__


def flow_getattr(r: Recipe) -> Callable[[str], Any]:
    """A recipe module's ``__getattr__``: ``<name>_flow`` is the recipe's Prefect flow (prefect.yaml's
    entrypoints), built on first use so that importing a recipe does not import Prefect."""

    def module_getattr(name: str):
        if name == f"{r.name}_flow":
            return r.flow
        raise AttributeError(name)

    return module_getattr


_DISCOVERED = False


def _discover() -> None:
    """Import every module of irflow's recipes package once: each recipe registers itself."""
    global _DISCOVERED
    if not _DISCOVERED:
        from irflow.engine.registry import import_modules

        import_modules(RECIPES_PACKAGE)
        _DISCOVERED = True


def recipe_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get_recipe(name: str) -> Recipe:
    if name not in _REGISTRY:
        _discover()
    return _REGISTRY[name]


def load_config(config: str | Path | dict | BaseModel, overrides: list[str] | tuple[str, ...] | None = None
                ) -> RecipeConfig:
    """The validated config (every default filled in) from a YAML path, a dict, or a config model, with
    overrides applied: ``flow:`` picks the recipe, whose config model checks the rest. Raises
    ConfigError listing every problem."""
    if isinstance(config, RecipeConfig) and not overrides:
        return config
    raw, source = config_files.read(config, overrides)
    flow = raw.get("flow")
    if flow is None:
        raise ConfigError(f"{source}: no 'flow' key; it picks the recipe: {', '.join(recipe_names())}")
    if flow not in recipe_names():
        close = difflib.get_close_matches(str(flow), recipe_names(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{source}: flow: unknown recipe {flow!r}{hint}; known: {', '.join(recipe_names())}")
    c = config_files.validate(get_recipe(flow).config_cls, raw, source)
    if not executors.known(c.runtime.executor):  # registered at run time, so not in the runtime's model
        raise ConfigError(f"{source}: 1 problem\n  runtime.executor: '{c.runtime.executor}' is not an executor "
                          f"({', '.join(executors.names())})")
    return c


def new_run_id(name: str) -> str:
    return f"{name}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def execute(recipe: Recipe, c: RecipeConfig, store: str, *, force: set[str] = frozenset(),
            run_id: str | None = None, config_path: str | None = None, to: set[str] = frozenset()) -> RunResult:
    """Run a recipe body on a validated config: the run row, the stages, the metrics, the result.
    ``to``: stage names or labels; only they and what they need run (the others are skipped)."""
    from irflow.engine.stage import PENDING
    from irflow.stages.report import report

    store_root = str(Path(store).resolve())
    only = None
    if to:
        steps = plan(recipe, c, store_root)
        only = upstream(steps, to)
        # api.run says which names are wrong, with the stages; a flow started another way still must not
        # silently skip everything
        missing = sorted(t for t in to if not any(labels.matches(p["name"], t) for p in steps))
        if missing:
            raise ConfigError(f"--to {', '.join(missing)}: no such stage in recipe '{recipe.name}'")
    run = Run(store_root, run_id or new_run_id(recipe.name), runtime=c.runtime, force=force, only=only)
    flow_run_id = _prefect_flow_run_id()
    run.store.reclaim()  # staging left by killed runs
    dead_runs = run.catalog.start_run(run.run_id, recipe.name,
                                      str(Path(config_path).resolve()) if config_path else None,
                                      c.model_dump(mode="json"))
    if dead_runs:
        log.warning("earlier run(s) %s died without finishing (killed?): marked interrupted", ", ".join(dead_runs))
    t0 = time.perf_counter()
    status, rows, selected, promotion, made = "failed", [], None, None, None
    try:
        # executor ray: the run's Ray; and its stage calls run at once where they may (irflow.engine.branches:
        # leaving the block waits for every stage and raises the first failure)
        with older_objects_frozen(), run.executor.session(c.runtime), branches_for(run, c.runtime):
            made = recipe.body(c, run)
            if not isinstance(made, Made):
                raise TypeError(f"recipe {recipe.name}: its body returned {type(made).__name__}, not Made "
                                "(irflow.recipes.common.evaluate_systems makes one)")
            # stages run at once leave Deferred refs: what the selection reads must be the refs themselves
            made = replace(made, models={k: resolve_deferred(v) for k, v in made.models.items()})
        # an evaluation that --to left out has no metrics to report
        evaluated = [ev for ev in made.evaluations if ev["metrics"].kind != PENDING]
        # a proxy's query -> its held-out document: the unit of the selection's and the promotion's tests
        units = _proxy_documents(run) if made.evaluation.startswith("proxy") and made.units == "documents" else None
        selected = _select(run, made, evaluated, units)
        rows = report(run, evaluated, selected)
        _warn_if_saturated(made.evaluation, rows)
        check_interrupted()
        # the last act of a run: its models are published, its metrics recorded; one INSERT, or nothing
        promotion = _promote(run, c, made, evaluated, selected, rows, units)
        status = "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception:
        if interrupted():  # a Ctrl-C some library turned into its own error: the CLI says "interrupted"
            status = "interrupted"
        raise
    finally:
        run.catalog.finish_run(run.run_id, status, flow_run_id, run.skipped, run.failed)
    stages = [StageResult(s["name"], s["status"], s["outputs"], s["seconds"], s.get("runtime"), s["shards"],
                          s["started"], s.get("rows")) for s in run.catalog.stage_runs(run.run_id)]
    return RunResult(run.run_id, recipe.name, store_root, status, round(time.perf_counter() - t0, 3), stages, rows,
                     flow_run_id, _unique(s["name"] for s in run.skipped), selected=selected,
                     evaluation=made.evaluation, promotion=promotion)


def _select(run: Run, made: Made, evaluations: list[dict], units: dict[str, str] | None = None,
            metric: str = "ndcg@10") -> dict | None:
    """The run's model to ship (``irflow.decide.selection``) among the dense models its recipe evaluated,
    recorded in the catalog (``selections``)."""
    from irflow.decide import selection

    if made.start is None:
        return None
    models = made.models
    per_query = {s: v for s, v in _per_query(evaluations, metric).items() if s in models}
    if made.evaluation == selection.NO_EVALUATION and not evaluations:
        sel = selection.unmeasured(list(models), made.start, metric)
        per_query = dict.fromkeys(models, {})
    elif made.start not in per_query:
        return None
    else:
        if units:
            # only held-out documents no compared model trained on (a start continued from an alias's model
            # trained on an earlier night's corpus, perhaps under another fraction or seed)
            from irflow.decide.promotion import trained_documents
            from irflow.engine.store import DatasetRef

            seen = set().union(*(trained_documents(run.catalog, per.id) for s, per in models.items()
                                 if s in per_query and isinstance(per, DatasetRef)))
            if seen:
                per_query = {s: {q: v for q, v in values.items() if units.get(q) not in seen}
                             for s, values in per_query.items()}
        sel = selection.select(per_query, made.start, made.evaluation, metric, caveat=made.caveat,
                               units=units, unit_name="held-out documents" if units else "queries")
    out = {**sel.to_dict(), "model_id": models[sel.system].id, "models": {s: models[s].id for s in per_query}}
    run.catalog.record_selection(run.run_id, out)
    log.info("selected model: %s (%s)", sel.system, sel.reason)
    return out


SATURATED = 0.95  # a proxy on which BM25 scores above this tells nothing about dense models


def _warn_if_saturated(evaluation: str, rows: list[dict]) -> None:
    """A proxy whose queries BM25 answers almost perfectly measures string matching: say so."""
    if not evaluation.startswith("proxy"):
        return
    for r in rows:
        value = r.get("ndcg@10")
        if r["system"].startswith("bm25") and value is not None and value > SATURATED:
            log.warning("the proxy is saturated: %s scores %.4f nDCG@10 on it (above %.2f), so its queries are "
                        "matched by their words; it tells little about dense models. A query log "
                        "(dataset.query_log) or another dataset.proxy.queries source measures retrieval better",
                        r["system"], value, SATURATED)


def _proxy_documents(run: Run) -> dict[str, str] | None:
    """A proxy's query -> the held-out document its relevant passage belongs to (the unit its queries share),
    read from the judgements this run's evaluations read; None when there are none."""
    from irflow.sources.corpus_sources import document_id

    for s in run.catalog.stage_runs(run.run_id, with_inputs=True):
        qrels = (s.get("inputs") or {}).get("qrels")
        if labels.stage_name(s["name"]) == "evaluate" and qrels:
            ref = run.catalog.ref(qrels[0])
            if ref is None or not ref.path:
                return None
            t = ref.table(columns=["query_id", "doc_id"])
            return {q: document_id(d) for q, d in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist())}
    return None


def _per_query(evaluations: list[dict], metric: str) -> dict[str, dict[str, float]]:
    """system -> {query id: value} of ``metric``, over the run's evaluations."""
    per_query: dict[str, dict[str, float]] = {}
    for ev in evaluations:
        t = ev["per_query"].table()
        for system, q, m, v in zip(*(t.column(c).to_pylist() for c in ("system", "query_id", "metric", "value"))):
            if m == metric:
                per_query.setdefault(system, {})[q] = v
    return per_query


def _promote(run: Run, c: RecipeConfig, made: Made, evaluations: list[dict], selected: dict | None,
             rows: list[dict], units: dict[str, str] | None = None, metric: str = "ndcg@10") -> dict | None:
    """With ``promote.alias``: the run's selected model against the alias's current model on the run's
    evaluation (``irflow.decide.promotion``), decided and recorded; None when promotion is off."""
    from irflow.decide import promotion
    from irflow.stages.report import publish_summary

    alias = c.promote.alias
    if alias is None:
        return None
    evaluated = dict((selected or {}).get("models") or {})
    # the alias's model, evaluated apart (irflow.recipes.common.alias_runs): what its search read
    search = labels.label("dense_search", alias)
    for s in run.catalog.stage_runs(run.run_id, with_inputs=True):
        if s["name"] == search and s["inputs"].get("model"):
            evaluated.setdefault(alias, s["inputs"]["model"][0])
    partial = (f"--to left {len(_unique(s['name'] for s in run.skipped))} stage(s) out: a partial run promotes "
               "nothing") if run.skipped else None
    p = promotion.promote(run.catalog, run.store, run.run_id, c.promote, selected, _per_query(evaluations, metric),
                          evaluated, made.evaluation, metric, partial, units).to_dict()
    publish_summary(run, rows, selected, p)
    return p


def plan(recipe: Recipe, c: RecipeConfig, store: str, force: set[str] = frozenset(),
         only: set[str] | None = None) -> list[dict]:
    """Run the body as a dry run: per stage, cached or stale and why (or skipped: not in ``only``), with
    the ids it reads and writes. Computes nothing."""
    run = Run(store, "status", runtime=c.runtime, force=force, dry_run=True, only=only)
    recipe.body(c, run)
    return run.plan


def upstream(plan: list[dict], targets: set[str] | frozenset[str]) -> set[str]:
    """The labels of the planned stages that ``targets`` (names or labels) need: the targets and every
    stage whose outputs they read, transitively (Kedro's --to-nodes). Pure: a plan in, labels out."""
    # One dataset id can come from two stages: two calls with one cache key (RocketQA encodes the corpus
    # with M_D0 for the train queries and again for the test queries: the same embeddings). Whichever of
    # them the plan runs, the reader gets that id only if every producer of it runs.
    producers: dict[str, list[str]] = {}
    for p in plan:
        for i in p["outputs"].values():
            producers.setdefault(i, []).append(p["name"])
    reads: dict[str, set[str]] = {}
    for p in plan:  # a label planned twice (a repeated call) reads what both calls read
        reads.setdefault(p["name"], set()).update(i for ids in p["inputs"].values() for i in ids)
    need = [p["name"] for p in plan if any(labels.matches(p["name"], t) for t in targets)]
    seen: set[str] = set()
    while need:
        label = need.pop()
        if label not in seen:
            seen.add(label)
            need += [name for i in reads[label] for name in producers.get(i, ())]
    return seen


def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def _prefect_flow_run_id() -> str | None:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    except Exception:  # noqa: BLE001 -- outside Prefect
        return None
