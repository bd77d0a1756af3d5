"""What happened inside a run, as HTML sections for a page a person reads.

``inside_sections(catalog, store, run_id)`` finds, through the catalog, what a run's stages published
(its ``stage_runs`` rows name each stage's outputs, cached ones included; the ``datasets`` rows say
what each output is and with which params it was made), reads those tables from the store, and
returns ``[(title, html)]``: the PNGs of ``irflow.tools.plots`` inlined as base64 ``<img>``, each with a
one-line caption of what it shows and its numbers. Sections, when the run has what they read:

- training losses: every trainer's ``training_losses`` (loss and learning rate per step);
- GPL's teacher: the distribution of the pseudo-label margins (``pseudo_labels``; the teacher is named
  by the params of the ``label_scores`` they were scaled from);
- RocketQA's teachers: probabilities by rank bucket and what denoising dropped or kept, per
  ``denoise`` call (its ``scores`` and ``audit`` outputs).

The page builder places them; nothing here writes a file.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from irflow.engine.catalog import Catalog
from irflow.engine.store import TABLE_FILE, DatasetRef, Store
from irflow.learn.teachers import teacher_scores_check
from irflow.tools import plots


def _outputs(catalog: Catalog, run_id: str) -> list[tuple[str, dict[str, dict]]]:
    """(stage label, {output name: its datasets row}) for each stage the run executed, in order."""
    out = []
    for s in catalog.stage_runs(run_id):
        rows = {name: catalog.dataset(did) for name, did in s["outputs"].items()}
        out.append((s["name"], {name: row for name, row in rows.items() if row is not None}))
    return out


def _table(store: Store, row: dict) -> pa.Table:
    """A catalogued table, read only if its files still match their digest (a damaged one is an error
    that names it, never a figure of other bytes)."""
    ref = DatasetRef(row["dataset_id"], row["name"], row["kind"], row["contract"],
                     str(store.object_dir(row["dataset_id"])), row.get("digest"))
    problem = store.check(ref)
    if problem:
        raise ValueError(f"dataset {ref.id} is {problem}; `irflow verify` checks the store")
    return pq.read_table(Path(ref.path) / TABLE_FILE)


def _params(row: dict) -> dict:
    return json.loads(row.get("params") or "{}")


def _labelling_params(catalog: Catalog, row: dict) -> dict:
    """The params of a ``pseudo_labels`` dataset (its scale) and of the teacher's scores it was made from
    (``label_scores``: the teacher): GPL's labelling is two stages."""
    params = {}
    for role, parent in catalog.parents(row["dataset_id"]):
        scores = catalog.dataset(parent) if role == "scores" else None
        if scores is not None:
            params.update(_params(scores))
    return {**params, **_params(row)}


# Numbers in captions and tables: 4 significant digits (a tiny model's margins are ~1e-5, not zero).
def _figure(png: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _html_table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---- sections ---------------------------------------------------------------------------------------
def losses_section(curves: dict[str, pa.Table], ids: dict[str, str]) -> tuple[str, str]:
    """Loss per step of each trainer (``curves``: stage label -> training_losses table)."""
    summaries = {name: plots.loss_summary(t) for name, t in curves.items()}
    caption = ("Loss per step of each trainer (learning rate dashed, right axis): " + "; ".join(
        f"{name}: {s['steps']} steps, loss {s['first']:.4g} -> {s['last']:.4g}" for name, s in summaries.items()))
    rows = [[name, s["steps"], f"{s['first']:.4g}", f"{s['last']:.4g}", f"{s['min']:.4g} (step {s['min_step']})",
             ids[name]] for name, s in summaries.items()]
    table = _html_table(["trainer", "steps", "first loss", "last loss", "lowest loss", "dataset"], rows)
    return "Training losses", _figure(plots.loss_curves(curves), "training loss per step", caption) + table


def margins_section(label: str, pseudo_labels: pa.Table, params: dict) -> tuple[str, str]:
    """GPL's teacher: the distribution of its margins score(q, pos) - score(q, neg)."""
    s = plots.margin_summary(pseudo_labels.column("margin").to_numpy())
    teacher = (params.get("teacher") or {}).get("type", "?")
    scaled = "" if params.get("scale") in (None, 1.0) else " (scaled to the student's similarity)"
    caption = (f"{s['pairs']} (query, positive, negative) triples labelled by the {teacher} teacher{scaled}: "
               f"mean margin {s['mean']:.4g}, median {s['median']:.4g}; {s['not_positive']} "
               f"({s['not_positive'] / max(s['pairs'], 1):.1%}) with margin <= 0 (the teacher scores the "
               f"negative at least as high as the positive)")
    return (f"GPL teacher: pseudo-label margins ({label})",
            _figure(plots.margin_histogram(pseudo_labels.column("margin").to_numpy()), "margin histogram", caption))


def denoise_section(label: str, scores: pa.Table, audit: pa.Table, params: dict) -> tuple[str, str]:
    """RocketQA's teacher: its probabilities of the retrieved candidates by rank bucket, and what
    denoising dropped (likely false negatives) or kept (negatives)."""
    threshold = params["negative_threshold"]
    buckets = plots.bucket_summary(scores, audit)
    total = {k: sum(b[k] for b in buckets) for k in ("candidates", "known_positives", "dropped", "kept")}
    method = (params.get("calibration") or {}).get("method", "?")
    caption = (f"{total['dropped']} of {total['candidates']} retrieved candidates dropped as likely false "
               f"negatives (teacher probability >= {threshold:g}, {method} calibration), {total['kept']} kept "
               f"as negatives, {total['known_positives']} judged positives")
    check = teacher_scores_check(scores)
    if (problem := check.problem()) is not None:  # the sentence the stage logged, numbers included
        caption += f". Warning: {problem}"
    elif check.queries:
        caption += (f". The teacher's order of the labelled lists: mean AUC {check.teacher_auc:.3f} over "
                    f"{check.queries} labelled lists (judged positives above the other candidates; chance 0.5), "
                    f"the retriever's own order {check.list_auc:.3f}")
    rows = [[b["bucket"], b["candidates"], b["known_positives"], b["dropped"], b["kept"],
             f"{float(np.median(b['probs'])):.3f}" if b["probs"].size else "-"] for b in buckets]
    table = _html_table(["ranks", "candidates", "judged positives", "dropped", "kept",
                         "median probability (not judged)"], rows)
    png = plots.bucket_probabilities(scores, audit, threshold)
    return (f"RocketQA teacher: probabilities by rank bucket ({label})",
            _figure(png, "teacher probabilities by rank bucket", caption) + table)


def inside_sections(catalog: Catalog, store: Store, run_id: str) -> list[tuple[str, str]]:
    """[(title, html)] for the run ``run_id``: its trainers' losses, its teachers' outputs (see the
    module doc); empty when the run has none of them."""
    sections = []
    stages = _outputs(catalog, run_id)
    curves, ids = {}, {}
    for label, outs in stages:
        row = outs.get("training_losses")
        if row is not None and row["contract"] == "training_losses":
            curves[label], ids[label] = _table(store, row), row["dataset_id"]
    if curves:
        sections.append(losses_section(curves, ids))
    for label, outs in stages:
        by_contract = {row["contract"]: row for row in outs.values()}
        if "pseudo_labels" in by_contract:
            row = by_contract["pseudo_labels"]
            sections.append(margins_section(label, _table(store, row), _labelling_params(catalog, row)))
        if "denoise_audit" in by_contract and "teacher_scores" in by_contract:
            audit = by_contract["denoise_audit"]
            sections.append(denoise_section(label, _table(store, by_contract["teacher_scores"]), _table(store, audit),
                                            _params(audit)))
    return sections
