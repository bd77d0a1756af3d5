"""Dual-encoder training in one process or many: InfoNCE with in-batch / cross-batch negatives,
GradCache, or listwise distillation. No refs, no store: texts and examples in, a saved model out.

``train(job)`` is what each process runs. One process: the stage calls it. Several: the stage
starts ``torchrun`` (``python -m torch.distributed.run``) on this module, which reads the job from a
file; every process trains on its slice of each global batch and rank 0 saves. Backend gloo on
CPU, nccl on CUDA. Gradients are averaged over processes after each backward (what DDP does), and
the loss gathers every process's passages (``irflow.losses.CrossBatchInfoNCE``), so W processes
of B queries take the same step as one process with a batch of W * B -- with W times the memory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from irflow.training import LoopParams

log = logging.getLogger("irflow.train")


class TrainDualEncoderParams(LoopParams):
    """How a dual encoder (bi-encoder) is trained on (query, positive[, negatives]) examples."""

    loss: Literal["infonce", "listwise_kl"] = Field(
        "infonce", description="infonce: softmax over the positive, the other queries' passages and the hard "
                               "negatives (in-batch; cross-batch with processes > 1); listwise_kl: KL from a "
                               "frozen re-ranker's distribution over each query's candidate list (RocketQAv2)")
    similarity: Literal["cos", "dot"] = Field("cos", description="cos (MiniLM's) or dot")
    scale: float | None = Field(None, gt=0, description="similarity scale before the softmax (null: 20 for cos, "
                                                        "1 for dot)")
    batch_size: PositiveInt = Field(32, description="queries per step, per process")
    processes: PositiveInt = Field(1, description="processes (torchrun) whose passages every query is scored "
                                                  "against: cross-batch negatives; the global batch is "
                                                  "processes x batch_size")
    mini_batch: PositiveInt | None = Field(None, description="GradCache: embed at most this many texts at once "
                                                             "(null: the whole batch in one graph); same "
                                                             "gradients, bounded memory, so batch_size can be large")
    negatives_per_line: NonNegativeInt = Field(0, description="hard negatives on each training line, from the "
                                                               "negatives input (0: in-batch negatives only)")
    negative_lines: PositiveInt = Field(1, description="training lines per (query, positive), each with its own "
                                                       "negatives_per_line negatives (RocketQA: 4 lines of 1 "
                                                       "negative); lines of one query never share a batch")
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
    device: str = "cpu"
    precision: str = "fp32"
    threads: int = 1
    recompute_activations: bool = True
    resume_dir: str | None = None


def train(job: Job) -> list[dict]:
    """Train (this process's share of) the dual encoder; rank 0 saves it to ``job.out_dir``.
    Returns the loss history."""
    import torch
    import torch.distributed as dist

    from irflow.losses import CrossBatchInfoNCE, ListwiseDistillationLoss, grad_cache_step
    from irflow.models import load_sentence_transformer
    from irflow.runtime import StageRuntime
    from irflow.training import BatchPlan, seed_everything, train_loop

    p = TrainDualEncoderParams(**job.params)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = job.device
    if device.startswith("cuda") and distributed:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    rt = StageRuntime(device=device, precision=job.precision, threads=job.threads,
                      recompute_activations=job.recompute_activations,
                      resume_dir=Path(job.resume_dir) if job.resume_dir else None, work="train")
    seed_everything(p.seed)  # same initial weights in every process
    model = load_sentence_transformer(job.model_path, device, p.passage_max_length)
    n = len(job.queries)
    keys = [frozenset(k) for k in job.keys] if job.keys is not None else None
    plan = BatchPlan(n, p.batch_size * world, p.seed, keys)  # the global batch; each process takes a slice

    def embed(texts: list[str], max_length: int):
        model.max_seq_length = max_length
        f = model.preprocess(texts) if hasattr(model, "preprocess") else model.tokenize(texts)
        f = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in f.items()}
        return model(f)["sentence_embedding"]

    def my_slice(idx: list[int]) -> list[int]:
        if world == 1:
            return idx
        b = len(idx) // world  # the global batch is world * batch_size (a tiny dataset: its whole size)
        return idx[rank * b:(rank + 1) * b]

    if p.loss == "infonce":
        loss_fn = CrossBatchInfoNCE(similarity=p.similarity, scale=p.scale)
        n_neg = p.negatives_per_line

        def texts_of(idx):
            qs = [job.queries[i] for i in idx]
            ps = [job.positives[i] for i in idx]
            ns = [t for i in idx for t in job.negatives[i][:n_neg]] if n_neg else []
            return qs, ps, ns

        def compute_loss(idx):
            qs, ps, ns = texts_of(my_slice(idx))
            if p.mini_batch:
                groups = [qs, ps, ns] if ns else [qs, ps]
                embeds = [lambda t: embed(t, p.query_max_length)] + [lambda t: embed(t, p.passage_max_length)] * 2
                return grad_cache_step(embeds[:len(groups)], groups, lambda reps: loss_fn.from_embeddings(
                    reps[0], reps[1], reps[2] if len(reps) > 2 else None), p.mini_batch)
            q = embed(qs, p.query_max_length)
            pos = embed(ps, p.passage_max_length)
            neg = embed(ns, p.passage_max_length) if ns else None
            return loss_fn.from_embeddings(q, pos, neg)

        def step_info():
            return {"candidates": loss_fn.last_candidates}
    else:
        loss_fn = ListwiseDistillationLoss(similarity=p.similarity, scale=p.scale, temperature=p.temperature)
        m = p.list_size

        def compute_loss(idx):
            idx = my_slice(idx)
            q = embed([job.queries[i] for i in idx], p.query_max_length)
            cands = embed([t for i in idx for t in job.candidates[i][:m]], p.passage_max_length)
            teacher = torch.tensor([job.teacher[i][:m] for i in idx], dtype=torch.float32, device=device)
            return loss_fn.from_embeddings(q, cands.view(len(idx), m, -1), teacher)

        def step_info():
            return {"candidates": m}

    def average_gradients():
        # DDP's all-reduce, done by hand: the model is called several times per step (queries,
        # passages, GradCache's chunks), which DDP's hooks do not expect.
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= world

    total = plan.total_steps(p)
    warmup = int(round(p.warmup_ratio * total))
    if rank == 0:
        log.info("train_dual_encoder: %s on %d examples, %d steps of %d queries x %d process(es)%s (%s, %s)",
                 p.loss, n, total, p.batch_size, world,
                 f", GradCache chunks of {p.mini_batch}" if p.mini_batch else "", device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, warmup, rt, f"train_dual_encoder[{p.loss}]",
                         after_backward=average_gradients if world > 1 else None, step_info=step_info,
                         save_checkpoints=rank == 0, show_progress=rank == 0)
    if rank == 0:
        out = Path(job.out_dir)
        model.eval()
        model.save(str(out), create_model_card=False)
        (out / "irflow_training.json").write_text(json.dumps(
            {"loss": p.loss, "examples": n, "processes": world, "global_batch": p.batch_size * world,
             "steps": len(history), "history": history}, indent=1))
    return history


def run_distributed(job: Job, world_size: int, workdir: Path, threads: int) -> None:
    """Train with ``world_size`` processes started by torchrun (gloo on CPU, nccl on CUDA)."""
    import subprocess

    from irflow.processes import die_with_parent

    spec = Path(workdir) / "dual_encoder_job.json"
    spec.write_text(json.dumps(asdict(job)))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads)), IRFLOW_DDP_THREADS=str(max(1, threads)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           "-m", "irflow.dual_encoder", str(spec)]
    log.info("train_dual_encoder: %s", " ".join(cmd[2:]))
    proc = subprocess.run(cmd, env=env, preexec_fn=die_with_parent(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun with {world_size} processes failed (rc {proc.returncode}):\n{tail}")
    for line in proc.stdout.splitlines()[-5:]:
        log.debug("torchrun: %s", line)


def _worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    job = Job(**json.loads(Path(spec_path).read_text()))
    backend = "nccl" if job.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend)
    torch.set_num_threads(int(os.environ.get("IRFLOW_DDP_THREADS", "1")))
    try:
        train(job)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
