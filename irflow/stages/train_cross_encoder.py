"""Fine-tune a cross-encoder (a BERT-style model with one relevance logit) on labelled pairs.

Training pairs: every positive of the ``split`` qrels (score > 0) with label 1 (at most
``positives_per_query`` of each query's, a seeded sample, when it is set), and for each positive
``negatives_per_positive`` negatives with label 0 -- sampled (seeded) from the query's mined negatives
when the ``negatives`` input is given, else random corpus passages; a judged positive of the query is
never a negative. Loss (``loss``): binary cross-entropy on each pair's logit (as sentence-transformers'
CrossEncoder trains with one label; RocketQA's M_C), or ``listwise``: each positive and its negatives
as one group, softmax cross-entropy with the positive as the target (``irflow.learn.losses.
LocalizedContrastiveLoss``). The loop, precision, checkpoints and resume are ``irflow.learn.training``'s.

With ``runtime.train_processes: N`` (not keyed) the same training runs in N torchrun processes
(``irflow.engine.distributed``; one per GPU on CUDA): each computes the loss of ``batch_size / N`` pairs (listwise:
groups) of every batch and gradients are averaged, so the steps are those of one process with the whole batch.
``batch_size`` (listwise: its groups a step) must be divisible by N.

The base checkpoint may be a plain encoder (e.g. MiniLM's BERT weights): a fresh 1-logit head is
initialised (seeded). The result is saved with ``save_pretrained`` (model + tokenizer), so
``AutoModelForSequenceClassification.from_pretrained(path)`` loads it and the ``pseudo_label``
stage's cross-encoder teacher can use it. (Measured caveat: on SciFact-sized data a fresh head from
MiniLM weights is not a useful teacher: trained on 919 train qrels for 253 steps, it re-ranked the top 30
far below BM25; bench/results/cross_encoder_dev_scifact.json.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Literal

import pyarrow as pa
from pydantic import Field, PositiveInt, model_validator

from irflow.engine import distributed
from irflow.engine.errors import DataError
from irflow.engine.params import KEYED_WHEN_SET
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.qrels import cap_per_query, group, judged_positives, positive_pairs
from irflow.learn.sampling import sample
from irflow.learn.text import doc_texts, query_texts
from irflow.learn.training import TRAINING_LOG, BatchPlan, LoopParams, seed_everything, train_loop, training_losses

log = logging.getLogger("irflow.train")


def _check_cross_encoder(path: Path) -> None:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise RuntimeError(f"{path}: no config.json (not a Hugging Face model)")
    config = json.loads(cfg_file.read_text())
    if len(config.get("id2label") or {"0": "LABEL_0"}) != 1:
        raise RuntimeError(f"{path}: a cross-encoder must have exactly one output logit")


class TrainCrossEncoderParams(LoopParams):
    split: str = Field("train", min_length=1, description="the qrels split whose positives it trains on")
    negatives_per_positive: PositiveInt = Field(4, description="negatives (label 0) per positive")
    batch_size: PositiveInt = Field(16, description="(query, passage) pairs per step")
    max_length: PositiveInt = Field(256, description="tokens of (query, passage) the model reads")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps, then linear decay to 0")
    head_lr: float | None = Field(None, gt=0, description="peak learning rate of the classification head (the "
                                                          "parameters outside the pretrained body); null: lr")
    loss: Annotated[Literal["bce", "listwise"], KEYED_WHEN_SET] = Field(
        "bce", description="bce: each pair alone, label 1 or 0 (binary cross-entropy: RocketQA's M_C, "
                           "sentence-transformers' CrossEncoder); listwise: each positive with its "
                           "negatives_per_positive negatives as one group, softmax cross-entropy towards the "
                           "positive (Localized Contrastive Estimation, Gao et al. 2021): batch_size pairs a step "
                           "are batch_size / (1 + negatives_per_positive) groups; its logits are not "
                           "probabilities (calibrate them where a threshold reads them)")
    positives_per_query: Annotated[PositiveInt | None, KEYED_WHEN_SET] = Field(
        None, description="keep at most this many of each query's positives (a seeded sample per query; null: "
                          "every positive), each with its negatives_per_positive negatives. The pairs are "
                          "shuffled, so without it a query weighs as much as it has judged passages (NFCorpus: "
                          "180 broad queries of 2,590 hold half the 110,575 positives). Measured there at 200 "
                          "steps: it did not lift M_C off its label prior (bench/README.md)")

    @model_validator(mode="after")
    def _groups_fit_a_batch(self):
        if self.loss == "listwise" and self.batch_size < 1 + self.negatives_per_positive:
            raise ValueError(f"batch_size: {self.batch_size} pairs cannot hold one listwise group of 1 positive + "
                             f"{self.negatives_per_positive} negatives (negatives_per_positive)")
        return self

    def examples_per_step(self) -> int:
        """What one step's batch counts: pairs (bce), or groups of 1 + negatives_per_positive (listwise)."""
        return self.batch_size if self.loss == "bce" else self.batch_size // (1 + self.negatives_per_positive)


def pair_groups(ex: dict) -> list[list[int]]:
    """Indices into ``ex``, one group per positive: the positive first, then the negatives
    ``training_pairs`` drew for it (which follow it); a positive that got none makes no group."""
    groups: list[list[int]] = []
    for i, label in enumerate(ex["label"]):
        if label > 0:
            groups.append([i])
        elif groups:
            groups[-1].append(i)
    return [g for g in groups if len(g) > 1]


def training_pairs(qrels: pa.Table, corpus_ids: list[str], p: TrainCrossEncoderParams,
                   negatives: pa.Table | None = None) -> dict:
    """{q, d, label}: positives of the split (score > 0) and their sampled negatives."""
    k, seed = p.negatives_per_positive, p.seed
    judged = judged_positives(qrels)
    pairs = positive_pairs(qrels, p.split)
    if not pairs:
        raise DataError(f"no positive qrels in split '{p.split}'")
    pairs = cap_per_query(pairs, p.positives_per_query, seed)
    pools = group(negatives) if negatives is not None else {}
    ex = {"q": [], "d": [], "label": []}
    short = 0
    for q, pos in pairs:
        ex["q"].append(q), ex["d"].append(pos), ex["label"].append(1.0)
        if negatives is not None:
            pool = [d for d in pools.get(q, ()) if d not in judged[q] and d != q]
        else:
            # Draw a few more than needed from the whole corpus, then drop judged positives.
            pool = [d for d in sample(corpus_ids, k + len(judged[q]) + 1, seed, "random", q, pos)
                    if d not in judged[q] and d != q]
        negs = sample(pool, k, seed, q, pos)
        short += len(negs) < k
        for d in negs:
            ex["q"].append(q), ex["d"].append(d), ex["label"].append(0.0)
    if short:
        log.warning("train_cross_encoder: %d positive(s) got fewer than %d negatives", short, k)
    return ex


def fit_cross_encoder(ex: dict, qtext: dict[str, str], dtext: dict[str, str], base_path, p: TrainCrossEncoderParams,
                      rt: StageRuntime, desc: str = "train_cross_encoder", show_progress: bool = True):
    """(model, tokenizer, loss history): ``base_path``'s weights (a fresh 1-logit head where it has none)
    trained on the ``{q, d, label}`` pairs of ``ex`` with binary cross-entropy."""
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from irflow.learn.losses import LocalizedContrastiveLoss

    device = rt.device
    seed_everything(p.seed)  # the fresh head's initialisation
    tok = AutoTokenizer.from_pretrained(base_path)
    model, info = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1, ignore_mismatched_sizes=True,
                                                                     output_loading_info=True)
    fresh = [k for k in [*(info.get("missing_keys") or ()),
                         *(m if isinstance(m, str) else m[0] for m in info.get("mismatched_keys") or ())]
             if not k.startswith(model.base_model_prefix + ".")]
    if fresh and p.head_lr is None:
        log.warning("train_cross_encoder: %s has no relevance head; a fresh one is trained at lr %g, where it barely "
                    "leaves its initialisation in a few hundred steps (set head_lr, e.g. 1e-3)", base_path, p.lr)
    model.to(device)
    bce, lce = torch.nn.BCEWithLogitsLoss(), LocalizedContrastiveLoss()
    labels = torch.tensor(ex["label"], dtype=torch.float32)

    def logits_of(idx: list[int]):
        enc = tok([qtext[ex["q"][i]] for i in idx], [dtext[ex["d"][i]] for i in idx], padding=True,
                  truncation="longest_first", max_length=p.max_length, return_tensors="pt").to(device)
        return model(**enc).logits.view(-1).float()

    if p.loss == "bce":
        def compute_loss(idx: list[int]):
            return bce(logits_of(idx), labels[idx].to(device))
        examples = len(ex["q"])
    else:
        groups = pair_groups(ex)
        if not groups:
            raise DataError("listwise: no positive has a negative to be contrasted with")

        def compute_loss(idx: list[int]):
            members = [groups[g] for g in idx]
            flat = logits_of([i for m in members for i in m])
            # one row per group; a shorter group's empty slots are -inf (no probability)
            return lce(pad_sequence(flat.split([len(m) for m in members]), batch_first=True,
                                    padding_value=float("-inf")))
        examples = len(groups)

    plan = BatchPlan(examples, p.examples_per_step(), p.seed)
    rank, world = distributed.rank_and_world()
    if rank == 0:
        log.info("%s: %d pairs (%d positive), %s loss, %d steps on %d process(es) (%s, %s)", desc, len(ex["q"]),
                 int(sum(ex["label"])), p.loss, plan.total_steps(p), world, device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, p.warmup_steps, rt, desc, show_progress=show_progress,
                         head_lr=p.head_lr)
    model.eval()
    return model, tok, history


# version 3: also the loss history as a dataset (training_losses)
@stage("train_cross_encoder", version="3",
       outputs=[Output("cross_encoder", kind="model", check=_check_cross_encoder),
                Output("training_losses", "training_losses")],
       work="train", resumable=True)
def train_cross_encoder(p: TrainCrossEncoderParams, rt: StageRuntime, *, queries: DatasetRef, corpus: DatasetRef,
                        qrels: DatasetRef, base_model: DatasetRef, negatives: DatasetRef | None = None) -> dict:
    """A cross-encoder fine-tuned from ``base_model`` (a fresh 1-logit head where it has none) on the
    positives of ``qrels`` and negatives (from ``negatives``, else random passages); and its loss per
    step (``training_losses``)."""
    corpus_t = corpus.table()
    ex = training_pairs(qrels.table(), corpus_t.column("doc_id").to_pylist(), p,
                        negatives.table() if negatives is not None else None)
    qtext = query_texts(queries.table(), set(ex["q"]))
    dtext = doc_texts(corpus_t, set(ex["d"]))
    keep = [i for i in range(len(ex["q"])) if ex["q"][i] in qtext and ex["d"][i] in dtext]
    ex = {k: [v[i] for i in keep] for k, v in ex.items()}
    if not ex["q"]:
        raise DataError("no training pairs")

    distributed.check_split(p.examples_per_step(), rt.train_processes,
                            "batch_size" if p.loss == "bce" else "listwise groups a step")
    out = Path(rt.workdir) / "cross_encoder"
    job = {"ex": ex, "qtext": qtext, "dtext": dtext, "base_model": base_model.path, "out": str(out),
           "params": p.model_dump(mode="json")}
    distributed.run(fit_and_save, job, rt, rt.train_processes)
    return {"cross_encoder": out, "training_losses": training_losses(out)}


def fit_and_save(job: dict, rt: StageRuntime) -> None:
    """What each training process runs (``irflow.engine.distributed.run``): ``fit_cross_encoder`` on the job's
    pairs; rank 0 saves the model, its tokenizer and the training log to ``job["out"]``."""
    ex = job["ex"]
    model, tok, history = fit_cross_encoder(ex, job["qtext"], job["dtext"], job["base_model"],
                                            TrainCrossEncoderParams(**job["params"]), rt)
    rank, world = distributed.rank_and_world()
    if rank > 0:
        return
    out = Path(job["out"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / TRAINING_LOG).write_text(json.dumps(
        {"pairs": len(ex["q"]), "positives": int(sum(ex["label"])), "processes": world, "steps": len(history),
         "history": history}, indent=1))
