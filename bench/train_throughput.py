"""Training throughput: irflow's cross-encoder and GradCache dual-encoder training against plain
sentence-transformers (its trainers and losses) on the same inputs.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/train_throughput.py [--steps 12] [--reps 2]
        [--out bench/results/train_throughput.json]

Inputs: SciFact train pairs (real texts), all-MiniLM-L6-v2, fp32 on both sides (the trainers'
default), the same batch sizes, lengths, learning rate and number of steps.
- cross-encoder: irflow's ``train_cross_encoder`` model, loss and loop vs sentence-transformers'
  ``CrossEncoder`` with its ``BinaryCrossEntropyLoss`` (1 logit), batch 16, max length 200;
- GradCache: irflow's ``train_dual_encoder`` (``mini_batch``) vs sentence-transformers'
  ``CachedMultipleNegativesRankingLoss``, batch 64 (query, positive) pairs in chunks of 16.
sentence-transformers' side runs its losses in a plain AdamW loop with clipping (its Trainer needs
``accelerate``, which irflow does not install). Time is measured between the end of step 1 and the
end of the last step (set-up and the first step's warm-up excluded on both sides). Both sides train on
the same batches (irflow's BatchPlan picks them; padding cost depends on which texts share a batch).
Runs alternate (irflow, st, irflow, st, ...) so load drifts hit both.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import harness

os.environ.setdefault("WANDB_DISABLED", "true")


def scifact_pairs(n: int):
    """(query text, positive text) for the first n SciFact train qrels, and some other passages."""
    corpus, queries, qrels = harness.read_beir(harness.DATASETS / "scifact.zip", "train")
    docs = {str(d["_id"]): f"{d.get('title') or ''} {d['text']}".strip() for d in corpus}
    pairs = []
    for q, judged in qrels.items():  # the first judged passage in the corpus, per query
        d = next((d for d in judged if d in docs), None)
        if d is not None:
            pairs.append((queries[q], docs[d]))
        if len(pairs) == n:
            break
    others = list(docs.values())[: 4 * n]
    return pairs, others


class StepClock:
    def __init__(self):
        self.times = []

    def tick(self, *_):
        self.times.append(time.perf_counter())

    def rate(self, per_step: int) -> float:
        """Examples per second between the end of step 1 and the end of the last step."""
        return per_step * (len(self.times) - 1) / (self.times[-1] - self.times[0])


def irflow_ce(pairs, others, steps, batch, max_length) -> float:
    import irflow.learn.training as training
    from irflow.engine.models import minilm_path
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    import torch

    from irflow.engine.runtime import StageRuntime
    from irflow.stages.train_cross_encoder import TrainCrossEncoderParams
    from irflow.learn.training import BatchPlan, seed_everything, train_loop

    # The stage's own model set-up and loss (train_cross_encoder), on in-memory pairs.
    texts = [(q, d, 1.0) for q, d in pairs] + [(q, o, 0.0) for (q, _), o in zip(pairs, others)]
    p = TrainCrossEncoderParams(steps=steps, batch_size=batch, max_length=max_length, checkpoint_every=0,
                                warmup_steps=0, lr=3e-5)
    seed_everything(p.seed)
    tok = AutoTokenizer.from_pretrained(minilm_path())
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=1,
                                                               ignore_mismatched_sizes=True)
    bce = torch.nn.BCEWithLogitsLoss()
    labels = torch.tensor([t[2] for t in texts])

    def compute_loss(idx):
        enc = tok([texts[i][0] for i in idx], [texts[i][1] for i in idx], padding=True,
                  truncation="longest_first", max_length=max_length, return_tensors="pt")
        return bce(model(**enc).logits.view(-1).float(), labels[idx])

    clock = StepClock()
    training._on_step = clock.tick
    try:
        train_loop(model, compute_loss, BatchPlan(len(texts), batch, p.seed), p, 0, StageRuntime(), "irflow CE",
                   show_progress=False)
    finally:
        training._on_step = lambda step: None
    return clock.rate(batch)


def _st_loop(model, step_loss, steps: int, lr: float) -> StepClock:
    """sentence-transformers' losses in a plain AdamW loop (what its Trainer runs per step, without the
    Trainer, which needs `accelerate`: not part of irflow's install)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    clock = StepClock()
    model.train()
    for step in range(steps):
        loss = step_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.tick()
    return clock


def st_ce(pairs, others, steps, batch, max_length) -> float:
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    from irflow.engine.models import minilm_path

    model = CrossEncoder(minilm_path(), num_labels=1, max_length=max_length, device="cpu")
    loss = BinaryCrossEntropyLoss(model)
    from irflow.stages.train_cross_encoder import TrainCrossEncoderParams
    from irflow.learn.training import BatchPlan

    texts = [(q, d, 1.0) for q, d in pairs] + [(q, o, 0.0) for (q, _), o in zip(pairs, others)]
    plan = BatchPlan(len(texts), batch, TrainCrossEncoderParams().seed)  # irflow's batches: the same inputs

    def step_loss(step):
        idx = plan.at(step)
        return loss([[texts[i][0] for i in idx], [texts[i][1] for i in idx]],
                    torch.tensor([texts[i][2] for i in idx]))

    return _st_loop(model, step_loss, steps, 3e-5).rate(batch)


def irflow_gradcache(pairs, steps, batch, mini, q_len, p_len) -> float:
    import irflow.learn.training as training
    from irflow.learn.dual_encoder import Job, TrainDualEncoderParams, train
    from irflow.engine.models import minilm_path
    from irflow.engine.runtime import StageRuntime

    p = TrainDualEncoderParams(batch_size=batch, mini_batch=mini, steps=steps, checkpoint_every=0, warmup_ratio=0,
                               query_max_length=q_len, passage_max_length=p_len, lr=2e-5)
    clock = StepClock()
    training._on_step = clock.tick
    try:
        with tempfile.TemporaryDirectory() as out:
            train(Job(model_path=minilm_path(), out_dir=out, params=p.model_dump(mode="json"),
                      queries=[q for q, _ in pairs], positives=[d for _, d in pairs],
                      keys=[[f"q{i}"] for i in range(len(pairs))]), StageRuntime(work="train"))
    finally:
        training._on_step = lambda step: None
    return clock.rate(batch)


def st_gradcache(pairs, steps, batch, mini, q_len, p_len) -> float:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    from irflow.engine.models import minilm_path

    model = SentenceTransformer(minilm_path(), device="cpu")
    model.max_seq_length = p_len  # one limit for both sides in sentence-transformers
    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini)

    from irflow.learn.dual_encoder import TrainDualEncoderParams
    from irflow.learn.training import BatchPlan

    # irflow's batches (the same seed and keys as irflow_gradcache's job): the same inputs per step
    keys = [frozenset([f"q{i}"]) for i in range(len(pairs))]
    plan = BatchPlan(len(pairs), batch, TrainDualEncoderParams().seed, keys)

    def step_loss(step):
        chunk = [pairs[i] for i in plan.at(step)]
        feats = [model.tokenize([q for q, _ in chunk]), model.tokenize([d for _, d in chunk])]
        return loss(feats, torch.empty(0))

    return _st_loop(model, step_loss, steps, 2e-5).rate(batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(harness.ROOT / "bench/results/train_throughput.json"))
    a = ap.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    pairs, others = scifact_pairs(64 * (a.steps + 1))
    ce = {"irflow": [], "sentence-transformers": []}
    gc = {"irflow": [], "sentence-transformers": []}
    for rep in range(a.reps):
        ce["irflow"].append(irflow_ce(pairs, others, a.steps, 16, 200))
        ce["sentence-transformers"].append(st_ce(pairs, others, a.steps, 16, 200))
        # (queries are SciFact claims, under 64 tokens: one max length for both sides matches ST's single limit)
        gc["irflow"].append(irflow_gradcache(pairs, a.steps, 64, 16, 200, 200))
        gc["sentence-transformers"].append(st_gradcache(pairs, a.steps, 64, 16, 200, 200))
        harness.log(f"rep {rep}: CE {ce['irflow'][-1]:.2f} vs {ce['sentence-transformers'][-1]:.2f} pairs/s; "
                    f"GradCache {gc['irflow'][-1]:.2f} vs {gc['sentence-transformers'][-1]:.2f} queries/s")
    res = {"machine": {**harness.machine(), "load": harness.loadavg()},
           "settings": {"steps": a.steps, "precision": "fp32", "ce": {"batch": 16, "max_length": 200},
                        "gradcache": {"batch": 64, "mini_batch": 16, "max_length": 200}},
           "cross_encoder_pairs_per_s": ce, "gradcache_queries_per_s": gc}
    for name, d in (("cross_encoder", ce), ("gradcache", gc)):
        res[f"{name}_ratio"] = round(sum(d["irflow"]) / sum(d["sentence-transformers"]), 3)
    harness.table(["what", "irflow", "sentence-transformers", "ratio"],
                  [[what, ", ".join(f"{x:.2f}" for x in d["irflow"]),
                    ", ".join(f"{x:.2f}" for x in d["sentence-transformers"]), res[f"{name}_ratio"]]
                   for what, name, d in (("cross-encoder (pairs/s)", "cross_encoder", ce),
                                         ("GradCache (queries/s)", "gradcache", gc))])
    print(f"wrote {harness.write_json(a.out, res)}")


if __name__ == "__main__":
    main()
