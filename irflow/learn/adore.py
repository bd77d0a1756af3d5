"""ADORE (Zhan et al., SIGIR 2021): a query encoder trained against fixed document embeddings. No refs, no
store: query texts, positives and an embedding matrix in, a saved asymmetric model out.

Each step the current query encoder embeds the batch's queries; those embeddings (detached) search the
whole embedding matrix exactly (inner product; ``cos``: both sides unit length). A query's candidates are
its judged positives and the first ``negatives_per_query`` passages of its top ``depth`` that are not
judged positive for it (in any split), each at its rank in that ranking; ``irflow.learn.losses.LambdaLoss``
scores them with the same embeddings, so the hard negatives are always the current model's own and only
the query encoder learns. The documents are never re-encoded: a step costs one matrix product over the
corpus, not an index refresh (ANCE's cost). The matrix is held whole on the training device.

The result is a sentence-transformers folder whose one module is a ``Router``: the trained query encoder
on the ``query`` route, the document encoder (the model that made the embeddings) unchanged on the
``document`` route. ``SentenceTransformer(DIR).encode_query`` / ``encode_document`` use them, and
``irflow.learn.encoding.encode_texts`` picks the route by the side it encodes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.learn.encoding import asymmetric
from irflow.learn.training import TRAINING_LOG, LoopParams

log = logging.getLogger("irflow.train")


class TrainQueryEncoderParams(LoopParams):
    """How ADORE trains a query encoder against fixed document embeddings."""

    similarity: Literal["cos", "dot"] = Field("cos", description="the embeddings' similarity, as they were encoded "
                                                                 "(cos: unit length) and as they are searched")
    scale: float | None = Field(None, gt=0, description="score scale inside LambdaLoss's RankNet (null: 20 for cos, "
                                                        "1 for dot)")
    batch_size: PositiveInt = Field(32, description="queries per step (ADORE: 32)")
    depth: PositiveInt = Field(200, description="at each step, each query's top n of the current query encoder's "
                                                "ranking over the fixed embeddings (ADORE: 200)")
    negatives_per_query: PositiveInt | None = Field(
        None, description="the first n passages of that top `depth` not judged positive are the query's hard "
                          "negatives (null: all of them, as ADORE)")
    positives_per_query: PositiveInt | None = Field(
        None, description="keep at most this many of each query's judged positives as its relevant candidates (a "
                          "seeded sample; null: all, as ADORE). The loss weighs every (positive, negative) pair: "
                          "NFCorpus's broad queries have hundreds of positives; the others stay out of its "
                          "negatives")
    positives_beyond_depth: Literal["keep", "drop"] = Field(
        "drop", description="a positive the current ranking leaves out of its top `depth`: drop it for that step "
                            "(it is never a negative either), or keep it a candidate (keep: as ADORE's paper). Where "
                            "most positives start beyond the depth, each of their pairs ranks them below every "
                            "negative and the loss falls by pulling the scores together: on NFCorpus keep lost "
                            "nDCG@10 on ADORE's own training queries where drop gained (bench/results/adore_fit_"
                            "nfcorpus.json); on SciFact (few beyond) the two were level")
    splits: tuple[str, ...] = Field(("train",), min_length=1, description="the qrels splits whose judged queries "
                                                                          "are trained on, with their positives")
    query_max_length: PositiveInt = Field(64, description="tokens per query (ADORE: 64)")
    warmup_ratio: float = Field(0.1, ge=0, le=1, description="linear warm-up over this share of the steps, then "
                                                             "linear decay to 0")

    @model_validator(mode="after")
    def _negatives(self):
        if self.negatives_per_query is not None and self.negatives_per_query > self.depth:
            raise ValueError(f"negatives_per_query: {self.negatives_per_query} is more than the top {self.depth} "
                             "(depth) they are taken from")
        return self


@dataclass
class Job:
    """What one ADORE training needs (in this process: the matrix is not serialised)."""

    model_path: str  # the query encoder's start
    document_model_path: str  # the model that made `doc_emb`: saved unchanged on the document route
    out_dir: str
    params: dict  # TrainQueryEncoderParams.model_dump()
    queries: list[str]  # query i's text ...
    positives: list[dict[int, float]]  # ... its judged positives: matrix row -> relevance grade ...
    excluded: list[set[int]] = field(default_factory=list)  # ... rows never its negatives (judged in any split)
    doc_emb: np.ndarray | None = None  # (passages, dim) float32: the fixed document embeddings


@dataclass
class Candidates:
    """A batch's candidates: (B, m) matrix rows, relevance grades, ranks in the current ranking, and
    ``valid`` (False: padding); ``negatives``: each query's hard-negative rows, best ranked first."""

    rows: "object"
    labels: "object"
    ranks: "object"
    valid: "object"
    negatives: list[list[int]]
    beyond: float = 0.0  # the share of the batch's positives the ranking leaves out of its top `depth`


def embedding_matrix(table: pa.Table) -> np.ndarray:
    """An ``embeddings`` table's vectors as a (rows, dim) float32 matrix, in table order."""
    col = table.column("embedding").combine_chunks()
    flat = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(len(col), -1)


def candidates(q, docs, positives: list[dict[int, float]], excluded: list[set[int]], depth: int,
               negatives: int | None, beyond_depth: str = "drop") -> Candidates:
    """Each query's candidates from the ranking of ``docs`` (N, d) by ``q`` (B, d) (inner products, exact):
    its positives (``beyond_depth`` drop: only those in its top ``depth``) and the first ``negatives`` rows of
    its top ``depth`` that are neither positives nor ``excluded``. A rank is 1 + the number of passages that
    score strictly higher."""
    import torch

    # fp32 whatever the step's autocast: bf16 scores tie passages and blur the ranks the weights read
    with torch.autocast(device_type=q.device.type, enabled=False):
        scores = q.float() @ docs.float().T
    top = scores.topk(min(depth, docs.shape[0]), dim=1).indices.tolist()
    rows, labels, negs = [], [], []
    n_pos = n_beyond = 0
    for i, pos in enumerate(positives):
        skip = set(pos) | excluded[i]
        within = set(top[i])
        n_pos += len(pos)
        n_beyond += sum(r not in within for r in pos)
        if beyond_depth == "drop":
            pos = {r: g for r, g in pos.items() if r in within}
        n = [r for r in top[i] if r not in skip][:negatives]
        negs.append(n)
        rows.append(list(pos) + n)
        labels.append([float(pos[r]) for r in pos] + [0.0] * len(n))
    m = max(1, max(len(r) for r in rows))
    device = scores.device
    row_t = torch.zeros(len(rows), m, dtype=torch.long, device=device)
    label_t = torch.zeros(len(rows), m, device=device)
    valid = torch.zeros(len(rows), m, dtype=torch.bool, device=device)
    for i, (r, y) in enumerate(zip(rows, labels)):
        row_t[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        label_t[i, :len(r)] = torch.tensor(y)
        valid[i, :len(r)] = True
    own = scores.gather(1, row_t)
    ascending = scores.sort(dim=1).values.contiguous()
    ranks = (1 + scores.shape[1] - torch.searchsorted(ascending, own.contiguous(), right=True)).float()
    return Candidates(row_t, label_t, ranks, valid, negs, n_beyond / max(1, n_pos))


BEYOND_WARN = 0.5  # most positives beyond the depth: NFCorpus's case, not SciFact's (bench/results/adore_fit_*.json)


def beyond_depth_warning(history: list[dict], keep: bool, depth: int) -> str | None:
    """The warning for an ADORE training whose first steps (a tenth, at least one) found most positives
    beyond the ranking's top ``depth`` while ``keep`` kept them as candidates; None otherwise."""
    head = [h["beyond"] for h in history[:max(1, len(history) // 10)] if h.get("beyond") is not None]
    share = sum(head) / len(head) if head else 0.0
    if not keep or share < BEYOND_WARN:
        return None
    return (f"{share:.0%} of the positives of ADORE's first steps lay beyond the top {depth} of the ranking it "
            "started from, so each of their pairs ranks them below every hard negative, and the loss can fall "
            "by pulling the scores together instead of ranking better (on NFCorpus ADORE then lost on its own "
            "training queries). positives_beyond_depth: drop trains on the positives within the depth "
            "(measured in docs/recipes/star.md)")


def route_modules(st, task: str) -> list:
    """The modules that encode ``task``'s side: an asymmetric model's route, or every module of another."""
    return list(st[0].sub_modules[task]) if asymmetric(st) else list(st.children())


def _router():
    try:  # sentence-transformers >= 6
        from sentence_transformers.base.modules import Router
    except ImportError:
        from sentence_transformers.models import Router
    return Router


def train(job: Job, rt) -> list[dict]:
    """Train the query encoder on ``rt`` (a ``StageRuntime``) and save the asymmetric model to
    ``job.out_dir``. Returns the loss history."""
    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from irflow.learn.losses import LambdaLoss
    from irflow.learn.training import BatchPlan, seed_everything, train_loop

    p = TrainQueryEncoderParams(**job.params)
    device = rt.device
    seed_everything(p.seed)
    start = SentenceTransformer(job.model_path, device=device)
    model = start if not asymmetric(start) else SentenceTransformer(modules=route_modules(start, "query"),
                                                                    device=device)
    saved_length = model.max_seq_length
    docs = torch.from_numpy(np.array(job.doc_emb, dtype=np.float32)).to(device)  # a writable copy
    loss_fn = LambdaLoss(similarity=p.similarity, scale=p.scale)
    plan = BatchPlan(len(job.queries), p.batch_size, p.seed)
    last: dict = {}

    def embed(texts: list[str]):
        model.max_seq_length = p.query_max_length
        f = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
        f = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in f.items()}
        return model(f)["sentence_embedding"]

    def compute_loss(idx):
        q = embed([job.queries[i] for i in idx]).float()
        with torch.no_grad():
            search = F.normalize(q, dim=-1) if p.similarity == "cos" else q
            c = candidates(search.detach(), docs, [job.positives[i] for i in idx], [job.excluded[i] for i in idx],
                           p.depth, p.negatives_per_query, p.positives_beyond_depth)
            first = torch.where(c.valid & (c.labels > 0), c.ranks, torch.full_like(c.ranks, float("inf"))).min(1)
            last.update(candidates=int(c.valid.sum(1).max()), beyond=c.beyond,
                        mrr10=float(torch.where(first.values <= 10, 1.0 / first.values, 0.0).mean()))
        return loss_fn.from_embeddings(q, docs[c.rows], c.labels, c.ranks, c.valid)

    total = plan.total_steps(p)
    log.info("train_query_encoder: ADORE on %d queries against %d fixed passages, %d steps of %d (top %d, %s, %s)",
             len(job.queries), docs.shape[0], total, p.batch_size, p.depth, device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, int(round(p.warmup_ratio * total)), rt,
                         "train_query_encoder[adore]", step_info=lambda: {"candidates": last["candidates"],
                                                                         "mrr@10": last["mrr10"],
                                                                         "beyond": last["beyond"]})
    warning = beyond_depth_warning(history, p.positives_beyond_depth == "keep", p.depth)
    if warning:
        log.warning("train_query_encoder: %s", warning)
    model.max_seq_length = saved_length
    model.eval()
    model.to("cpu")
    document = SentenceTransformer(job.document_model_path, device="cpu")
    router = _router().for_query_document(query_modules=route_modules(model, "query"),
                                          document_modules=route_modules(document, "document"))
    both = SentenceTransformer(modules=[router], device="cpu",
                               similarity_fn_name="dot" if p.similarity == "dot" else "cosine")
    out = Path(job.out_dir)
    both.save(str(out), create_model_card=False)
    (out / TRAINING_LOG).write_text(json.dumps(
        {"loss": "lambdaloss", "examples": len(job.queries), "processes": 1, "global_batch": p.batch_size,
         "steps": len(history), "history": history}, indent=1))
    return history
