"""The training loop shared by every trained model (bi-encoder students, cross-encoders).

A plain PyTorch loop (no ``model.fit``), so that everything that decides the result is visible and
checkpointable:

- batches: a seeded permutation per epoch (``drop_last`` as GPL's DataLoader); with keys, no two
  examples in a batch share a key (in-batch negatives must be negatives);
- AdamW (weight decay on everything but biases and LayerNorm) with linear warm-up then linear
  decay (``transformers.get_linear_schedule_with_warmup``), gradient clipping at ``max_grad_norm``;
- autocast at the runtime's precision (``StageRuntime.autocast``: bf16 only where the hardware has
  it, unless forced);
- a checkpoint every ``checkpoint_every`` steps in the stage's resume dir (weights, optimizer,
  scheduler, step, RNG state, loss history). A crashed run restarts from its last checkpoint and
  ends with the same weights as an uninterrupted run (batches are a function of (seed, step));
- under torchrun (``runtime.train_processes``, ``irflow.engine.distributed``) each process computes its share
  of every batch and gradients are averaged: the steps of one process with the whole batch. Rank 0
  writes the checkpoints; every process resumes from them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
from pydantic import Field, PositiveInt
from tqdm.auto import tqdm

from irflow.engine import pace
from irflow.engine.params import Params
from irflow.engine.processes import check_interrupted, steady_heap

log = logging.getLogger("irflow.train")
CHECKPOINT = "checkpoint.pt"
TRAINING_LOG = "irflow_training.json"  # what rank 0 writes beside a trained model: summary + loss history


class LoopParams(Params):
    """Optimisation settings every trained stage shares (each stage adds its batch size and warm-up)."""

    lr: float = Field(2e-5, gt=0, description="peak learning rate (AdamW)")
    steps: PositiveInt | None = Field(None, description="optimizer steps; null: `epochs` passes over the data")
    epochs: PositiveInt = Field(1, description="passes over the data (used only when `steps` is null)")
    seed: int = Field(42, description="seed of the initialisation, the batch order and the sampling")
    checkpoint_every: int = Field(500, ge=0, description="save a resumable checkpoint every n steps (0: never)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping norm (0: no clipping)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases and LayerNorm)")


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

    def total_steps(self, p: LoopParams) -> int:
        if p.steps:
            return int(p.steps)
        return sum(self.steps_per_epoch(e) for e in range(int(p.epochs)))

    def at(self, step: int) -> list[int]:
        if step < self._start:
            self._epoch, self._start, self._batches = 0, 0, epoch_batches(self.n, self.batch_size, self.seed, 0,
                                                                           self.keys)
        while step >= self._start + len(self._batches):
            self._start += len(self._batches)
            self._epoch += 1
            self._batches = epoch_batches(self.n, self.batch_size, self.seed, self._epoch, self.keys)
        return self._batches[step - self._start]


# ---- the loop ---------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(model, lr: float, weight_decay: float = 0.01, head_lr: float | None = None):
    """AdamW, no weight decay on biases and norms. ``head_lr``: the learning rate of the parameters
    outside the model's pretrained body (``model.base_model_prefix``, e.g. a sequence classifier's
    fresh head); None: ``lr`` for every parameter."""
    import torch

    no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "norm.weight")
    body = getattr(model, "base_model_prefix", "") or ""

    def group_of(name: str) -> tuple[bool, bool]:
        """(decayed, in the head)"""
        return (not any(k in name for k in no_decay),
                head_lr is not None and bool(body) and not name.startswith(body + "."))

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = []
    for decay, head in ((True, False), (True, True), (False, False), (False, True)):
        params = [p for n, p in named if group_of(n) == (decay, head)]
        if params:
            groups.append({"params": params, "weight_decay": weight_decay if decay else 0.0,
                           "lr": head_lr if head else lr})
    return torch.optim.AdamW(groups, lr=lr)


def train_loop(model, compute_loss: Callable[[list[int]], "object"], plan: BatchPlan, p: LoopParams,
               warmup_steps: int, rt, desc: str, *, step_info: Callable[[], dict] | None = None,
               show_progress: bool = True, head_lr: float | None = None,
               after_step: Callable[[], None] | None = None, texts_per_example: int = 3,
               keep: Callable[[int], None] | None = None) -> list[dict]:
    """Run ``plan.total_steps(p)`` optimizer steps of ``compute_loss(batch indices)`` on ``rt.device``
    under ``rt.autocast()``; checkpoint into and resume from ``rt.resume_dir``.

    A loss returned without a graph has already been back-propagated (GradCache does its own
    backward). ``step_info`` adds fields to each history entry. ``after_step`` runs after each
    optimizer step, before its checkpoint (MoCo's momentum update of its key encoder). ``keep`` runs on
    rank 0 with the steps done after each step, before its checkpoint (train_student's candidates).

    Under torchrun (``irflow.engine.distributed``) ``compute_loss`` gets this process's share of each batch,
    gradients are averaged over processes before clipping, the history holds the whole batch's loss,
    and only rank 0 checkpoints and shows progress. A loss without a graph is not re-weighted, so
    GradCache needs equal shares (the gather of its in-batch negatives refuses others).

    Returns the loss history [{step, loss, lr, ...}] (including steps done before a crash).
    """
    import torch
    from transformers import get_linear_schedule_with_warmup

    from irflow.engine import distributed

    rank, world = distributed.rank_and_world()
    total = plan.total_steps(p)
    device = rt.device
    opt = make_optimizer(model, p.lr, p.weight_decay, head_lr)
    sched = get_linear_schedule_with_warmup(opt, int(warmup_steps), total)
    ckpt_path = Path(rt.resume_dir) / CHECKPOINT if rt.resume_dir else None
    start, history = 0, []
    if ckpt_path is not None and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        start, history = int(state["step"]), list(state["history"])
        log.info("%s: resuming from step %d (checkpoint in %s)", desc, start, rt.resume_dir)

    model.to(device)
    recompute = rt.recompute_activations
    if recompute == "auto":
        recompute, why = recompute_needed(model, rt, len(plan.at(start)) * texts_per_example, device)
        if rank == 0:
            log.info("%s: activation recomputation %s: %s", desc, "on" if recompute else "off", why)
    checkpoint_activations(model, bool(recompute))
    bar = tqdm(range(start, total), desc=desc, initial=start, total=total, unit=" step", mininterval=2,
               disable=not show_progress or rank > 0)
    with steady_heap(device):  # a step's largest blocks mapped apart: the heap does not fragment
        for step in bar:
            check_interrupted()
            model.train()
            share, weight = distributed.share_of(plan.at(step), rank, world)
            with rt.autocast():
                loss = compute_loss(share)
                if weight != 1.0:
                    loss = loss * weight
            if loss.requires_grad:
                loss.backward()
            if world > 1:
                distributed.average_gradients(model, world)
            if p.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), p.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step()
            value = distributed.mean_over_processes(loss.detach(), world)
            history.append({"step": step + 1, "loss": value, "lr": sched.get_last_lr()[0],
                            **(step_info() if step_info else {})})
            # refresh=False: the bar's own refresh (every 2 s) shows it. A refresh here would redraw the bar with the
            # step count the iterator last published, which lags (a log read "22/861" for steps 22 and 23)
            bar.set_postfix(loss=f"{value:.4f}", refresh=False)
            done = step + 1
            if keep is not None and rank == 0:
                keep(done)
            if (ckpt_path is not None and rank == 0 and p.checkpoint_every and done % p.checkpoint_every == 0
                    and done < total):
                tmp = ckpt_path.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "step": done,
                            "history": history}, tmp)
                os.replace(tmp, ckpt_path)
            _on_step(done)
            pace.progress(done / total)
    checkpoint_activations(model, False)  # the trained model leaves as it came (it is saved, or used, next)
    return history


# bytes a training step keeps per token, per transformer layer and per unit of its hidden size (all of a
# layer's activations for the backward pass): MiniLM, 96 sequences of 160 tokens in bf16 on CPU kept 2.45 GiB
# more than with checkpointing (checkpoint_activations' measurement); fp32 holds twice the bytes
ACTIVATION_BYTES = {"bf16": 74, "fp16": 74, "fp32": 148}
RECOMPUTE_ABOVE = 0.5  # auto: recompute when a step's activations would take more than this share of free memory


def available_memory(device: str) -> int:
    """Bytes the device can still give: a GPU's free memory, else the machine's MemAvailable."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def recompute_needed(model, rt, texts: int, device: str) -> tuple[bool, str]:
    """``runtime.recompute_activations: auto``: whether a step of ``texts`` sequences at the model's maximum
    length would keep more activation memory than ``RECOMPUTE_ABOVE`` of what the device has free (an
    upper bound: sequences are padded to their batch's longest, often shorter), and why."""
    from transformers import PreTrainedModel

    trainable = [m for m in model.modules() if isinstance(m, PreTrainedModel)
                 and any(p.requires_grad for p in m.parameters())]
    if not trainable:
        return False, "no trainable transformer"
    tokens = int(getattr(model, "max_seq_length", None) or 512)
    size = sum(getattr(m.config, "num_hidden_layers", 12) * getattr(m.config, "hidden_size", 768) for m in trainable)
    need = texts * tokens * size * ACTIVATION_BYTES.get(rt.precision, ACTIVATION_BYTES["fp32"])
    free = available_memory(device)
    on = need > RECOMPUTE_ABOVE * free
    return on, (f"a step's activations ({texts} sequences of up to {tokens} tokens) need about {need / 2**30:.1f} GiB "
                f"of the {free / 2**30:.1f} GiB free on {device} ({'more' if on else 'less'} than "
                f"{RECOMPUTE_ABOVE:.0%}); runtime.recompute_activations: true / false decides it yourself")


def checkpoint_activations(model, on: bool) -> None:
    """Activation checkpointing in every Hugging Face model inside ``model`` (a SentenceTransformer
    holds one in its Transformer module). Backward needs every layer's activations; kept, they are
    most of a step's memory (MiniLM, 96 sequences of 160 tokens in bf16: a process peak of 4.2 GiB,
    1.75 GiB checkpointed), so each layer is recomputed from its input instead. torch's checkpoint
    restores the RNG state (dropout) and the autocast state for the recomputation, so the gradients
    are the ones of the kept activations."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing:
            if on and not any(p.requires_grad for p in m.parameters()):
                continue  # a frozen model (MoCo's key encoder) builds no graph: nothing to recompute
            # transformers < 5.2x names it gradient_checkpointing (seen: 5.17 on a lent H100)
            kind = "activation" if hasattr(m, "activation_checkpointing_enable") else "gradient"
            if on:
                getattr(m, f"{kind}_checkpointing_enable")()
            elif getattr(m, f"is_{kind}_checkpointing", False):
                getattr(m, f"{kind}_checkpointing_disable")()


def losses_table(history: list[dict]) -> pa.Table:
    """A loss history (``train_loop``'s) as a ``training_losses`` table: one row per step."""
    return pa.table({"step": pa.array([h["step"] for h in history], pa.int32()),
                     "loss": pa.array([float(h["loss"]) for h in history], pa.float64()),
                     "lr": pa.array([float(h["lr"]) for h in history], pa.float64()),
                     "candidates": pa.array([h.get("candidates") for h in history], pa.int32())})


def training_losses(model_dir: str | Path) -> pa.Table:
    """The ``training_losses`` table of a model a trainer stage just saved, from its ``TRAINING_LOG``.
    Read from the file rank 0 wrote (not from a return value), so one code path serves one process and
    torchrun workers alike; a resumed training's log holds the steps before the checkpoint too."""
    return losses_table(json.loads((Path(model_dir) / TRAINING_LOG).read_text())["history"])
