"""Train a bi-encoder student: Margin-MSE on pseudo labels (GPL), listwise KL on the same pseudo labels
grouped per query, or MNRL on (query, positive) pairs (QGen), optionally with Contriever's MoCo
(``moco.enabled``: a momentum key encoder embeds the passages and a queue of earlier batches' keys adds
negatives; ``irflow.learn.moco``), or, for Margin-MSE, with TAS-B's batches and second teacher (``tas.enabled``;
``irflow.learn.tas``): topic-aware batches from k-means clusters of the training queries, balanced margin
sampling of each query's pairs, and (with the ``inbatch_teacher`` input) an in-batch Margin-MSE against a
bi-encoder teacher's scores added to the pairwise one.

The loop, optimizer, schedule, precision and checkpoints are ``irflow.learn.training``'s; the losses are
``irflow.learn.losses``'s. For MNRL no two examples in a batch share a query or a passage (in-batch
negatives must be negatives). Passages are BEIR's ``title + " " + text``. The model is saved with
``SentenceTransformer.save`` so ``SentenceTransformer(path)`` loads it.

With ``runtime.train_processes: N`` (not keyed) the same training runs in N torchrun processes
(``irflow.engine.distributed``; one per GPU on CUDA): each embeds ``batch_size / N`` examples of every batch
and gradients are averaged, so the steps are those of one process with the whole batch (Margin-MSE and
the listwise KL are means over examples; MNRL gathers every process's passages, so each query still
sees the whole batch's in-batch negatives). ``batch_size`` must be divisible by N.

With ``candidates_every: n`` the student is also kept every n steps before its last (in the model's
``checkpoints/step-<k>``, which an export leaves out); ``checkpoint_student`` makes one of them a model of its
own, so that a recipe evaluates it beside the final student and its selection can ship an earlier one (early
stopping by the run's evaluation, each candidate counted in Holm's adjustment).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt, field_validator, model_validator

from irflow.engine import distributed
from irflow.engine.errors import DataError
from irflow.engine.params import KEYED_WHEN_SET, Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.generation import crop_queries
from irflow.learn.losses import (
    CrossBatchInfoNCE,
    InBatchMarginMSELoss,
    ListwiseDistillationLoss,
    MarginMSELoss,
    gather_ids,
)
from irflow.learn.moco import MoCo
from irflow.learn.qrels import group, judged_positives, positive_pairs
from irflow.learn.sampling import sample
from irflow.learn.scoring import least_squares_scale
from irflow.learn.tas import TASPlan, default_clusters, kmeans_clusters
from irflow.learn.text import doc_texts, query_texts
from irflow.learn.training import TRAINING_LOG, BatchPlan, LoopParams, seed_everything, train_loop, training_losses

log = logging.getLogger("irflow.train")


class MoCoParams(Params):
    """Contriever's MoCo for the mnrl loss (Izacard et al., 2022; ``irflow.learn.moco``)."""

    enabled: bool = Field(False, description="mnrl: the passages are embedded by a momentum key encoder (an "
                                             "exponential moving average of the trained encoder, no gradient) "
                                             "and a queue of earlier batches' passage embeddings adds "
                                             "negatives (Contriever); the saved model is the trained encoder. "
                                             "Other losses ignore it (in GPL it trains the QGen student only)")
    queue_size: PositiveInt = Field(4096, description="passage embeddings of earlier batches kept as extra "
                                                      "negatives (FIFO); a multiple of batch_size (Contriever: "
                                                      "65536)")
    momentum: float = Field(0.999, gt=0, lt=1, description="m in theta_k <- m * theta_k + (1 - m) * theta_q after "
                                                           "each step; closer to 1: a slower key encoder (Contriever: "
                                                           "0.999)")
    temperature: float | None = Field(None, gt=0, description="tau: scores are similarity / tau before the softmax "
                                                              "(null: 1 / the mnrl scale -- 0.05 for cos, "
                                                              "Contriever's; 1 for dot)")


class TASParams(Params):
    """TAS-B for the margin_mse loss (Hofstätter et al., SIGIR 2021; ``irflow.learn.tas``)."""

    enabled: bool = Field(False, description="margin_mse: TAS-B's batches -- the training queries are clustered "
                                             "(k-means on the starting model's query embeddings, once before "
                                             "training), each batch is drawn from clusters_per_batch clusters, "
                                             "and each query's pair is drawn by balanced margin sampling; with "
                                             "an in-batch teacher (GPL: train.tas.teacher) its in-batch "
                                             "Margin-MSE is added to the pairwise one. Needs loss margin_mse")
    clusters: PositiveInt | None = Field(None, description="k of the k-means over the training queries (null: "
                                                           "max(2, queries // 200): about TAS-B's ratio, 2000 "
                                                           "clusters of MS MARCO's some 0.4-0.5M training queries)")
    clusters_per_batch: PositiveInt = Field(1, description="n: clusters each batch is drawn from, batch_size / n "
                                                           "rows from each; must divide batch_size (TAS-B: 1)")
    margin_bins: PositiveInt = Field(10, description="h: each query's pairs are cut into h equal-width bins of "
                                                     "their teacher margin; a draw picks a non-empty bin "
                                                     "uniformly, then a pair in it (1: a uniform draw over the "
                                                     "query's pairs; TAS-B: 10)")
    seed: int | None = Field(None, description="seed of the k-means and of the batches (null: the training seed)")
    kmeans_iterations: PositiveInt = Field(20, description="k-means iterations (faiss)")
    teacher_similarity: Literal["cos", "dot"] = Field(
        "cos", description="the in-batch teacher's similarity (a bi-encoder; MiniLM: cos)")
    teacher_scale: Literal["auto"] | float = Field(
        "auto", description="factor on the in-batch teacher's margins before the MSE (auto: the least-squares "
                            "factor from its margins on the training rows to their pseudo-label margins, so "
                            "both losses regress on margins in the same units)")

    @field_validator("teacher_scale")
    @classmethod
    def _scale(cls, v):
        if v != "auto" and not v > 0:
            raise ValueError(f"auto or a positive factor, got {v}")
        return v


class TrainStudentParams(LoopParams):
    loss: Literal["margin_mse", "listwise_kl", "mnrl"] = Field(
        "margin_mse", description="margin_mse: match the teacher's margins, one (query, positive, negative) "
                                  "triple an example (GPL); listwise_kl: match the teacher's softmax over a "
                                  "query's positive and all its negatives, one query an example (the same "
                                  "pseudo labels; RocketQAv2's distillation with the teacher frozen); mnrl: "
                                  "in-batch negatives on (query, positive) pairs (QGen)")
    similarity: Literal["cos", "dot"] = Field("dot", description="the student's similarity (GPL's student: dot)")
    batch_size: PositiveInt = Field(32, description="examples per step (listwise_kl: queries, each with its "
                                                    "positive and every negative)")
    max_seq_length: PositiveInt = Field(350, description="tokens per text")
    warmup_steps: int = Field(1000, ge=0, description="linear warm-up steps, then linear decay to 0")
    split: str = Field("generated", min_length=1, description="mnrl: the qrels split of the (query, positive) pairs")
    mnrl_scale: float | None = Field(None, gt=0, description="mnrl: similarity scale before the softmax (null: 20 "
                                                             "for cos, 1 for dot)")
    # added after stores were made: not in the key while it holds its default, so existing students stay cached
    listwise_scale: Annotated[float, KEYED_WHEN_SET] = Field(
        20.0, gt=0, description="listwise_kl: the factor on both the student's similarities and the teacher's "
                                "scores (already in the student's units, pseudo_label's scale) before each "
                                "softmax; larger is sharper")
    crop_positives: Annotated[tuple[float, float] | None, KEYED_WHEN_SET] = Field(
        None, description="mnrl: each pair's positive is a random span of its passage, this fraction range of its "
                          "words (Contriever's independent cropping: [0.1, 0.5]), drawn once per pair from seed, "
                          "query and passage; null: the whole passage")
    candidates_every: Annotated[int, KEYED_WHEN_SET] = Field(
        0, ge=0, description="keep the student every n steps before its last as a candidate model of its own, "
                             "evaluated beside the final student (GPL's and Contriever's student): the selection "
                             "may ship an earlier one (early stopping by the run's evaluation; every candidate "
                             "counts in its Holm adjustment). Needs `steps`. 0: the final student only")
    moco: MoCoParams = Field(MoCoParams(), description="Contriever's MoCo for loss mnrl: momentum key encoder and "
                                                       "queue of negatives (keyed only when enabled with loss mnrl)")
    tas: TASParams = Field(TASParams(), description="TAS-B for loss margin_mse: topic-aware batches, balanced "
                                                    "margin sampling, in-batch teacher (keyed only when enabled)")

    @model_validator(mode="after")
    def _tas(self):
        t = self.tas
        if not t.enabled:
            return self
        if self.loss != "margin_mse":
            raise ValueError(f"tas.enabled: TAS-B samples (query, positive, negative) rows for Margin-MSE: "
                             f"loss margin_mse, not {self.loss}")
        if self.batch_size % t.clusters_per_batch:
            raise ValueError(f"tas.clusters_per_batch: {t.clusters_per_batch} does not divide batch_size "
                             f"{self.batch_size} (each cluster gives batch_size / clusters_per_batch rows)")
        if t.clusters is not None and t.clusters_per_batch > t.clusters:
            raise ValueError(f"tas.clusters_per_batch: {t.clusters_per_batch} is more than the {t.clusters} "
                             f"clusters (tas.clusters)")
        return self

    @model_validator(mode="after")
    def _crop_positives(self):
        if self.crop_positives is None:
            return self
        lo, hi = self.crop_positives
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_positives: [{lo}, {hi}] is not a range of fractions 0 < low <= high <= 1")
        if self.loss != "mnrl":
            raise ValueError(f"crop_positives: crops the positives of (query, positive) pairs: loss mnrl, not "
                             f"{self.loss}")
        return self

    @model_validator(mode="after")
    def _moco(self):
        # checked whatever the loss: GPL's train section (loss margin_mse) hands its moco to the QGen student
        if self.moco.enabled and self.moco.queue_size % self.batch_size:
            raise ValueError(f"moco.queue_size: {self.moco.queue_size} is not a multiple of batch_size "
                             f"{self.batch_size}: the queue holds whole batches")
        return self

    @model_validator(mode="after")
    def _candidates(self):
        if self.candidates_every and self.steps is None:
            raise ValueError("candidates_every: the candidates are steps before the last, so it needs `steps` (with "
                             "`epochs` the number of steps is known only from the data)")
        return self

    @property
    def candidate_steps(self) -> list[int]:
        """The steps whose student is kept as a candidate (``candidates_every``), before the last."""
        return list(range(self.candidates_every, self.steps, self.candidates_every)) if self.candidates_every else []

    @property
    def uses_moco(self) -> bool:
        return self.moco.enabled and self.loss == "mnrl"

    def key_dump(self) -> dict:
        """The key leaves ``moco`` out unless MoCo runs (enabled, loss mnrl), and ``tas`` unless TAS-B runs:
        keys made before they existed stay, and a GPL student (margin_mse) is not recomputed when train.moco
        is set for the QGen one."""
        dumped = super().key_dump()
        if not self.uses_moco:
            dumped.pop("moco")
        if not self.tas.enabled:
            dumped.pop("tas")
        return dumped


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


def listwise_examples(pseudo_labels: pa.Table) -> dict:
    """One example per (query, positive) of the pseudo labels: the positive, its negatives (in the
    table's order) and the teacher's scores relative to the positive, [0, -margin_1, -margin_2, ...]
    (a softmax does not see a shift, so these are the teacher's scores, and the list carries exactly the
    margins Margin-MSE reads as triples, even where a table gives one positive several scores)."""
    t = pseudo_labels
    groups: dict[tuple[str, str], dict] = {}
    for q, p, n, m in zip(*(t.column(c).to_pylist() for c in ("query_id", "pos_doc_id", "neg_doc_id", "margin"))):
        g = groups.setdefault((q, p), {"negs": [], "scores": [0.0]})
        g["negs"].append(n)
        g["scores"].append(-m)
    keys = sorted(groups)
    return {"q": [q for q, _ in keys], "p": [p for _, p in keys], "negs": [groups[k]["negs"] for k in keys],
            "scores": [groups[k]["scores"] for k in keys]}


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


def positive_texts(ex: dict, dtext: dict[str, str], crop: tuple[float, float] | None, seed: int) -> list[str]:
    """Each pair's positive text: its passage, or with ``crop`` a random span of it (Contriever's independent
    cropping: the span is drawn from the pair, not the passage alone, so it is not the query's own crop)."""
    if crop is None:
        return [dtext[d] for d in ex["p"]]
    out = []
    for q, d in zip(ex["q"], ex["p"]):
        span = crop_queries(f"{q}>{d}", dtext[d], 1, seed, ratio=crop)
        out.append(span[0] if span else dtext[d])
    return out


def _check_student(path: Path) -> None:
    for f in ("modules.json", "config.json"):
        if not (Path(path) / f).exists():
            raise RuntimeError(f"{path}: not a sentence-transformers model (no {f})")


CANDIDATES = "checkpoints"  # in a student's folder: the students kept every candidates_every steps, step-<k>



# version 3: also the loss history as a dataset (training_losses)
@stage("train_student", version="3", outputs=[Output("student", kind="model", check=_check_student),
                                              Output("training_losses", "training_losses")],
       work="train", resumable=True)
def train_student(p: TrainStudentParams, rt: StageRuntime, *, queries: DatasetRef, corpus: DatasetRef,
                  base_model: DatasetRef, pseudo_labels: DatasetRef | None = None, qrels: DatasetRef | None = None,
                  negatives: DatasetRef | None = None, inbatch_teacher: DatasetRef | None = None) -> dict:
    """A student trained from ``base_model``: on ``pseudo_labels`` (loss margin_mse) or on ``qrels``
    [+ ``negatives``] (loss mnrl); and its loss per step (``training_losses``). ``inbatch_teacher`` (with
    ``tas.enabled``): the bi-encoder whose scores of the in-batch pairs TAS-B's in-batch Margin-MSE reads."""
    if inbatch_teacher is not None and not p.tas.enabled:
        raise ValueError("train_student: the inbatch_teacher input is TAS-B's second teacher; set tas.enabled")
    corpus_t = corpus.table()
    if p.loss == "margin_mse":
        if pseudo_labels is None:
            raise ValueError("train_student: loss margin_mse needs the pseudo_labels input")
        ex = margin_mse_examples(pseudo_labels.table())
    elif p.loss == "listwise_kl":
        if pseudo_labels is None:
            raise ValueError("train_student: loss listwise_kl needs the pseudo_labels input")
        ex = listwise_examples(pseudo_labels.table())
    else:
        if qrels is None:
            raise ValueError("train_student: loss mnrl needs the qrels input")
        ex = mnrl_examples(qrels.table(), negatives.table() if negatives is not None else None,
                           corpus_t.column("doc_id").to_pylist(), p.split, p.seed)

    qtext = query_texts(queries.table(), set(ex["q"]))
    listed = {d for negs in ex.get("negs", []) for d in negs}
    dtext = doc_texts(corpus_t, set(ex["p"]) | set(ex.get("n", [])) | listed)
    n_ex = len(ex["q"])
    keep = [i for i in range(n_ex) if ex["q"][i] in qtext and ex["p"][i] in dtext and
            ("n" not in ex or ex["n"][i] in dtext) and
            ("negs" not in ex or all(d in dtext for d in ex["negs"][i]))]
    if len(keep) < n_ex:
        log.warning("train_student: %d example(s) refer to unknown queries/passages and are dropped", n_ex - len(keep))
        ex = {k: ([v[i] for i in keep] if isinstance(v, list) else v[keep]) for k, v in ex.items()}
    if not ex["q"]:
        raise DataError("no training examples")

    distributed.check_split(p.batch_size, rt.train_processes)
    out = Path(rt.workdir) / "student"
    job = {"ex": {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in ex.items()}, "qtext": qtext,
           "dtext": dtext, "base_model": base_model.path, "out": str(out), "params": p.model_dump(mode="json")}
    if p.tas.enabled:
        job["tas"] = tas_setup(p, rt, ex, qtext, dtext, base_model.path,
                               inbatch_teacher.path if inbatch_teacher is not None else None)
    distributed.run(fit_and_save, job, rt, rt.train_processes)
    return {"student": out, "training_losses": training_losses(out)}


class CheckpointParams(Params):
    step: PositiveInt = Field(description="the training step whose student to take (a multiple of the "
                                          "trainer's candidates_every, before its last step)")


@stage("checkpoint_student", version="1", outputs=Output("student", kind="model", check=_check_student))
def checkpoint_student(p: CheckpointParams, rt: StageRuntime, *, student: DatasetRef) -> dict:
    """The ``student`` as it was after ``step`` steps (kept by ``candidates_every``): a model of its own."""
    kept = Path(student.path) / CANDIDATES
    src = kept / f"step-{p.step}"
    if not src.is_dir():
        have = sorted(d.name for d in kept.iterdir()) if kept.is_dir() else []
        raise DataError(f"checkpoint_student: the student kept no step {p.step} (kept: {have or 'none'}; "
                        f"train_student keeps every candidates_every steps)")
    out = Path(rt.workdir) / "student"
    shutil.copytree(src, out, copy_function=_link_or_copy)  # both immutable: one copy of the weights on disk
    return {"student": out}


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link to ``src`` where the file system allows one (the same store), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ---- TAS-B --------------------------------------------------------------------------------------------
TAS_CLUSTERS = "tas_clusters.json"  # in the resume dir: a resumed training draws the same batches


def _free_gpu_cache(device: str) -> None:
    """After a model used before training is dropped: its GPU memory goes back before the student loads."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def tas_setup(p: TrainStudentParams, rt: StageRuntime, ex: dict, qtext: dict, dtext: dict, base_model: str,
              teacher: str | None) -> dict:
    """What TAS-B needs before training, computed once (not per torchrun process), JSON for the job:
    each training query's cluster (k-means on ``base_model``'s embeddings of the queries, kept in the resume
    dir) and, with an in-batch ``teacher``, its embeddings of every training query and passage (``.npy``
    files in the workdir, rows in sorted id order) and the factor on its margins."""
    from irflow.learn.encoding import encode_texts, load_sentence_transformer

    t = p.tas
    seed = p.seed if t.seed is None else t.seed
    qids = sorted(set(ex["q"]))
    k = t.clusters or default_clusters(len(qids))
    if k > len(qids):
        raise DataError(f"tas.clusters: {k} clusters for {len(qids)} training queries (at most one per query)")
    saved = Path(rt.resume_dir) / TAS_CLUSTERS if rt.resume_dir else None
    if saved is not None and saved.exists():
        cluster = json.loads(saved.read_text())
    else:
        model = load_sentence_transformer(base_model, rt.device, p.max_seq_length)
        emb = encode_texts(model, [qtext[q] for q in qids], 64, normalize=True, desc="tas: queries")
        del model
        _free_gpu_cache(rt.device)
        cluster = dict(zip(qids, kmeans_clusters(emb, k, seed, t.kmeans_iterations).tolist()))
        if saved is not None:
            saved.write_text(json.dumps(cluster))
    TASPlan(ex["q"], ex["margin"], cluster, p.batch_size, t.clusters_per_batch, t.margin_bins, seed)  # refuses no batch
    sizes = np.bincount(list(cluster.values()), minlength=k)
    out = {"cluster": cluster, "clusters": k, "seed": seed,
           "cluster_sizes": {"min": int(sizes.min()), "median": float(np.median(sizes)), "max": int(sizes.max()),
                             "empty": int((sizes == 0).sum())}}
    log.info("train_student: TAS-B: %d training queries in %d clusters (sizes %s)", len(qids), k,
             out["cluster_sizes"])
    if teacher is None:
        return out

    model = load_sentence_transformer(teacher, rt.device)
    normalize = t.teacher_similarity == "cos"
    all_q, all_d = sorted(qtext), sorted(dtext)
    qe = encode_texts(model, [qtext[q] for q in all_q], 64, normalize=normalize, desc="tas: teacher queries")
    de = encode_texts(model, [dtext[d] for d in all_d], 64, normalize=normalize, desc="tas: teacher passages")
    del model
    _free_gpu_cache(rt.device)
    paths = {"teacher_q": str(Path(rt.workdir) / "tas_teacher_queries.npy"),
             "teacher_d": str(Path(rt.workdir) / "tas_teacher_passages.npy")}
    np.save(paths["teacher_q"], qe)
    np.save(paths["teacher_d"], de)
    qi, di = {q: i for i, q in enumerate(all_q)}, {d: i for i, d in enumerate(all_d)}
    q_rows = qe[[qi[q] for q in ex["q"]]]
    margins = ((q_rows * de[[di[d] for d in ex["p"]]]).sum(1) - (q_rows * de[[di[d] for d in ex["n"]]]).sum(1))
    scale = least_squares_scale(margins, np.asarray(ex["margin"])) if t.teacher_scale == "auto" else float(t.teacher_scale)
    log.info("train_student: TAS-B in-batch teacher (%s), its margins x %.4g", t.teacher_similarity, scale)
    return {**out, **paths, "teacher_scale": scale}


class InBatchTeacher:
    """The in-batch teacher's margins t(q_i, p_i) - t(q_i, d_j) of a batch, from its embeddings (computed
    once, ``tas_setup``), already scaled: (B, 2 W B) over every process's positives then negatives."""

    def __init__(self, tas: dict, ex: dict, qtext: dict, dtext: dict):
        self.qe, self.de = np.load(tas["teacher_q"]), np.load(tas["teacher_d"])
        qi, di = {q: i for i, q in enumerate(sorted(qtext))}, {d: i for i, d in enumerate(sorted(dtext))}
        self.q = np.array([qi[q] for q in ex["q"]])
        self.p = np.array([di[d] for d in ex["p"]])
        self.n = np.array([di[d] for d in ex["n"]])
        self.scale = float(tas["teacher_scale"])

    def margins(self, share: list[int], batch: list[int]) -> np.ndarray:
        q = self.qe[self.q[share]]
        cands = self.de[np.concatenate([self.p[batch], self.n[batch]])]
        pos = (q * self.de[self.p[share]]).sum(1)
        return (self.scale * (pos[:, None] - q @ cands.T)).astype(np.float32)


def fit_and_save(job: dict, rt: StageRuntime) -> None:
    """What each training process runs (``irflow.engine.distributed.run``): the student trained on the job's
    examples; rank 0 saves it and the training log to ``job["out"]``."""
    import torch

    from irflow.learn.encoding import load_sentence_transformer

    p = TrainStudentParams(**job["params"])
    ex, qtext, dtext = job["ex"], job["qtext"], job["dtext"]
    loss_fn, keys = _loss(p, ex)
    margins = torch.tensor(ex["margin"], dtype=torch.float32) if p.loss == "margin_mse" else None
    device = rt.device
    seed_everything(p.seed)  # same initial weights in every process
    model = load_sentence_transformer(job["base_model"], device, p.max_seq_length)
    tas, inbatch, teacher = job.get("tas"), None, None
    if tas is not None:
        plan = TASPlan(ex["q"], ex["margin"], tas["cluster"], p.batch_size, p.tas.clusters_per_batch,
                       p.tas.margin_bins, tas["seed"])
        if "teacher_q" in tas:
            inbatch, teacher = InBatchMarginMSELoss(similarity=p.similarity), InBatchTeacher(tas, ex, qtext, dtext)
    else:
        plan = BatchPlan(len(ex["q"]), p.batch_size, p.seed, keys)
    moco = None
    if p.uses_moco:
        scale = p.mnrl_scale or (20.0 if p.similarity == "cos" else 1.0)
        moco = MoCo(model, p.moco.queue_size, p.moco.momentum, p.similarity, p.moco.temperature or 1.0 / scale)
        number = {d: k for k, d in enumerate(sorted(dtext))}  # passage numbers: the queue's ids

    positives = positive_texts(ex, dtext, p.crop_positives, p.seed) if p.loss == "mnrl" else None

    def moco_loss(idx: list[int], q):
        with torch.no_grad():
            k = _embed(moco.key_encoder, [positives[i] for i in idx], device)
            n = _embed(moco.key_encoder, [dtext[ex["n"][i]] for i in idx], device) if "n" in ex else None
        return moco.loss(q, k, torch.tensor([number[ex["p"][i]] for i in idx]), n)

    def compute_loss(idx: list[int]):
        q = _embed(model, [qtext[ex["q"][i]] for i in idx], device)
        if moco is not None:
            return moco_loss(idx, q)
        if p.loss == "mnrl":
            return mnrl_loss(idx, q)
        pos = _embed(model, [dtext[ex["p"][i]] for i in idx], device)
        if p.loss == "margin_mse":
            n = _embed(model, [dtext[ex["n"][i]] for i in idx], device)
            loss = loss_fn.from_embeddings(q, pos, n, margins[idx].to(device))
            if inbatch is not None:  # TAS-B's dual teacher: L = L_pair + L_inbatch
                batch = gather_ids(torch.tensor(idx, device=device)).tolist()  # every process's share, in order
                t = torch.from_numpy(teacher.margins(idx, batch)).to(device)
                loss = loss + inbatch.from_embeddings(q, pos, n, t)
            return loss
        if p.loss == "listwise_kl":
            # one forward pass for every negative of the batch
            negs = _embed(model, [dtext[d] for i in idx for d in ex["negs"][i]], device)
            return _listwise_loss(loss_fn, q, pos, negs, [len(ex["negs"][i]) for i in idx],
                                  [ex["scores"][i] for i in idx])
        raise AssertionError(p.loss)

    def mnrl_loss(idx: list[int], q):
        pos = _embed(model, [positives[i] for i in idx], device)
        n = _embed(model, [dtext[ex["n"][i]] for i in idx], device) if "n" in ex else None
        return loss_fn.from_embeddings(q, pos, n)

    rank, world = distributed.rank_and_world()
    if rank == 0:
        _say_start(p, len(ex["q"]), plan.total_steps(p), world, rt, moco is not None, tas, inbatch is not None)
    # sequences a step encodes per example: the query, the positive and the negative(s)
    texts = 2 + (max(map(len, ex["negs"]), default=0) if p.loss == "listwise_kl" else int("n" in ex))
    out = Path(job["out"])
    # the candidates are kept beside the resume checkpoint, so that a resumed training still has those it
    # kept before the crash; they join the model's folder at the end
    kept = (Path(rt.resume_dir) if rt.resume_dir else out) / CANDIDATES
    steps = set(p.candidate_steps)

    def keep(done: int) -> None:
        if done in steps:
            shutil.rmtree(kept / f"step-{done}", ignore_errors=True)
            model.save(str(kept / f"step-{done}"), create_model_card=False)

    if moco is None:
        history = train_loop(model, compute_loss, plan, p, p.warmup_steps, rt, f"train_student[{p.loss}]",
                             texts_per_example=texts, keep=keep if steps else None)
    else:  # the loop trains the query encoder inside MoCo; `model` is that encoder, saved below
        history = train_loop(moco, compute_loss, plan, p, p.warmup_steps, rt, f"train_student[{p.loss}]",
                             step_info=lambda: {"candidates": moco.loss_fn.last_candidates},
                             after_step=moco.momentum_update, keep=keep if steps else None)
    if rank > 0:
        return
    model.eval()
    model.save(str(out), create_model_card=False)
    if steps and kept != out / CANDIDATES:
        shutil.rmtree(out / CANDIDATES, ignore_errors=True)
        shutil.move(str(kept), str(out / CANDIDATES))
    (out / TRAINING_LOG).write_text(json.dumps(
        {"loss": p.loss, "similarity": p.similarity, "examples": len(ex["q"]), "processes": world,
         "steps": len(history), **({"moco": p.moco.model_dump()} if moco else {}),
         **({"tas": {**p.tas.model_dump(), "clusters": tas["clusters"], "seed": tas["seed"],
                     "cluster_sizes": tas["cluster_sizes"], "inbatch_teacher": inbatch is not None,
                     "teacher_scale": tas.get("teacher_scale")}} if tas else {}),
         "history": history}, indent=1))


def _listwise_loss(loss_fn, q, pos, negs, lengths: list[int], scores: list[list[float]]):
    """The mean over the batch of each query's KL on its list (its positive, then its ``lengths[row]``
    negatives, in ``negs`` one query after another): lists may differ in length, so each is taken on its own."""
    import torch

    losses, at = [], 0
    for row, k in enumerate(lengths):
        cands = torch.cat([pos[row:row + 1], negs[at:at + k]])
        at += k
        target = torch.tensor(scores[row], dtype=torch.float32, device=q.device)
        losses.append(loss_fn.from_embeddings(q[row:row + 1], cands.unsqueeze(0), target.unsqueeze(0)))
    return torch.stack(losses).mean()


def _loss(p: TrainStudentParams, ex: dict):
    """(the loss module, the examples' keys that must not share a batch: MNRL's in-batch negatives, else None)."""
    if p.loss == "margin_mse":
        return MarginMSELoss(similarity=p.similarity), None
    if p.loss == "listwise_kl":
        # the teacher's scores are in the student's similarity units (pseudo_label's scale), so one factor
        # serves both softmaxes: temperature = 1 / scale
        return ListwiseDistillationLoss(similarity=p.similarity, scale=p.listwise_scale,
                                        temperature=1.0 / p.listwise_scale), None
    cols = [c for c in ("q", "p", "n") if c in ex]
    keys = [frozenset((c, ex[c][i]) if c == "q" else ("d", ex[c][i]) for c in cols) for i in range(len(ex["q"]))]
    # MNRL that also scores the passages of the other processes' shares (MNRL itself in one process)
    return CrossBatchInfoNCE(similarity=p.similarity, scale=p.mnrl_scale), keys


def _say_start(p: TrainStudentParams, examples: int, steps: int, world: int, rt: StageRuntime, moco: bool,
               tas: dict | None, inbatch: bool) -> None:
    extra = f" with MoCo (queue {p.moco.queue_size}, momentum {p.moco.momentum})" if moco else ""
    if tas is not None:
        extra = (f" with TAS-B ({tas['clusters']} clusters, {p.tas.clusters_per_batch} a batch, "
                 f"{p.tas.margin_bins} margin bins{', in-batch teacher' if inbatch else ''})")
    log.info("train_student: %s/%s%s on %d examples, %d steps of %d on %d process(es) (%s, %s)", p.loss,
             p.similarity, extra, examples, steps, p.batch_size, world, rt.device, rt.precision)
    if p.moco.enabled and not moco:
        log.info("train_student: moco applies to loss mnrl only; %s trains without it", p.loss)
