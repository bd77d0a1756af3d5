"""Train a query encoder against fixed document embeddings: ADORE (Zhan et al., SIGIR 2021).

The training queries are the judged queries of the ``splits`` of ``qrels``; a query's relevant passages
are its positives there (score > 0, the score as the relevance grade; ``positives_per_query`` keeps a
seeded sample of them), and no passage judged positive for it in any split is ever its negative.
``embeddings`` is the corpus as ``document_model`` encoded it (an ``encode_corpus`` output): it is read,
never re-encoded or changed. The query encoder starts from ``base_model`` (ADORE: the STAR model, the
same as ``document_model``); each step's hard negatives come from its own current ranking of
``embeddings`` (``irflow.learn.adore``).

The output is one asymmetric sentence-transformers model: the trained query encoder beside
``document_model``, unchanged (a ``Router``: ``encode_query`` / ``encode_document``). Searching
``embeddings`` with its queries is what it was trained for; its lineage reaches both inputs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from irflow.engine.errors import DataError
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.adore import Job, TrainQueryEncoderParams, embedding_matrix, train
from irflow.learn.qrels import cap_per_query, judged_positives, positive_rows
from irflow.learn.text import query_texts
from irflow.learn.training import training_losses

log = logging.getLogger("irflow.train")

__all__ = ["TrainQueryEncoderParams", "train_query_encoder"]


def _check_asymmetric(path: Path) -> None:
    for f in ("modules.json", "router_config.json"):
        if not (Path(path) / f).exists():
            raise RuntimeError(f"{path}: not an asymmetric sentence-transformers model (no {f})")


@stage("train_query_encoder", version="1",
       outputs=[Output("model", kind="model", check=_check_asymmetric),
                Output("training_losses", "training_losses")],
       work="train", resumable=True)
def train_query_encoder(p: TrainQueryEncoderParams, rt: StageRuntime, *, queries: DatasetRef, qrels: DatasetRef,
                        embeddings: DatasetRef, base_model: DatasetRef, document_model: DatasetRef) -> dict:
    """A query encoder trained from ``base_model`` against the fixed ``embeddings`` (``document_model``'s)
    on the positives of ``qrels``, saved beside ``document_model`` as one asymmetric model; and its loss
    per step (``training_losses``)."""
    emb = embeddings.table()
    doc_ids = emb.column("doc_id").to_pylist()
    matrix = embedding_matrix(emb)
    if p.similarity == "cos":
        norms = np.linalg.norm(matrix, axis=1)
        if matrix.shape[0] and float(np.abs(norms - 1).max()) > 1e-3:
            raise DataError(f"similarity: cos, but the embeddings are not unit length (norms {norms.min():.3f} to "
                            f"{norms.max():.3f}): they were encoded for dot")
    row = {d: i for i, d in enumerate(doc_ids)}
    q = qrels.table()
    grades: dict[str, dict[int, float]] = {}
    unknown = 0
    for split in p.splits:
        t = positive_rows(q, split)
        for qid, did, score in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
            if did not in row:
                unknown += 1
                continue
            g = grades.setdefault(qid, {})
            g[row[did]] = max(float(score), g.get(row[did], 0.0))
    if p.positives_per_query:
        kept = set(cap_per_query([(qid, doc_ids[r]) for qid, g in grades.items() for r in g],
                                 p.positives_per_query, p.seed))
        grades = {qid: {r: v for r, v in g.items() if (qid, doc_ids[r]) in kept} for qid, g in grades.items()}
    if unknown:
        log.warning("train_query_encoder: %d judged positive(s) are not in the embeddings and are left out", unknown)
    texts = query_texts(queries.table(), set(grades))
    qids = sorted(qid for qid in grades if qid in texts)
    if not qids:
        raise DataError(f"no judged query of split(s) {', '.join(p.splits)} with a positive in the embeddings: "
                        "nothing to train on")
    judged = judged_positives(q)
    excluded = [{row[d] for d in judged.get(qid, ()) if d in row} | ({row[qid]} if qid in row else set())
                for qid in qids]
    job = Job(model_path=base_model.path, document_model_path=document_model.path,
              out_dir=str(Path(rt.workdir) / "model"), params=p.model_dump(mode="json"),
              queries=[texts[qid] for qid in qids], positives=[grades[qid] for qid in qids], excluded=excluded,
              doc_emb=matrix)
    if rt.train_processes > 1:
        log.info("train_query_encoder: trains in one process (runtime.train_processes %d is for dual encoders)",
                 rt.train_processes)
    train(job, rt)
    return {"model": Path(job.out_dir), "training_losses": training_losses(job.out_dir)}
