"""Train a bi-encoder student: Margin-MSE on pseudo labels (GPL) or MNRL on (query, positive) pairs (QGen).

The loop, optimizer, schedule, precision and checkpoints are ``irflow.training``'s; the losses are
``irflow.losses``'s. For MNRL no two examples in a batch share a query or a passage (in-batch
negatives must be negatives). Passages are BEIR's ``title + " " + text``. The model is saved with
``SentenceTransformer.save`` so ``SentenceTransformer(path)`` loads it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.errors import DataError
from irflow.losses import MarginMSELoss, MultipleNegativesRankingLoss
from irflow.qrels import group, judged_positives, positive_pairs
from irflow.runtime import StageRuntime
from irflow.sampling import sample
from irflow.stage import Output, stage
from irflow.store import DatasetRef
from irflow.text import doc_texts, query_texts
from irflow.training import BatchPlan, LoopParams, seed_everything, train_loop

log = logging.getLogger("irflow.train")


class TrainStudentParams(LoopParams):
    loss: Literal["margin_mse", "mnrl"] = Field("margin_mse", description="margin_mse: match the teacher's margins "
                                                                        "(GPL); mnrl: in-batch negatives on "
                                                                        "(query, positive) pairs (QGen)")
    similarity: Literal["cos", "dot"] = Field("dot", description="the student's similarity (GPL's student: dot)")
    batch_size: PositiveInt = Field(32, description="examples per step")
    max_seq_length: PositiveInt = Field(350, description="tokens per text")
    warmup_steps: int = Field(1000, ge=0, description="linear warm-up steps, then linear decay to 0")
    split: str = Field("generated", min_length=1, description="mnrl: the qrels split of the (query, positive) pairs")
    mnrl_scale: float | None = Field(None, gt=0, description="mnrl: similarity scale before the softmax (null: 20 "
                                                             "for cos, 1 for dot)")


# ---- data -----------------------------------------------------------------------------------------
def _features(model, texts: list[str], device: str) -> dict:
    f = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
    return {k: (v.to(device) if hasattr(v, "to") else v) for k, v in f.items()}


def _embed(model, texts: list[str], device: str):
    return model(_features(model, texts, device))["sentence_embedding"]


def margin_mse_examples(pseudo_labels: pa.Table) -> dict:
    t = pseudo_labels
    return {"q": t.column("query_id").to_pylist(), "p": t.column("pos_doc_id").to_pylist(),
            "n": t.column("neg_doc_id").to_pylist(), "margin": t.column("margin").to_numpy().astype(np.float32)}


def mnrl_examples(qrels: pa.Table, negatives: pa.Table | None, corpus_ids: list[str], split: str, seed: int) -> dict:
    """(query, positive) pairs from the ``split`` qrels (score > 0); with negatives, one hard negative
    per pair, sampled (seeded) from the query's mined negatives that are not judged positives (a
    random corpus passage where a query has none)."""
    pairs = positive_pairs(qrels, split)
    if not pairs:
        raise DataError(f"no positive qrels in split '{split}'")
    ex = {"q": [q for q, _ in pairs], "p": [d for _, d in pairs]}
    if negatives is not None:
        judged = judged_positives(qrels)
        pools = group(negatives)
        ex["n"], fallback = [], 0
        for q, p in pairs:
            pool = [d for d in pools.get(q, ()) if d not in judged.get(q, ())]
            if not pool:
                fallback += 1
                pool = [d for d in sample(corpus_ids, 8, seed, "random", q, p) if d not in judged.get(q, ())]
            ex["n"].append(sample(pool, 1, seed, q, p)[0])
        if fallback:
            log.warning("train_student: %d pair(s) had no mined negative; a random passage is used", fallback)
    return ex


def _check_student(path: Path) -> None:
    for f in ("modules.json", "config.json"):
        if not (Path(path) / f).exists():
            raise RuntimeError(f"{path}: not a sentence-transformers model (no {f})")



@stage("train_student", version="2", outputs=Output("student", kind="model", check=_check_student), work="train",
       resumable=True)
def train_student(p: TrainStudentParams, rt: StageRuntime, *, queries: DatasetRef, corpus: DatasetRef,
                  base_model: DatasetRef, pseudo_labels: DatasetRef | None = None, qrels: DatasetRef | None = None,
                  negatives: DatasetRef | None = None) -> Path:
    """A student trained from ``base_model``: on ``pseudo_labels`` (loss margin_mse) or on ``qrels``
    [+ ``negatives``] (loss mnrl)."""
    import torch

    from irflow.models import load_sentence_transformer

    corpus_t = corpus.table()
    if p.loss == "margin_mse":
        if pseudo_labels is None:
            raise ValueError("train_student: loss margin_mse needs the pseudo_labels input")
        ex = margin_mse_examples(pseudo_labels.table())
        keys = None
        loss_fn = MarginMSELoss(similarity=p.similarity)
    else:
        if qrels is None:
            raise ValueError("train_student: loss mnrl needs the qrels input")
        ex = mnrl_examples(qrels.table(), negatives.table() if negatives is not None else None,
                           corpus_t.column("doc_id").to_pylist(), p.split, p.seed)
        cols = [c for c in ("q", "p", "n") if c in ex]
        keys = [frozenset((c, ex[c][i]) if c == "q" else ("d", ex[c][i]) for c in cols) for i in range(len(ex["q"]))]
        loss_fn = MultipleNegativesRankingLoss(similarity=p.similarity, scale=p.mnrl_scale)

    qtext = query_texts(queries.table(), set(ex["q"]))
    dtext = doc_texts(corpus_t, set(ex["p"]) | set(ex.get("n", [])))
    n_ex = len(ex["q"])
    keep = [i for i in range(n_ex) if ex["q"][i] in qtext and ex["p"][i] in dtext and
            ("n" not in ex or ex["n"][i] in dtext)]
    if len(keep) < n_ex:
        log.warning("train_student: %d example(s) refer to unknown queries/passages and are dropped", n_ex - len(keep))
        ex = {k: ([v[i] for i in keep] if isinstance(v, list) else v[keep]) for k, v in ex.items()}
        keys = [keys[i] for i in keep] if keys is not None else None
    if not ex["q"]:
        raise DataError("no training examples")

    device = rt.device
    seed_everything(p.seed)
    model = load_sentence_transformer(base_model.path, device, p.max_seq_length)
    plan = BatchPlan(len(ex["q"]), p.batch_size, p.seed, keys)

    def compute_loss(idx: list[int]):
        q = _embed(model, [qtext[ex["q"][i]] for i in idx], device)
        pos = _embed(model, [dtext[ex["p"][i]] for i in idx], device)
        if p.loss == "margin_mse":
            n = _embed(model, [dtext[ex["n"][i]] for i in idx], device)
            return loss_fn.from_embeddings(q, pos, n, torch.from_numpy(ex["margin"][idx]).to(device))
        n = _embed(model, [dtext[ex["n"][i]] for i in idx], device) if "n" in ex else None
        return loss_fn.from_embeddings(q, pos, n)

    log.info("train_student: %s/%s on %d examples, %d steps of %d (%s, %s)", p.loss, p.similarity, len(ex["q"]),
             plan.total_steps(p), p.batch_size, device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, p.warmup_steps, rt, f"train_student[{p.loss}]")
    out = Path(rt.workdir) / "student"
    model.eval()
    model.save(str(out), create_model_card=False)
    (out / "irflow_training.json").write_text(json.dumps(
        {"loss": p.loss, "similarity": p.similarity, "examples": len(ex["q"]), "steps": len(history),
         "history": history}, indent=1))
    return out
