"""GPL's student step, side by side: plain sentence-transformers against irflow's ``train_student``, on the
same model, batches, sequence length, loss and precision, each arm in a fresh process (its peak memory is
that process's).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/train_speed.py [--steps 20] [--reps 2]
        [--out bench/results/train_speed.json]

Inputs: SciFact train queries with a judged passage and another passage (real texts), a margin per
triple; all-MiniLM-L6-v2, batch 16, max_seq_length 200, Margin-MSE on dot products (GPL's), lr 2e-5, the
precision irflow resolves for training here (bf16 autocast where the CPU has AMX / AVX-512 BF16, else
fp32), the same batches in the same order (irflow's BatchPlan).
- sentence-transformers: its ``MarginMSELoss`` in a plain AdamW loop with clipping (its Trainer needs
  ``accelerate``, which irflow does not install; the loop is what the Trainer runs per step), as it comes
  (the positive and negative columns merged into one forward pass) and per column
  (``column_merging_disabled``: one forward pass per column, as irflow);
- irflow: ``train_student``'s process function (``fit_and_save``: the stage's model, loss, loop, schedule),
  with ``runtime.recompute_activations`` auto (the default) and true, and (``irflow-glibc-heap``) without
  ``steady_heap`` (glibc's own mmap threshold while training).
Seconds per step between the end of step 1 and the end of the last step; the loss of every step (the
curves must agree: same weights, same batches; dropout draws differ); ru_maxrss of the arm's process.
Arms alternate rep by rep so that load drifts hit each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import harness

ARMS = ("sentence-transformers", "sentence-transformers-per-column", "irflow-auto", "irflow-glibc-heap",
        "irflow-recompute")
BATCH, MAX_LEN, LR, SEED = 16, 200, 2e-5, 42


def triples(n: int) -> list[tuple[str, str, str, float]]:
    """(query, positive, negative, margin) from SciFact train: a judged passage and a random other one."""
    corpus, queries, qrels = harness.read_beir(harness.DATASETS / "scifact.zip", "train")
    docs = {str(d["_id"]): f"{d.get('title') or ''} {d['text']}".strip() for d in corpus}
    ids = sorted(docs)
    rng = random.Random(0)
    out = []
    for q, judged in qrels.items():
        d = next((d for d in judged if d in docs), None)
        if d is not None:
            out.append((queries[q], docs[d], docs[rng.choice(ids)], rng.gauss(4.0, 2.0)))
        if len(out) == n:
            break
    return out


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _precision() -> str:
    from irflow.engine.runtime import resolve_precision

    return resolve_precision("auto", "train", "cpu")


def arm_st(data, steps: int, merge: bool = True) -> dict:
    """``merge``: sentence-transformers 6's default, the positive and negative columns in one forward pass
    padded to the longer; False (``column_merging_disabled``): a forward pass per column, as irflow does."""
    import contextlib

    import torch
    from sentence_transformers.base.losses.merged_forward import column_merging_disabled
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MarginMSELoss

    from irflow.engine.models import minilm_path
    from irflow.learn.training import BatchPlan, seed_everything

    seed_everything(SEED)
    model = SentenceTransformer(minilm_path(), device="cpu")
    model.max_seq_length = MAX_LEN
    loss_fn = MarginMSELoss(model)
    plan = BatchPlan(len(data), BATCH, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    bf16 = _precision() == "bf16"
    times, losses, peaks = [], [], []
    model.train()
    for step in range(steps):
        idx = plan.at(step)
        feats = [model.tokenize([data[i][c] for i in idx]) for c in range(3)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                (contextlib.nullcontext() if merge else column_merging_disabled()):
            loss = loss_fn(feats, torch.tensor([data[i][3] for i in idx]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        peaks.append(_peak_mb())
        losses.append(float(loss.detach()))
    return {"times": times, "losses": losses, "peak_mb_by_step": peaks}


def arm_irflow(data, steps: int, recompute, heap: bool = True) -> dict:
    """``heap`` False: glibc's own mmap threshold during training (``irflow.engine.processes.steady_heap`` off)."""
    import contextlib

    import irflow.learn.training as training
    from irflow.engine.models import minilm_path
    from irflow.engine.runtime import StageRuntime
    from irflow.stages.train_student import TrainStudentParams, fit_and_save

    ex = {"q": [f"q{i}" for i in range(len(data))], "p": [f"p{i}" for i in range(len(data))],
          "n": [f"n{i}" for i in range(len(data))], "margin": [t[3] for t in data]}
    qtext = {f"q{i}": t[0] for i, t in enumerate(data)}
    dtext = {**{f"p{i}": t[1] for i, t in enumerate(data)}, **{f"n{i}": t[2] for i, t in enumerate(data)}}
    p = TrainStudentParams(loss="margin_mse", similarity="dot", batch_size=BATCH, max_seq_length=MAX_LEN, lr=LR,
                           steps=steps, warmup_steps=0, checkpoint_every=0, seed=SEED)
    times, peaks = [], []

    def tick(step):
        times.append(time.perf_counter())
        peaks.append(_peak_mb())

    training._on_step = tick
    if not heap:
        training.steady_heap = lambda device: contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as out:
        rt = StageRuntime(precision=_precision(), threads=os.cpu_count() or 2, work="train",
                          recompute_activations=recompute, workdir=out)
        fit_and_save({"ex": ex, "qtext": qtext, "dtext": dtext, "base_model": minilm_path(), "out": f"{out}/s",
                      "params": p.model_dump(mode="json")}, rt)
        history = json.loads(open(f"{out}/s/irflow_training.json").read())["history"]
    return {"times": times, "losses": [h["loss"] for h in history], "peak_mb_by_step": peaks}


def child(arm: str, steps: int, out: str) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    data = triples(BATCH * (steps + 1))
    if arm.startswith("sentence-transformers"):
        r = arm_st(data, steps, merge=arm == "sentence-transformers")
    else:
        r = arm_irflow(data, steps, True if arm == "irflow-recompute" else "auto", heap=arm != "irflow-glibc-heap")
    t = r["times"]
    r["seconds_per_step"] = (t[-1] - t[0]) / (len(t) - 1)
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r["precision"] = _precision()
    del r["times"]
    with open(out, "w") as f:
        json.dump(r, f)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per arm: the mean over reps of seconds per step, the highest peak, the first rep's mean loss; against
    sentence-transformers: the time ratio and the mean absolute gap between the first reps' loss curves."""
    base = "sentence-transformers"
    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {"seconds_per_step": round(sum(r["seconds_per_step"] for r in rs) / len(rs), 3),
                        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in rs)),
                        "mean_loss": round(sum(rs[0]["losses"]) / len(rs[0]["losses"]), 4)}
    if base in summary:
        for arm, s in summary.items():
            s["time_ratio"] = round(s["seconds_per_step"] / summary[base]["seconds_per_step"], 3)
            s["peak_ratio"] = round(s["peak_rss_mb"] / summary[base]["peak_rss_mb"], 3)
            gaps = [abs(x - y) for x, y in zip(runs[arm][0]["losses"], runs[base][0]["losses"])]
            s["mean_abs_loss_gap_vs_st"] = round(sum(gaps) / len(gaps), 4)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--out", default=str(harness.ROOT / "bench/results/train_speed.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.steps, a.child_out)
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    load = []
    for rep in range(a.reps):
        for arm in a.arms:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                load.append(harness.loadavg())
                subprocess.run([sys.executable, __file__, "--child", arm, "--steps", str(a.steps), "--child-out",
                                f.name], check=True, env={**os.environ, **harness.ENV, "TQDM_DISABLE": "1"})
                runs[arm].append(json.loads(open(f.name).read()))
            harness.log(f"rep {rep} {arm}: {runs[arm][-1]['seconds_per_step']:.3f} s/step, "
                        f"peak {runs[arm][-1]['peak_rss_mb']:.0f} MB")
    summary = summarize(runs)
    harness.table(["arm", "s/step", "x sentence-transformers", "peak RSS MB", "x peak", "mean loss", "loss gap vs ST"],
                  [[arm, s["seconds_per_step"], s.get("time_ratio", ""), s["peak_rss_mb"], s.get("peak_ratio", ""),
                    s["mean_loss"], s.get("mean_abs_loss_gap_vs_st", "")] for arm, s in summary.items()])
    res = {"machine": {**harness.machine(), "load_at_arm_starts": load},
           "settings": {"steps": a.steps, "reps": a.reps, "batch": BATCH, "max_seq_length": MAX_LEN, "lr": LR,
                        "loss": "margin_mse (dot)", "model": "all-MiniLM-L6-v2"},
           "summary": summary, "runs": runs}
    print(f"wrote {harness.write_json(a.out, res)}")


if __name__ == "__main__":
    main()
