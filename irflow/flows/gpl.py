"""GPL: Generative Pseudo Labeling (Wang et al., NAACL 2022), as a declared, cached DAG.

    corpus ──generate_queries──> queries', qrels'        (T5 / ICT / cropping / unlabelled real queries)
       │            │
       │     ┌──────┴───────────── miners (BM25, dense models) retrieve for queries'
       │     └─> mine_negatives ──> negatives              (positives excluded; miner + rank kept)
       │                 │
       │         pseudo_label ──> (q, pos, neg, margin)    (cross-encoder logits, or a BM25+dense fusion)
       │                 │
       │         train_student (Margin-MSE) ──> student     (and a QGen baseline: MNRL on (q, pos))
       │                 │
    test queries ──> BM25 | zero-shot | hybrid | doc2query | QGen | GPL ──> evaluate ──> report

Each arrow is a stage cached on its inputs: change `train.*` and only training and evaluation
recompute; change the teacher and labels, training, evaluation recompute while generation and
mining are reused; change the generator and everything after ingest recomputes.
"""

from __future__ import annotations

from prefect import flow

from irflow.config import section
from irflow.flows.common import bm25_runs, dense_cfg, dense_run, evaluate_runs, ingest, system_name, threads
from irflow.models import model_cfg
from irflow.stage import RunContext
from irflow.tasks.bm25 import bm25_index, bm25_search
from irflow.tasks.doc2query import doc2query_expand
from irflow.tasks.fuse import fuse
from irflow.tasks.generate_queries import generate_queries
from irflow.tasks.mine_negatives import mine_negatives
from irflow.tasks.pseudo_label import label_positives, pseudo_label
from irflow.tasks.report import report
from irflow.tasks.train_student import train_student

GENERATOR_DEFAULTS = {"source": "t5", "model": "BeIR/query-gen-msmarco-t5-base-v1", "queries_per_passage": 3,
                      "max_input_length": 350, "max_length": 64, "top_p": 0.95, "top_k": 25, "batch_size": 32,
                      "shard_size": 10000, "seed": 42}
MINE_DEFAULTS = {"miners": [{"name": "bm25", "type": "bm25"}], "strategy": "topk", "top_k": 50, "seed": 42}
TEACHER_DEFAULTS = {"type": "cross_encoder", "model": "cross-encoder/ms-marco-MiniLM-L-6-v2", "batch_size": 32,
                    "max_length": 350}
LABEL_DEFAULTS = {"negatives_per_query": 1, "neg_rank_range": [3, 30], "scale": None, "seed": 42}
TRAIN_DEFAULTS = {"model": "GPL/msmarco-distilbert-margin-mse", "loss": "margin_mse", "similarity": "dot",
                  "batch_size": 32, "max_seq_length": 350, "lr": 2e-5, "warmup_steps": 1000, "steps": 140000,
                  "seed": 42, "checkpoint_every": 500, "bf16_autocast": False}


def _device(cfg: dict) -> dict:
    d = section(cfg, "runtime").get("device")
    return {"_device": d} if d else {}


def _generator_cfg(cfg: dict, ctx: RunContext) -> dict:
    gen = section(cfg, "generate", GENERATOR_DEFAULTS)
    out = {k: v for k, v in gen.items() if k != "model"}
    if gen["source"] == "t5":
        out.update(model_cfg(gen["model"], ctx.store_root, role="generate.model"))
    else:  # model-free sources: the generator's model settings are not part of what they compute
        for k in ("max_input_length", "max_length", "top_p", "top_k", "batch_size", "shard_size"):
            out.pop(k, None)
    return {**out, "_threads": threads(cfg), **_device(cfg)}


def _miner_runs(ctx: RunContext, cfg: dict, corpus, queries) -> list:
    """Each miner retrieves top_k for the generated queries; the run's system is the miner's name."""
    mine = section(cfg, "mine", MINE_DEFAULTS)
    runs = []
    for m in mine["miners"]:
        name = m.get("name") or (m["type"] if m["type"] == "bm25" else system_name(m["model"]))
        label = f"miner-{name}"
        if m["type"] == "bm25":
            variant = m.get("variant", "flat")
            index = bm25_index(ctx, cfg={"variant": variant, "_threads": threads(cfg)}, label=variant, corpus=corpus)
            runs.append(bm25_search(ctx, label=label, bm25_index=index, queries=queries, cfg={
                "system": name, "variant": variant, "k1": m.get("k1", 0.9), "b": m.get("b", 0.4),
                "top_k": mine["top_k"], "remove_query": False, "_threads": threads(cfg)}))
        elif m["type"] == "dense":
            dcfg = {**dense_cfg(cfg, ctx, model=m["model"]), "top_k": mine["top_k"], "remove_query": False}
            if m.get("similarity"):
                dcfg["similarity"] = m["similarity"]
            # Same model + corpus as the zero-shot system: its corpus embeddings are reused (cached).
            runs.append(dense_run(ctx, dcfg, corpus, queries, system=name, label=label))
        else:
            raise ValueError(f"mine.miners: unknown miner type '{m['type']}' (bm25 or dense)")
    return runs


def _teacher_cfg(cfg: dict, ctx: RunContext, student: dict) -> dict:
    teacher = section(cfg, "teacher", TEACHER_DEFAULTS)
    label = section(cfg, "label", LABEL_DEFAULTS)
    source = section(cfg, "generate", GENERATOR_DEFAULTS)["source"]
    if teacher["type"] == "cross_encoder":
        t = {"type": "cross_encoder", **model_cfg(teacher["model"], ctx.store_root, role="teacher.model"),
             "batch_size": teacher.get("batch_size", 32), "max_length": teacher.get("max_length", 350)}
    elif teacher["type"] == "fusion":
        t = {"type": "fusion", "method": teacher.get("method", "zscore"), "weights": teacher.get("weights")}
    else:
        raise ValueError(f"teacher.type: unknown '{teacher['type']}' (cross_encoder or fusion)")
    # Real unlabelled queries have no source passage: the teacher's top-1 is the positive.
    positive = label.get("positive") or ("teacher_top1" if source == "unlabelled" else "qrels")
    out = {**{k: v for k, v in label.items() if k != "positive"}, "teacher": t, "positive": positive,
           **_device(cfg)}
    if out.get("scale") == "auto":
        out["student"] = {k: student[k] for k in ("model_key", "_model_path", "similarity", "max_seq_length")
                          if k in student}
    return out


def gpl(cfg: dict, ctx: RunContext) -> list[dict]:
    beir, test_queries = ingest(ctx, cfg)
    corpus = beir["corpus"]
    train = section(cfg, "train", TRAIN_DEFAULTS)
    student_cfg = {**{k: v for k, v in train.items() if k not in ("model", "qgen")},
                   **model_cfg(train["model"], ctx.store_root, role="train.model"), **_device(cfg)}

    # 1. Query generation.
    gen_cfg = _generator_cfg(cfg, ctx)
    unlabelled = gen_cfg["source"] == "unlabelled"
    gen = generate_queries(ctx, cfg=gen_cfg, label=gen_cfg["source"], corpus=corpus,
                           queries=beir["queries"] if unlabelled else None,
                           qrels=beir["qrels"] if unlabelled else None)

    # 2. Negative mining with every miner.
    miner_runs = _miner_runs(ctx, cfg, corpus, gen["queries"])
    mine = section(cfg, "mine", MINE_DEFAULTS)
    negatives = mine_negatives(ctx, cfg={k: v for k, v in mine.items() if k != "miners"},
                               runs=miner_runs, qrels=gen["qrels"], corpus=corpus)

    # 3. Pseudo labels from the teacher.
    label_cfg = _teacher_cfg(cfg, ctx, student_cfg)
    labels = pseudo_label(ctx, cfg=label_cfg, queries=gen["queries"], corpus=corpus,
                          qrels=None if label_cfg["positive"] == "teacher_top1" else gen["qrels"],
                          negatives=negatives,
                          teacher_runs=miner_runs if label_cfg["teacher"]["type"] == "fusion" else None)

    # 4. Students: GPL (Margin-MSE on the teacher's margins) and the QGen baseline (MNRL on (q, pos)).
    gpl_student = train_student(ctx, cfg=student_cfg, label="gpl", queries=gen["queries"], corpus=corpus,
                                pseudo_labels=labels)
    qgen_section = train.get("qgen") or {}
    qgen_student = None
    if qgen_section.get("enabled", True):
        positives = label_positives(ctx, cfg={}, pseudo_labels=labels)
        qgen_cfg = {**student_cfg, "loss": "mnrl", **{k: v for k, v in qgen_section.items() if k != "enabled"}}
        qgen_student = train_student(ctx, cfg=qgen_cfg, label="qgen", queries=gen["queries"], corpus=corpus,
                                     qrels=positives)

    # 5. Evaluation on the test split: baselines and the adapted students side by side.
    runs = bm25_runs(ctx, cfg, corpus, test_queries)
    zs_cfg = dense_cfg(cfg, ctx, model=train["model"])
    zs_cfg["similarity"] = train["similarity"]
    zero_shot_system = system_name(train["model"])
    runs[zero_shot_system] = dense_run(ctx, zs_cfg, corpus, test_queries, system=zero_shot_system, label="zero-shot")
    hybrid = section(cfg, "hybrid", {"enabled": True, "method": "zscore", "weights": [0.3, 0.7], "top_k": 100})
    if hybrid.pop("enabled"):
        bm25_system = next(iter(runs))
        runs["hybrid"] = fuse(ctx, cfg={**hybrid, "system": "hybrid"}, label="hybrid",
                              runs=[runs[bm25_system], runs[zero_shot_system]])
    d2q = section(cfg, "doc2query", {"enabled": gen_cfg["source"] == "t5"})
    if d2q.pop("enabled"):
        expanded = doc2query_expand(ctx, cfg=d2q, corpus=corpus, queries=gen["queries"], qrels=gen["qrels"])
        runs.update(bm25_runs(ctx, {**cfg, "bm25": {**section(cfg, "bm25"), "variants": ["flat"]}}, expanded,
                              test_queries, system_prefix="bm25-doc2query", label_suffix="-doc2query"))
    eval_dense = zs_cfg  # same encoding/search settings; the model comes in as a stored model ref
    if qgen_student is not None:
        runs["qgen-student"] = dense_run(ctx, eval_dense, corpus, test_queries, system="qgen-student",
                                         label="qgen-student", model_ref=qgen_student)
    runs["gpl-student"] = dense_run(ctx, eval_dense, corpus, test_queries, system="gpl-student",
                                    label="gpl-student", model_ref=gpl_student)
    evals = evaluate_runs(ctx, cfg, runs, beir["qrels"], test_queries)
    return [] if ctx.dry_run else report(ctx, evals)


gpl_flow = flow(name="gpl", log_prints=True, validate_parameters=False)(gpl)
