"""Train a dual encoder on labelled pairs: RocketQA's M_D0 / M_D1 / M_D2, DPR, ANCE's rounds.

Examples are the positives (score > 0) of the ``splits`` of every ``qrels`` input (labelled pairs,
and augmented ones). With ``negatives_per_line`` > 0 each example carries that many hard negatives,
sampled (seeded, per query and positive) from the ``negatives`` inputs (BM25's or a retriever's
top-k, denoised or not, random passages); a judged positive of the query is never one, and a query
whose pool runs short is filled with random corpus passages (counted in a warning); without a
``negatives`` input they are all random passages (DPR's random negatives). ``negative_lines`` > 1
makes several lines per positive, each with its own negatives (RocketQA's training files: 4 lines of
one negative per positive). No two lines in a batch share a query or a passage: in-batch negatives
must be negatives. Another line's passage may still be judged relevant to a query (queries that share
judged passages: NFCorpus); ``false_negatives: mask`` leaves such passages out of that query's softmax.
``positives_per_query`` keeps a seeded sample of each query's positives, so that queries with hundreds
of judgements do not take most of the batches.

``loss: star`` takes the same lines as infonce (hard negatives from ``negatives``) and scores them with
STAR's pairwise loss (``irflow.learn.losses.StarLoss``): the hard negatives, plus ``alpha`` x the batch's other
passages as random negatives.

``loss: listwise_kl`` reads ``teacher_scores`` (query, doc, score: a re-ranker's scores, as the
``denoise`` stage writes them): each example's list is its positive plus ``list_size - 1`` scored
candidates that are not positives.

The work is ``irflow.learn.dual_encoder.train``: in this process, or in torchrun workers: ``processes`` of
them (keyed: cross-batch negatives over a global batch of ``processes x batch_size``), or
``runtime.train_processes`` when it is above 1 (not keyed: the global batch is split between them, and
they take the same steps; it must divide the global batch). The result is a sentence-transformers model.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

from irflow.engine import distributed
from irflow.engine.errors import DataError
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.dual_encoder import Job, TrainDualEncoderParams, train, train_json
from irflow.learn.qrels import cap_per_query, group, judged_positives, positive_pairs
from irflow.learn.sampling import sample
from irflow.learn.text import doc_texts, query_texts
from irflow.learn.training import training_losses

log = logging.getLogger("irflow.train")

__all__ = ["TrainDualEncoderParams", "train_dual_encoder", "training_examples"]


def training_examples(p: TrainDualEncoderParams, qrels: list[pa.Table], corpus_ids: list[str],
                      negatives: list[pa.Table] = (), teacher_scores: pa.Table | None = None) -> dict:
    """{q, p, n (lists of ids), cand, teacher}: the examples of the stage, as ids (no texts); and judged
    (query -> its judged positives in every qrels input)."""
    pairs = sorted({pair for t in qrels for split in p.splits for pair in positive_pairs(t, split)})
    if not pairs:
        raise DataError(f"no positive qrels in split(s) {', '.join(p.splits)}: nothing to train on")
    pairs = cap_per_query(pairs, p.positives_per_query, p.seed)
    judged: dict[str, set[str]] = defaultdict(set)
    for t in qrels:
        for q, ds in judged_positives(t).items():
            judged[q] |= ds
    ex: dict = {"q": [q for q, _ in pairs], "p": [d for _, d in pairs], "n": [], "cand": [], "teacher": [],
                "judged": judged}
    if p.loss in ("infonce", "star") and p.negatives_per_line:
        # Each (query, positive) becomes `negative_lines` lines with `negatives_per_line` negatives each,
        # drawn without replacement from the query's pool; no negatives input: random passages (DPR).
        pools: dict[str, set[str]] = defaultdict(set)
        for t in negatives:
            for q, ds in group(t).items():
                pools[q] |= ds
        per_line, lines = p.negatives_per_line, p.negative_lines
        want, short = per_line * lines, 0
        lines_q, lines_p = [], []
        for q, pos in pairs:
            pool = [d for d in pools.get(q, ()) if d not in judged[q] and d != q]
            negs = sample(pool, want, p.seed, q, pos)
            if len(negs) < want:
                short += bool(negatives)
                extra = [d for d in sample(corpus_ids, 2 * want + len(judged[q]) + 1, p.seed, "random", q, pos)
                         if d not in judged[q] and d != q and d not in negs]
                negs += extra[:want - len(negs)]
            for k in range(lines):
                lines_q.append(q), lines_p.append(pos)
                ex["n"].append(negs[k * per_line:(k + 1) * per_line])
        ex["q"], ex["p"] = lines_q, lines_p
        if short:
            log.warning("train_dual_encoder: %d of %d (query, positive) pair(s) had fewer than %d negatives in the "
                        "pool; filled with random passages", short, len(pairs), want)
        elif not negatives:
            log.info("train_dual_encoder: %d random negative(s) per line (no negatives input)", per_line)
    if p.loss == "listwise_kl":
        if teacher_scores is None:
            raise ValueError("train_dual_encoder: loss listwise_kl needs the teacher_scores input")
        scored: dict[str, dict[str, float]] = defaultdict(dict)
        for q, d, s in zip(*(teacher_scores.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
            scored[q][d] = s
        keep, missing = [], 0
        for i, (q, pos) in enumerate(pairs):
            others = [d for d in scored.get(q, {}) if d not in judged[q] and d != q]
            if pos not in scored.get(q, {}) or len(others) < p.list_size - 1:
                missing += 1
                continue
            cand = [pos] + sample(others, p.list_size - 1, p.seed, q, pos)
            keep.append(i)
            ex["cand"].append(cand)
            ex["teacher"].append([float(scored[q][d]) for d in cand])
        if missing:
            log.warning("train_dual_encoder: %d example(s) skipped: the teacher did not score the positive or "
                        "fewer than %d other candidates", missing, p.list_size - 1)
        ex["q"], ex["p"] = [ex["q"][i] for i in keep], [ex["p"][i] for i in keep]
        if not keep:
            raise DataError("listwise_kl: no query has its positive and enough candidates scored by the teacher")
    return ex


# version 2: also the loss history as a dataset (training_losses)
@stage("train_dual_encoder", version="2",
       outputs=[Output("model", kind="model"), Output("training_losses", "training_losses")],
       work="train", resumable=True)
def train_dual_encoder(p: TrainDualEncoderParams, rt: StageRuntime, *, queries: list[DatasetRef],
                       corpus: DatasetRef, base_model: DatasetRef, qrels: list[DatasetRef],
                       negatives: list[DatasetRef] | None = None, teacher_scores: DatasetRef | None = None) -> dict:
    """A dual encoder trained from ``base_model`` on the positives of ``qrels`` (+ ``negatives``, or a
    re-ranker's ``teacher_scores`` for listwise_kl); and its loss per step (``training_losses``)."""
    corpus_t = corpus.table()
    corpus_ids = corpus_t.column("doc_id").to_pylist()
    ex = training_examples(p, [t.table() for t in qrels], corpus_ids,
                           [t.table() for t in negatives or []],
                           teacher_scores.table() if teacher_scores is not None else None)
    qtext: dict[str, str] = {}
    for t in queries:
        qtext.update(query_texts(t.table(), set(ex["q"])))
    doc_ids = set(ex["p"]) | {d for ns in ex["n"] for d in ns} | {d for c in ex["cand"] for d in c}
    dtext = doc_texts(corpus_t, doc_ids)
    n = len(ex["q"])
    keep = [i for i in range(n) if ex["q"][i] in qtext and ex["p"][i] in dtext]
    if len(keep) < n:
        log.warning("train_dual_encoder: %d example(s) refer to unknown queries/passages and are dropped", n - len(keep))
    if not keep:
        raise DataError("no training examples: the qrels name no query or passage of the inputs")
    job = Job(model_path=base_model.path, out_dir=str(Path(rt.workdir) / "model"), params=p.model_dump(mode="json"),
              queries=[qtext[ex["q"][i]] for i in keep], positives=[dtext[ex["p"][i]] for i in keep],
              negatives=[[dtext[d] for d in ex["n"][i]] for i in keep] if ex["n"] else [],
              candidates=[[dtext[d] for d in ex["cand"][i]] for i in keep] if ex["cand"] else [],
              teacher=[ex["teacher"][i] for i in keep] if ex["teacher"] else [],
              # no two lines of a batch share a query or a passage: in-batch negatives must be negatives
              keys=[sorted({"q:" + ex["q"][i], "d:" + ex["p"][i], *("d:" + d for d in (ex["n"][i] if ex["n"] else []))})
                    for i in keep])
    if p.false_negatives == "mask":
        number = {d: k for k, d in enumerate(corpus_ids)}
        job.positive_ids = [number[ex["p"][i]] for i in keep]
        job.negative_ids = [[number[d] for d in ex["n"][i]] for i in keep] if ex["n"] else []
        job.judged_ids = [sorted(number[d] for d in ex["judged"].get(ex["q"][i], ()) if d in number) for i in keep]
    processes = p.processes
    if rt.train_processes > 1:
        distributed.check_split(p.batch_size * p.processes, rt.train_processes, "processes x batch_size")
        processes = rt.train_processes
    if processes == 1:
        train(job, rt)  # the job as it is: no JSON copy of its texts
    else:
        distributed.run(train_json, asdict(job), rt, processes)
    return {"model": Path(job.out_dir), "training_losses": training_losses(job.out_dir)}
