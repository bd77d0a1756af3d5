"""NFCorpus on a lent GPU: irflow's own training code at budgets a 2-core CPU cannot give.

The device machine has CUDA, torch, transformers and sentence-transformers, but no Java, no DuckDB, no
faiss, no Prefect and no package index, and a call carries at most 64 MiB. So the pipeline does not run
there; its training functions do, on the very jobs its stages build:

    # here: capture the jobs from the CPU stores' catalogs (no training), and MiniLM in fp16
    .venv/bin/python bench/gpu_lease.py pack --out .lease
    # pydantic for the device's Python 3.12, as wheels (.whl/ is git-ignored, like .lease/):
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.3 pydantic-core==2.50.4 annotated-types \
        typing-inspection==0.4.5 typing-extensions==4.16.0
    # on the device machine (the `run` tool, carry [".lease", ".whl"]):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    HF_HUB_OFFLINE=1 python3 bench/gpu_lease.py run --bundle .lease --out $OUT --budget-s 460 2>$OUT/stderr.log
    # here: evaluate what came back with the evaluate stage's own function, paired tests
    .venv/bin/python bench/gpu_lease.py score --results /work/.device/... --bundle .lease

``pack`` calls each training stage's plain function (``stage.fn``) with the store's datasets and stops
it where it would train (``irflow.engine.distributed.run`` / ``irflow.learn.dual_encoder.train``): the job it would
run -- its examples, its texts, its params -- is saved, ids in place of texts. Three jobs:

- **gpl**: ``train_student`` on ``configs/gpl_nfcorpus_offline.yaml``'s pseudo-labels (teacher scores
  every candidate, 16 negatives; the CPU runs' labels, dataset id in the manifest).
- **md0**: ``train_dual_encoder[md0]`` of ``configs/rocketqa_nfcorpus_offline.yaml`` on the *fit* part of
  the train qrels (train queries minus a seeded dev cut: the cut ``cross_encoder_dev.py`` uses).
- **mc**: ``train_cross_encoder`` of the same config, on the fit part, negatives from M_D0's top 1000.

``run`` trains each with the stage's ``fit_and_save`` / ``train`` on CUDA (precision ``auto``: bf16
training), at a step count measured to fit the time given: a short calibration run first, then the
steps the remaining budget allows (capped). GPL and M_D0 are evaluated at a few points of their run on
the dev-cut queries (train-side: GPL never reads train qrels; M_D0 never saw these queries) and on test,
so the budget is chosen on dev. M_C scores M_D0's top 20 of the dev queries (AUC) and re-ranks M_D0's
test top 100 (the recipe's ``mc-rerank``). The base model travels as fp16 (the fp32 file alone is 87
MiB): ``run`` upcasts it, and its zero-shot is measured there with the same weights.

``score`` evaluates every returned ranking with ``irflow.stages.evaluate.evaluate_run`` (pytrec_eval),
picks each trained system's evaluation point by dev nDCG@10, runs paired t-tests on test against
zero-shot and BM25 (the CPU store's runs), and writes ``bench/results/gpu_nfcorpus.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

try:  # the device machine has no harness deps beyond the stdlib, but run it from the repo root there too
    import harness
    from harness import ROOT
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness
    from harness import ROOT

GPL_STORE = "/work/runs/gpl-nfcorpus"
RQ_STORE = "/work/runs/bench-nfcorpus"
DEV_SEED, DEV_SHARE, MAX_DEV = 7, 0.2, 300  # cross_encoder_dev.py's cut


# ---- pack (here) ---------------------------------------------------------------------------------
class Ref:
    """What a stage function reads of a DatasetRef: ``table()`` and ``path``."""

    def __init__(self, path: str, table=None, id: str = ""):
        self.path, self._table, self.id = path, table, id

    def table(self):
        return self._table


class Captured(Exception):
    pass


def _capture(module, name: str, sink: dict):
    """Replace ``module.name`` with a function that records its arguments and stops the stage."""
    original = getattr(module, name)

    def fake(*args, **kwargs):
        sink["args"] = args
        raise Captured

    setattr(module, name, fake)
    return lambda: setattr(module, name, original)


def pack(args) -> None:
    import duckdb
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file, save_file

    from cross_encoder_dev import dev_cut
    from irflow.engine import distributed
    from irflow.engine.models import minilm_path
    from irflow.engine.runtime import StageRuntime
    from irflow.stages import train_dual_encoder as tde
    from irflow.stages.train_cross_encoder import TrainCrossEncoderParams, train_cross_encoder
    from irflow.stages.train_dual_encoder import TrainDualEncoderParams
    from irflow.stages.train_student import TrainStudentParams, train_student
    from irflow.learn.text import passage_texts, query_texts

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    def obj(store: str, dataset_id: str):
        return pq.read_table(Path(store) / "objects" / dataset_id / "data.parquet")

    def params_of(store: str, dataset_id: str) -> dict:
        con = duckdb.connect(str(Path(store) / "catalog.duckdb"), read_only=True)
        row = con.execute("SELECT params FROM datasets WHERE dataset_id = ?", [dataset_id]).fetchone()
        con.close()
        return json.loads(row[0])

    def parents(store: str, dataset_id: str) -> dict:
        con = duckdb.connect(str(Path(store) / "catalog.duckdb"), read_only=True)
        rows = con.execute("SELECT role, parent_id FROM edges WHERE child_id = ?", [dataset_id]).fetchall()
        con.close()
        return dict(rows)

    def latest(store: str, stage: str) -> str:
        con = duckdb.connect(str(Path(store) / "catalog.duckdb"), read_only=True)
        row = con.execute("SELECT dataset_id FROM datasets WHERE stage = ? ORDER BY created_at DESC", [stage]).fetchone()
        con.close()
        return row[0]

    # the GPL config's student at seed 42 (the CPU row), and the RocketQA recipe's M_D0 / M_C / mc-rerank
    gpl_student = args.gpl_student
    gpl_in = parents(args.gpl_store, gpl_student)
    mc_model = args.mc_model or latest(args.rq_store, "train_cross_encoder")
    mc_in = parents(args.rq_store, mc_model)
    mc_rerank_in = parents(args.rq_store, args.mc_rerank or latest(args.rq_store, "rerank[mc]"))
    md0_train_run = args.md0_train_run or latest(args.rq_store, "dense_search[md0-train]")
    manifest = {"gpl_store": args.gpl_store, "rq_store": args.rq_store, "gpl_student_cpu": gpl_student,
                "gpl_inputs": gpl_in, "mc_cpu": mc_model, "mc_inputs": mc_in, "md0_test_run": mc_rerank_in["ranking"],
                "md0_train_run": md0_train_run, "dev_cut": {"seed": DEV_SEED, "share": DEV_SHARE, "max": MAX_DEV}}
    corpus = obj(args.rq_store, mc_in["corpus"])
    assert gpl_in["corpus"] == mc_in["corpus"], "the two stores ingested different corpora"
    qrels = obj(args.rq_store, mc_in["qrels"])
    train_q = obj(args.rq_store, mc_in["queries"])
    test_q = obj(args.rq_store, mc_rerank_in["queries"])

    # the dev cut of the labelled train queries (cross_encoder_dev.py's)
    train = qrels.filter(pc.equal(qrels.column("split"), "train"))
    labelled, dev = dev_cut(train, DEV_SEED, DEV_SHARE, MAX_DEV)
    n_dev = len(dev)
    fit_qrels = train.filter(pc.invert(pc.is_in(train.column("query_id"), pa.array(dev))))
    manifest["dev_queries"], manifest["fit_queries"] = len(dev), len(labelled) - n_dev

    # texts once; jobs refer to them by id
    doc_ids = corpus.column("doc_id").to_pylist()
    doc_text = dict(zip(doc_ids, passage_texts(corpus)))
    qtext = {**query_texts(train_q), **query_texts(test_q)}
    pq.write_table(pa.table({"doc_id": doc_ids, "text": [doc_text[d] for d in doc_ids]}), out / "corpus.parquet",
                   compression="zstd")
    pq.write_table(pa.table({"query_id": list(qtext), "text": list(qtext.values())}), out / "queries.parquet",
                   compression="zstd")
    q_rows = [(q, "dev") for q in dev] + [(q, "test") for q in test_q.column("query_id").to_pylist()]
    pq.write_table(pa.table({"query_id": [q for q, _ in q_rows], "split": [s for _, s in q_rows],
                             "text": [qtext[q] for q, _ in q_rows]}), out / "eval_queries.parquet", compression="zstd")
    text_id = {t: d for d, t in doc_text.items()}
    qtext_id = {t: q for q, t in qtext.items()}
    rt = StageRuntime(workdir=Path(tempfile.mkdtemp()))
    base = Ref(minilm_path() or "all-MiniLM-L6-v2")

    # gpl: train_student's job as it is (its texts are dicts by id already)
    sink: dict = {}
    undo = _capture(distributed, "run", sink)
    try:
        p = TrainStudentParams(**params_of(args.gpl_store, gpl_student))
        labels = obj(args.gpl_store, gpl_in["pseudo_labels"])
        train_student.fn(p, rt, queries=Ref("", obj(args.gpl_store, gpl_in["queries"])), corpus=Ref("", corpus),
                         base_model=base, pseudo_labels=Ref("", labels))
    except Captured:
        pass
    finally:
        undo()
    job = sink["args"][1]
    job["dtext"] = sorted(job["dtext"])  # ids only: the device rebuilds the texts from corpus.parquet
    _write_job(out / "gpl.json.gz", job)
    manifest["gpl"] = {"params": p.model_dump(mode="json"), "examples": len(job["ex"]["q"]),
                       "queries": len(job["qtext"]), "pseudo_labels": gpl_in["pseudo_labels"],
                       "pseudo_label_params": params_of(args.gpl_store, gpl_in["pseudo_labels"])}

    # md0: train_dual_encoder[md0]'s job on the fit qrels
    md0_cpu = args.md0_model or latest(args.rq_store, "train_dual_encoder[md0]")
    sink = {}
    undo = _capture(tde, "train", sink)
    try:
        p = TrainDualEncoderParams(**{**params_of(args.rq_store, md0_cpu), "seed": 42})
        tde.train_dual_encoder.fn(p, rt, queries=[Ref("", train_q)], corpus=Ref("", corpus), base_model=base,
                                  qrels=[Ref("", fit_qrels)])
    except Captured:
        pass
    finally:
        undo()
    j = sink["args"][0]
    d = {k: v for k, v in vars(j).items()}
    d["queries"] = [qtext_id[t] for t in j.queries]
    d["positives"] = [text_id[t] for t in j.positives]
    d["negatives"] = [[text_id[t] for t in ns] for ns in j.negatives]
    _write_job(out / "md0.json.gz", d)
    manifest["md0"] = {"params": p.model_dump(mode="json"), "examples": len(j.queries), "cpu_model": md0_cpu}

    # mc: train_cross_encoder's job on the fit qrels, negatives from M_D0's top 1000 (the recipe's)
    sink = {}
    undo = _capture(distributed, "run", sink)
    try:
        p = TrainCrossEncoderParams(**{**params_of(args.rq_store, mc_model),
                                       "positives_per_query": args.mc_positives_per_query})
        train_cross_encoder.fn(p, rt, queries=Ref("", train_q), corpus=Ref("", corpus), qrels=Ref("", fit_qrels),
                               base_model=base, negatives=Ref("", obj(args.rq_store, mc_in["negatives"])))
    except Captured:
        pass
    finally:
        undo()
    job = sink["args"][1]
    job["dtext"] = sorted(job["dtext"])
    _write_job(out / "mc.json.gz", job)
    manifest["mc"] = {"params": p.model_dump(mode="json"), "pairs": len(job["ex"]["q"]),
                      "positives": int(sum(job["ex"]["label"]))}

    # candidates M_C reads: M_D0's top 20 of the dev queries (train side), its top 100 on test
    run = obj(args.rq_store, md0_train_run)
    run = run.filter(pc.and_(pc.is_in(run.column("query_id"), pa.array(dev)), pc.less_equal(run.column("rank"), 20)))
    test_run = obj(args.rq_store, mc_rerank_in["ranking"])
    test_run = test_run.filter(pc.less_equal(test_run.column("rank"), 100))
    cand = pa.concat_tables([
        pa.table({"split": ["dev"] * run.num_rows, "query_id": run.column("query_id"), "doc_id": run.column("doc_id"),
                  "rank": run.column("rank").cast(pa.int32()), "score": run.column("score").cast(pa.float32())}),
        pa.table({"split": ["test"] * test_run.num_rows, "query_id": test_run.column("query_id"),
                  "doc_id": test_run.column("doc_id"), "rank": test_run.column("rank").cast(pa.int32()),
                  "score": test_run.column("score").cast(pa.float32())})])
    pq.write_table(cand, out / "mc_candidates.parquet", compression="zstd")

    # MiniLM in fp16 (every other file as it is); run upcasts it
    src = Path(base.path)
    dst = out / "minilm"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "README.md", ".gitattributes",
                                                            "onnx", "openvino", "*.onnx"))
    weights = load_file(src / "model.safetensors")
    save_file({k: v.to(torch.float16) for k, v in weights.items()}, dst / "model.fp16.safetensors")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"packed {out}: {size / 2**20:.1f} MiB; gpl {manifest['gpl']['examples']} examples, md0 "
          f"{manifest['md0']['examples']}, mc {manifest['mc']['pairs']} pairs; {len(dev)} dev / "
          f"{test_q.num_rows} test queries")


def _write_job(path: Path, job: dict) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(job, f)


def _read_job(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


# ---- run (device) --------------------------------------------------------------------------------
def run(args) -> None:
    try:
        import duckdb  # noqa: F401
    except ImportError:
        # irflow.engine.catalog / irflow.learn.fusion import it at module level; nothing run here touches the catalog
        sys.modules["duckdb"] = types.ModuleType("duckdb")
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file, save_file

    import irflow.learn.encoding
    import irflow.learn.training
    from irflow.learn.dual_encoder import Job
    from irflow.learn.dual_encoder import train as train_dual
    from irflow.learn.encoding import encode_texts
    from irflow.engine.runtime import StageRuntime, host_info, resolve_precision
    from irflow.learn.scoring import cross_encoder_scores
    from irflow.stages import train_cross_encoder as tce
    from irflow.stages import train_student as ts

    t0 = time.time()
    deadline = t0 + args.budget_s
    bundle, out = Path(args.bundle), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    train_rt = StageRuntime(device=device, precision=resolve_precision("auto", "train", device),
                            threads=os.cpu_count() or 2, work="train", recompute_activations=False)
    report: dict = {"host": host_info(device), "torch": torch.__version__, "train_precision": train_rt.precision,
                    "budget_s": args.budget_s, "parts": {}}
    rows: list[dict] = []

    def save():
        (out / "report.json").write_text(json.dumps(report, indent=1))
        if rows:
            pq.write_table(pa.Table.from_pylist(rows), out / "runs.parquet", compression="zstd")

    # the base model: fp16 weights carried, upcast to fp32 here
    base = Path(tempfile.mkdtemp()) / "minilm"
    shutil.copytree(bundle / "minilm", base, ignore=shutil.ignore_patterns("model.fp16.safetensors"))
    save_file({k: v.float() for k, v in load_file(bundle / "minilm" / "model.fp16.safetensors").items()},
              base / "model.safetensors")
    corpus = pq.read_table(bundle / "corpus.parquet")
    doc_ids = corpus.column("doc_id").to_pylist()
    doc_text = dict(zip(doc_ids, corpus.column("text").to_pylist()))
    evq = pq.read_table(bundle / "eval_queries.parquet")
    eval_qids, eval_split, eval_texts = (evq.column(c).to_pylist() for c in ("query_id", "split", "text"))
    allq = pq.read_table(bundle / "queries.parquet")
    query_text = dict(zip(allq.column("query_id").to_pylist(), allq.column("text").to_pylist()))
    if args.smoke:  # a CPU check of this path: a slice of the corpus, a few steps
        doc_ids = doc_ids[:300]
    docs = [doc_text[d] for d in doc_ids]

    def retrieve(model, system: str, step: int) -> float:
        """Top 100 of every dev/test query by ``model`` (flat inner product on the device, as the dense
        stages' flat index; cos: normalised); rows appended. Returns the seconds it took."""
        s = time.time()
        model.eval()
        with torch.no_grad():
            d = torch.from_numpy(encode_texts(model, docs, 64, True, desc=f"encode {system}")).to(device)
            q = torch.from_numpy(encode_texts(model, eval_texts, 64, True, desc="encode queries")).to(device)
            scores, idx = torch.topk(q @ d.T, min(100, len(docs)), dim=1)
        for qi, (qid, split) in enumerate(zip(eval_qids, eval_split)):
            for r, (sc, di) in enumerate(zip(scores[qi].tolist(), idx[qi].tolist()), 1):
                rows.append({"system": system, "step": step, "split": split, "query_id": qid,
                             "doc_id": doc_ids[di], "rank": r, "score": float(sc)})
        return time.time() - s

    def fresh(path, max_len):
        from sentence_transformers import SentenceTransformer

        m = SentenceTransformer(str(path), device=device)
        if max_len:
            m.max_seq_length = int(max_len)
        return m

    # zero-shot with these weights, at the two lengths the configs encode with
    for name, max_len in (("zero-shot", None), ("zero-shot-128", 128)):
        report.setdefault("zero_shot_eval_s", {})[name] = round(retrieve(fresh(base, max_len), name, 0), 1)
    save()

    # the model a training function loads, so the step hook can evaluate it; always a fresh one
    holder: dict = {}

    def load_fresh(path, device=device, max_seq_length=None, **_):
        holder["model"] = fresh(path, max_seq_length)
        return holder["model"]

    irflow.learn.encoding.load_sentence_transformer = load_fresh

    def timed_steps(fn, steps: int, evals=(), system="", eval_len=None) -> tuple[float, float, list]:
        """Run ``fn(steps)``; (seconds per step from step 5 on, total seconds, eval seconds)."""
        marks: dict[int, float] = {}
        eval_s: list[float] = []

        def hook(step: int) -> None:
            marks[step] = time.time()
            if step in evals:
                m = holder["model"]
                keep_len = m.max_seq_length
                if eval_len:
                    m.max_seq_length = eval_len
                eval_s.append(retrieve(m, system, step))
                m.max_seq_length = keep_len
                marks[step] = time.time()  # the next step's time excludes this evaluation
                save()

        irflow.learn.training._on_step = hook
        s = time.time()
        fn(steps)
        total = time.time() - s
        per = [marks[k + 1] - marks[k] for k in range(5, steps) if k in marks and k + 1 in marks
               and k not in evals]
        return (float(np.median(per)) if per else total / steps), total, eval_s

    def budget_for(share: float) -> float:
        return max(0.0, min(share * args.budget_s, deadline - time.time() - 15))

    def plan(name: str, fn, share: float, max_steps: int, n_evals: int, eval_guess: float) -> dict:
        """Calibrate (a short run), then the steps that fit this part's budget."""
        info: dict = {}
        calib = 8 if args.smoke else 30
        rate, total, _ = timed_steps(fn, calib)
        info["calibration"] = {"steps": calib, "s_per_step": round(rate, 4), "total_s": round(total, 1)}
        budget = budget_for(share) - total
        setup = total - rate * calib  # model load and the rest that every run pays once
        steps = int((budget - setup - n_evals * eval_guess) / rate)
        steps = max(0, min(max_steps, steps))
        info.update({"budget_s": round(budget, 1), "steps": steps})
        report["parts"][name] = info
        save()
        return info

    eval_s = max(report["zero_shot_eval_s"].values())

    # ---- GPL: the config's pseudo-labels, Margin-MSE (train_student.fit_and_save) ----
    def part_gpl():
        job = _read_job(bundle / "gpl.json.gz")
        job["dtext"] = {d: doc_text[d] for d in job["dtext"]}
        job["base_model"] = str(base)
        p = dict(job["params"], batch_size=args.gpl_batch, checkpoint_every=0)

        def fn(steps):
            job["params"] = dict(p, steps=steps, warmup_steps=max(1, int(0.1 * steps)))
            job["out"] = tempfile.mkdtemp()
            ts.fit_and_save(job, train_rt)

        info = plan("gpl", fn, args.gpl_share, args.max_steps, 3, eval_s)
        steps = info["steps"]
        if steps < 10:
            return
        evals = sorted({steps // 4, steps // 2, steps})
        rate, total, ev = timed_steps(fn, steps, evals, "gpl")
        info.update({"s_per_step": round(rate, 4), "train_s": round(total - sum(ev), 1), "evals": evals,
                     "eval_s": [round(e, 1) for e in ev], "params": job["params"],
                     "examples": len(job["ex"]["q"]),
                     "epochs": round(steps * args.gpl_batch / len(job["ex"]["q"]), 2)})
        log = json.loads((Path(job["out"]) / irflow.learn.training.TRAINING_LOG).read_text())
        info["loss_first_last"] = [log["history"][0]["loss"], log["history"][-1]["loss"]]
        save()

    # ---- M_D0: the RocketQA config's first dual encoder on the fit qrels (dual_encoder.train) ----
    def part_md0():
        d = _read_job(bundle / "md0.json.gz")
        d["queries"] = [query_text[q] for q in d["queries"]]
        d["positives"] = [doc_text[x] for x in d["positives"]]
        d["negatives"] = [[doc_text[x] for x in ns] for ns in d["negatives"]]
        d["model_path"] = str(base)
        p = dict(d["params"], checkpoint_every=0)

        def fn(steps):
            d["params"] = dict(p, steps=steps)
            d["out_dir"] = tempfile.mkdtemp()
            train_dual(Job(**d), train_rt)

        info = plan("md0", fn, args.md0_share, args.max_steps, 4, eval_s)
        steps = info["steps"]
        if steps < 10:
            return
        evals = sorted({steps // 8, steps // 4, steps // 2, steps})
        rate, total, ev = timed_steps(fn, steps, evals, "md0", 128)
        info.update({"s_per_step": round(rate, 4), "train_s": round(total - sum(ev), 1), "evals": evals,
                     "eval_s": [round(e, 1) for e in ev], "params": d["params"], "examples": len(d["queries"]),
                     "epochs": round(steps * p["batch_size"] / len(d["queries"]), 2)})
        save()

    # ---- M_C: the cross-encoder on the fit pairs (train_cross_encoder.fit_and_save) ----
    def part_mc():
        job = _read_job(bundle / "mc.json.gz")
        job["dtext"] = {d: doc_text[d] for d in job["dtext"]}
        job["base_model"] = str(base)
        p = dict(job["params"], batch_size=args.mc_batch, lr=args.mc_lr, head_lr=args.mc_head_lr, checkpoint_every=0)
        n_pairs = len(job["ex"]["q"])

        def fn(steps):
            job["params"] = dict(p, steps=steps, warmup_steps=max(1, int(0.1 * steps)))
            job["out"] = tempfile.mkdtemp()
            tce.fit_and_save(job, train_rt)

        info = plan("mc", fn, args.mc_share, min(args.max_steps, int(args.mc_epochs * n_pairs / args.mc_batch)), 0, 0.0)
        steps = info["steps"]
        if steps < 10:
            return
        rate, total, _ = timed_steps(fn, steps)
        info.update({"s_per_step": round(rate, 4), "train_s": round(total, 1), "params": job["params"],
                     "pairs": n_pairs, "epochs": round(steps * args.mc_batch / n_pairs, 3)})
        cand = pq.read_table(bundle / "mc_candidates.parquet")
        if args.smoke:
            cand = cand.slice(0, 200)
        pairs_q = cand.column("query_id").to_pylist()
        pairs_d = cand.column("doc_id").to_pylist()
        qtext = query_text
        s = time.time()
        logits = cross_encoder_scores(job["out"], [(qtext[q], doc_text[x]) for q, x in zip(pairs_q, pairs_d)],
                                      batch_size=256, max_length=p["max_length"], device=device)
        info["score_s"] = round(time.time() - s, 1)
        for split, q, x, sc in zip(cand.column("split").to_pylist(), pairs_q, pairs_d, np.asarray(logits).tolist()):
            rows.append({"system": "mc", "step": steps, "split": split, "query_id": q, "doc_id": x, "rank": 0,
                         "score": float(sc)})
        log = json.loads((Path(job["out"]) / irflow.learn.training.TRAINING_LOG).read_text())
        tail = log["history"][-max(1, len(log["history"]) // 10):]
        info["final_loss"] = round(float(np.mean([h["loss"] for h in tail])), 4)
        save()

    for name, part in (("gpl", part_gpl), ("md0", part_md0), ("mc", part_mc)):
        if name not in args.parts.split(","):
            continue
        try:
            part()
        except Exception as e:  # one part's failure must not lose the others' results
            import traceback

            report["parts"].setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            print(f"{name} failed: {e!r}", file=sys.stderr)
        report["elapsed_s"] = round(time.time() - t0, 1)
        save()
        print(f"[{time.time() - t0:6.1f}s] {name}: {json.dumps(report['parts'].get(name, {}))[:600]}", flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "parts"}))


# ---- score (here) --------------------------------------------------------------------------------
def score(args) -> None:
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from irflow.learn.stats import paired
    from irflow.stages.evaluate import evaluate_run

    bundle, res = Path(args.bundle), Path(args.results)
    manifest = json.loads((bundle / "manifest.json").read_text())
    report = json.loads((res / "report.json").read_text())
    runs = pq.read_table(res / "runs.parquet")
    qrels_t = pq.read_table(Path(manifest["rq_store"]) / "objects" / manifest["mc_inputs"]["qrels"] / "data.parquet")
    evq = pq.read_table(bundle / "eval_queries.parquet")
    split_of = dict(zip(evq.column("query_id").to_pylist(), evq.column("split").to_pylist()))
    qrels: dict[str, dict] = {"dev": {}, "test": {}}
    for q, d, s, sp in zip(*(qrels_t.column(c).to_pylist() for c in ("query_id", "doc_id", "score", "split"))):
        want = split_of.get(q)
        if want and ((want == "dev" and sp == "train") or (want == "test" and sp == "test")):
            qrels[want].setdefault(q, {})[d] = int(s)

    def per_query(system: str, step: int, split: str) -> dict[str, float]:
        t = runs.filter(pc.and_(pc.and_(pc.equal(runs.column("system"), system), pc.equal(runs.column("step"), step)),
                                pc.equal(runs.column("split"), split)))
        results: dict = {}
        for q, d, s in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
            results.setdefault(q, {})[d] = float(s)
        ev = evaluate_run(qrels[split], results, ["ndcg@10", "recall@100"])
        return ev

    def cpu_run(dataset_id: str, split: str = "test") -> dict[str, float]:
        t = pq.read_table(Path(manifest["rq_store"]) / "objects" / dataset_id / "data.parquet")
        results: dict = {}
        for q, d, s in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
            results.setdefault(q, {})[d] = float(s)
        return evaluate_run(qrels[split], results, ["ndcg@10", "recall@100"])

    def mean(v: dict) -> float:
        return round(float(np.mean(list(v.values()))), 4)

    out: dict = {"machine": report["host"], "torch": report["torch"], "train_precision": report["train_precision"],
                 "manifest": manifest, "parts": report["parts"], "systems": {}}
    pairs = {(r["system"], r["step"]) for r in runs.select(["system", "step"]).to_pylist()}
    table = []
    for system, step in sorted(pairs):
        row = {"system": system, "step": step}
        for split in ("dev", "test"):
            ev = per_query(system, step, split)
            row[split] = {"ndcg@10": mean(ev["ndcg@10"]), "recall@100": mean(ev["recall@100"])}
            row[f"_{split}_per_query"] = ev["ndcg@10"]
        out["systems"][f"{system}@{step}"] = {k: v for k, v in row.items() if not k.startswith("_")}
        table.append(row)

    zs = next(r for r in table if r["system"] == "zero-shot")
    zs128 = next((r for r in table if r["system"] == "zero-shot-128"), zs)
    import duckdb

    con = duckdb.connect(str(Path(manifest["rq_store"]) / "catalog.duckdb"), read_only=True)
    bm25_id = con.execute("SELECT dataset_id FROM datasets WHERE stage = 'bm25_search[flat]' "
                          "ORDER BY created_at DESC").fetchone()[0]
    zs_cpu_id = con.execute("SELECT dataset_id FROM datasets WHERE stage = 'dense_search[zero-shot]' "
                            "ORDER BY created_at DESC").fetchone()[0]
    con.close()
    bm25 = cpu_run(bm25_id)["ndcg@10"]
    zs_cpu = cpu_run(zs_cpu_id)["ndcg@10"]
    out["reference"] = {"bm25_cpu": {"run": bm25_id, "ndcg@10": mean(bm25)},
                        "zero_shot_cpu_fp32": {"run": zs_cpu_id, "ndcg@10": mean(zs_cpu)},
                        "zero_shot_fp16_weights_here": zs["test"], "zero_shot_128_fp16_weights_here": zs128["test"]}

    def test_against(row, ref: dict, name: str) -> dict:
        a = row["_test_per_query"]
        common = sorted(set(a) & set(ref))
        r = paired({q: ref[q] for q in common}, {q: a[q] for q in common}).to_dict()
        return {"against": name, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}

    chosen = {}
    for system in sorted({r["system"] for r in table} - {"zero-shot", "zero-shot-128"}):
        rows = [r for r in table if r["system"] == system]
        ref = zs128 if system in ("md0", "mc") else zs
        if system == "mc":
            best = rows[-1]  # one training; its dev row is AUC-checked below
        else:
            best = max(rows, key=lambda r: r["dev"]["ndcg@10"])  # the budget, chosen on train-side dev
        chosen[system] = {"step": best["step"], "dev": best["dev"], "test": best["test"],
                          "dev_zero_shot": ref["dev"], "test_zero_shot": ref["test"],
                          "vs_zero_shot": test_against(best, ref["_test_per_query"], "zero-shot (same weights)"),
                          "vs_bm25": test_against(best, bm25, "BM25 (CPU store)")}
    out["chosen_on_dev"] = chosen
    if "mc" in {r["system"] for r in table}:
        from sklearn.metrics import roc_auc_score

        # what M_C re-ranks: the CPU store's M_D0 (40 steps), its own order on the same candidates
        cand = pq.read_table(bundle / "mc_candidates.parquet")
        first = {}
        for split in ("dev", "test"):
            t = cand.filter(pc.equal(cand.column("split"), split))
            results: dict = {}
            for q, d, s in zip(*(t.column(c).to_pylist() for c in ("query_id", "doc_id", "score"))):
                results.setdefault(q, {})[d] = float(s)
            first[split] = evaluate_run(qrels[split], results, ["ndcg@10"])["ndcg@10"]
        mc_row = next(r for r in table if r["system"] == "mc")
        out["chosen_on_dev"]["mc"]["md0_cpu_order"] = {"dev_depth20_ndcg@10": mean(first["dev"]),
                                                       "test_depth100_ndcg@10": mean(first["test"])}
        out["chosen_on_dev"]["mc"]["vs_md0_cpu_order"] = test_against(mc_row, first["test"], "M_D0 (CPU) order")
        t = runs.filter(pc.and_(pc.equal(runs.column("system"), "mc"), pc.equal(runs.column("split"), "dev")))
        y = [d in qrels["dev"].get(q, {}) and qrels["dev"][q][d] > 0 for q, d in
             zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist())]
        out["chosen_on_dev"]["mc"]["dev_auc"] = round(float(roc_auc_score(y, t.column("score").to_numpy())), 4)
        c = cand.filter(pc.equal(cand.column("split"), "dev"))
        y0 = [d in qrels["dev"].get(q, {}) and qrels["dev"][q][d] > 0 for q, d in
              zip(c.column("query_id").to_pylist(), c.column("doc_id").to_pylist())]
        out["chosen_on_dev"]["mc"]["md0_cpu_order"]["dev_auc"] = round(float(roc_auc_score(y0, c.column("score").to_numpy())),
                                                                       4)
    harness.table(["system", "step", "dev nDCG@10", "test nDCG@10", "test R@100"],
                  [[r["system"], r["step"], r["dev"]["ndcg@10"], r["test"]["ndcg@10"], r["test"]["recall@100"]]
                   for r in table])
    for s, c in chosen.items():
        print(f"{s} (step {c['step']}, chosen on dev): test {c['test']['ndcg@10']} vs zero-shot "
              f"{c['test_zero_shot']['ndcg@10']}: {c['vs_zero_shot']}; vs BM25 {c['vs_bm25']}"
              + (f"; dev AUC {c['dev_auc']}; M_D0 order {c['md0_cpu_order']}, vs it {c['vs_md0_cpu_order']}"
                 if "dev_auc" in c else ""))
    dest = harness.write_json(args.out or ROOT / "bench/results/gpu_nfcorpus.json", out)
    print(f"wrote {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack")
    a.add_argument("--out", default=str(ROOT / ".lease"))
    a.add_argument("--gpl-store", default=GPL_STORE)
    a.add_argument("--rq-store", default=RQ_STORE)
    a.add_argument("--mc-positives-per-query", type=int, default=None,
                   help="M_C: at most this many positives of each query (the stage's positives_per_query)")
    # the datasets this session's pack read (bench/results/gpu_nfcorpus*.json); "" takes the store's latest
    a.add_argument("--mc-model", default="cross_encoder-26e2392f90b13105", help="the CPU M_C whose params and "
                                                                                "inputs (negatives) are taken")
    a.add_argument("--mc-rerank", default="run-bbd476b5abd61925", help="the CPU mc-rerank run: its M_D0 test "
                                                                      "ranking is what M_C re-ranks")
    a.add_argument("--md0-train-run", default="run-017c62fca0010dc6", help="an M_D0's train-query ranking: "
                                                                          "the dev queries' candidates (this "
                                                                          "one: seed 44, 40 steps, whole train "
                                                                          "split)")
    a.add_argument("--md0-model", default="model-5fa439b993aec8c7", help="the CPU M_D0 whose params are taken "
                                                                        "(seed set to 42; steps set on the device)")
    a.add_argument("--gpl-student", default="student-69bcc5544d069067", help="the CPU GPL student (seed 42) whose "
                                                                            "job is taken")
    b = sub.add_parser("run")
    b.add_argument("--bundle", default=".lease")
    b.add_argument("--out", required=True)
    b.add_argument("--device", default="cuda")
    b.add_argument("--budget-s", type=float, default=470)
    b.add_argument("--parts", default="gpl,md0,mc")
    b.add_argument("--gpl-share", type=float, default=0.40)
    b.add_argument("--md0-share", type=float, default=0.17)
    b.add_argument("--mc-share", type=float, default=0.30)
    b.add_argument("--gpl-batch", type=int, default=32, help="GPL's paper: 32 (the CPU config: 16)")
    b.add_argument("--mc-batch", type=int, default=128)
    b.add_argument("--mc-lr", type=float, default=5e-5)
    b.add_argument("--mc-epochs", type=float, default=1.0, help="M_C: at most this many passes over its pairs")
    b.add_argument("--mc-head-lr", type=float, default=1e-3, help="the fresh head's (cross_encoder_dev.py's base)")
    b.add_argument("--max-steps", type=int, default=20000)
    b.add_argument("--smoke", action="store_true", help="CPU check of this path: 300 passages, few steps")
    c = sub.add_parser("score")
    c.add_argument("--results", required=True)
    c.add_argument("--bundle", default=str(ROOT / ".lease"))
    c.add_argument("--out", default=None)
    args = ap.parse_args()
    {"pack": pack, "run": run, "score": score}[args.cmd](args)


if __name__ == "__main__":
    main()
