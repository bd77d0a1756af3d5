"""``irflow new``: a commented config for a user's own documents and this machine.

It reads the corpus as a run would (so its errors are the run's), counts documents, passages and words,
cuts long documents into passages, picks what can run here -- the query source (a query log, a T5
generator by local folder or hub id, else the best offline choice and its measured caveat), the teacher
(a cross-encoder, else the BM25 + MiniLM fusion) -- sizes training to a time budget with the rates
measured on this kind of hardware (``irflow.estimate``), and writes the estimate into the config.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import yaml

from irflow.errors import ConfigError, UserError

RECIPES = ("gpl", "baselines")
T5_HUB = "BeIR/query-gen-msmarco-t5-base-v1"
CE_HUB = "cross-encoder/ms-marco-MiniLM-L-6-v2"
LONG_WORDS = 350  # a document above this many words (p90) is cut: ~450 tokens, past MiniLM's 256


def _available(name: str) -> bool:
    from irflow.models import ModelNotAvailable, model_ref

    try:
        model_ref(name, None, "check")
        return True
    except ModelNotAvailable:
        return False


def _words(path: Path, fmt: str, fields: dict | None) -> tuple[int, list[int]]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from irflow.corpus_sources import read_corpus

    with tempfile.TemporaryDirectory(prefix="irflow-new-") as tmp:
        out = Path(tmp) / "c.parquet"
        stats = read_corpus(path, out, format=fmt, fields=fields)
        t = pq.read_table(out, columns=["text"])
    return stats.documents, sorted(pc.list_value_length(pc.utf8_split_whitespace(t.column("text"))).to_pylist())


def new_config(recipe: str, corpus: str, *, queries: str | None = None, qrels: str | None = None,
               query_log: str | None = None, model: str = "all-MiniLM-L6-v2", generator: str | None = None,
               teacher: str | None = None, fields: dict | None = None, budget_minutes: float = 60.0) -> tuple[str, str]:
    """(the config's YAML text with comments, the estimate table)."""
    from irflow import estimate as est
    from irflow.beir import is_beir_source

    if recipe not in RECIPES:
        raise ConfigError(f"recipe '{recipe}': irflow new writes {' or '.join(RECIPES)} configs for your own "
                          "documents (RocketQA and ANCE train on labelled train queries: start from configs/)")
    if (queries is None) != (qrels is None):
        raise ConfigError("--queries and --qrels go together (a labelled set); a file of queries without labels "
                          "is --query-log")
    src = Path(corpus).expanduser()
    if is_beir_source(corpus):
        raise ConfigError(f"{corpus} is a BEIR dataset: start from configs/baselines_scifact.yaml (dataset.source)")
    read = src / "corpus.jsonl" if src.is_dir() and (src / "corpus.jsonl").is_file() else src
    docs, words = _words(read, "auto", fields)
    p90 = words[int(0.9 * (len(words) - 1))] if words else 0
    passages = {"max_words": 200, "stride": 150} if p90 > LONG_WORDS else None
    hw = est.hardware()
    labelled = qrels is not None
    proxy_docs = max(20, min(200, docs // 10))

    d: dict = {"source": corpus}
    if fields:
        d["fields"] = fields
    if passages:
        d["passages"] = passages
    if labelled:
        d.update(queries=queries, qrels=qrels)
    else:
        d["proxy"] = {"documents": proxy_docs}
    if query_log:
        d["query_log"] = query_log
    cfg: dict = {"flow": recipe, "dataset": d}
    notes: list[str] = []
    if recipe == "baselines":
        cfg.update(bm25={"variants": ["flat"]}, dense={"model": model})
    else:
        if query_log:
            gen, why = {"source": "unlabelled"}, "your query log (what made GPL's student gain on SciFact and NFCorpus)"
        elif generator or _available(T5_HUB):
            gen = {"source": "t5", "model": generator or T5_HUB, "queries_per_passage": 3}
            why = "a T5 query generator (the paper's)"
        else:
            gen, why = {"source": "ict"}, (
                f"ict: no query log and no T5 generator here ({T5_HUB} is not downloadable; give --generator DIR). "
                "Measured: model-free queries lowered GPL's student below zero-shot on SciFact and NFCorpus "
                "(bench/results/model_free.json), so the run will most likely keep the starting model; a query "
                "log (--query-log) is the offline source that gained")
        notes.append(f"generate: {why}")
        if teacher or _available(CE_HUB):
            t = {"type": "cross_encoder", "model": teacher or CE_HUB}
            notes.append("teacher: a cross-encoder (the paper's)")
        else:
            t = {"type": "fusion", "method": "zscore", "weights": {"bm25": 0.3, "minilm": 0.7},
                 "score_every_candidate": True}
            notes.append(f"teacher: BM25 + MiniLM fusion (no cross-encoder here: {CE_HUB} is not downloadable; "
                         "give --teacher DIR)")
        cfg.update(generate=gen,
                   mine={"miners": [{"name": "bm25", "type": "bm25"},
                                    {"name": "minilm", "type": "dense", "model": model}], "depth": 50},
                   teacher=t, label={"negatives_per_positive": 16, "rank_range": [3, 30], "scale": "auto"},
                   train={"model": model, "similarity": "cos", "batch_size": 16, "max_seq_length": 200,
                          "lr": 2.0e-5, "warmup_steps": 25, "steps": 100, "checkpoint_every": 50,
                          "qgen": {"enabled": False}},
                   bm25={"variants": ["flat"]}, dense={"batch_size": 64, "max_seq_length": 256},
                   hybrid={"method": "zscore", "sparse_weight": 0.3, "depth": 100})

    # size training to the budget, then estimate every stage of the plan
    text = yaml.safe_dump(cfg, sort_keys=False)
    c, stages, size = _plan(text, labelled, proxy_docs)
    if recipe == "gpl":
        one = est.estimate(c, ["train_student[gpl]"], size, hw)[0].seconds
        per_step = max(1e-3, (one - 3) / c.train.steps)
        others = sum(e.seconds for e in est.estimate(c, stages, size, hw) if not e.stage.startswith("train_student"))
        left = max(60.0, budget_minutes * 60 - others)
        steps = int(min(140_000, max(50, left / per_step)))
        cfg["train"]["steps"] = steps
        cfg["train"]["checkpoint_every"] = max(50, steps // 10)
        notes.append(f"train.steps: {steps}, what fits --budget-minutes {budget_minutes:g} here (the paper: 140,000 "
                     "steps on a GPU)")
        text = yaml.safe_dump(cfg, sort_keys=False)
        # the stages and the corpus are those planned above: only train.steps changed
        from irflow.recipe import load_config

        c = load_config(yaml.safe_load(text))
    estimates = est.estimate(c, stages, size, hw)
    table = est.format_estimates(estimates, hw)
    evaluation = (f"labelled ({queries}, {qrels})" if labelled else
                  f"a synthetic held-out set: {proxy_docs} documents set aside, one ICT query each (a proxy)")
    header = [f"irflow new {recipe} --corpus {corpus}", "",
              f"corpus: {docs:,} documents -> {size.passages:,} passages, {size.mean_words:.0f} words each on average"
              + (f" (documents over {LONG_WORDS} words at p90 ({p90}): cut into passages)" if passages else ""),
              f"evaluation: {evaluation}", f"machine: {hw.describe()}", *notes, "", *table.splitlines(), "",
              "irflow run THIS_FILE; then irflow export latest --out DIR (the model the run selected)"]
    return "\n".join("# " + ln if ln else "#" for ln in header) + "\n" + text, table


def _plan(text: str, labelled: bool, proxy_docs: int):
    """The config model, the stage labels a first run computes, and the corpus's size."""
    from irflow import estimate as est
    from irflow.recipe import get_recipe, load_config, plan

    c = load_config(yaml.safe_load(text))
    store = tempfile.mkdtemp(prefix="irflow-new-store-")
    old = os.environ.get("PREFECT_HOME")
    try:
        from irflow import orchestration

        orchestration.configure(store)
        # a stage called twice with the same inputs (BM25's index for mining and for evaluation) computes once
        stages = list(dict.fromkeys(p["name"] for p in plan(get_recipe(c.flow), c, store)))
    finally:
        shutil.rmtree(store, ignore_errors=True)
        if old is None:
            os.environ.pop("PREFECT_HOME", None)
    size = est.corpus_size(c.dataset, None if labelled else proxy_docs)
    return c, stages, size


def write(out: str | Path, text: str, force: bool = False) -> Path:
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"--out {out} exists (--force to replace it)")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: no directory {out.parent}")
    out.write_text(text)
    return out
