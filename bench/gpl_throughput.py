"""GPL stage throughput: irflow's stage code vs the same work done with plain library calls.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/gpl_throughput.py [--out bench/results/gpl_throughput.json]
        [--stages gen,ce,train] [--gen-passages 64] [--ce-pairs 512] [--train-steps 6] [--reps 2]
        [--no-st-loss]

Same process, same inputs, same settings; each stage runs its sides interleaved (irflow, plain,
irflow, plain, ...) ``--reps`` times and the best time of each side is reported, with the ratio
irflow/plain of the best rates (1.0 = no overhead, > 1 = irflow faster). Inputs are real SciFact
passages and queries read straight from the BEIR zip with json/csv.

1. Query generation (queries/s). A randomly initialised T5 with t5-small dimensions (d_model 512,
   d_ff 2048, 6+6 layers, 8 heads; MiniLM's WordPiece vocabulary, as irflow.dev.testing.make_tiny_t5
   builds its tiny one) saved to a temp dir: generation cost does not depend on the weights.
   irflow: ``irflow.learn.generation.BatchGenerator`` (what the t5 source calls per shard; it runs
   ``_generate_batch`` per batch) on a model from ``load_generator`` (given the model's path, as the
   stage passes its model ref's), passages as ``irflow.learn.text.passage_text``. plain: AutoTokenizer +
   AutoModelForSeq2SeqLM.generate in batches. Both: 1 query per passage, do_sample, top_p 0.95,
   top_k 25 (the stage's ``sample_top_k``), max_length 32, inputs truncated at 350 tokens, batch 16,
   the same torch seed before each side (so both sample the same queries; ``same_outputs`` checks
   it). Model loading is not timed. Generation runs in fp32 (the stage's precision ``auto`` for
   inference).
2. Cross-encoder scoring (pairs/s). MiniLM with a fresh 1-logit head
   (AutoModelForSequenceClassification, num_labels=1) saved to a temp dir. irflow:
   ``irflow.learn.scoring.cross_encoder_scores(path, pairs, batch_size=32, max_length=350)`` (what the
   ``pseudo_label`` stage's cross-encoder teacher calls; fp32, no autocast) -- it loads
   the model itself, so the plain side's timed region loads it too (``plain_scoring_only`` leaves
   the load out). plain: tokenize (query, passage) pairs in input order with truncation at 350,
   padding, inference_mode, ``model(**batch).logits``. irflow sorts pairs by length before
   batching; ``padded_tokens`` gives the tokens each order actually feeds the model.
   ``max_abs_diff`` compares the two score vectors.
3. Student training (examples/s = steps * batch / seconds). Margin-MSE (dot product, as the stage's
   default), all-MiniLM-L6-v2 as student, batch 16, max_seq_length 200, lr 2e-5, AdamW (weight decay
   0.01), linear warm-up schedule, grad clipping at 1.0, on SciFact train (query, positive, random
   negative) triples with random margins; 1 warm-up step then ``--train-steps`` timed steps, same
   batches on every side. Precision: ``--precision`` (default ``auto``: what the runtime picks for
   training here -- bf16 autocast only on hardware with native bf16, else fp32; the results in
   bench/results/gpl_throughput*.json used bf16 autocast), the same on every side. irflow: ``irflow.learn.training.train_loop``
   (given ``LoopParams`` and a ``StageRuntime`` with that precision) with the compute_loss the
   ``train_student`` stage builds (``_embed`` per column +
   ``irflow.learn.losses.MarginMSELoss.from_embeddings``), timed through ``irflow.learn.training._on_step``. plain:
   a manual loop, ``model.preprocess`` (``tokenize`` before sentence-transformers 6) +
   ``model(features)['sentence_embedding']`` per column +
   ``sentence_transformers`` MarginMSELoss's ``compute_loss_from_embeddings``. Extra arm
   ``st_loss`` (unless --no-st-loss): the same loop calling sentence-transformers' MarginMSELoss
   forward itself (``loss([fq, fp, fn], labels)``), which in sentence-transformers >= 6 embeds the
   positive and negative columns in one merged forward pass.

The defaults are the full sizes; on the shared 2-core machine bench/results/gpl_throughput.json was
made with ``--gen-passages 32 --ce-pairs 128 --train-steps 2 --no-st-loss`` (recorded under
``scaled_down``), which still took 14 minutes at load average 6-7.

The machine is shared (other benchmarks may run at the same time): ``environment.loadavg_*`` and
the per-stage loadavg record what else was going on; compare the two sides of one stage, which ran
back to back, rather than absolute rates across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import harness
from harness import ROOT, log, loadavg

DEFAULT_ZIP = harness.DATASETS / "scifact.zip"
SEED = 13


# ---- data: the BEIR zip read with json/csv only ------------------------------------------------
def read_scifact(zip_path: Path) -> dict:
    corpus, queries, qrels = harness.read_beir(zip_path, "train")
    return {"corpus": {d["_id"]: (d.get("title") or "", d.get("text") or "") for d in corpus}, "queries": queries,
            "train": [(q, d) for q, judged in qrels.items() for d, score in judged.items() if score > 0]}


def passage(title: str, text: str) -> str:
    return f"{title} {text}".strip()


# ---- timing helpers ----------------------------------------------------------------------------
def interleave(sides: dict, reps: int) -> dict:
    """Run each side's callable ``reps`` times, alternating (A, B, A, B, ...). Each callable returns
    (seconds, info). Returns per side: all times, best time, and the info of its last run."""
    out = {name: {"seconds": [], "cpu_seconds": [], "info": None} for name in sides}
    for r in range(reps):
        for name, fn in sides.items():
            gc.collect()
            la = loadavg()
            secs, cpu, info = fn()
            out[name]["seconds"].append(round(secs, 4))
            out[name]["cpu_seconds"].append(round(cpu, 4))
            out[name]["info"] = info
            log(f"  rep {r + 1} {name}: {secs:.2f} s wall, {cpu:.2f} s cpu (loadavg before {la[0]})")
    for v in out.values():
        v["best_seconds"] = min(v["seconds"])
        v["best_cpu_seconds"] = min(v["cpu_seconds"])
    return out


def summarize(stage: str, unit: str, work: int, res: dict, extra: dict | None = None) -> dict:
    rates = {k: work / v["best_seconds"] for k, v in res.items()}
    row = {"stage": stage, "unit": unit, "work_items": work,
           "irflow_per_s": round(rates["irflow"], 3), "plain_per_s": round(rates["plain"], 3),
           "ratio_irflow_over_plain": round(rates["irflow"] / rates["plain"], 3),
           "seconds": {k: v["seconds"] for k, v in res.items()},
           "cpu_seconds": {k: v["cpu_seconds"] for k, v in res.items()},
           # process CPU time is less sensitive to other processes on a shared machine than wall time
           "ratio_by_cpu_time": round(res["plain"]["best_cpu_seconds"] / res["irflow"]["best_cpu_seconds"], 3)}
    for k in rates:
        if k not in ("irflow", "plain"):
            row[f"{k}_per_s"] = round(rates[k], 3)
            row[f"ratio_irflow_over_{k}"] = round(rates["irflow"] / rates[k], 3)
    row.update(extra or {})
    return row


# ---- 1. query generation -----------------------------------------------------------------------
def make_t5_small_random(out_dir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    from irflow.engine.models import minilm_path

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(minilm_path())
    cfg = T5Config(vocab_size=tok.vocab_size, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                   num_heads=8, decoder_start_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id,
                   eos_token_id=tok.sep_token_id)
    T5ForConditionalGeneration(cfg).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"  # like T5's tokenizer: no token_type_ids
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    return out_dir


def bench_generation(data: dict, n_passages: int, reps: int, tmp: Path) -> dict:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from irflow.learn.generation import BatchGenerator, load_generator
    from irflow.learn.text import passage_text

    log("query generation: building a random t5-small-sized model")
    path = make_t5_small_random(tmp / "t5-small-random")
    rng = random.Random(SEED)
    ids = rng.sample(sorted(data["corpus"]), n_passages)
    texts = [passage_text(*data["corpus"][i]) for i in ids]
    gen = {"max_input_length": 350, "max_length": 32, "top_p": 0.95, "sample_top_k": 25}  # the stage's keys
    bs, n = 16, 1

    tok_i, model_i = load_generator(str(path), "cpu", path.name)
    generator = BatchGenerator(model_i, tok_i, gen, "cpu", bs)
    tok_p = AutoTokenizer.from_pretrained(str(path))
    model_p = AutoModelForSeq2SeqLM.from_pretrained(str(path)).eval()
    n_params = sum(p.numel() for p in model_p.parameters())

    def irflow_side():
        torch.manual_seed(SEED)
        t0, c0 = time.perf_counter(), time.process_time()
        out = generator(texts, n)
        return time.perf_counter() - t0, time.process_time() - c0, [q for qs in out for q in qs]

    def plain_side():
        torch.manual_seed(SEED)
        t0, c0 = time.perf_counter(), time.process_time()
        out = []
        for s in range(0, len(texts), bs):
            enc = tok_p(texts[s:s + bs], padding=True, truncation=True, max_length=gen["max_input_length"],
                        return_tensors="pt")
            with torch.inference_mode():
                ids_ = model_p.generate(**enc, do_sample=True, top_p=gen["top_p"], top_k=gen["sample_top_k"],
                                        max_length=gen["max_length"], num_return_sequences=n)
            out.extend(tok_p.batch_decode(ids_, skip_special_tokens=True))
        return time.perf_counter() - t0, time.process_time() - c0, out

    la0 = loadavg()
    res = interleave({"irflow": irflow_side, "plain": plain_side}, reps)
    q_i, q_p = res["irflow"].pop("info"), res["plain"].pop("info")
    input_tokens = sum(len(x) for x in tok_p(texts, truncation=True, max_length=350)["input_ids"])
    row = summarize("query generation", "queries/s", len(texts) * n, res, {
        "settings": {"passages": len(texts), "queries_per_passage": n, "batch_size": bs, **gen, "do_sample": True,
                     "model": "T5ForConditionalGeneration, random init, t5-small dims (d_model 512, d_ff 2048, "
                              "6+6 layers, 8 heads), MiniLM WordPiece vocab",
                     "parameters": n_params},
        "input_tokens_after_truncation": input_tokens,
        "same_outputs": q_i == q_p, "nonempty_queries": {"irflow": sum(bool(q.strip()) for q in q_i),
                                                         "plain": sum(bool(q.strip()) for q in q_p)},
        "loadavg": {"before": la0, "after": loadavg()}})
    del model_i, model_p, generator
    return row


# ---- 2. cross-encoder scoring ------------------------------------------------------------------
def bench_cross_encoder(data: dict, n_pairs: int, reps: int, tmp: Path) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from irflow.engine.models import minilm_path
    from irflow.learn.scoring import cross_encoder_scores

    log("cross-encoder: MiniLM with a fresh 1-logit head")
    path = tmp / "minilm-ce"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=1).save_pretrained(path)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(path)

    rng = random.Random(SEED + 1)
    train_q = sorted({q for q, _ in data["train"]})
    doc_ids = sorted(data["corpus"])
    pairs = [(data["queries"][rng.choice(train_q)], passage(*data["corpus"][rng.choice(doc_ids)]))
             for _ in range(n_pairs)]
    bs, max_len = 32, 350
    load_secs = []

    def irflow_side():
        t0, c0 = time.perf_counter(), time.process_time()
        s = cross_encoder_scores(str(path), pairs, batch_size=bs, max_length=max_len, device="cpu")
        return time.perf_counter() - t0, time.process_time() - c0, s

    def plain_side():
        t0, c0 = time.perf_counter(), time.process_time()
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        load_secs.append(time.perf_counter() - t0)
        out = []
        with torch.inference_mode():
            for s in range(0, len(pairs), bs):
                b = pairs[s:s + bs]
                enc = tok([q for q, _ in b], [p for _, p in b], padding=True, truncation=True, max_length=max_len,
                          return_tensors="pt")
                out.append(model(**enc).logits[:, 0].float().numpy())
        return time.perf_counter() - t0, time.process_time() - c0, np.concatenate(out)

    la0 = loadavg()
    res = interleave({"irflow": irflow_side, "plain": plain_side}, reps)
    s_i, s_p = res["irflow"].pop("info"), res["plain"].pop("info")
    diff = float(np.max(np.abs(s_i - s_p)))
    assert diff < 1e-3, f"cross-encoder scores differ: max abs diff {diff}"

    tok = AutoTokenizer.from_pretrained(str(path))
    lens = [len(x) for x in tok([q for q, _ in pairs], [p for _, p in pairs], truncation=True,
                                max_length=max_len)["input_ids"]]
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))

    def padded(idx):
        return sum(len(b) * max(lens[i] for i in b) for b in (idx[s:s + bs] for s in range(0, len(idx), bs)))

    best_plain = res["plain"]["best_seconds"]
    best_load = min(load_secs)
    row = summarize("cross-encoder scoring", "pairs/s", len(pairs), res, {
        "settings": {"pairs": len(pairs), "batch_size": bs, "max_length": max_len,
                     "model": "all-MiniLM-L6-v2 encoder + fresh 1-logit head (BertForSequenceClassification)",
                     "pairs_from": "SciFact train queries x random SciFact passages (title + ' ' + text)"},
        "max_abs_diff": diff,
        "tokens": {"real": sum(lens), "padded_irflow_length_sorted": padded(order),
                   "padded_plain_input_order": padded(list(range(len(pairs))))},
        "plain_load_seconds_best": round(best_load, 3),
        "plain_scoring_only_per_s": round(len(pairs) / (best_plain - best_load), 3),
        "note": "both sides' times include loading tokenizer+model (cross_encoder_scores loads it itself)",
        "loadavg": {"before": la0, "after": loadavg()}})
    return row


# ---- 3. student training ----------------------------------------------------------------------
def bench_training(data: dict, steps: int, reps: int, st_loss: bool, precision: str = "auto") -> dict:
    import contextlib

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import get_linear_schedule_with_warmup

    try:
        from sentence_transformers.sentence_transformer.losses import MarginMSELoss as STMarginMSE
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MarginMSELoss as STMarginMSE

    import irflow.learn.training as tr
    from irflow.learn.losses import MarginMSELoss
    from irflow.engine.models import minilm_path
    from irflow.engine.runtime import StageRuntime, precision_warning, resolve_precision
    from irflow.stages.train_student import _embed

    bs, max_seq, lr, warmup, seed = 16, 200, 2e-5, 1000, 42
    total = steps + 1
    rng = random.Random(SEED + 2)
    doc_ids = sorted(data["corpus"])
    judged: dict[str, set] = {}
    for q, d in data["train"]:
        judged.setdefault(q, set()).add(d)
    ex = {"q": [], "p": [], "n": []}
    for q, d in data["train"]:
        neg = rng.choice(doc_ids)
        while neg in judged[q]:
            neg = rng.choice(doc_ids)
        ex["q"].append(q), ex["p"].append(d), ex["n"].append(neg)
    ex["margin"] = np.random.default_rng(SEED).normal(0.0, 3.0, len(ex["q"])).astype(np.float32)
    qtext = {q: data["queries"][q] for q in ex["q"]}
    dtext = {d: passage(*data["corpus"][d]) for d in set(ex["p"]) | set(ex["n"])}
    plan = tr.BatchPlan(len(ex["q"]), bs, seed)
    batches = [plan.at(s) for s in range(total)]
    device = "cpu"
    precision = resolve_precision(precision, "train", device)
    if precision_warning(precision, "train", device):
        log(precision_warning(precision, "train", device))
    loop = tr.LoopParams(lr=lr, steps=total, seed=seed, checkpoint_every=0, max_grad_norm=1.0, weight_decay=0.01)
    rt = StageRuntime(device=device, precision=precision, threads=torch.get_num_threads())  # no resume dir

    def autocast():  # the plain side's own autocast, the same precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)

    def fresh_model():
        tr.seed_everything(seed)
        m = SentenceTransformer(minilm_path(), device=device)
        m.max_seq_length = max_seq
        return m

    def irflow_side():
        model = fresh_model()
        loss_fn = MarginMSELoss(similarity="dot")

        def compute_loss(idx):  # as the train_student stage builds it (loss margin_mse)
            q = _embed(model, [qtext[ex["q"][i]] for i in idx], device)
            p = _embed(model, [dtext[ex["p"][i]] for i in idx], device)
            n = _embed(model, [dtext[ex["n"][i]] for i in idx], device)
            return loss_fn.from_embeddings(q, p, n, torch.from_numpy(ex["margin"][idx]).to(device))

        stamps = {}
        orig = tr._on_step
        tr._on_step = lambda done: stamps.__setitem__(done, (time.perf_counter(), time.process_time()))
        tr.seed_everything(seed)
        try:
            hist = tr.train_loop(model, compute_loss, plan, loop, warmup, rt, "irflow train_loop")
        finally:
            tr._on_step = orig
        return (stamps[total][0] - stamps[1][0], stamps[total][1] - stamps[1][1], [h["loss"] for h in hist])

    def plain_loop(merged: bool):
        def run():
            model = fresh_model()
            st = STMarginMSE(model)
            # sentence-transformers >= 6 renamed tokenize to preprocess (tokenize warns)
            tokenize = getattr(model, "preprocess", None) or model.tokenize
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
            sched = get_linear_schedule_with_warmup(opt, warmup, total)
            tr.seed_everything(seed)
            losses, t1, c1 = [], None, None
            for step, idx in enumerate(batches):
                model.train()
                labels = torch.from_numpy(ex["margin"][idx])
                with autocast():
                    fq = tokenize([qtext[ex["q"][i]] for i in idx])
                    fp = tokenize([dtext[ex["p"][i]] for i in idx])
                    fn = tokenize([dtext[ex["n"][i]] for i in idx])
                    if merged:
                        loss = st([fq, fp, fn], labels)
                    else:
                        embs = [model(f)["sentence_embedding"] for f in (fq, fp, fn)]
                        loss = st.compute_loss_from_embeddings(embs, labels)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
                if step == 0:
                    t1, c1 = time.perf_counter(), time.process_time()
            return time.perf_counter() - t1, time.process_time() - c1, losses
        return run

    sides = {"irflow": irflow_side, "plain": plain_loop(False)}
    if st_loss:
        sides["st_loss"] = plain_loop(True)
    la0 = loadavg()
    res = interleave(sides, reps)
    losses = {k: [round(x, 5) for x in v.pop("info")] for k, v in res.items()}
    return summarize("student training (Margin-MSE)", "examples/s", steps * bs, res, {
        "settings": {"student": "all-MiniLM-L6-v2", "batch_size": bs, "max_seq_length": max_seq,
                     "precision": precision, "lr": lr, "warmup_steps": warmup, "similarity": "dot",
                     "timed_steps": steps, "warmup_steps_untimed": 1, "optimizer": "AdamW wd 0.01",
                     "grad_clip": 1.0, "train_examples": len(ex["q"]),
                     "data": "SciFact train (query, positive, random negative), random margins N(0, 3)"},
        "note": "irflow's AdamW has no weight decay on biases/LayerNorm (param groups); plain's decays all. "
                "st_loss = sentence-transformers' MarginMSELoss forward (merges the p and n columns into one "
                "forward pass).",
        "losses_last_rep": losses,
        "loadavg": {"before": la0, "after": loadavg()}})


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpl_throughput.json"))
    ap.add_argument("--zip", default=str(DEFAULT_ZIP))
    ap.add_argument("--stages", default="gen,ce,train")
    ap.add_argument("--gen-passages", type=int, default=64)
    ap.add_argument("--ce-pairs", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-st-loss", action="store_true")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                    help="training autocast precision, both sides (auto: the runtime's choice on this hardware)")
    args = ap.parse_args(argv)

    import torch

    la_start = loadavg()
    t_start = time.perf_counter()
    data = read_scifact(Path(args.zip))
    stages = args.stages.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="irflow-gpl-tp-") as tmp:
        if "gen" in stages:
            rows.append(bench_generation(data, args.gen_passages, args.reps, Path(tmp)))
        gc.collect()
        if "ce" in stages:
            rows.append(bench_cross_encoder(data, args.ce_pairs, args.reps, Path(tmp)))
        gc.collect()
        if "train" in stages:
            rows.append(bench_training(data, args.train_steps, args.reps, not args.no_st_loss, args.precision))

    m = harness.machine()
    result = {
        "benchmark": "gpl_throughput",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "method": "same process, same inputs; sides interleaved (irflow, plain, ...) x reps; best time per side; "
                  "ratio = irflow rate / plain rate",
        "reps": args.reps,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "zip")},
        "scaled_down": {k: (getattr(args, k), ap.get_default(k)) for k in ("gen_passages", "ce_pairs", "train_steps")
                        if getattr(args, k) != ap.get_default(k)} or None,
        "environment": {
            "cpu_count": m["cores"], "torch_threads": torch.get_num_threads(), "torch": m["torch"],
            "transformers": m["transformers"], "sentence_transformers": m["sentence-transformers"],
            "python": m["python"], "platform": m["platform"],
            "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
            "loadavg_start": la_start, "loadavg_end": loadavg(),
            "shared_machine": "yes: other heavy jobs (benchmarks) ran at the same time; absolute rates are "
                              "depressed and noisy, the interleaved irflow/plain ratio is the number to read",
        },
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "stages": rows,
    }
    out = harness.write_json(args.out, result)

    harness.table(["stage", "irflow/s", "plain/s", "ratio", "cpu-ratio", "unit", "n"],
                  [[r["stage"], f"{r['irflow_per_s']:.2f}", f"{r['plain_per_s']:.2f}",
                    f"{r['ratio_irflow_over_plain']:.3f}", f"{r['ratio_by_cpu_time']:.3f}", r["unit"], r["work_items"]]
                   for r in rows]
                  + [["  (st MarginMSELoss forward)", "", f"{r['st_loss_per_s']:.2f}",
                      f"{r['ratio_irflow_over_st_loss']:.3f}"] for r in rows if "st_loss_per_s" in r])
    print(f"loadavg start {la_start} end {result['environment']['loadavg_end']} (shared machine); -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
