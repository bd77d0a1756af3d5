"""Dual-encoder training in one process or many: InfoNCE with in-batch / cross-batch negatives,
GradCache, listwise distillation, or STAR's pairwise loss. No refs, no store: texts and examples in, a
saved model out.

``train(job, rt)`` is what each process runs: the stage calls it through ``irflow.engine.distributed.run``,
in this process or in torchrun workers (gloo on CPU, nccl on CUDA); every process trains on its share
of each global batch of ``processes x batch_size`` queries and rank 0 saves. Gradients are averaged
over processes after each backward (what DDP does), and the InfoNCE loss gathers every process's
passages (``irflow.learn.losses.CrossBatchInfoNCE``), so W processes of B queries take the same step as one
process with a batch of W * B -- with W times the memory.

How many processes: ``runtime.train_processes`` when it is above 1 (not keyed: the global batch is
split between them), else the keyed ``processes``. Both give the same step, since every query is
scored against the gathered passages of the whole global batch wherever its share was computed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from irflow.engine.params import KEYED_WHEN_SET
from irflow.learn.collapse import COSINE_PROBE, collapse_warning, mean_cosine
from irflow.learn.training import TRAINING_LOG, LoopParams

log = logging.getLogger("irflow.train")


class TrainDualEncoderParams(LoopParams):
    """How a dual encoder (bi-encoder) is trained on (query, positive[, negatives]) examples."""

    loss: Literal["infonce", "listwise_kl", "star"] = Field(
        "infonce", description="infonce: softmax over the positive, the other queries' passages and the hard "
                               "negatives (in-batch; cross-batch with processes > 1); listwise_kl: KL from a "
                               "frozen re-ranker's distribution over each query's candidate list (RocketQAv2); "
                               "star: RankNet on the hard negatives plus alpha x RankNet on the batch's other "
                               "passages (STAR, irflow.learn.losses.StarLoss)")
    alpha: Annotated[float, KEYED_WHEN_SET] = Field(
        0.1, gt=0, le=1, description="star: the weight of the random (in-batch) negatives' loss beside the hard "
                                     "negatives' (STAR: small, 0 < alpha << 1)")
    similarity: Literal["cos", "dot"] = Field("cos", description="cos (MiniLM's) or dot")
    scale: float | None = Field(None, gt=0, description="similarity scale before the softmax (null: 20 for cos, "
                                                        "1 for dot)")
    batch_size: PositiveInt = Field(32, description="queries per step, per process")
    processes: PositiveInt = Field(1, description="processes (torchrun) whose passages every query is scored "
                                                  "against: cross-batch negatives; the global batch is "
                                                  "processes x batch_size (runtime.train_processes, when "
                                                  "above 1, says how many processes compute it)")
    mini_batch: PositiveInt | None = Field(None, description="GradCache: embed at most this many texts at once "
                                                             "(null: the whole batch in one graph); same "
                                                             "gradients, bounded memory, so batch_size can be large")
    negatives_per_line: NonNegativeInt = Field(0, description="hard negatives on each training line, from the "
                                                               "negatives input (0: in-batch negatives only)")
    negative_lines: PositiveInt = Field(1, description="training lines per (query, positive), each with its own "
                                                       "negatives_per_line negatives (RocketQA: 4 lines of 1 "
                                                       "negative); lines of one query never share a batch")
    false_negatives: Annotated[Literal["keep", "mask"], KEYED_WHEN_SET] = Field(
        "keep", description="passages another line brings into the batch that this query's qrels judge relevant: "
                            "keep them as its negatives (DPR, RocketQA as published) or mask them out of its "
                            "softmax (infonce). Masking matters where queries share judged passages, as "
                            "NFCorpus's do far more often than SciFact's (docs/recipes/rocketqa.md)")
    positives_per_query: Annotated[PositiveInt | None, KEYED_WHEN_SET] = Field(
        None, description="keep at most this many of each query's judged positives as training pairs (a seeded "
                          "sample per query; null: every pair). The batches are a shuffle of the pairs, so a "
                          "query counts as often as it has positives: on NFCorpus 180 broad queries ('cancer': "
                          "1,363 positives) of 2,590 hold half the 110,575 pairs; 1 weighs every query alike")
    splits: tuple[str, ...] = Field(("train",), min_length=1, description="the qrels splits whose positives are "
                                                                          "the training pairs")
    query_max_length: PositiveInt = Field(64, description="tokens per query")
    passage_max_length: PositiveInt = Field(256, description="tokens per passage (also the saved model's limit)")
    warmup_ratio: float = Field(0.1, ge=0, le=1, description="linear warm-up over this share of the steps, "
                                                             "then linear decay to 0 (RocketQA: 10%)")
    list_size: PositiveInt = Field(8, description="listwise_kl: candidates per query, the positive included")
    temperature: float = Field(1.0, gt=0, description="listwise_kl: the re-ranker's softmax temperature "
                                                      "(RocketQAv2: 1)")

    @model_validator(mode="after")
    def _loss_fields(self):
        if self.loss == "listwise_kl":
            if self.processes > 1 or self.mini_batch:
                raise ValueError("processes / mini_batch: listwise_kl has no in-batch negatives to share; use "
                                 "them with infonce")
            if self.list_size < 2:
                raise ValueError("list_size: a list needs the positive and at least one other candidate")
            if self.negatives_per_line:
                raise ValueError("negatives_per_line: listwise_kl takes its candidates from the teacher's "
                                 "scores, not from negatives")
            if self.false_negatives == "mask":
                raise ValueError("false_negatives: mask applies to infonce's in-batch negatives; listwise_kl's "
                                 "lists hold no judged passage")
        if self.loss == "star" and self.negatives_per_line < 1:
            raise ValueError("negatives_per_line: star trains on static hard negatives: at least 1 per line")
        if self.loss != "star" and self.alpha != type(self).model_fields["alpha"].default:
            raise ValueError(f"alpha: weighs star's random negatives; loss is {self.loss}")
        if self.negative_lines > 1 and self.negatives_per_line == 0:
            raise ValueError("negative_lines: more than one line per positive needs negatives_per_line >= 1")
        return self


@dataclass
class Job:
    """Everything one training process needs (JSON-serialisable: it crosses to torchrun workers)."""

    model_path: str
    out_dir: str
    params: dict  # TrainDualEncoderParams.model_dump()
    queries: list[str]  # example i's query text ...
    positives: list[str]  # ... its positive passage text ...
    negatives: list[list[str]] = field(default_factory=list)  # ... its hard negatives (infonce)
    candidates: list[list[str]] = field(default_factory=list)  # listwise: the list (positive first)
    teacher: list[list[float]] = field(default_factory=list)  # listwise: teacher scores of the list
    keys: list[list[str]] | None = None  # per example: what may not repeat in a batch
    # false_negatives: mask -- passage numbers of each example's positive and negatives, and of its
    # query's judged passages (numbers, not ids: they are gathered across processes as a tensor)
    positive_ids: list[int] = field(default_factory=list)
    negative_ids: list[list[int]] = field(default_factory=list)
    judged_ids: list[list[int]] = field(default_factory=list)


def train_json(job: dict, rt) -> None:
    """``train`` of a job that crossed to a torchrun worker as JSON."""
    train(Job(**job), rt)


def train(job: Job, rt) -> list[dict]:
    """Train (this process's share of) the dual encoder on ``rt`` (a ``StageRuntime``); rank 0 saves it
    to ``job.out_dir``. Returns the loss history."""
    from irflow.engine.distributed import rank_and_world
    from irflow.learn.encoding import load_sentence_transformer
    from irflow.learn.training import BatchPlan, seed_everything, train_loop

    p = TrainDualEncoderParams(**job.params)
    rank, world = rank_and_world()
    device = rt.device
    seed_everything(p.seed)  # same initial weights in every process
    model = load_sentence_transformer(job.model_path, device, p.passage_max_length)
    n = len(job.queries)
    keys = [frozenset(k) for k in job.keys] if job.keys is not None else None
    global_batch = p.batch_size * p.processes
    plan = BatchPlan(n, global_batch, p.seed, keys)  # train_loop gives each process its share

    def embed(texts: list[str], max_length: int):
        model.max_seq_length = max_length
        f = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
        f = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in f.items()}
        return model(f)["sentence_embedding"]

    make = _contrastive_objective if p.loss in ("infonce", "star") else _listwise_objective
    compute_loss, step_info = make(job, p, embed, device)

    probe = cosine_probe(job, p.seed) if rank == 0 else []
    before = probe_mean_cosine(model, embed, probe, p.passage_max_length)
    total = plan.total_steps(p)
    warmup = int(round(p.warmup_ratio * total))
    if rank == 0:
        log.info("train_dual_encoder: %s on %d examples, %d steps of %d queries on %d process(es)%s (%s, %s)",
                 p.loss, n, total, global_batch, world,
                 f", GradCache chunks of {p.mini_batch}" if p.mini_batch else "", device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, warmup, rt, f"train_dual_encoder[{p.loss}]",
                         step_info=step_info)
    if rank == 0:
        after = probe_mean_cosine(model, embed, probe, p.passage_max_length)
        warning = collapse_warning(before, after, f"{len(probe)} training passages", [h["loss"] for h in history],
                                   (1 + p.alpha) * math.log(2) if p.loss == "star" else None)
        if warning:
            log.warning("train_dual_encoder: %s", warning)
        out = Path(job.out_dir)
        model.eval()
        model.save(str(out), create_model_card=False)
        (out / TRAINING_LOG).write_text(json.dumps(
            {"loss": p.loss, "examples": n, "processes": world, "global_batch": global_batch,
             "steps": len(history), "mean_cosine": {"texts": len(probe), "before": round(before, 4),
                                               "after": round(after, 4)}, "history": history}, indent=1))
    return history


def _contrastive_objective(job: Job, p: TrainDualEncoderParams, embed, device: str):
    """(compute_loss, step_info) of InfoNCE or STAR over the batch's positives and hard negatives of every
    process, judged passages masked when ``false_negatives: mask``; GradCache in chunks of ``mini_batch``."""
    import torch

    from irflow.learn.losses import CrossBatchInfoNCE, StarLoss, gather_ids, grad_cache_step

    loss_fn = (CrossBatchInfoNCE(similarity=p.similarity, scale=p.scale) if p.loss == "infonce" else
               StarLoss(similarity=p.similarity, scale=p.scale, alpha=p.alpha))
    n_neg = p.negatives_per_line

    def texts_of(idx):
        qs = [job.queries[i] for i in idx]
        ps = [job.positives[i] for i in idx]
        ns = [t for i in idx for t in job.negatives[i][:n_neg]] if n_neg else []
        return qs, ps, ns

    def judged_mask(idx):
        """True where a gathered candidate is judged relevant to the row's query (candidates in the
        loss's order: every process's positives, then every process's negatives)."""
        if p.false_negatives != "mask":
            return None

        def ids(values):  # on the training device: nccl gathers CUDA tensors only
            return gather_ids(torch.tensor(values, dtype=torch.long, device=device))

        cand = [ids([job.positive_ids[i] for i in idx])]
        if n_neg:
            cand.append(ids([d for i in idx for d in job.negative_ids[i][:n_neg]]))
        cand_ids = torch.cat(cand)
        judged = [torch.tensor(job.judged_ids[i], dtype=torch.long, device=device) for i in idx]
        return torch.stack([torch.isin(cand_ids, j) for j in judged])

    def compute_loss(idx):
        qs, ps, ns = texts_of(idx)
        mask = judged_mask(idx)
        if p.mini_batch:
            groups = [qs, ps, ns] if ns else [qs, ps]
            embeds = [lambda t: embed(t, p.query_max_length)] + [lambda t: embed(t, p.passage_max_length)] * 2
            return grad_cache_step(embeds[:len(groups)], groups, lambda reps: loss_fn.from_embeddings(
                reps[0], reps[1], reps[2] if len(reps) > 2 else None, mask), p.mini_batch)
        q = embed(qs, p.query_max_length)
        pos = embed(ps, p.passage_max_length)
        neg = embed(ns, p.passage_max_length) if ns else None
        return loss_fn.from_embeddings(q, pos, neg, mask)

    return compute_loss, lambda: {"candidates": loss_fn.last_candidates}


def _listwise_objective(job: Job, p: TrainDualEncoderParams, embed, device: str):
    """(compute_loss, step_info) of the KL between the teacher's and the student's softmax over each query's
    first ``list_size`` candidates."""
    import torch

    from irflow.learn.losses import ListwiseDistillationLoss

    loss_fn = ListwiseDistillationLoss(similarity=p.similarity, scale=p.scale, temperature=p.temperature)
    m = p.list_size

    def compute_loss(idx):
        q = embed([job.queries[i] for i in idx], p.query_max_length)
        cands = embed([t for i in idx for t in job.candidates[i][:m]], p.passage_max_length)
        teacher = torch.tensor([job.teacher[i][:m] for i in idx], dtype=torch.float32, device=device)
        return loss_fn.from_embeddings(q, cands.view(len(idx), m, -1), teacher)

    return compute_loss, lambda: {"candidates": m}


def cosine_probe(job: Job, seed: int, size: int = COSINE_PROBE) -> list[str]:
    """A seeded sample of the job's distinct passages (positives, then negatives and list candidates),
    whose embeddings' mean cosine (``irflow.learn.collapse``) is measured before and after training."""
    from irflow.learn.sampling import sample

    texts = list(dict.fromkeys([*job.positives, *(t for ns in job.negatives for t in ns),
                                *(t for c in job.candidates for t in c)]))
    return sample(texts, size, seed, "cosine probe")


def probe_mean_cosine(model, embed, texts: list[str], max_length: int) -> float:
    """``irflow.learn.collapse.mean_cosine`` of ``texts``' embeddings under the model as it is now (nan: under 2 texts)."""
    import torch

    if len(texts) < 2:
        return float("nan")
    was_training = model.training
    model.eval()
    with torch.no_grad():
        vectors = torch.cat([embed(texts[i:i + 32], max_length).float().cpu() for i in range(0, len(texts), 32)])
    model.train(was_training)
    return mean_cosine(vectors.numpy())

