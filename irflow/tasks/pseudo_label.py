"""Pseudo labels for Margin-MSE training (GPL's third step, and its offline variants).

GPL (Wang, Thakur, Reimers, Gurevych, NAACL 2022) pairs every generated query with its source
passage (the positive) and one negative drawn from the union of the hard-negative miners' lists,
and labels the triple with a cross-encoder's margin ``CE(q, pos) - CE(q, neg)`` (raw logits). Here:

- ``teacher.type: cross_encoder``: any Hugging Face sequence-classification checkpoint with one
  logit (``cross-encoder/ms-marco-*`` layout, or one made by the ``train_cross_encoder`` stage);
  raw logits, as GPL uses them.
- ``teacher.type: fusion``: a training-free hybrid of ranked runs (e.g. BM25 + the zero-shot dense
  model). Per run and query the scores are z-scored (or min-max scaled); a document missing from a
  run gets that run's per-query minimum; the teacher score is the weighted sum over runs. Measured
  offline on SciFact this is the strongest teacher available without a hub (see
  /work/shared/notes/offline-adaptation-findings.md).
- ``positive: qrels`` (GPL): positives are the ``split`` qrels with score > 0 (for generated
  queries, ``split=generated`` and the doc is the source passage); ``negatives_per_query``
  negatives per (query, positive) are sampled without replacement from the union of the miners'
  negatives, never a judged positive of the query.
- ``positive: teacher_top1`` (unlabelled real queries, e.g. a query log): the teacher ranks each
  query's candidates (the union of the teacher runs and/or the negatives lists); the positive is its
  top-1 and the negatives are sampled from teacher ranks ``neg_rank_range`` (inclusive, 1-based).
  qrels are not read in this mode.
- ``scale``: teacher margins are in the teacher's units, the student's margins in cosine (or dot)
  units. ``auto`` multiplies the teacher scores by the least-squares factor that maps teacher
  margins onto the student's own margins on a sample of the triples; a float multiplies by it;
  null leaves them as they are. pos_score, neg_score and margin are all scaled, so
  ``margin == pos_score - neg_score`` always holds.

Sampling is deterministic for a seed and independent of table order (one RNG per query).
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import Sequence

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm.auto import tqdm

from irflow.stage import Output, stage

log = logging.getLogger("irflow.pseudo_label")


# ---- texts ----------------------------------------------------------------------------------------
def doc_text(title: str | None, text: str | None) -> str:
    """BEIR's passage text: title + " " + text (stripped, so an empty title adds nothing)."""
    return f"{title or ''} {text or ''}".strip()


def query_texts(queries: pa.Table, ids: set[str] | None = None) -> dict[str, str]:
    if ids is not None:
        queries = queries.filter(pc.is_in(queries.column("query_id"), pa.array(sorted(ids), pa.string())))
    return dict(zip(queries.column("query_id").to_pylist(), queries.column("text").to_pylist()))


def doc_texts(corpus: pa.Table, ids: set[str] | None = None) -> dict[str, str]:
    if ids is not None:
        corpus = corpus.filter(pc.is_in(corpus.column("doc_id"), pa.array(sorted(ids), pa.string())))
    return {d: doc_text(t, x) for d, t, x in zip(*(corpus.column(c).to_pylist() for c in ("doc_id", "title", "text")))}


# ---- cross-encoder teacher ------------------------------------------------------------------------
def cross_encoder_scores(model_path: str, pairs: Sequence[tuple[str, str]], batch_size: int = 32,
                         max_length: int = 512, device: str = "cpu", show_progress: bool = True) -> np.ndarray:
    """Raw logits of a 1-logit sequence-classification model for (query, passage) pairs.

    Pairs are batched in order of length (less padding), results returned in input order.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path).to(device).eval()
    if model.config.num_labels != 1:
        raise ValueError(f"cross-encoder teacher {model_path}: expected one output logit, model has "
                         f"{model.config.num_labels} labels")
    n = len(pairs)
    out = np.empty(n, dtype=np.float32)
    order = sorted(range(n), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    with torch.inference_mode():
        for start in tqdm(range(0, n, batch_size), desc="cross-encoder scoring", unit=" batch",
                          disable=not show_progress, mininterval=2):
            idx = order[start:start + batch_size]
            enc = tok([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], padding=True,
                      truncation="longest_first", max_length=max_length, return_tensors="pt").to(device)
            out[idx] = model(**enc).logits[:, 0].float().cpu().numpy()
    return out


# ---- fusion teacher -------------------------------------------------------------------------------
def _runs_table(runs: Sequence[pa.Table], depth: int | None) -> tuple[pa.Table, list[str]]:
    """One table (run_idx, query_id, doc_id, score) over all runs; each (table, system) is one run."""
    parts, names = [], []
    for t in runs:
        for system in sorted(set(t.column("system").to_pylist())):
            r = t.filter(pc.equal(t.column("system"), system))
            if depth:
                r = r.filter(pc.less_equal(r.column("rank"), int(depth)))
            idx = len(names)
            names.append(system)
            parts.append(pa.table({"run_idx": pa.array(np.full(r.num_rows, idx, dtype=np.int32)),
                                   "query_id": r.column("query_id"), "doc_id": r.column("doc_id"),
                                   "score": r.column("score").cast(pa.float64())}))
    if not parts:
        raise ValueError("fusion teacher: no teacher runs given")
    return pa.concat_tables(parts), names


def resolve_weights(weights, systems: list[str]) -> list[float]:
    """None: equal weights summing to 1; a list: one per run, in order; a dict: by system name."""
    if weights is None:
        return [1.0 / len(systems)] * len(systems)
    if isinstance(weights, dict):
        missing = [s for s in systems if s not in weights]
        if missing:
            raise ValueError(f"fusion teacher: no weight for run(s) {missing} (weights name {sorted(weights)})")
        return [float(weights[s]) for s in systems]
    weights = [float(w) for w in weights]
    if len(weights) != len(systems):
        raise ValueError(f"fusion teacher: {len(weights)} weight(s) for {len(systems)} run(s) {systems}")
    return weights


def fused_scores(runs: Sequence[pa.Table], *, method: str = "zscore", weights=None, depth: int | None = None,
                 pairs: pa.Table | None = None) -> pa.Table:
    """Fused teacher scores (query_id, doc_id, score float64).

    Per run and query, scores are normalised over that run's list for the query (``zscore``:
    (s - mean) / std, population std, 0 where std is 0; ``minmax``: (s - min) / (max - min), 0 where
    max == min). A document missing from a run's list gets that run's minimum normalised score for
    the query (0 if the run does not answer the query). score = sum of weight * normalised score.
    ``pairs`` (query_id, doc_id): score these; default: every (query, doc) that any run returns.
    """
    if method not in ("zscore", "minmax"):
        raise ValueError(f"fusion teacher: method must be zscore or minmax, got {method!r}")
    table, systems = _runs_table(runs, depth)
    w = resolve_weights(weights, systems)
    con = duckdb.connect()
    con.register("runs", table)
    con.register("weights", pa.table({"run_idx": pa.array(range(len(w)), pa.int32()), "weight": w}))
    if pairs is None:
        con.execute("CREATE TEMP TABLE cand AS SELECT DISTINCT query_id, doc_id FROM runs")
    else:
        con.register("pairs_in", pairs.select(["query_id", "doc_id"]))
        con.execute("CREATE TEMP TABLE cand AS SELECT DISTINCT query_id, doc_id FROM pairs_in")
    norm = ("coalesce((score - avg(score) OVER w) / nullif(stddev_pop(score) OVER w, 0), 0)" if method == "zscore"
            else "coalesce((score - min(score) OVER w) / nullif(max(score) OVER w - min(score) OVER w, 0), 0)")
    return con.sql(f"""
        WITH z AS (SELECT run_idx, query_id, doc_id, max(z) AS z FROM (
                     SELECT run_idx, query_id, doc_id, {norm} AS z FROM runs
                     WINDOW w AS (PARTITION BY run_idx, query_id)) GROUP BY ALL),
             zmin AS (SELECT run_idx, query_id, min(z) AS zmin FROM z GROUP BY ALL),
             grid AS (SELECT c.query_id, c.doc_id, w.run_idx, w.weight FROM cand c CROSS JOIN weights w)
        SELECT g.query_id, g.doc_id, sum(g.weight * coalesce(z.z, zmin.zmin, 0)) AS score
        FROM grid g
        LEFT JOIN z ON z.run_idx = g.run_idx AND z.query_id = g.query_id AND z.doc_id = g.doc_id
        LEFT JOIN zmin ON zmin.run_idx = g.run_idx AND zmin.query_id = g.query_id
        GROUP BY g.query_id, g.doc_id ORDER BY g.query_id, g.doc_id
    """).to_arrow_table()


# ---- margin scale ---------------------------------------------------------------------------------
def least_squares_scale(teacher_margins: np.ndarray, student_margins: np.ndarray) -> float:
    """argmin_a sum (a * t - s)^2 = <t, s> / <t, t>.

    If teacher and student disagree on the sample (a <= 0), falls back to the ratio of RMS values
    so the scaled margins still have the student's magnitude (with a warning).
    """
    t = np.asarray(teacher_margins, dtype=np.float64)
    s = np.asarray(student_margins, dtype=np.float64)
    tt = float(t @ t)
    if tt == 0.0:
        return 1.0
    a = float(t @ s) / tt
    if a <= 0:
        a = float(np.sqrt((s @ s) / tt)) or 1.0
        log.warning("scale: teacher and student margins are not positively related on the sample; "
                    "using the RMS ratio %.4g instead of least squares", a)
    return a


def student_margins(model_path: str, similarity: str, triples: Sequence[tuple[str, str, str]], *,
                    batch_size: int = 64, max_seq_length: int | None = None, device: str = "cpu") -> np.ndarray:
    """sim(q, p) - sim(q, n) under the student model, for (query text, pos text, neg text) triples."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path, device=device)
    if max_seq_length:
        model.max_seq_length = int(max_seq_length)
    texts = sorted({x for tr in triples for x in tr})
    emb = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False,
                       normalize_embeddings=(similarity == "cos")).astype(np.float64)
    pos = {t: i for i, t in enumerate(texts)}
    q = emb[[pos[t[0]] for t in triples]]
    p = emb[[pos[t[1]] for t in triples]]
    n = emb[[pos[t[2]] for t in triples]]
    return (q * p).sum(1) - (q * n).sum(1)


# ---- sampling -------------------------------------------------------------------------------------
def _rng(seed, *parts: str) -> random.Random:
    return random.Random("\x1f".join([str(seed), *parts]))


def sample_negatives(pool: Sequence[str], n: int, seed, *key: str) -> list[str]:
    """n distinct items from pool (all of them if fewer), deterministic for (seed, key)."""
    pool = sorted(pool)
    return _rng(seed, *key).sample(pool, min(int(n), len(pool)))


def _groups(table: pa.Table, key: str, value: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for k, v in zip(table.column(key).to_pylist(), table.column(value).to_pylist()):
        out[k].add(v)
    return out


# ---- the stage ------------------------------------------------------------------------------------
def _teacher_scores(teacher: dict, pairs: list[tuple[str, str]], qtext: dict, dtext: dict, runs) -> np.ndarray:
    kind = teacher.get("type")
    if kind == "cross_encoder":
        return cross_encoder_scores(teacher["_model_path"], [(qtext[q], dtext[d]) for q, d in pairs],
                                    batch_size=int(teacher.get("batch_size", 32)),
                                    max_length=int(teacher.get("max_length", 512)),
                                    device=teacher.get("_device", "cpu"))
    if kind == "fusion":
        if not runs:
            raise ValueError("pseudo_label: teacher.type fusion needs the teacher_runs input")
        want = pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs]},
                        schema=pa.schema([("query_id", pa.string()), ("doc_id", pa.string())]))
        fused = fused_scores(runs, method=teacher.get("method", "zscore"), weights=teacher.get("weights"),
                             depth=teacher.get("depth"), pairs=want)
        lookup = dict(zip(zip(fused.column("query_id").to_pylist(), fused.column("doc_id").to_pylist()),
                          fused.column("score").to_pylist()))
        return np.array([lookup[p] for p in pairs], dtype=np.float64)
    raise ValueError(f"pseudo_label: teacher.type must be cross_encoder or fusion, got {kind!r}")


def _score_unique(teacher, pairs, qtext, dtext, runs) -> dict[tuple[str, str], float]:
    uniq = sorted(set(pairs))
    return dict(zip(uniq, (float(s) for s in _teacher_scores(teacher, uniq, qtext, dtext, runs)))) if uniq else {}


def _miners_filter(negatives: pa.Table, miners) -> pa.Table:
    if miners:
        negatives = negatives.filter(pc.is_in(negatives.column("miner"), pa.array(list(miners), pa.string())))
    return negatives


def build_triples(queries: pa.Table, corpus: pa.Table, cfg: dict, qrels: pa.Table | None = None,
                  negatives: pa.Table | None = None, runs: Sequence[pa.Table] | None = None) -> dict:
    """The stage's work without the store: returns {triples, pos_score, neg_score, margin, scale, qtext, dtext}.

    triples are (query_id, pos_doc_id, neg_doc_id); scores are unscaled teacher scores.
    """
    teacher = dict(cfg["teacher"])
    if "_device" in cfg and "_device" not in teacher:
        teacher["_device"] = cfg["_device"]
    seed = cfg.get("seed", 42)
    n_neg = int(cfg.get("negatives_per_query", 1))
    mode = cfg.get("positive", "qrels")
    runs = list(runs or [])
    all_q = set(queries.column("query_id").to_pylist())
    all_d = set(corpus.column("doc_id").to_pylist())

    if mode == "qrels":
        if qrels is None or negatives is None:
            raise ValueError("pseudo_label: positive=qrels needs the qrels and negatives inputs")
        split = cfg.get("split", "generated")
        pos_rows = qrels.filter(pc.and_(pc.equal(qrels.column("split"), split), pc.greater(qrels.column("score"), 0)))
        if pos_rows.num_rows == 0:
            raise ValueError(f"pseudo_label: no positive qrels in split '{split}'")
        positives = _groups(pos_rows, "query_id", "doc_id")
        judged = _groups(qrels.filter(pc.greater(qrels.column("score"), 0)), "query_id", "doc_id")
        pools = _groups(_miners_filter(negatives, cfg.get("miners")), "query_id", "doc_id")
        triples, skipped = [], 0
        for qid in sorted(positives):
            if qid not in all_q:
                skipped += 1
                continue
            pool = [d for d in pools.get(qid, ()) if d not in judged[qid] and d != qid and d in all_d]
            if not pool:
                skipped += 1
                continue
            for pos in sorted(positives[qid]):
                if pos not in all_d:
                    continue
                triples += [(qid, pos, neg) for neg in sample_negatives(pool, n_neg, seed, qid, pos)]
        if skipped:
            log.warning("pseudo_label: %d quer(ies) without text or negatives skipped", skipped)
        qtext = query_texts(queries, {t[0] for t in triples})
        dtext = doc_texts(corpus, {d for t in triples for d in t[1:]})
        scores = _score_unique(teacher, [(q, d) for q, p, n in triples for d in (p, n)], qtext, dtext, runs)
    elif mode == "teacher_top1":
        if qrels is not None:
            raise ValueError("pseudo_label: positive=teacher_top1 reads no qrels (the queries are unlabelled); "
                             "do not pass the qrels input")
        lo, hi = (int(x) for x in cfg.get("neg_rank_range", [3, 30]))
        if not 1 < lo <= hi:
            raise ValueError(f"pseudo_label: neg_rank_range must be [lo, hi] with 1 < lo <= hi, got {[lo, hi]}")
        cand: dict[str, set[str]] = defaultdict(set)
        depth = teacher.get("depth")
        for t in runs:
            if depth:
                t = t.filter(pc.less_equal(t.column("rank"), int(depth)))
            for q, ds in _groups(t, "query_id", "doc_id").items():
                cand[q] |= ds
        if negatives is not None:
            for q, ds in _groups(_miners_filter(negatives, cfg.get("miners")), "query_id", "doc_id").items():
                cand[q] |= ds
        cand = {q: {d for d in ds if d in all_d and d != q} for q, ds in cand.items() if q in all_q}
        if not cand:
            raise ValueError("pseudo_label: positive=teacher_top1 found no candidates (give teacher_runs or negatives)")
        qtext = query_texts(queries, set(cand))
        dtext = doc_texts(corpus, {d for ds in cand.values() for d in ds})
        scores = _score_unique(teacher, [(q, d) for q, ds in cand.items() for d in ds], qtext, dtext, runs)
        triples, skipped = [], 0
        for qid in sorted(cand):
            ranked = sorted(cand[qid], key=lambda d: (-scores[(qid, d)], d))
            pool = ranked[lo - 1:hi]
            if not pool:
                skipped += 1
                continue
            triples += [(qid, ranked[0], neg) for neg in sample_negatives(pool, n_neg, seed, qid)]
        if skipped:
            log.warning("pseudo_label: %d quer(ies) with fewer than %d candidates skipped", skipped, lo)
    else:
        raise ValueError(f"pseudo_label: positive must be qrels or teacher_top1, got {mode!r}")

    if not triples:
        raise ValueError("pseudo_label: no training triples could be built")
    pos_score = np.array([scores[(q, p)] for q, p, _ in triples], dtype=np.float64)
    neg_score = np.array([scores[(q, n)] for q, _, n in triples], dtype=np.float64)
    scale = _scale(cfg, triples, pos_score - neg_score, qtext, dtext, seed)
    log.info("pseudo_label: %d triples over %d queries; teacher %s; margin scale %.4g", len(triples),
             len({t[0] for t in triples}), teacher.get("type"), scale)
    return {"triples": triples, "pos_score": pos_score, "neg_score": neg_score, "scale": scale,
            "qtext": qtext, "dtext": dtext}


def _scale(cfg: dict, triples, teacher_margins: np.ndarray, qtext, dtext, seed) -> float:
    scale = cfg.get("scale")
    if scale is None:
        return 1.0
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    if scale != "auto":
        raise ValueError(f"pseudo_label: scale must be 'auto', a number or null, got {scale!r}")
    student = cfg.get("student") or {}
    if not student.get("_model_path"):
        raise ValueError("pseudo_label: scale=auto needs cfg.student {model_key, _model_path, similarity}")
    idx = sorted(_rng(seed, "scale").sample(range(len(triples)), min(len(triples), int(cfg.get("scale_sample", 1000)))))
    sample = [(qtext[triples[i][0]], dtext[triples[i][1]], dtext[triples[i][2]]) for i in idx]
    s = student_margins(student["_model_path"], student.get("similarity", "cos"), sample,
                        max_seq_length=student.get("max_seq_length"), device=cfg.get("_device", "cpu"))
    return least_squares_scale(teacher_margins[idx], s)


def to_table(triples, pos_score: np.ndarray, neg_score: np.ndarray, scale: float) -> pa.Table:
    pos32 = (pos_score * scale).astype(np.float32)
    neg32 = (neg_score * scale).astype(np.float32)
    return pa.table({
        "query_id": [t[0] for t in triples], "pos_doc_id": [t[1] for t in triples],
        "neg_doc_id": [t[2] for t in triples], "pos_score": pos32, "neg_score": neg32,
        "margin": pos32 - neg32,
    })


@stage("pseudo_label", version="1", outputs=Output("pseudo_labels", "pseudo_labels"))
def pseudo_label(queries, corpus, cfg: dict, qrels=None, negatives=None, teacher_runs=None) -> pa.Table:
    """Inputs: queries, corpus, qrels (positive=qrels), negatives, teacher_runs (list of runs; fusion).

    cfg: {teacher: {type: cross_encoder, model, model_key, _model_path, batch_size, max_length}
                   | {type: fusion, method: zscore|minmax, weights: list|{system: w}, depth},
          positive: qrels|teacher_top1, split (qrels: generated), negatives_per_query (1),
          neg_rank_range ([3, 30]; teacher_top1), miners (optional filter), seed,
          scale: auto|float|null, scale_sample (1000), student: {model_key, _model_path, similarity,
          max_seq_length} (scale=auto), _device}
    """
    runs = [r.table() for r in (teacher_runs if isinstance(teacher_runs, (list, tuple)) else
                                ([teacher_runs] if teacher_runs is not None else []))]
    out = build_triples(queries.table(), corpus.table(), cfg, qrels=qrels.table() if qrels is not None else None,
                        negatives=negatives.table() if negatives is not None else None, runs=runs)
    return to_table(out["triples"], out["pos_score"], out["neg_score"], out["scale"])


@stage("label_positives", version="1", outputs=Output("qrels", "qrels"))
def label_positives(pseudo_labels, cfg: dict) -> pa.Table:
    """The (query, positive) pairs the teacher labelled, as qrels (split="generated").

    For the QGen baseline (MNRL with in-batch negatives) on queries that came without a source
    passage -- real unlabelled queries, whose positive is the teacher's top-1.
    """
    t = pseudo_labels.table(columns=["query_id", "pos_doc_id"])
    pairs = sorted(set(zip(t.column("query_id").to_pylist(), t.column("pos_doc_id").to_pylist())))
    return pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs],
                     "score": pa.array([1] * len(pairs), pa.int32()), "split": ["generated"] * len(pairs)})
