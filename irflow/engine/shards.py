"""Sharded stages: one stage computed as row-range shards of one input, then assembled.

A stage declared with ``shard="corpus"`` (encode_corpus, generate_queries, doc2query_expand) or
``shard="queries"`` (the searches and the cross-encoder scorers) is a map over that input's rows:
rows [a, b) of the input give rows of each output that depend on nothing else in the input, in the
input's order. The runner then computes it as shards of ``runtime.shard_rows`` input rows:

- each shard reads only its row range (``DatasetRef.slice``: the Parquet row groups that hold it; the
  slice still knows where it starts in the whole table and the whole table's row count, for a stage
  whose rows depend on them: ``DatasetRef.row_offset``, ``DatasetRef.total_rows``) and writes one part
  per output, validated against that output's contract, into ``<store>/partial/<stage key>/``:
  ``part-<a>-<b>.parquet`` for a stage with one output, ``part-<a>-<b>.<output>.parquet`` for each
  output of a stage with several (generate_queries: queries and qrels). Each part is written to a
  temporary name, then renamed (a part is whole or absent), and a shard is done when all its parts are;
- a shard already done is reused, so a run killed mid-stage resumes with the missing shards only;
- a stage may ask for shard boundaries on multiples of ``align`` rows (``stage(shard_align=...)``, a
  function of its params): generate_queries with t5 samples in batches that start at multiples of its
  batch size, so that no batch straddles two shards; ``shard_rows`` is then rounded up to a multiple;
- a stage may be sharded for some params only (``stage(shard_when=...)``): generate_queries'
  ``unlabelled`` source reads the dataset's queries, not the corpus, and is computed whole;
- with ``runtime.executor: ray`` the shards are Prefect tasks on the flow's ``RayTaskRunner`` (they
  return a small record, never a table: Ray keeps returned objects in the driver, prefect-ray#93);
  with ``local`` they run here, one after another;
- a warning a shard logs on a Ray worker is kept in its record, and the driver logs each distinct one
  again, naming the shards (it reaches the run's log and ``RunResult.warnings``, as with ``local``);
- each output's parts are assembled, in order and streaming, into one table with fixed row groups
  (``irflow.engine.store.write_parts``): the same rows give the same bytes and the same content id whether
  they came in 1 shard or 100, so everything downstream stays cached. Every output is assembled and
  checked before any is published.

A shard that raises is retried once (Prefect's retry, on Ray); a shard whose worker is lost (a killed
process, a preempted node) is computed again, at most ``LOST_WORKER_RETRIES`` times within the run. If it
still fails, the stage fails naming the shard's row range and nothing is published: the finished parts
stay, and the next run computes only the missing ones. A user error a shard raises (a model that cannot be
loaded, data that cannot support the params) fails the stage as that error, as it would unsharded.
The key of a sharded stage is the key of the whole stage: shard_rows, the executor and the workers
are runtime, never keyed.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from irflow.engine import pace
from irflow.engine.params import Params

if TYPE_CHECKING:  # an executor's module imports this one while irflow.engine.runtime is read
    from irflow.engine.runtime import RuntimeConfig

log = logging.getLogger("irflow.engine.shards")



@dataclass(frozen=True)
class ShardJob:
    """Everything one shard needs, small and picklable (it travels to a Ray worker)."""

    module: str  # where the stage is declared, to find it again in a worker process
    attr: str
    label: str  # the stage call's name in the run, e.g. encode_corpus[zero-shot]
    index: int
    start: int
    stop: int
    role: str  # the sharded input
    params: Params
    inputs: dict
    parts: dict[str, str]  # output -> where its part goes
    runtime: RuntimeConfig
    threads: int
    onnx_models: dict | None = None  # StageRuntime.onnx_models: exported by the driver before the shards


def aligned(shard_rows: int, align: int = 1) -> int:
    """``shard_rows`` rounded up to a multiple of ``align``."""
    align = max(1, int(align))
    return -(-shard_rows // align) * align


def row_ranges(num_rows: int, shard_rows: int, align: int = 1) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of ``shard_rows`` rows, rounded up to a multiple of ``align`` (the last
    one shorter); one empty range for an empty input, so that the stage still runs once and says what it
    thinks of empty input."""
    if num_rows == 0:
        return [(0, 0)]
    rows = aligned(shard_rows, align)
    return [(a, min(a + rows, num_rows)) for a in range(0, num_rows, rows)]


def part_name(start: int, stop: int, output: str | None = None) -> str:
    """The part of rows [start, stop): of the stage's only output, or of ``output`` among several."""
    return f"part-{start:012d}-{stop:012d}{'.' + output if output else ''}.parquet"


def part_names(stage, start: int, stop: int) -> dict[str, str]:
    """output name -> its part's file name, for one shard of ``stage`` (one part per output)."""
    if len(stage.outputs) == 1:
        return {stage.outputs[0].name: part_name(start, stop)}
    return {o.name: part_name(start, stop, o.name) for o in stage.outputs}


def run_shard(job: ShardJob) -> dict:
    """Compute one shard in this process and write its part. Returns the shard's record."""
    from irflow.engine.store import write_parts

    stage = getattr(importlib.import_module(job.module), job.attr)
    t0 = time.perf_counter()
    parts = {name: Path(p) for name, p in job.parts.items()}
    folder = next(iter(parts.values())).parent
    workdir = folder / f".work-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    tmps: dict[str, Path] = {}
    try:
        rt = stage.runtime(job.runtime, workdir, onnx_models=job.onnx_models, threads=job.threads)
        inputs = {**job.inputs, job.role: job.inputs[job.role].slice(job.start, job.stop)}
        result, warned = stage.compute(job.params, rt, inputs)
        rows = {}
        # Every output's part is written and checked before any is renamed into place.
        for o in stage.outputs:
            value = result[o.name]
            tmps[o.name] = parts[o.name].with_name(f".{parts[o.name].name}.{os.getpid()}.tmp")
            # Conformed and checked as the whole output will be -- except that a shard may be empty (a
            # query shard none of whose queries is judged); the assembled output is checked whole.
            empty = isinstance(value, pa.Table) and value.num_rows == 0
            rows[o.name] = write_parts(o.contract, [value], tmps[o.name], check=not empty)
        # Whole or absent: a killed shard leaves no part, or (killed between two renames) some of its
        # parts only, and a shard counts as done only when all of its parts are there.
        for name, tmp in tmps.items():
            os.replace(tmp, parts[name])
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    if len(rows) == 1:
        rows = next(iter(rows.values()))
    return {"index": job.index, "rows": [job.start, job.stop], "output_rows": rows, "host": socket.gethostname(),
            "pid": os.getpid(), "device": rt.device, "seconds": round(time.perf_counter() - t0, 3),
            "status": "computed", "warnings": warned}


def relay_warnings(label: str, records: list[dict]) -> None:
    """A Ray worker's warnings are logged where nobody collects them (its stderr): each distinct one that
    the shards computed on Ray workers logged is logged here once, naming those shards (the run's log,
    ``RunResult.warnings``, and the datasets' recorded warnings then have it)."""
    where: dict[str, list[str]] = {}
    for r in sorted(records, key=lambda r: r["index"]):
        for message in r["warnings"]:
            where.setdefault(message, []).append(f"{r['rows'][0]}-{r['rows'][1]}")
    for message, rows in where.items():
        shown = ", ".join(rows[:3]) + (f" and {len(rows) - 3} more" if len(rows) > 3 else "")
        log.warning("%s (%s: shard%s of rows %s, on a Ray worker)", message, label, "s" if len(rows) > 1 else "",
                    shown)


# ---- running every shard of a stage ---------------------------------------------------------------
class ShardFailed(RuntimeError):
    """A shard failed; ``cause`` is what it raised (a user error is reported as the stage's own)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def compute(stage, label: str, params: Params, inputs: dict, runtime: RuntimeConfig, resume_dir: Path,
            onnx_models: dict | None = None, *, executor) -> list[dict]:
    """Every shard's parts in ``resume_dir`` (computing the missing ones, on ``executor``: the run's,
    ``irflow.engine.executors``); their records, in order."""

    role = stage.shard
    align = stage.shard_align(params) if stage.shard_align else 1
    shard_rows = aligned(runtime.shard_rows, align)
    if shard_rows != runtime.shard_rows:
        log.info("%s: shard_rows %d rounded up to %d, a multiple of %d (shards start on the stage's batch "
                 "boundaries)", label, runtime.shard_rows, shard_rows, align)
    ranges = row_ranges(inputs[role].num_rows(), shard_rows)
    records: list[dict | None] = [None] * len(ranges)
    jobs = []
    for i, (a, b) in enumerate(ranges):
        parts = {name: str(resume_dir / f) for name, f in part_names(stage, a, b).items()}
        if all(Path(p).exists() for p in parts.values()):
            records[i] = {"index": i, "rows": [a, b], "host": None, "pid": None, "device": None, "seconds": 0.0,
                          "status": "resumed"}
            continue
        jobs.append(ShardJob(stage.fn.__module__, stage.fn.__name__, label, i, a, b, role, params, inputs, parts,
                             runtime, executor.worker_threads(runtime), onnx_models))
    if len(ranges) > 1 or executor.remote:
        log.info("%s: %d shard(s) of %d %s rows (%d to compute, %d resumed), executor %s", label, len(ranges),
                 shard_rows, role, len(jobs), len(ranges) - len(jobs), executor.name)
    done = executor.map_shards(stage, label, jobs, runtime) if jobs else []
    for r in done:
        records[r["index"]] = r
    return records  # type: ignore[return-value]


def run_here(jobs: list[ShardJob]) -> list[dict]:
    """The shards in this process, one after another, the stage's model and index kept between them."""
    from irflow.engine.worker import keeping

    with keeping():
        done = []
        for i, job in enumerate(jobs):
            try:
                with pace.part(i, len(jobs)):
                    done.append(run_shard(job))
            except Exception as e:
                raise ShardFailed(f"shard {job.index} (rows {job.start}-{job.stop} of {job.role}) failed: "
                                  f"{type(e).__name__}: {e}", e) from e
        return done
