"""Train a bi-encoder student: Margin-MSE on pseudo labels (GPL) or MNRL on (query, positive) pairs (QGen).

A plain PyTorch loop over a sentence-transformers model (no ``model.fit``), so that everything that
decides the result is visible and checkpointable:

- batches: a seeded permutation per epoch (``drop_last`` as GPL's DataLoader); for MNRL no two
  examples in a batch share a query or a passage (in-batch negatives must be negatives);
- AdamW (weight decay 0.01, none on biases and LayerNorm) with linear warm-up then linear decay
  (``transformers.get_linear_schedule_with_warmup``), gradient clipping at ``max_grad_norm``;
- optional bfloat16 autocast (on CPU: about 2x faster on the machines we measured);
- a checkpoint every ``checkpoint_every`` steps in the stage's ``resume_dir`` (weights, optimizer,
  scheduler, step, RNG state, loss history). A crashed run restarts from its last checkpoint and
  ends with the same weights as an uninterrupted run (batches are a function of (seed, step)).

Passages are ``title + " " + text`` (BEIR's convention). The model is saved with
``SentenceTransformer.save`` so ``SentenceTransformer(path)`` loads it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm.auto import tqdm

from irflow.losses import MarginMSELoss, MultipleNegativesRankingLoss
from irflow.stage import Output, stage
from irflow.tasks.pseudo_label import doc_texts, query_texts, sample_negatives

log = logging.getLogger("irflow.train")
CHECKPOINT = "checkpoint.pt"


def _on_step(step: int) -> None:
    """Called after every completed optimizer step (and after its checkpoint). A test hook."""


# ---- batches --------------------------------------------------------------------------------------
def epoch_batches(n: int, batch_size: int, seed: int, epoch: int,
                  keys: Sequence[frozenset] | None = None) -> list[list[int]]:
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into full batches
    (a last partial batch is dropped, unless the data is smaller than one batch).

    With ``keys`` (one set per example), an example whose keys collide with the batch being filled
    is deferred to a later batch (sentence-transformers' NoDuplicatesDataLoader idea).
    """
    perm = np.random.default_rng([int(seed), int(epoch)]).permutation(n).tolist()
    if n <= batch_size:
        return [perm]
    if keys is None:
        return [perm[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]
    batches, pending, it = [], [], iter(perm)
    while True:
        batch, used, still = [], set(), []
        for i in pending:
            if len(batch) < batch_size and not (keys[i] & used):
                batch.append(i)
                used |= keys[i]
            else:
                still.append(i)
        pending = still
        while len(batch) < batch_size:
            i = next(it, None)
            if i is None:
                break
            if keys[i] & used:
                pending.append(i)
            else:
                batch.append(i)
                used |= keys[i]
        if len(batch) < batch_size:
            return batches or [batch]
        batches.append(batch)


class BatchPlan:
    """Which examples make up step ``s`` (0-based), for any s: a pure function of (seed, s)."""

    def __init__(self, n: int, batch_size: int, seed: int, keys=None):
        self.n, self.batch_size, self.seed, self.keys = n, batch_size, seed, keys
        self._epoch, self._start, self._batches = 0, 0, epoch_batches(n, batch_size, seed, 0, keys)

    def steps_per_epoch(self, epoch: int) -> int:
        return len(epoch_batches(self.n, self.batch_size, self.seed, epoch, self.keys))

    def total_steps(self, cfg: dict) -> int:
        if cfg.get("steps"):
            return int(cfg["steps"])
        return sum(self.steps_per_epoch(e) for e in range(int(cfg.get("epochs", 1))))

    def at(self, step: int) -> list[int]:
        if step < self._start:
            self._epoch, self._start, self._batches = 0, 0, epoch_batches(self.n, self.batch_size, self.seed, 0,
                                                                           self.keys)
        while step >= self._start + len(self._batches):
            self._start += len(self._batches)
            self._epoch += 1
            self._batches = epoch_batches(self.n, self.batch_size, self.seed, self._epoch, self.keys)
        return self._batches[step - self._start]


# ---- the training loop (shared with train_cross_encoder) -------------------------------------------
def seed_everything(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(model, lr: float, weight_decay: float = 0.01):
    import torch

    no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "norm.weight")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def train_loop(model, compute_loss: Callable[[list[int]], "object"], plan: BatchPlan, cfg: dict,
               resume_dir: Path | None, desc: str) -> list[dict]:
    """Run ``total`` optimizer steps of ``compute_loss(batch indices)``; checkpoint and resume.

    Returns the loss history [{step, loss, lr}] (including steps done before a crash).
    """
    import torch
    from transformers import get_linear_schedule_with_warmup

    total = plan.total_steps(cfg)
    device = cfg.get("_device", "cpu")
    bf16 = bool(cfg.get("bf16_autocast", False))
    every = int(cfg.get("checkpoint_every") or 0)
    max_grad_norm = float(cfg.get("max_grad_norm", 1.0))
    opt = make_optimizer(model, float(cfg.get("lr", 2e-5)), float(cfg.get("weight_decay", 0.01)))
    sched = get_linear_schedule_with_warmup(opt, int(cfg.get("warmup_steps", 1000)), total)
    ckpt_path = Path(resume_dir) / CHECKPOINT if resume_dir else None
    start, history = 0, []
    if ckpt_path is not None and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start, history = int(state["step"]), list(state["history"])
        log.info("%s: resuming from step %d (checkpoint in %s)", desc, start, resume_dir)

    model.to(device)
    bar = tqdm(range(start, total), desc=desc, initial=start, total=total, unit=" step", mininterval=2)
    for step in bar:
        model.train()
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = compute_loss(plan.at(step))
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        history.append({"step": step + 1, "loss": value, "lr": sched.get_last_lr()[0]})
        bar.set_postfix(loss=f"{value:.4f}")
        done = step + 1
        if ckpt_path is not None and every and done % every == 0 and done < total:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "step": done,
                        "history": history}, tmp)
            os.replace(tmp, ckpt_path)
        _on_step(done)
    return history


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


def mnrl_examples(qrels: pa.Table, negatives: pa.Table | None, corpus_ids: list[str], cfg: dict) -> dict:
    """(query, positive) pairs from the ``split`` qrels (score > 0); with negatives, one hard negative
    per pair, sampled (seeded) from the query's mined negatives that are not judged positives (a
    random corpus passage where a query has none)."""
    split = cfg.get("split", "generated")
    seed = int(cfg.get("seed", 42))
    pos = qrels.filter(pc.and_(pc.equal(qrels.column("split"), split), pc.greater(qrels.column("score"), 0)))
    if pos.num_rows == 0:
        raise ValueError(f"train_student: no positive qrels in split '{split}'")
    pairs = sorted(set(zip(pos.column("query_id").to_pylist(), pos.column("doc_id").to_pylist())))
    ex = {"q": [q for q, _ in pairs], "p": [d for _, d in pairs]}
    if negatives is not None:
        judged: dict[str, set] = {}
        good = qrels.filter(pc.greater(qrels.column("score"), 0))
        for q, d in zip(good.column("query_id").to_pylist(), good.column("doc_id").to_pylist()):
            judged.setdefault(q, set()).add(d)
        pools: dict[str, set] = {}
        for q, d in zip(negatives.column("query_id").to_pylist(), negatives.column("doc_id").to_pylist()):
            pools.setdefault(q, set()).add(d)
        ex["n"], fallback = [], 0
        for q, p in pairs:
            pool = [d for d in pools.get(q, ()) if d not in judged.get(q, ())]
            if not pool:
                fallback += 1
                pool = [d for d in sample_negatives(corpus_ids, 8, seed, "random", q, p) if d not in judged.get(q, ())]
            ex["n"].append(sample_negatives(pool, 1, seed, q, p)[0])
        if fallback:
            log.warning("train_student: %d pair(s) had no mined negative; a random passage is used", fallback)
    return ex


def _check_student(path: Path) -> None:
    for f in ("modules.json", "config.json"):
        if not (Path(path) / f).exists():
            raise RuntimeError(f"{path}: not a sentence-transformers model (no {f})")


def base_model_path(cfg: dict, base_model=None) -> str:
    if base_model is not None:
        return base_model.path
    path = cfg.get("_model_path") or cfg.get("model")
    if not path:
        raise ValueError("no base model: give cfg model/_model_path (irflow.models.model_cfg) or a base_model input")
    return str(path)


# ---- the stage ------------------------------------------------------------------------------------
@stage("train_student", version="1", outputs=Output("student", kind="model", check=_check_student))
def train_student(queries, corpus, cfg: dict, workdir: Path, resume_dir: Path, pseudo_labels=None, qrels=None,
                  negatives=None, base_model=None) -> Path:
    """Inputs: queries, corpus; pseudo_labels (loss margin_mse) or qrels [+ negatives] (loss mnrl);
    base_model (a stored model) unless cfg names one.

    cfg: {model, model_key, _model_path, loss: margin_mse|mnrl, similarity: dot|cos, batch_size (32),
          max_seq_length (350), lr (2e-5), warmup_steps (1000), steps | epochs (1), seed (42),
          checkpoint_every (500), bf16_autocast (false), max_grad_norm (1.0), weight_decay (0.01),
          split (mnrl: generated), mnrl_scale (20 for cos, 1 for dot), _device (cpu)}
    """
    import torch
    from sentence_transformers import SentenceTransformer

    loss_name = cfg.get("loss", "margin_mse")
    similarity = cfg.get("similarity", "dot")
    seed = int(cfg.get("seed", 42))
    device = cfg.get("_device", "cpu")
    bs = int(cfg.get("batch_size", 32))

    corpus_t = corpus.table()
    if loss_name == "margin_mse":
        if pseudo_labels is None:
            raise ValueError("train_student: loss margin_mse needs the pseudo_labels input")
        ex = margin_mse_examples(pseudo_labels.table())
        keys = None
        loss_fn = MarginMSELoss(similarity=similarity)
    elif loss_name == "mnrl":
        if qrels is None:
            raise ValueError("train_student: loss mnrl needs the qrels input")
        ex = mnrl_examples(qrels.table(), negatives.table() if negatives is not None else None,
                           corpus_t.column("doc_id").to_pylist(), cfg)
        cols = [c for c in ("q", "p", "n") if c in ex]
        keys = [frozenset((c, ex[c][i]) if c == "q" else ("d", ex[c][i]) for c in cols) for i in range(len(ex["q"]))]
        loss_fn = MultipleNegativesRankingLoss(similarity=similarity, scale=cfg.get("mnrl_scale"))
    else:
        raise ValueError(f"train_student: loss must be margin_mse or mnrl, got {loss_name!r}")

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
        raise ValueError("train_student: no training examples")

    seed_everything(seed)
    model = SentenceTransformer(base_model_path(cfg, base_model), device=device)
    model.max_seq_length = int(cfg.get("max_seq_length", 350))
    plan = BatchPlan(len(ex["q"]), bs, seed, keys)

    def compute_loss(idx: list[int]):
        q = _embed(model, [qtext[ex["q"][i]] for i in idx], device)
        p = _embed(model, [dtext[ex["p"][i]] for i in idx], device)
        if loss_name == "margin_mse":
            n = _embed(model, [dtext[ex["n"][i]] for i in idx], device)
            return loss_fn.from_embeddings(q, p, n, torch.from_numpy(ex["margin"][idx]).to(device))
        n = _embed(model, [dtext[ex["n"][i]] for i in idx], device) if "n" in ex else None
        return loss_fn.from_embeddings(q, p, n)

    log.info("train_student: %s/%s on %d examples, %d steps of %d", loss_name, similarity, len(ex["q"]),
             plan.total_steps(cfg), bs)
    history = train_loop(model, compute_loss, plan, cfg, resume_dir, f"train_student[{loss_name}]")
    out = Path(workdir) / "student"
    model.eval()
    model.save(str(out), create_model_card=False)
    (out / "irflow_training.json").write_text(json.dumps(
        {"loss": loss_name, "similarity": similarity, "examples": len(ex["q"]), "steps": len(history),
         "history": history}, indent=1))
    return out
