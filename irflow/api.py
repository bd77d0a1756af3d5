"""The Python API: what the CLI, the Prefect deployments, the tests and the benchmarks call.

    from irflow import api
    result = api.run("configs/demo.yaml", overrides=["train.lr=3e-5"], store="store")
    result.computed                      # {"train_student[gpl]", ...}
    result.metric("gpl-student", "ndcg@10")
    api.status("configs/demo.yaml", overrides=["teacher.weights.bm25=0.5"])   # what would recompute, why
    api.load_config("configs/demo.yaml") # the validated config, every default filled in
    api.report("latest", out="report")   # report/index.html: metrics with CIs, systems against baselines
    api.compare(run_a, run_b)            # config, stage and metric differences between two runs
    api.estimate("configs/demo.yaml")    # what the stale stages will take here, before running them

Everything a user can get wrong is checked before Prefect starts: the config (every key, type and
range, and the recipe's cross-stage rules), the models it names, the devices it asks for, and the
stages named by ``force`` (``--from``) and ``to`` (``--to``). Errors are ``irflow.engine.errors.UserError``
subclasses with one readable message; a stage that fails raises ``StageFailed`` naming the stage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from irflow.engine import orchestration, runtime
from irflow.engine.errors import ConfigError, UserError
from irflow.engine.executors import executor_for
from irflow.engine.labels import stage_name
from irflow.engine.params import model_fields
from irflow.engine.worker import warnings_logged
from irflow.engine.store import DEFAULT_STORE
from irflow.recipes.base import (
    RecipeConfig,
    RunResult,
    StageResult,
    get_recipe,
    load_config,
    new_run_id,
    plan,
    upstream,
)

__all__ = ["run", "status", "estimate", "report", "compare", "load_config", "store_root", "RunResult",
           "StageResult", "StageStatus", "RunEstimate"]

log = logging.getLogger("irflow")


@dataclass
class StageStatus:
    name: str
    status: str  # cached | stale | skipped (not needed for --to)
    why: list[str]
    inputs: dict[str, list[str]] = field(default_factory=dict)  # role -> dataset ids it would read
    outputs: dict[str, str] = field(default_factory=dict)  # output -> id (`<stage:output>`: not computed yet)
    datasets: dict[str, dict] = field(default_factory=dict)  # id -> {name, kind, contract} of those ids
    params: dict = field(default_factory=dict)  # the stage's params, as it would run with them


def store_root(store: str | os.PathLike | None = None) -> str:
    """``store``, else ``$IRFLOW_STORE``, else ``./store``, as an absolute path."""
    return str(Path(store or os.environ.get("IRFLOW_STORE") or DEFAULT_STORE).resolve())


def preflight(c: RecipeConfig, store: str) -> list[str]:
    """Fail fast, before any stage runs: every model the config names must be loadable here and every
    device it asks for must exist. Returns warnings: the recipe's advice (settings measured to give a worse
    model, ``RecipeConfig.advice``) and a precision that is slow on this hardware."""
    from irflow.engine.models import model_ref
    from irflow.learn.scoring import NotACrossEncoder, check_cross_encoder

    for where, name in model_fields(c):
        model_ref(name, store, where)  # raises ModelNotAvailable naming `where`
    for where, name in c.required_cross_encoders():
        try:
            check_cross_encoder(model_ref(name, store, where).path)
        except NotACrossEncoder as e:
            raise NotACrossEncoder(f"{where}: {e}") from None
    try:
        runtime.check_devices(c.runtime)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    executor_for(c.runtime).preflight(c.runtime)
    check_own_documents(getattr(c, "dataset", None))
    warnings = list(c.advice())
    for work, r in runtime.resolved_plan(c.runtime).items():
        if r["warning"] and r["warning"] not in warnings:
            warnings.append(r["warning"])
    return warnings


_CHECKED_SOURCES: set[tuple] = set()  # sources read whole by this process, with their files' sizes and times


def check_own_documents(d) -> None:
    """Your own documents are read once before Prefect starts or anything is recorded, as ``irflow new``
    reads them, so that a bad file (a broken line, a missing column) is one line in seconds; a source over
    ``estimate.MAX_SIZED_BYTES`` is left to the run's ingest. A source this process has read unchanged (the
    estimate's ``status`` and then the ``run`` of one ``irflow run``) is not read again."""
    import json
    import tempfile
    from pathlib import Path

    from irflow.sources.corpus_sources import documents_path, read_documents, source_bytes
    from irflow.tools.estimate import MAX_SIZED_BYTES, no_progress_bars

    if d is None or not getattr(d, "own", False):
        return
    src = Path(d.source).expanduser()
    if not src.exists():
        raise ConfigError(f"dataset.source: no such file or folder: {d.source}")
    files = [documents_path(src)] if documents_path(src).is_file() else [f for f in src.rglob("*") if f.is_file()]
    key = (str(src.resolve()), json.dumps([d.format, d.fields, d.passages and d.passages.model_dump()], sort_keys=True),
           tuple(sorted((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)))
    if key in _CHECKED_SOURCES or source_bytes(src) > MAX_SIZED_BYTES:
        return
    with tempfile.TemporaryDirectory(prefix="irflow-check-") as tmp, no_progress_bars():
        read_documents(src, Path(tmp) / "corpus.parquet", d)
    _CHECKED_SOURCES.add(key)


def _check_stages(recipe, c: RecipeConfig, store: str, flag: str, stages: set[str]) -> None:
    """Stage names given with ``flag`` (--from, --to) must be stages of the recipe (a name or a label)."""
    if not stages:
        return
    names = list(dict.fromkeys(p["name"] for p in plan(recipe, c, store)))
    known = set(names) | {stage_name(n) for n in names}
    unknown = sorted(stages - known)
    if unknown:
        import difflib

        hints = [f"{u} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(u, sorted(known), n=1))
                 else u for u in unknown]
        raise ConfigError(f"{flag} {', '.join(hints)}: no such stage in recipe '{c.flow}'; its stages: "
                          f"{', '.join(names)}")


@contextlib.contextmanager
def _no_store_left_on_error(root: str):
    """A run refused before it starts (a missing model, a device, an unknown --from) leaves no new
    store behind: the checks need Prefect's home and the catalog, which live in the store."""
    existed = Path(root).exists()
    try:
        yield
    except UserError:
        if not existed:
            shutil.rmtree(root, ignore_errors=True)
        raise


def run(config: Any, overrides: list[str] | tuple[str, ...] | None = None, store: str | os.PathLike | None = None,
        force: list[str] | tuple[str, ...] | set[str] = (), *, run_id: str | None = None,
        to: list[str] | tuple[str, ...] | set[str] = ()) -> RunResult:
    """Run a recipe as a Prefect flow (local mode unless PREFECT_API_URL is set) and return its result.

    config: a YAML path, a mapping, or a config model; overrides: ``key=value`` edits (as ``--set``);
    force: stage names or labels to recompute with everything downstream (as ``--from``);
    to: stage names or labels to stop after: only they and the stages they need run (as ``--to``;
    ``RunResult.skipped`` lists the others). ``RunResult.warnings``: what irflow warned about on the way.
    """
    # This process's warnings, those relayed from Ray workers among them (irflow.engine.shards); two runs started
    # at once in one process would share what they collect.
    with warnings_logged(every_thread=True) as warnings:
        result = _run(config, overrides, store, force, run_id=run_id, to=to)
    result.warnings = list(warnings)
    return result


def _run(config: Any, overrides, store, force, *, run_id: str | None, to) -> RunResult:
    root = store_root(store)
    c = load_config(config, overrides)  # first: a bad config creates nothing
    recipe = get_recipe(c.flow)
    force, to = set(force), set(to)
    with _no_store_left_on_error(root):
        orchestration.configure(root)
        for w in preflight(c, root):
            log.warning(w)
        _check_stages(recipe, c, root, "--from", force)
        _check_stages(recipe, c, root, "--to", to)
    run_id = run_id or new_run_id(c.flow)
    flow = recipe.flow.with_options(flow_run_name=run_id)
    orchestration.prefect_home()
    orchestration.start_prefect_server()
    if isinstance(config, (str, os.PathLike)):  # the path and overrides: what Prefect's UI shows
        return flow(config=str(config), overrides=list(overrides or []), store=root, force=sorted(force),
                    run_id=run_id, to=sorted(to))
    return flow(config=c.model_dump(mode="json"), store=root, force=sorted(force), run_id=run_id, to=sorted(to))


def status(config: Any, overrides: list[str] | tuple[str, ...] | None = None,
           store: str | os.PathLike | None = None, force: list[str] | tuple[str, ...] | set[str] = (),
           to: list[str] | tuple[str, ...] | set[str] = ()) -> list[StageStatus]:
    """What ``run`` would do now, per stage: cached, or stale and why (with ``to``: the stages not
    needed are ``skipped``), and the ids each stage reads and writes. Computes nothing."""
    return _status(load_config(config, overrides), store_root(store), force, to)


def _status(c, root: str, force, to) -> list[StageStatus]:
    recipe = get_recipe(c.flow)
    with _no_store_left_on_error(root):
        orchestration.configure(root)
        for w in preflight(c, root):
            log.warning(w)
        _check_stages(recipe, c, root, "--from", set(force))
        _check_stages(recipe, c, root, "--to", set(to))
    steps = plan(recipe, c, root, set(force))
    if to:  # planned again, with the stages --to leaves out marked skipped
        steps = plan(recipe, c, root, set(force), only=upstream(steps, set(to)))
    return [StageStatus(p["name"], p["status"], p["why"], p["inputs"], p["outputs"], p["datasets"], p["params"])
            for p in steps]


@dataclass(frozen=True)
class RunEstimate:
    """What a run's stale stages will take here (``estimate``)."""

    rows: list  # irflow.tools.estimate.StageEstimate per stale stage, calibrated by the store where it could be
    prior: list  # the same from the shipped rates alone
    hw: Any  # irflow.tools.estimate.Hardware
    calibrated: Any  # irflow.tools.estimate.Calibration, or None (no run on this hardware with free cores)
    load: float | None  # the cores other processes kept busy when it was made (runtime.others_busy)
    threads: int | None = None  # the run's runtime.threads (None: every core)

    def table(self, measured: dict[str, float] | None = None) -> str:
        """The estimate per stage, and with ``measured`` (stage -> seconds) the seconds each took beside it."""
        from irflow.tools import estimate as est

        if measured is None:
            return est.format_estimates(self.rows, self.hw, calibrated=self.calibrated, load=self.load,
                                        threads=self.threads)
        return est.format_estimates(self.rows, self.hw, measured, self.calibrated)

    @property
    def busy(self) -> bool:
        """Whether other work kept the cores busy when it was made (its figures then assume what was not so)."""
        from irflow.tools import estimate as est

        return est.cores_busy(self.hw, self.load)

    def record(self, run_id: str, store: str | os.PathLike | None = None) -> None:
        """Kept beside the run in its catalog: what later estimates on this hardware calibrate by."""
        from irflow.tools import estimate as est

        prior = {p.stage: p.seconds for p in self.prior}
        catalog(store).record_estimates(run_id, [{"stage": r.stage, "kind": r.kind, "prior": prior[r.stage],
                                                  "seconds": r.seconds} for r in self.rows],
                                        est.hardware_key(self.hw), self.load)


def estimate(config: Any, overrides: list[str] | tuple[str, ...] | None = None,
             store: str | os.PathLike | None = None, force: list[str] | tuple[str, ...] | set[str] = (),
             to: list[str] | tuple[str, ...] | set[str] = ()) -> RunEstimate | None:
    """What ``run`` with these arguments would spend here on each stale stage (``irflow.tools.estimate``: each
    stage's work from its own params, at the rates this store measured on this hardware with free cores, else
    the shipped ones); None when nothing is stale. Raises UserError as ``status`` does."""
    from irflow.tools import estimate as est

    c = load_config(config, overrides)
    plan_ = _status(c, store_root(store), force, to)
    stale = list(dict.fromkeys(p.name for p in plan_ if p.status == "stale"))
    if not stale:
        return None
    hw = est.hardware()
    size = est.corpus_size(c.dataset, model=est.student_model(c))
    try:
        cat = catalog(store)
    except UserError:  # no store yet: every input is still to be made
        cat = None
    prior = est.estimate(c, stale, size, hw, {p.name: p.params for p in plan_}, est.searched_queries(plan_, size, cat),
                         {p.name: p.inputs for p in plan_})
    calibrated = est.calibration(cat, hw)
    return RunEstimate(calibrated.apply(prior) if calibrated else prior, prior, hw, calibrated,
                       runtime.others_busy(), c.runtime.threads)


def catalog(store: str | os.PathLike | None = None, must_exist: bool = True):
    """The catalog of an existing store; UserError if there is none (reading never creates a store), unless
    ``must_exist`` is false."""
    from irflow.engine.catalog import Catalog

    root = Path(store_root(store))
    if must_exist and not (root / "catalog.duckdb").exists():
        raise UserError(f"no irflow store at {root} (no catalog.duckdb); give --store, or run something first")
    return Catalog(root / "catalog.duckdb")


def report(run_id: str = "latest", out: str | os.PathLike = "report", store: str | os.PathLike | None = None,
           baselines: list[str] | tuple[str, ...] = (), metric: str = "ndcg@10", sections=()):
    """Write ``out/index.html``, one self-contained page about a run (an id, a unique prefix, or
    ``latest``); returns a ``irflow.tools.report.ReportResult`` (path, run_id, data: the numbers shown).
    ``sections``: extra ``irflow.tools.report.Section``s for the page. An unknown run raises UnknownRun (a
    UserError) naming the recent runs."""
    from irflow.tools.report import build_report

    return build_report(catalog(store), run_id, out, list(baselines) or None, metric, sections)


def compare(run_a: str, run_b: str, store: str | os.PathLike | None = None, metric: str = "ndcg@10"):
    """Run B against run A: config changes by dotted key, stages computed or cached in each, and the
    metrics of the systems both evaluated with wins/ties/losses and paired p-values
    (``irflow.tools.report.compare.RunComparison``)."""
    from irflow.tools.report.compare import compare_runs

    return compare_runs(catalog(store), run_a, run_b, metric)
