"""Every recipe on one page per dataset: the measured rows side by side, with the goals checked.

    .venv/bin/python bench/quality.py [--out bench/results/quality.json]

Reads the result files the recipe benchmarks wrote (no run here): ``gpl.json`` / ``gpl_nfcorpus.json``
(bench/gpl.py), ``gpl_teacher_<ds>*.json`` (bench/gpl_teacher.py: the GPL student with each fusion
teacher, over seeds; ``GPL_FILES`` says which is the config's), ``rocketqa_<ds>.json`` and ``ance_<ds>.json`` (bench/rocketqa.py), ``model_free.json``
(bench/model_free.py), ``seed_mean_<ds>.json`` (bench/seed_mean.py), ``train_dev_<recipe>_<ds>_offline_test.json`` (settings chosen on a dev cut of train,
then run on test: bench/train_dev.py --on-test). For SciFact and NFCorpus it prints one table -- nDCG@10 and R@100 on the test
split, the gain over the zero-shot row *of the same run* (RocketQA and ANCE encode 200 / 128-token
passages, GPL 256: their zero-shot rows differ), the machine, the training budget and the file -- and
then the issue's goals: every trained student above its zero-shot, GPL's student above BM25 on SciFact,
the best dense student within 0.02 of the fusion teacher. ``--store DIR`` (repeatable) adds the latest run of
a store -- a demo's -- with each system's paired t-test against zero-shot (is a gap real?), and each
BM25 + trained model fusion's (``hybrid-<model>``) against BM25 + zero-shot (``hybrid``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness
from harness import ROOT

RESULTS = ROOT / "bench" / "results"
ZERO = "dense-all-MiniLM-L6-v2"
# The training budget of each trained row, as the offline configs set it (configs/<recipe>_<ds>_offline.yaml).
BUDGET = {
    "scifact": {"gpl": "Margin-MSE 388 steps x 16, 200 tokens", "qgen": "MNRL 250 steps x 16",
                "rocketqa": "1 epoch x 32 per dual encoder (919 pairs), 200 tokens; M_C 3 epochs x 16",
                "ance": "warm-up{rounds}, 1 epoch x 32 each, 200 tokens"},
    "nfcorpus": {"gpl": "Margin-MSE 388 steps x 16, 200 tokens", "qgen": "MNRL 250 steps x 16",
                 "rocketqa": "114 steps x 32 per dual encoder (of ~3.8k steps an epoch), 128 tokens; "
                             "M_C 200 steps x 16",
                 "ance": "warm-up{rounds}, 460 steps x 32 each, 128 tokens"},
}
LABELS = {"bm25-flat": "BM25", ZERO: "zero-shot MiniLM", "hybrid": "fusion 0.3 z(BM25) + 0.7 z(MiniLM), no training "
          "(GPL's teacher)", "gpl-student": "GPL student", "qgen-student": "QGen student (MNRL)"}
STUDENTS = {"gpl-student", "qgen-student", "md0", "md0-bm25neg", "md0-hardneg", "md1-ce", "md1-fusion", "md2",
            "ance-warmup"}


# Where RocketQA's and ANCE's configs changed after their first files (``rocketqa_<ds>.json``, ``ance_<ds>.json``,
# labelled BEFORE): bench/rocketqa.py's files since, newest first, each with what it had that the next one
# changed. The newest is the configs as they are (configs/*_<ds>_offline.yaml); an older one adds only the
# rows that differ from the newest. SciFact's newest holds ANCE only (rounds 2 -> 7): RocketQA's rows stay
# rocketqa_scifact.json's.
CURRENT = {"scifact": [("ance_scifact_rounds7.json", None)],
           "nfcorpus": [("rocketqa_nfcorpus_skip50.json", None),
                        ("rocketqa_nfcorpus_ppq4.json", "BM25 negatives from ranks 1-100")]}
BEFORE = {"scifact": "rounds: 2", "nfcorpus": "false negatives kept, every pair"}
# GPL (bench/gpl_teacher.py): the config as it is first, then files of settings it no longer has, each with what
# that file had that the config changed
# (SciFact: gpl_teacher_scifact_neg16.json, seeds 42-43 of the config on the AMD cores, is left out: the same settings
# and seeds are in the 3-seed file, run in one store so that each query can be averaged over the seeds)
# (SciFact at 256 tokens: the 5-seed file holds the 3-seed file's runs of seeds 42-44, reused from the same store)
GPL_FILES = {"scifact": [("gpl_teacher_scifact_neg16_5seeds_len256.json", None),
                         ("gpl_teacher_scifact_neg16_3seeds.json", "the student read 200 tokens of each passage"),
                         ("gpl_teacher_scifact.json", "4 negatives per query, 200 tokens")],
             "nfcorpus": [("gpl_teacher_nfcorpus.json", None),
                          ("gpl_teacher_nfcorpus_before.json", "4 negatives per query")]}
# bench/gpl_teacher.py files whose runs also hold BM25 fused with the GPL student (hybrid.students, the
# hybrid-gpl-student system; a row each, beside the fusion of BM25 and the zero-shot model)
GPL_HYBRID_FILES = {"scifact": ["gpl_hybrid_scifact.json"], "nfcorpus": ["gpl_hybrid_nfcorpus.json"]}
# bench/rocketqa.py files run with ``hybrid.enabled`` (the recipe's config otherwise): BM25 fused with the zero-shot
# model at the recipe's passage length and with each trained model (``hybrid-<model>``); a row each, with the
# file's paired tests against that zero-shot fusion and against BM25 (configs/ance_scifact_offline.yaml enables
# hybrid since its file; the other RocketQA / ANCE configs leave it off). Not students: no goal reads them.
RECIPE_HYBRID_FILES = {"scifact": ["ance_scifact_rounds7_hybrid.json", "rocketqa_scifact_hybrid.json"],
                       "nfcorpus": ["rocketqa_nfcorpus_hybrid_partial.json"]}
# What bench/gpl.py's trained rows (gpl.json, gpl_<ds>.json) had that the GPL config no longer has: those rows
# are history (``[before: ...]``, not counted for the goals); the config's rows are gpl_teacher.py's
GPL_PY_BEFORE = {"scifact": "teacher fuses each miner's own top 50",
                 "nfcorpus": "teacher fuses each miner's own top 50, 4 negatives per query"}
# bench/train_dev.py --on-test files whose settings a later config change superseded: what they lacked
TRAIN_DEV_BEFORE = {"train_dev_rocketqa_nfcorpus_offline_test.json": "every pair",
                    "train_dev_ance_nfcorpus_offline_test.json": "every pair"}
# A recipe whose config has a budget that bench/rocketqa.py's files were not run at: its config rows are this
# bench/train_dev.py --on-test file's (the config's settings, given by --set before the config took them). That
# recipe's rows in every other file are history: labelled with what they had, and with their own budget line.
CONFIG_FROM = {"nfcorpus": {"ance": ("train_dev_ance_nfcorpus_offline_test_460.json", "40 steps x 32 per model",
                                     "warm-up{rounds}, 40 steps x 32 each, 128 tokens"),
                            "rocketqa": ("train_dev_rocketqa_nfcorpus_offline_test_114.json",
                                         "40 steps x 32 per dual encoder",
                                         "40 steps x 32 per dual encoder (of ~3.8k steps an epoch), 128 tokens; "
                                         "M_C 200 steps x 16")}}
# bench/seed_mean.py over a config's rows at more than one seed (CONFIG_FROM's file and a students-only seed run):
# (file, what was run again)
CONFIG_SEED_MEAN = {"nfcorpus": {"rocketqa": ("seed_mean_rocketqa_nfcorpus_offline_test_114.json",
                                              "dual_encoder.seed 42-44 for M_D0 and + BM25 negatives, student.seed 42-44 for the "
                                              "students (all on seed 42's M_D0, M_C and lists)")}}
# A config's rows run again at other seeds (bench/train_dev.py --on-test, the seeds set): (recipe, file, what was
# set). Each such system counts for the "best dense" goal as its mean over the seeds, the config's file's row and
# these (its best seed alone would be a pick).
CONFIG_SEEDS = {"scifact": [("ance", "train_dev_ance_scifact_offline_test_s43.json", "warmup.seed and round.seed 43"),
                            ("rocketqa", "train_dev_rocketqa_scifact_offline_test_s43.json",
                             "dual_encoder.seed, denoise.seed and student.seed 43; M_D0, undenoised hard negatives "
                             "and M_D1-fusion only (no M_C), fp32")]}
# what seed_mean_<ds>.json's seeds were trained with, where a config has moved on since
SEED_MEAN_NOTE = {"nfcorpus": "; 40 steps a model: RocketQA's and ANCE's configs before"}
RECIPE_NAMES = {"rocketqa": "RocketQA", "ance": "ANCE"}  # bench/rocketqa.py's and train_dev.py's recipes, as rows name them
TEACHER = {"own": "teacher fuses each miner's own top 50", "every": "teacher scores every candidate with both miners"}
# bench/train_dev.py --on-test files of a budget the config does not have, taken from a GPU run's dev choice
# (bench/gpu_lease.py): shown with what they set, and read by the GPU goal line, not by the configs' goals
BUDGET_FILES = {"nfcorpus": [("rocketqa", "train_dev_rocketqa_nfcorpus_offline_test_md0_460.json",
                              "M_D0 460 steps x 32 on this CPU (the H100's dev choice; the config: 114)",
                              "seed_mean_nfcorpus_md0_460.json"),
                             ("rocketqa", "train_dev_rocketqa_nfcorpus_offline_test_students_460.json",
                              "students 460 steps x 32 on this CPU (M_D0's dev-chosen budget; the config: 114), "
                              "after a 40-step M_D0", None),
                             ("rocketqa", "train_dev_rocketqa_nfcorpus_offline_test_md1_460_s43.json",
                              "M_D1-fusion 460 steps x 32 on this CPU, student seed 43 (the config: 114), "
                              "after a 40-step M_D0", None)]}
# Budgets a 2-core CPU cannot give: irflow's own training functions on the jobs the stages build, on a lent H100
# (bench/gpu_lease.py), each step count chosen on a train-side dev cut. Not the configs' rows: shown, and read by a
# goal line of their own, not by the configs' goals. The second file: M_C again, with what it changed.
GPU_FILES = {"nfcorpus": [("gpu_nfcorpus.json", None), ("gpu_nfcorpus_mc_ppq4.json", "positives_per_query 4")]}
GPU_LABELS = {"gpl": "GPL student (the config's pseudo-labels), Margin-MSE x 32 (GPL's paper batch)",
              "md0": "RocketQA M_D0 (the config's settings), trained on the fit part of train",
              "mc": "RocketQA M_C re-ranking M_D0's top 100, trained on the fit part of train"}


def config_from(ds: str, recipe: str) -> tuple[str | None, str | None, str | None]:
    """CONFIG_FROM's (file, what the older rows had, their budget line) for a recipe, or Nones."""
    return CONFIG_FROM.get(ds, {}).get(recipe, (None, None, None))


def recipe_of(system: str) -> str:
    """bench/rocketqa.py's recipe of a trained system: ANCE's are ``ance-*``."""
    return "ance" if system.startswith("ance-") else "rocketqa"


def is_student(system: str) -> bool:
    return system in STUDENTS or system.startswith(("gpl-student-own-", "gpl-student-every-", "ance-round"))


def machine(block: dict | None) -> str:
    if not block:
        return "2-core AMD EPYC (AVX-512 BF16), CPU"  # gpl.json predates the machine block; same machine
    gpus = block.get("gpus") or []
    return (f"{block.get('cores')}-core {block.get('cpu')}" + (" (AVX-512 BF16)" if block.get("avx512_bf16") else
                                                                " (AVX2 only)" if block.get("avx512") is False else "")
            + (" with AMX" if block.get("amx") else "")
            + (f", {gpus[0]}" if gpus else ", CPU"))


def rows_for(ds: str) -> list[dict]:
    rows = []
    gpl = json.loads((RESULTS / ("gpl.json" if ds == "scifact" else f"gpl_{ds}.json")).read_text())
    g = gpl["datasets"][ds]
    gzero = next(m["ndcg@10"] for m in g["metrics"] if m["system"] == ZERO)
    for m in g["metrics"]:
        kind = m["system"].split("-")[0] if m["system"] in ("gpl-student", "qgen-student") else None
        was = GPL_PY_BEFORE.get(ds) if kind else None
        rows.append({"recipe": "GPL", "system": m["system"], "label": LABELS.get(m["system"], m["system"]) +
                     (" (256 tokens)" if m["system"] == ZERO else "") + (f" [before: {was}]" if was else ""),
                     "ndcg@10": round(m["ndcg@10"], 4),
                     "recall@100": round(m["recall@100"], 4), "zero_shot": round(gzero, 4),
                     "budget": BUDGET[ds].get(kind, "-"), "machine": machine(gpl.get("machine")),
                     "file": "gpl.json" if ds == "scifact" else f"gpl_{ds}.json", "superseded": was is not None})
    # GPL's fusion teacher: each miner's own list or every candidate scored by both, over seeds (gpl_teacher.py);
    # GPL_FILES's first file (the config as it is) first, then the older files' rows, labelled with what changed
    for name, before in GPL_FILES.get(ds, []):
        gt = RESULTS / name
        if not gt.exists():
            continue
        d = json.loads(gt.read_text())
        for r in sorted(d["runs"], key=lambda r: (r["teacher"], r["seed"])):
            m = r["metrics"]
            rows.append(gpl_student_row(ds, f"gpl-student-{r['teacher']}-s{r['seed']}",
                                        f"GPL student, {TEACHER[r['teacher']]}, seed {r['seed']}"
                                        + (f" [before: {before}]" if before else ""), m,
                                        d.get("machine"), gt.name, superseded=before is not None,
                                        p_vs_bm25=(m["gpl-student"].get("vs_bm25") or {}).get("t_pvalue"),
                                        vs_zero_shot=m["gpl-student"].get("vs_zero_shot")))
    for name in GPL_HYBRID_FILES.get(ds, []):
        f = RESULTS / name
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        for r in sorted(d["runs"], key=lambda r: r["seed"]):
            m = r["metrics"]
            fused = m.get("hybrid-gpl-student")
            if not fused:
                continue
            rows.append(gpl_student_row(ds, f"hybrid-gpl-student-s{r['seed']}",
                                        f"BM25 + GPL student (fused as the fusion row fuses BM25 and MiniLM), seed "
                                        f"{r['seed']}; the student alone {m['gpl-student']['ndcg@10']:.4f}",
                                        {**m, "gpl-student": fused}, d.get("machine"), f.name,
                                        vs_zero_shot=None, vs_fusion=fused.get("vs_hybrid"),
                                        vs_bm25=fused.get("vs_bm25")))
    # RocketQA and ANCE (bench/rocketqa.py): its files newest first, CURRENT's then the first ones. A system's
    # first row is the config as it is; an older file adds only the rows that differ, labelled with what the
    # newer file changed (a file holding one recipe supersedes only that recipe's rows).
    files = [(RESULTS / name, was) for name, was in CURRENT.get(ds, [])] + \
            [(RESULTS / f"{recipe}_{ds}.json", BEFORE.get(ds)) for recipe in ("rocketqa", "ance")]
    newest: dict[str, float] = {}
    for current, was in [(f, was) for f, was in files if f.exists()]:
        d = json.loads(current.read_text())
        zero = next(r["ndcg@10"] for r in d["table"] if r["system"] == ZERO)
        for r in d["table"]:
            system = r["system"]
            if system == "bm25-flat" or (system in newest and (system == ZERO or newest[system] == r["ndcg@10"])):
                continue  # one BM25 / zero-shot row per table (ANCE's zero-shot is RocketQA's: same encoding)
            if system.startswith("hybrid"):
                continue  # BM25 fusions: RECIPE_HYBRID_FILES's rows
            recipe = recipe_of(system)
            _, config_was, budget_was = config_from(ds, recipe)
            before = ", ".join(w for w in (config_was, was if system in newest else None) if w) or None
            rows.append(recipe_row(ds, recipe, r, zero, d, current.name, before, budget_was))
            newest.setdefault(system, r["ndcg@10"])
    rows += recipe_hybrid_rows(ds)
    # settings chosen on a train-side dev cut, then run on test (bench/train_dev.py --on-test)
    for recipe in ("rocketqa", "ance"):
        config_file, config_was, budget_was = config_from(ds, recipe)
        f = RESULTS / f"train_dev_{recipe}_{ds}_offline_test.json"
        if f.exists():
            was = ", ".join(w for w in (config_was, TRAIN_DEV_BEFORE.get(f.name)) if w)
            rows += train_dev_rows(f, recipe, lambda system: budget(ds, recipe, system, budget_was),
                                   f" [before: {was}]" if was else "", superseded=bool(was))
        if config_file and (RESULTS / config_file).exists():  # the config as it is
            rows += train_dev_rows(RESULTS / config_file, recipe, lambda system: budget(ds, recipe, system), "",
                                   also=("mc-rerank", "mc-rerank-fused"))
        f = RESULTS / f"train_dev_{recipe}_{ds}_mc_test.json"
        if f.exists():  # M_C's loss, and its fusion with M_D0: chosen on a dev cut of train, then run on test
            rows += [r for r in train_dev_rows(f, recipe, lambda system: budget(ds, recipe, system), "",
                                               what="M_C chosen on a dev cut of train", prefix="m_c:",
                                               also=("mc-rerank", "mc-rerank-fused"))
                     if r["system"].startswith("m_c:mc-rerank")]
        f = RESULTS / f"train_dev_{recipe}_{ds}_mc_denoise_test.json"
        if f.exists():  # the listwise M_C (Platt-calibrated) as denoiser and labeller: M_D1-ce once, M_D2
            rows += [r for r in train_dev_rows(f, recipe, lambda system: budget(ds, recipe, system), "",
                                               what="denoised by the listwise M_C, Platt-calibrated", prefix="m_c:")
                     if r["system"] == "m_c:md1-ce-lce100-platt" or r["system"].startswith("m_c:md2")]
    for recipe, name, what in CONFIG_SEEDS.get(ds, []):
        f = RESULTS / name
        if f.exists():
            rows += train_dev_rows(f, recipe, lambda system: budget(ds, recipe, system), "", what=what, prefix="seed:",
                                   seed_run=True)
    for name, changed in GPU_FILES.get(ds, []):
        f = RESULTS / name
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        for system, c in d["chosen_on_dev"].items():
            part = d["parts"][system]
            steps = f"{c['step']} steps x {part['params']['batch_size']} ({part.get('epochs')} epoch)"
            chosen = "" if system == "mc" else f"; {part['evals']} evaluated, {c['step']} chosen on dev"
            auc = (f"; dev AUC {c['dev_auc']} (M_D0's {c['md0_cpu_order']['dev_auc']})" if "dev_auc" in c else "")
            rows.append({"recipe": {"gpl": "GPL"}.get(system, "RocketQA"), "system": f"gpu-{system}",
                         "label": GPU_LABELS[system] + (f", {changed}" if changed else "") + f" [H100: {steps}{chosen}{auc}]",
                         "ndcg@10": c["test"]["ndcg@10"], "recall@100": c["test"]["recall@100"],
                         "zero_shot": c["test_zero_shot"]["ndcg@10"], "vs_zero_shot": c["vs_zero_shot"],
                         "budget": steps, "machine": f"{d['machine'].get('gpu')}, {d['train_precision']} training",
                         "file": name, "other_budget": True})
    for recipe, name, what, _ in BUDGET_FILES.get(ds, []):
        f = RESULTS / name
        if f.exists():
            rows += train_dev_rows(f, recipe, lambda system: what, "", what=what, prefix="budget-",
                                   other_budget=True)
    rows += strategy_rows(ds)
    mf = RESULTS / "model_free.json"
    if mf.exists():
        d = json.loads(mf.read_text())
        for r in d["runs"]:
            if r["dataset"] == ds:
                rows.append(gpl_student_row(
                    ds, f"gpl-student-{r['source']}-{r['teacher']}",
                    f"GPL student, {dict(ict='ICT', crop='cropping')[r['source']]} queries (no query log), "
                    f"{TEACHER[r['teacher']]}", r["metrics"], d.get("machine"), mf.name, model_free=True))
    return rows


# bench/strategies.py's and bench/spider.py's systems: label -> (recipe, what it is)
STRATEGIES = {"gpl-margin-mse": ("GPL", "GPL student, plain Margin-MSE batches (TAS-B's relative)"),
              "qgen-mnrl": ("GPL", "QGen student, in-batch negatives (MoCo's relative)"),
              "tas-b": ("GPL + TAS-B", "GPL student on TAS-B batches (topic-aware, balanced margins), the "
                                       "fusion's pairwise Margin-MSE plus zero-shot MiniLM's in-batch one"),
              "qgen-moco": ("GPL + MoCo", "QGen student with Contriever's MoCo (queue 1,024, momentum 0.999)"),
              "contriever-moco": ("Contriever", "Contriever: crop pairs from the corpus alone, MoCo (queue 1,024, "
                                                "momentum 0.999)"),
              "crop-infonce": ("Contriever", "crop pairs, in-batch negatives only (Contriever's relative)"),
              "contriever-crop-key": ("Contriever", "Contriever with the key cropped too (independent cropping, "
                                                    "train.crop_positives: [0.1, 0.5]), MoCo"),
              "bm25-deepct": ("DeepCT", "BM25 over DeepCT term weights (MiniLM's encoder with a regression head, "
                                        "trained on the train qrels' query term recall)"),
              "ance-round1": ("ANCE", "ANCE warm-up + round 1 (STAR's relative)"),
              "star": ("STAR", "STAR: static hard negatives from zero-shot MiniLM + random in-batch (alpha 0.1), "
                               "RankNet"),
              "star-adore": ("STAR + ADORE", "STAR, then ADORE: the query encoder on its own ranking over STAR's "
                                             "frozen embeddings (LambdaLoss)")}


def strategy_budget(d: dict, r: dict) -> str:
    """A bench/strategies.py row's training budget: --steps for the arms it sets, else the config's (with the
    arm's overrides other than threads)."""
    if r["arm"] in ("gpl", "tasb", "moco", "contriever", "crop"):
        return f"{d['steps']} steps ({r['config']})"
    sets = [o for o in r["overrides"] if not o.startswith("runtime.")]
    return r["config"] + (f" with {', '.join(sets)}" if sets else "")


def strategy_rows(ds: str) -> list[dict]:
    """The other strategies against zero-shot (bench/strategies.py), each row with its paired test against
    zero-shot and BM25; and Spider against crop and ICT pairs on the corpus cut into passages (bench/spider.py:
    another corpus and task, so its own zero-shot)."""
    rows = []
    f = RESULTS / f"strategies_{ds}.json"
    if f.exists():
        d = json.loads(f.read_text())
        paired = d.get("paired", {})
        zero = d["table"].get("zero-shot", {}).get("ndcg@10")
        for label, r in d["table"].items():
            if label not in STRATEGIES or zero is None:
                continue
            recipe, what = STRATEGIES[label]
            arm = d["arms"][r["arm"]]
            trained = [k for k in arm["stage_seconds"] if k.startswith(("train_", "deepct"))]
            rows.append({"recipe": recipe, "system": f"strategy:{label}", "label": what, "ndcg@10": r["ndcg@10"],
                         "recall@100": r["recall@100"], "zero_shot": zero, "strategy": True,
                         "vs_zero_shot": paired.get(f"{label} vs zero-shot"), "vs_bm25": paired.get(f"{label} vs bm25"),
                         "budget": strategy_budget(d, r),
                         "machine": machine(d.get("machine")), "file": f.name + (f" ({', '.join(trained)})" if trained else "")})
    f = RESULTS / f"star_collapse_{ds}.json"
    if f.exists():  # bench/star_collapse.py: what NFCorpus's STAR config trains now that RankNet collapsed there
        d = json.loads(f.read_text())
        r = d["variants"].get("infonce")
        if r:
            rows.append({"recipe": "STAR", "system": "strategy:star-infonce",
                         "label": f"STAR's static lines under InfoNCE (the config's loss; RankNet collapsed here; zero-shot "
                                  f"at its 128 tokens {r['zero_shot_ndcg@10']:.4f})",
                         "ndcg@10": r["ndcg@10"], "recall@100": r["recall@100"], "zero_shot": r["zero_shot_ndcg@10"],
                         "strategy": True, "vs_zero_shot": r["vs_zero_shot"], "budget": f"{d['steps']} steps x 32",
                         "machine": machine(d.get("machine")), "file": f.name})
        r = d["variants"].get("infonce-adore-within")
        if r:
            rows.append({"recipe": "STAR", "system": "strategy:star-infonce-adore",
                         "label": "the same, then ADORE on the positives within its top 200 (adore.positives_beyond_"
                                  "depth: drop, the default; as the paper it lost 0.0253)",
                         "ndcg@10": r["adore_ndcg@10"], "recall@100": r["adore_recall@100"],
                         "zero_shot": r["zero_shot_ndcg@10"], "strategy": True,
                         "vs_zero_shot": r["paired"]["star-adore vs zero-shot"],
                         "vs_bm25": r["paired"]["star-adore vs bm25"], "budget": f"{d['steps']} steps x 32, then ADORE",
                         "machine": machine(d.get("machine")), "file": f.name})
    f = RESULTS / f"spider_{ds}.json"
    if f.exists():
        d = json.loads(f.read_text())
        zero = d["table"]["zero-shot"]["ndcg@10"]
        corpus = d["corpus"]
        for label, r in d["table"].items():
            if not label.endswith("-moco"):
                continue
            source = label.removesuffix("-moco")
            rows.append({"recipe": "Contriever", "system": f"passages:{label}",
                         "label": f"{dict(spider='Spider (recurring spans)', crop='crop', ict='ICT')[source]} pairs, "
                                  f"MoCo, on {corpus['documents']} documents cut into {corpus['passages']} passages of "
                                  f"{d['max_words']} words (passage-level qrels; zero-shot there {zero:.4f})",
                         "ndcg@10": r["ndcg@10"], "recall@100": r["recall@100"], "zero_shot": zero, "strategy": True,
                         "vs_zero_shot": d["paired"].get(f"{label} vs zero-shot"),
                         "budget": f"{d['steps']} steps x {d['batch_size']}", "machine": machine(d.get("machine")),
                         "file": f.name})
    return rows


def recipe_hybrid_rows(ds: str) -> list[dict]:
    """RECIPE_HYBRID_FILES's BM25 fusions: ``hybrid-zero-shot`` (BM25 + zero-shot MiniLM at the recipe's passage
    length; GPL's ``hybrid`` row reads 256 tokens) and ``hybrid-<model>``, each with its paired tests."""
    rows = []
    for name in RECIPE_HYBRID_FILES.get(ds, []):
        f = RESULTS / name
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        alone = {r["system"]: r["ndcg@10"] for r in d["table"]}
        labels = {r["system"]: r["label"] for r in d["table"]}
        for r in d["table"]:
            if not r["system"].startswith("hybrid"):
                continue
            model = r["system"].removeprefix("hybrid").removeprefix("-") or ZERO
            flow = next(iter(d["runs"])) if model == ZERO else recipe_of(model)
            tests = d["runs"][flow].get("paired", {}).get(r["system"], {})
            label = r["label"] + ("" if model == ZERO else f"; {labels[model]} alone {alone[model]:.4f} there")
            row = recipe_row(ds, flow, {**r, "system": "hybrid-zero-shot" if model == ZERO else r["system"],
                                        "label": label}, alone[ZERO], d, name)
            rows.append({**row, "system": f"{flow}:{r['system']}", "of": r["system"], "vs_fusion": tests.get("vs_hybrid"),
                         "vs_bm25": tests.get("vs_bm25")})
    return rows


def train_dev_rows(f: Path, recipe: str, budget_of, suffix: str, what: str = "", prefix: str = "",
                   also: tuple[str, ...] = (), **flags) -> list[dict]:
    """A row per trained system (and per system of ``also``) of each variant of a bench/train_dev.py result
    file: ``budget_of(system)`` its budget, ``what`` said in its label, ``suffix`` after it; ``prefix`` before
    its system name; ``flags`` added."""
    d = json.loads(f.read_text())
    rows = []
    for v in d["variants"]:
        m = v["metrics"]
        for system in (k for k in m if is_student(k) or k in also):
            rows.append({"recipe": RECIPE_NAMES[recipe], "of": system,
                         "system": f"{prefix}{system}" + (f"-{v['name']}" if prefix else ""),
                         "label": f"{system}, {what + ', ' if what else ''}variant {v['name']} "
                                  f"({'; '.join(v['sets']) or 'no override'}){suffix}",
                         "ndcg@10": m[system]["ndcg@10"], "recall@100": m[system]["recall@100"],
                         "zero_shot": m[ZERO]["ndcg@10"], "vs_zero_shot": m[system].get("vs_zero_shot"),
                         "budget": budget_of(system), "machine": machine(d.get("machine")), "file": f.name, **flags})
    return rows


def budget(ds: str, recipe: str, system: str, template: str | None = None) -> str:
    """BUDGET's line for a row (``template``: a budget the config no longer has); an ANCE row's counts the rounds
    that trained it (0 for the warm-up)."""
    rounds = int(system.removeprefix("ance-round")) if system.startswith("ance-round") else 0
    return (template or BUDGET[ds][recipe]).format(rounds=f" + {rounds} round{'s' * (rounds > 1)}" if rounds else "")


def recipe_row(ds: str, recipe: str, r: dict, zero: float, d: dict, file: str, before: str | None = None,
               budget_was: str | None = None) -> dict:
    """A row of bench/rocketqa.py's table (RocketQA or ANCE); ``before``: the settings it was measured with
    that the config no longer has (None: the config as it is); ``budget_was``: its budget, where the config's
    is another."""
    superseded = before is not None
    model = r["system"].removeprefix("hybrid-")  # a fusion of BM25 with a trained model: that model's budget
    length = " (200 tokens)" if ds == "scifact" else " (128 tokens)"
    label = r["label"] + length if r["system"] in (ZERO, "hybrid-zero-shot") else r["label"]
    if superseded and r["system"] != ZERO:
        label += f" [before: {before}]"
    return {"recipe": RECIPE_NAMES[recipe], "system": r["system"], "label": label,
            "ndcg@10": r["ndcg@10"], "recall@100": r["recall@100"], "zero_shot": zero,
            "budget": budget(ds, recipe, model, budget_was) if is_student(model) or model.startswith("mc-rerank") else "-",
            "machine": machine(d.get("machine")), "superseded": superseded,
            "file": file + (f" ({', '.join(d['overrides'])})" if d.get("overrides") else "")}


def gpl_student_row(ds: str, system: str, label: str, metrics: dict, machine_block: dict | None, file: str,
                    **extra) -> dict:
    """A row for the GPL student of one run that a bench wrote (its ``metrics`` by system)."""
    student = metrics["gpl-student"]
    return {"recipe": "GPL", "system": system, "label": label, "ndcg@10": student["ndcg@10"],
            "recall@100": student["recall@100"], "zero_shot": metrics[ZERO]["ndcg@10"], "budget": BUDGET[ds]["gpl"],
            "machine": machine(machine_block), "file": file, **extra}


def gpl_seed_mean(ds: str, against: str = "vs_zero_shot") -> str:
    """The config's GPL file's test of each query averaged over the seeds (bench/gpl_teacher.py) against zero-shot
    (``vs_zero_shot``) or BM25 (``vs_bm25``), as a clause."""
    f = RESULTS / GPL_FILES[ds][0][0]
    m = json.loads(f.read_text()).get("mean_over_seeds", {}).get("every", {})
    t = m.get("each_query_over_seeds", {}).get(against)
    return (f"; each query averaged over the {m['seeds']} seeds: {m['ndcg@10']:.4f} ({t['mean_diff']:+.4f}, "
            f"{t['wins']} / {t['losses']} queries, {p_text(t['t_pvalue'])})") if t else ""


def p_text(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p {p:.3f}"


def goals(ds: str, rows: list[dict]) -> list[str]:
    by = {r["system"]: r for r in rows}
    out = []
    # the goals are read on the configs as they are; rows of settings they no longer have are history
    trained = [r for r in rows if is_student(r["of"] if r.get("seed_run") else r["system"]) and not r.get("superseded")]
    below = [f"{r['recipe']} {r['label']} {r['ndcg@10']:.4f} (zero-shot {r['zero_shot']:.4f})"
             for r in trained if r["ndcg@10"] <= r["zero_shot"]]
    ps = [r["vs_zero_shot"]["t_pvalue"] for r in trained if r.get("vs_zero_shot")]
    tested = f" (paired t-test against zero-shot where measured: p {min(ps):.3f}-{max(ps):.3f})" if ps else ""
    out.append(f"every trained student above its zero-shot: {'met' if not below else 'MISSED: ' + '; '.join(below)}"
               f"{tested}")
    model_free = [f"{r['label']} {r['ndcg@10']:.4f} (zero-shot {r['zero_shot']:.4f})" for r in rows
                  if r.get("model_free") and r["ndcg@10"] <= r["zero_shot"]]
    if model_free:
        out.append("below zero-shot with model-free queries (the recipe warns before such a run): "
                   + "; ".join(model_free))
    sm = RESULTS / f"seed_mean_{ds}.json"
    if sm.exists():  # bench/seed_mean.py: each query's nDCG@10 averaged over seeds, against zero-shot
        d = json.loads(sm.read_text())["systems"]
        out.append(f"over seeds ({sm.name}{SEED_MEAN_NOTE.get(ds, '')}, each query averaged, paired t-test against "
                   "zero-shot): " + "; ".join(
            f"{k} {v['ndcg@10_mean']:.4f} ({v['gain']:+.4f}, {v['seeds']} seeds, p {v['t_pvalue']:.2f})"
            for k, v in d.items()))
    for recipe, (name, what) in CONFIG_SEED_MEAN.get(ds, {}).items():
        f = RESULTS / name
        if f.exists():  # bench/seed_mean.py over the config's file and a seed run of its students
            d = json.loads(f.read_text())
            line = (f"{RECIPE_NAMES[recipe]}'s config over seeds ({name}: {what}; each query "
                    "averaged, paired t-test against zero-shot): " + "; ".join(
                        f"{k} {v['ndcg@10_mean']:.4f} ({v['gain']:+.4f}, {v['seeds']} seeds: "
                        f"{' / '.join(f'{x:.4f}' for x in v['ndcg@10_each'])}, {p_text(v['t_pvalue'])})"
                        for k, v in d["systems"].items()))
            if d.get("pairs"):
                line += "; against each other: " + "; ".join(
                    f"{x['system']} - {x['against']} {x['mean_diff']:+.4f} ({p_text(x['t_pvalue'])})" for x in d["pairs"])
            out.append(line)
    # the config's GPL student at each seed (bench/gpl_teacher.py, the teacher scoring every candidate)
    seeded = [r for r in trained if r["system"].startswith("gpl-student-every-")]
    gpl_seeds = [r for r in seeded if r.get("vs_zero_shot")]
    if gpl_seeds:  # is the config's GPL gain real? each seed's paired t-test against zero-shot
        out.append("GPL student (the config) against zero-shot, paired t-test per seed: " + "; ".join(
            f"seed {r['system'].rsplit('-s', 1)[1]} {r['ndcg@10']:.4f} ({r['ndcg@10'] - r['zero_shot']:+.4f}, "
            f"{r['vs_zero_shot']['wins']} / {r['vs_zero_shot']['losses']} queries, {p_text(r['vs_zero_shot']['t_pvalue'])})"
            for r in gpl_seeds) + gpl_seed_mean(ds))
    strategies = [r for r in rows if r.get("strategy") and r.get("vs_zero_shot")]
    if strategies:  # bench/strategies.py, bench/spider.py: short budgets, one seed
        out.append("the other strategies against their zero-shot (bench/strategies.py, bench/spider.py; short "
                   "budgets, one seed): " + "; ".join(
                       f"{r['recipe']} {r['system'].split(':', 1)[1]} {r['ndcg@10']:.4f} "
                       f"({r['ndcg@10'] - r['zero_shot']:+.4f}, {r['vs_zero_shot']['wins']} / {r['vs_zero_shot']['losses']}, "
                       f"{p_text(r['vs_zero_shot']['t_pvalue'])})" for r in strategies))
    other = [r for r in rows if r.get("other_budget")]
    if other:  # bench/gpu_lease.py: the same training code at GPU budgets, step counts chosen on a train-side dev cut
        line = ("at GPU budgets (not the configs'; bench/gpu_lease.py, and a GPU budget run here), against zero-shot: "
                + "; ".join(f"{r['system'].removeprefix('gpu-').removeprefix('budget-')} {r['ndcg@10']:.4f} "
                            f"({r['ndcg@10'] - r['zero_shot']:+.4f}, {r['vs_zero_shot']['wins']} / "
                            f"{r['vs_zero_shot']['losses']} queries, {p_text(r['vs_zero_shot']['t_pvalue'])}; "
                            f"{r['budget']})" for r in other if r.get("vs_zero_shot")))
        for _, _, what, mean_file in BUDGET_FILES.get(ds, []):
            f = RESULTS / mean_file if mean_file else None
            if f is not None and f.exists():  # bench/seed_mean.py over that file's seeds
                for k, v in json.loads(f.read_text())["systems"].items():
                    line += (f"; {what}, each query averaged over {v['seeds']} seeds: {k} {v['ndcg@10_mean']:.4f} "
                             f"({v['gain']:+.4f}, {p_text(v['t_pvalue'])})")
        out.append(line)
    if ds == "scifact":
        b = by["bm25-flat"]["ndcg@10"]
        tested = ""
        every = [r["ndcg@10"] for r in seeded]
        if every:  # the config's teacher (configs/gpl_scifact_offline.yaml), over its seeds
            g = sum(every) / len(every)
            what = (f"mean of {len(every)} seeds {g:.4f}: {', '.join(f'{x:.4f}' for x in every)}" if len(every) > 1
                    else f"{g:.4f}, one seed")
            ps = [r["p_vs_bm25"] for r in seeded if r.get("p_vs_bm25") is not None]
            if ps:  # is the margin real? the paired t-test of each seed's student against BM25
                tested = "; paired t-test against BM25 p " + (f"{min(ps):.2f}-{max(ps):.2f}" if len(ps) > 1
                                                              else f"{ps[0]:.2f}")
        else:
            g = by["gpl-student"]["ndcg@10"]
            what = f"{g:.4f}"
        out.append(f"GPL student above BM25: {'met' if g > b else 'MISSED'} ({what} vs {b:.4f}{tested}"
                   f"{gpl_seed_mean(ds, 'vs_bm25') if every else ''})")
    # the config's GPL student counts once, as its mean over seeds (its best seed alone would be a pick)
    candidates = [r for r in trained if r not in seeded and not r.get("seed_run")]
    other_seeds: dict[str, list[float]] = {}  # CONFIG_SEEDS: a config's system at its other seeds
    for r in trained:
        if r.get("seed_run"):
            other_seeds.setdefault(r["of"], []).append(r["ndcg@10"])
    for i, r in enumerate(candidates):
        if r["system"] in other_seeds:
            each = [r["ndcg@10"], *other_seeds[r["system"]]]
            candidates[i] = {"recipe": r["recipe"], "ndcg@10": sum(each) / len(each),
                             "label": f"{r['label']}, mean of {len(each)} seeds ({' / '.join(f'{x:.4f}' for x in each)})"}
    if seeded:
        candidates.append({"recipe": "GPL", "ndcg@10": sum(r["ndcg@10"] for r in seeded) / len(seeded),
                           "label": f"GPL student (the config), mean of {len(seeded)} seed(s)"})
    best = max(candidates, key=lambda r: r["ndcg@10"])
    fusion = by["hybrid"]["ndcg@10"]
    gap = fusion - best["ndcg@10"]
    out.append(f"best dense student within 0.02 of the fusion teacher: {'met' if gap <= 0.02 else 'MISSED'} "
               f"({best['label'] if best['label'].startswith(best['recipe']) else best['recipe'] + ' ' + best['label']} {best['ndcg@10']:.4f} vs {fusion:.4f}: {abs(gap):.4f} {'below' if gap >= 0 else 'above'})")
    hybrids = [r for r in rows if r["system"].startswith("hybrid-gpl-student-") and r.get("vs_fusion")]
    if hybrids:  # not a goal: what adapting the dense model gives a deployed BM25 + dense hybrid
        out.append("BM25 fused with the GPL student (`hybrid.students`), paired t-tests against the same fusion of the "
                   "zero-shot model and against BM25: " + "; ".join(
                       f"seed {r['system'].rsplit('-s', 1)[1]} {r['ndcg@10']:.4f} {fused_tests(r)}" for r in hybrids) + gpl_hybrid_seed_mean(ds))
    zero_fused = [r for r in rows if r.get("of") == "hybrid"]
    fused = [r for r in rows if (r.get("of") or "").startswith("hybrid-") and r.get("vs_fusion")]
    if fused:  # not a goal: the same question for the supervised recipes (hybrid.enabled; RECIPE_HYBRID_FILES)
        out.append("BM25 fused with each RocketQA / ANCE model (`hybrid.enabled`), paired t-tests against BM25 + "
                   f"zero-shot MiniLM at the same length ({', '.join(sorted({format(r['ndcg@10'], '.4f') for r in zero_fused}))}) "
                   "and against BM25: " + "; ".join(
                       f"{r['of'].removeprefix('hybrid-')} {r['ndcg@10']:.4f} {fused_tests(r)}" for r in fused))
    return out


def gpl_hybrid_seed_mean(ds: str) -> str:
    """bench/gpl_teacher.py's test of each query of BM25 + GPL student averaged over the seeds against the zero-shot
    fusion, as a clause ("" with fewer than 2 seeds)."""
    clauses = []
    for name in GPL_HYBRID_FILES.get(ds, []):
        f = RESULTS / name
        m = json.loads(f.read_text()).get("mean_over_seeds", {}).get("every", {}) if f.exists() else {}
        h = m.get("hybrid_gpl_student")
        if h:
            t = h["vs_hybrid"]
            clauses.append(f"; each query averaged over the {h['seeds']} seeds: {h['ndcg@10']:.4f}, "
                           f"{t['mean_diff']:+.4f} against the fusion ({t['wins']} / {t['losses']} queries, "
                           f"{p_text(t['t_pvalue'])})")
    return "".join(clauses)


def tested(t: dict) -> str:
    """A paired test as ``wins / losses, p``."""
    return f"{t['wins']} / {t['losses']}, {p_text(t['t_pvalue'])}"


def fused_tests(r: dict) -> str:
    """A BM25 fusion row's tests against the zero-shot fusion and against BM25."""
    return f"(vs fusion {tested(r['vs_fusion'])}; vs BM25 {tested(r['vs_bm25'])})"


def vs_hybrid(system: dict) -> str:
    t = system.get("vs_hybrid")
    return tested(t) if t else "-"


def paired_in_store(spec: str) -> dict:
    """``DIR`` or ``DIR:RUN_ID``: that run (default: the store's latest completed one), each system's nDCG@10
    and its paired t-test against zero-shot (wins / losses over the evaluated queries), from the run's
    evaluate outputs."""
    import duckdb

    from train_dev import paired_with, per_query_ndcg

    folder, _, wanted = spec.partition(":")
    store = Path(folder)
    with duckdb.connect(str(store / "catalog.duckdb"), read_only=True) as con:
        run_id, config = con.execute("SELECT run_id, config_path FROM runs WHERE status = 'completed' "
                                     "AND run_id LIKE ? ORDER BY started_at DESC LIMIT 1",
                                     [(wanted or "") + "%"]).fetchone()
        ndcg = dict(con.execute("SELECT system, value FROM metrics WHERE run_id = ? AND metric = 'ndcg@10'",
                                [run_id]).fetchall())
    per_query = per_query_ndcg(store, run_id)  # read once: both tests below pair its rows
    tests = paired_with(per_query, "dense-")  # against zero-shot, as train_dev.paired_against_zero_shot
    systems = {k: {"ndcg@10": round(v, 4), **tests.get(k, {})} for k, v in ndcg.items()}
    if "hybrid" in per_query:  # BM25 + each trained model (hybrid.students) against exactly BM25 + zero-shot
        fused = {"hybrid": per_query["hybrid"], **{k: v for k, v in per_query.items() if k.startswith("hybrid-")}}
        for k, t in paired_with(fused, "hybrid").items():
            systems[k]["vs_hybrid"] = t
        bm25 = next((k for k in per_query if k.startswith("bm25-")), None)  # and against BM25 (its first variant)
        for k, t in (paired_with({bm25: per_query[bm25], **fused}, bm25) if bm25 else {}).items():
            systems[k]["vs_bm25"] = t
    return {"store": str(store), "run_id": run_id, "config": config, "systems": systems}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "quality.json"))
    ap.add_argument("--store", action="append", default=[], help="also: DIR[:RUN_ID], a store's latest (or that) "
                                                                   "run (e.g. a demo's), each system's paired test against "
                                                                   "zero-shot (repeatable)")
    args = ap.parse_args()
    out = {}
    for ds in ("scifact", "nfcorpus"):
        rows = rows_for(ds)
        print(f"\n### {ds}\n")
        harness.table(["recipe", "system", "nDCG@10", "R@100", "vs zero-shot", "budget", "machine", "file"],
                      [[r["recipe"], r["label"], f"{r['ndcg@10']:.4f}", f"{r['recall@100']:.4f}",
                        f"{r['ndcg@10'] - r['zero_shot']:+.4f}" if r["system"] != ZERO else "-", r["budget"],
                        r["machine"], r["file"]] for r in rows])
        g = goals(ds, rows)
        print("\n" + "\n".join(f"- {line}" for line in g))
        out[ds] = {"rows": rows, "goals": g}
    # stores read before (the demos' runs: their stores are not kept) stay, unless read again
    prior = json.loads(Path(args.out).read_text()).get("stores", []) if Path(args.out).exists() else []
    stores = []
    for store in args.store:
        r = paired_in_store(store)
        stores.append(r)
        print(f"\n{r['run_id']} ({r['config']}): nDCG@10, and against zero-shot: wins / losses, paired t-test p")
        harness.table(["system", "nDCG@10", "wins / losses", "p", "vs hybrid: wins / losses, p"],
                      [[k, v["ndcg@10"], f"{v['wins']} / {v['losses']}" if "wins" in v else "-",
                        v.get("t_pvalue", "-"), vs_hybrid(v)] for k, v in r["systems"].items()])
    again = {r["run_id"] for r in stores}
    stores = [r for r in prior if r["run_id"] not in again] + stores
    harness.write_json(Path(args.out), {"datasets": out, "stores": stores,
                                        "machine": {"note": "read from the result files"}})


if __name__ == "__main__":
    main()
