"""Does the synthetic held-out evaluation (the proxy) rank models as real judgements do?

A user with documents and no labels: SciFact or NFCorpus given as a folder of documents, plus the train
queries' texts as a query log (no labels). Six GPL runs (query log, ICT and crop queries; 30 and 120 steps;
each with its QGen baseline; one continued from another run's student, as ``train.init`` continues from
production) make 11 trained models; with the zero-shot start, 12. A seventh (``log-120-kept``) repeats the
120-step log run keeping its student every 30 steps (``train.candidates_every``): 3 more models, and the
selection among a run's own checkpoints (early stopping by the proxy). Every run holds the same documents out
(``dataset.proxy``: a fixed hash fraction), so every model is scored on documents none of them trained on.
Two more runs train other kinds of student on the same documents: ``tas-120`` (GPL's student on TAS-B's
topic-aware, margin-balanced batches, ``train.tas.enabled``) and ``moco-120`` (the contriever recipe: crop pairs,
InfoNCE with MoCo's queue). The contriever recipe refuses a proxy of its own pairs' kind, and no query generator
exists offline, so its run holds the same documents out with a tiny random T5 as its proxy's generator (that
run's own evaluation is never read: every model is scored here). ``--add-to`` runs only the runs named and adds
their models to an earlier result's (the held-out documents and proxies are made by the same rules; the
zero-shot model is scored again and must match the earlier scores).

Then, outside the runs, each model's stored corpus embeddings (the ones its run evaluated) are scored

- on the real test queries and qrels (used only here, after the runs), nDCG@10 per query;
- on several proxies made from the held-out passages, nDCG@10 per query:
  ``ict`` (a sentence of the passage, the passage left whole: irflow's proxy before this bench),
  ``ict-removed`` (the sentence cut out of the passage it points to, as Lee et al.'s ICT does),
  ``crop`` / ``crop-removed`` (a random span, kept or cut out), and two filters of ``ict-removed``:
  ``easy-dropped`` (NeMo Curator's easiness filter: drop queries above the 70th percentile of the
  zero-shot model's query-passage similarity) and ``round-trip`` (Promptagator: keep a query only when
  BM25-free zero-shot retrieval finds its passage in the top 20);
  ``log-teacher`` / ``log-teacher-top3``: a held-out part of the query log judged by the run's teacher, no
  passage at all: the test queries' texts (never trained on: the runs' log is the train queries), each judged
  by the config's teacher (z-score fusion of BM25 and the zero-shot model over the union of both top 50s,
  every candidate scored by both, as ``pseudo_label`` does), the teacher's top 1 (or top 3) taken as relevant.
  The real qrels of the same queries then differ from it only in who judged.

Reported per proxy: Kendall's tau against the real ranking of the models; the regret (real nDCG@10 of
the real best minus that of the proxy's best; and resampled with the test queries: how sure it is); what
irflow's selection rule (per-document units, Holm, at least 20 documents) would ship from each run and from
all the trained candidates, and that model's real score against the start's; the rate of false selection at k = 5 null candidates (bench/selection_null.py's
simulation on this proxy's per-query scores); and the continued-from-production case (proxy and real
difference of the continued model over the model it continued from).

    python bench/proxy_agreement.py --dataset scifact --store /work/bench-proxy/scifact \\
        --out bench/results/proxy_agreement_scifact.json
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
import yaml

import harness  # noqa: F401 -- first: offline environment, this checkout on sys.path
import own_corpus
import selection_null
from irflow.recipes.dataset import same_kind

# (run name, query source, GPL steps, with the QGen baseline, continued from this run's GPL student)
RUNS = [("log-30", "log", 30, True, None), ("log-120", "log", 120, True, None),
        ("ict-30", "ict", 30, True, None), ("ict-120", "ict", 120, True, None),
        ("crop-120", "crop", 120, True, None), ("continued", "log", 60, False, "log-120"),
        ("log-120-kept", "log", 120, False, None), ("tas-120", "log", 120, False, None),
        ("moco-120", "crop", 120, False, None)]
TAS = {"tas-120"}  # GPL's student on TAS-B's batches
CONTRIEVER = {"moco-120"}  # the contriever recipe (MoCo)
# runs that keep their GPL student every quarter of their steps (train.candidates_every): the kept students are
# models of their own; the final one is log-120's (the same weights), so it is not counted twice
KEPT = {"log-120-kept": "gpl-log-120"}
PROXIES = ("ict", "ict-removed", "crop", "crop-removed", "easy-dropped", "round-trip", "log-teacher",
           "log-teacher-top3")
# the query source each proxy is made of (the filters keep some of the cut ICT queries)
PROXY_SOURCE = {"ict": "ict", "ict-removed": "ict", "crop": "crop", "crop-removed": "crop", "easy-dropped": "ict",
                "round-trip": "ict", "log-teacher": "log", "log-teacher-top3": "log"}
FILTERS = {"easy-dropped": "ict-removed", "round-trip": "ict-removed"}  # a filter -> the proxy it keeps queries of
SEED = 42  # the proxy's sampling seed (ICTSource / CropSource default)


def config(dataset: str, name: str, source: str, steps: int, qgen: bool, init_model: str | None, docs: Path,
           log_file: Path, work: Path, keep_every: int = 0) -> Path:
    c = yaml.safe_load((harness.ROOT / "configs" / f"gpl_{dataset}_offline.yaml").read_text())
    # every held-out document (fraction 0.1); the corpus searched left whole: the proxies are made here
    c["dataset"] = {"name": dataset, "source": str(docs), "proxy": {"cut": False}}
    if source == "log":
        c["dataset"]["query_log"] = str(log_file)
    c["generate"] = own_corpus.GENERATE[source]
    c.get("label", {}).pop("positive", None)
    c["train"]["steps"] = steps
    c["train"]["qgen"] = {"enabled": qgen, "steps": steps}
    if keep_every:
        c["train"]["candidates_every"] = keep_every
    if name in TAS:
        c["train"]["tas"] = {"enabled": True}
    if init_model:
        c["train"]["model"] = init_model
        c["train"]["seed"] = 43
    c["hybrid"] = {"enabled": False}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def contriever_config(dataset: str, name: str, steps: int, docs: Path, work: Path) -> Path:
    """The contriever recipe on the documents alone, holding out what the GPL runs hold out."""
    from irflow.dev.testing import make_tiny_t5

    c = yaml.safe_load((harness.ROOT / "configs" / f"contriever_{dataset}.yaml").read_text())
    t5 = work / "tiny-t5"
    if not (t5 / "config.json").exists():
        make_tiny_t5(t5)
    # the proxy's queries are never read (the bench makes its own); its documents are the GPL runs' held-out ones
    c["dataset"] = {"name": dataset, "source": str(docs),
                    "proxy": {"cut": False, "queries": {"source": "t5", "model": str(t5), "queries_per_passage": 1}}}
    c.pop("md5", None)
    c["train"]["steps"] = steps
    c["hybrid"] = {"enabled": False}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return path


def run_models(result, run_name: str) -> dict[str, dict]:
    """name -> {model id, embeddings id, system} of a run's dense models (the start as 'zero-shot')."""
    stages = {s.name: s for s in result.stages}
    out = {}
    for system, model_id in result.selected["models"].items():
        start = system == result.selected["start"]
        tag = "zero-shot" if start else system
        name = "zero-shot" if start else f"{system.replace('-student', '')}-{run_name}"
        if run_name in TAS | CONTRIEVER and not start:
            name = f"{'contriever' if run_name in CONTRIEVER else 'tas'}-{run_name.split('-')[1]}"
        out[name] = {"model": model_id, "embeddings": stages[f"encode_corpus[{tag}]"].outputs["embeddings"],
                     "system": system, "run": run_name, "start": start}
    return out


def ndcg10(scores: np.ndarray, doc_ids: list[str], qids: list[str], qrels: dict) -> dict[str, float]:
    """Per-query nDCG@10 (pytrec_eval's ndcg_cut_10) of a score matrix (queries x corpus)."""
    import pytrec_eval

    top = np.argpartition(-scores, 100, axis=1)[:, :100]
    run = {q: {doc_ids[j]: float(scores[i, j]) for j in top[i]} for i, q in enumerate(qids)}
    ev = pytrec_eval.RelevanceEvaluator({q: qrels[q] for q in qids}, {"ndcg_cut.10"})
    return {q: v["ndcg_cut_10"] for q, v in ev.evaluate(run).items()}


def make_proxies(heldout) -> dict[str, dict]:
    """name -> {query id: (text, passage id, the passage's text with the query cut out or None)}."""
    from irflow.learn import generation
    from irflow.learn.text import passage_text

    out = {"ict": {}, "ict-removed": {}, "crop": {}, "crop-removed": {}}
    for doc_id, title, text in zip(*(heldout.column(c).to_pylist() for c in ("doc_id", "title", "text"))):
        for kind, qs in (("ict", generation.ict_queries(doc_id, text, 1, SEED)),
                         ("crop", generation.crop_queries(doc_id, text, 1, SEED))):
            for q in qs:
                masked = " ".join(text.replace(q, " ", 1).split())
                out[kind][f"{doc_id}-{kind}"] = (q, doc_id, None)
                out[f"{kind}-removed"][f"{doc_id}-{kind}"] = (q, doc_id, passage_text(title, masked))
    return out


def score_model(m: dict, catalog, test_q: dict, test_qrels: dict, proxies: dict, corpus_ids: list[str],
                judged: dict | None = None) -> dict:
    """Per-query nDCG@10 on the real test set and on each proxy (before the filters), and the zero-shot
    filters' inputs (query-passage similarity, rank of the passage)."""
    from irflow.learn.encoding import encode_texts
    from irflow.learn.encoding import load_sentence_transformer

    path = catalog.ref(m["model"]).path if not m["model"].startswith("hub:") else m["model"].removeprefix("hub:")
    if path == "sentence-transformers/all-MiniLM-L6-v2":
        from irflow.engine.models import minilm_path
        path = minilm_path()
    st = load_sentence_transformer(str(path), "cpu", 256)
    t = catalog.ref(m["embeddings"]).table()
    emb = np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)
    assert t.column("doc_id").to_pylist() == corpus_ids
    row = {d: i for i, d in enumerate(corpus_ids)}
    out = {}
    qids = sorted(q for q in test_qrels if q in test_q)
    qe = encode_texts(st, [test_q[q] for q in qids], 64, True, desc="test queries", task="query")
    out["real"] = ndcg10(qe @ emb.T, corpus_ids, qids, test_qrels)
    for name, qrels in (judged or {}).items():
        out[name] = ndcg10(qe @ emb.T, corpus_ids, qids, qrels)
    extra = {}
    for name, qs in proxies.items():
        ids = sorted(qs)
        qe = encode_texts(st, [qs[q][0] for q in ids], 64, True, desc=name, task="query")
        e = emb
        if name.endswith("-removed"):
            e = emb.copy()
            docs = [qs[q][1] for q in ids]
            masked = encode_texts(st, [qs[q][2] for q in ids], 64, True, desc=f"{name} passages", task="document")
            e[[row[d] for d in docs]] = masked  # one query per passage: each passage cut once
        s = qe @ e.T
        qrels = {q: {qs[q][1]: 1} for q in ids}
        out[name] = ndcg10(s, corpus_ids, ids, qrels)
        if name == "ict-removed":
            pos = np.array([s[i, row[qs[q][1]]] for i, q in enumerate(ids)])
            rank = (s > pos[:, None]).sum(axis=1)
            extra = {"similarity": dict(zip(ids, pos.tolist())), "rank": dict(zip(ids, rank.tolist()))}
    del st
    gc.collect()
    return out, extra


def teacher_qrels(config: dict, catalog, index_ref: str, zero_shot: dict, test_q: dict, qids: list[str],
                  corpus, depth: int = 50) -> dict[str, dict[str, dict[str, int]]]:
    """The run's fusion teacher on held-out log queries: ``{"log-teacher": qrels (top 1), "log-teacher-top3": ...}``."""
    import pyarrow as pa

    from irflow.engine.models import minilm_path
    from irflow.learn.encoding import encode_texts, load_sentence_transformer
    from irflow.learn.teachers import FusionTeacher
    from irflow.stages.pseudo_label import JudgeParams, judgements
    from irflow.stages.bm25 import score_pairs, search

    teacher = FusionTeacher(**{k: v for k, v in config["teacher"].items() if k != "score_every_candidate"})
    corpus_ids = corpus.column("doc_id").to_pylist()
    (sparse, dense), = [tuple(teacher.weights)]  # the offline configs: {bm25: w, minilm: w}
    st = load_sentence_transformer(str(minilm_path()), "cpu", 256)
    t = catalog.ref(zero_shot["embeddings"]).table()
    emb = np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)
    qe = encode_texts(st, [test_q[q] for q in qids], 64, True, desc="log queries (teacher)", task="query")
    ds = qe @ emb.T
    top = np.argsort(-ds, axis=1)[:, :depth]
    hits = search(catalog.ref(index_ref).path, qids, [test_q[q] for q in qids], k1=0.9, b=0.4, top_k=depth,
                  fields={"contents": 1.0}, remove_query=False, threads=1)
    cand = {q: {corpus_ids[j] for j in top[i]} for i, q in enumerate(qids)}
    for q, d in zip(hits["query_id"], hits["doc_id"]):
        cand[q].add(d)
    pairs = sorted((q, d) for q in qids for d in cand[q])
    bm25 = score_pairs(catalog.ref(index_ref).path, pairs, dict(test_q), k1=0.9, b=0.4)
    row, qrow = {d: j for j, d in enumerate(corpus_ids)}, {q: i for i, q in enumerate(qids)}
    runs = [pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs], "rank": [0] * len(pairs),
                      "score": scores, "system": [name] * len(pairs)})
            for name, scores in ((sparse, bm25), (dense, [float(ds[qrow[q], row[d]]) for q, d in pairs]))]
    # judged as the judge_queries stage judges: its own function, on these candidates and teacher runs
    asked = pa.table({"query_id": qids, "text": [test_q[q] for q in qids]})
    candidates = pa.table({"query_id": [q for q, _ in pairs], "doc_id": [d for _, d in pairs]})
    out = {}
    for name, relevant in (("log-teacher", 1), ("log-teacher-top3", 3)):
        t = judgements(JudgeParams(relevant=relevant, teacher=teacher), None, asked, corpus, [candidates], runs)
        out[name] = {}
        for q, d in zip(t.column("query_id").to_pylist(), t.column("doc_id").to_pylist()):
            out[name].setdefault(q, {})[d] = 1
    return out


def kendall(a: dict, b: dict) -> float:
    return round(own_corpus.kendall_tau(a, b), 3)


def mean(v: dict) -> float:
    return sum(v.values()) / len(v) if v else float("nan")


def real_reliability(real: dict[str, dict[str, float]], resamples: int = 2000, seed: int = 0) -> dict:
    """How far the test qrels can confirm a proxy's ranking of these models: the Kendall tau a proxy that ranks them
    by their true quality would show against the test queries' ranking, approximated by the tau between the
    models' mean over the test queries and their mean over a bootstrap resample of them (optimistic: the
    observed means stand for the true ones), and the tau between two disjoint halves of the test queries."""
    names = sorted(real)
    qids = sorted(real[names[0]])
    m = np.array([[real[n][q] for q in qids] for n in names])
    full, rng, n = m.mean(1), np.random.default_rng(seed), len(qids)
    as_dict = (lambda v: dict(zip(names, v.tolist())))
    boot = np.array([own_corpus.kendall_tau(as_dict(full), as_dict(m[:, rng.integers(0, n, n)].mean(1)))
                     for _ in range(resamples)])
    halves = []
    for _ in range(resamples):
        order = rng.permutation(n)
        halves.append(own_corpus.kendall_tau(as_dict(m[:, order[: n // 2]].mean(1)),
                                             as_dict(m[:, order[n // 2:]].mean(1))))
    return {"queries": n, "models": len(names), "real_range": round(float(full.max() - full.min()), 4),
            "perfect_proxy_tau": round(float(boot.mean()), 3),
            "perfect_proxy_tau_90": [round(float(x), 3) for x in np.percentile(boot, [5, 95])],
            "perfect_proxy_reaches_0.8": round(float((boot >= 0.8).mean()), 3),
            "split_half_tau": round(float(np.mean(halves)), 3)}


def regret_resampled(real: dict[str, dict[str, float]], proxy: dict[str, dict[str, float]], resamples: int = 1000,
                     seed: int = 0) -> dict:
    """How sure the regret is: the test queries resampled (and the proxy's queries with them when they are the
    same queries, as the judged log's are; else resampled apart), the real best and the proxy's pick found again
    in each resample. Returns the median and 90% interval of the regret and the share of resamples at or
    below 0.005."""
    names = sorted(real)
    rq, pq = sorted(real[names[0]]), sorted(proxy[names[0]])
    r = np.array([[real[n][q] for q in rq] for n in names])
    p = np.array([[proxy[n][q] for q in pq] for n in names])
    rng, joint = np.random.default_rng(seed), rq == pq
    out = []
    for _ in range(resamples):
        i = rng.integers(0, len(rq), len(rq))
        rm = r[:, i].mean(1)
        pm = p[:, i if joint else rng.integers(0, len(pq), len(pq))].mean(1)
        out.append(rm.max() - rm[int(pm.argmax())])
    out = np.array(out)
    return {"median": round(float(np.median(out)), 4), "90%": [round(float(x), 4) for x in np.percentile(out, [5, 95])],
            "at_most_0.005": round(float((out <= 0.005).mean()), 3), "queries_resampled_with_the_test": bool(joint)}


def significant_pairs(real: dict[str, dict[str, float]], proxy: dict[str, float], alpha: float = 0.05) -> dict:
    """The pairs of models the test qrels tell apart (paired t-test over the test queries, p < alpha), and how many
    of them the proxy orders as the qrels do: agreement where there is something to agree on."""
    from irflow.learn.stats import paired

    names, agree, pairs = sorted(real), 0, 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            t = paired(real[a], real[b])
            if t.t_pvalue < alpha:
                pairs += 1
                agree += (t.mean_diff > 0) == (proxy[b] > proxy[a])
    return {"pairs": pairs, "ordered_as_the_qrels": agree, "share": round(agree / pairs, 3) if pairs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=("scifact", "nfcorpus"))
    ap.add_argument("--store", required=True, help="the store (kept: a second call reuses every stage)")
    ap.add_argument("--trials", type=int, default=400, help="null-case trials per proxy")
    ap.add_argument("--runs", nargs="+", default=[r[0] for r in RUNS if r[0] not in KEPT],
                    choices=[r[0] for r in RUNS], help="which of the runs (default: all but log-120-kept)")
    ap.add_argument("--long-steps", type=int, default=120, help="the longer runs' GPL steps (the continued run "
                                                                "trains half as many)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--add-to", metavar="JSON", help="run only --runs and add their models to this earlier result "
                                                     "(its per-query scores are kept; --out is written)")
    ap.add_argument("--analyse", action="store_true", help="only the analysis again, on --out's stored per-query "
                                                           "scores (no run, no model scored again)")
    args = ap.parse_args()
    if args.analyse:
        return reanalyse(args.out, args.trials)
    if not set(args.runs) - CONTRIEVER:
        ap.error(f"--runs {' '.join(args.runs)}: name a GPL run beside it (the scoring reads a GPL run's BM25 index "
                 "and teacher; a cached one costs seconds)")

    from irflow import api
    from irflow.sources.corpus_sources import document_id

    store = Path(args.store)
    work = store.parent / f"{store.name}-inputs"
    work.mkdir(parents=True, exist_ok=True)
    docs, log_file = own_corpus.prepare(args.dataset, work)
    out: dict = {"dataset": args.dataset, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": {},
                 "machine": harness.machine()}
    prior = None
    if args.add_to:
        import json

        prior = json.loads(Path(args.add_to).read_text())
        assert prior["dataset"] == args.dataset, f"{args.add_to} is {prior['dataset']}'s"
        out["added_to"] = {"file": args.add_to, "started": prior["started"], "machine": prior["machine"]}
    models: dict[str, dict] = {}
    results = {}
    runs = [(n, src, args.long_steps if st == 120 else args.long_steps // 2 if st == 60 else st, q, i)
            for n, src, st, q, i in RUNS if n in args.runs]
    out["runs_config"] = runs
    for name, source, steps, qgen, init in runs:
        init_model = models[f"gpl-{init}"]["model"] if init else None
        path = (contriever_config(args.dataset, name, steps, docs, work) if name in CONTRIEVER else
                config(args.dataset, name, source, steps, qgen, init_model, docs, log_file, work,
                       steps // 4 if name in KEPT else 0))
        t = harness.run(path, store=store)
        results[name] = t.result
        found = run_models(t.result, name)
        if name in KEPT:  # its final student is KEPT[name]'s (the same weights): only the kept ones are new
            found = {k: v for k, v in found.items() if "-step" in k or v["start"]}
        for k, v in found.items():
            if not (init and v["start"]):
                models.setdefault(k, v)
        out["runs"][name] = {"run_id": t.result.run_id, "wall_seconds": round(t.wall_seconds, 1),
                             "load_before": t.load_before, "load_after": t.load_after,
                             "computed": len(t.result.computed), "selected": t.result.selected["system"],
                             "models": sorted(k for k, v in found.items() if not (init and v["start"]))}
        harness.write_json(args.out, out)

    catalog = api.catalog(store)
    first = results[next(n for n, *_ in runs if n not in CONTRIEVER)]  # a GPL run: its BM25 index and config
    ingest = next(s for s in first.stages if s.name == "ingest_corpus").outputs["corpus"]
    corpus = catalog.ref(ingest).table()
    corpus_ids = corpus.column("doc_id").to_pylist()
    heldout = catalog.ref(next(s for s in first.stages if s.name == "holdout").outputs["heldout"]).table()
    _, test_q, test_qrels = harness.read_beir(harness.DATASETS / f"{args.dataset}.zip", "test")
    proxies = make_proxies(heldout)
    harness.log(f"{len(models)} models; held-out passages {heldout.num_rows}; proxy queries "
                + ", ".join(f"{k} {len(v)}" for k, v in proxies.items()))
    index = next(s for s in first.stages if s.name.startswith("bm25_index")).outputs["bm25_index"]
    judged = teacher_qrels(yaml.safe_load((work / f"{first_name(runs)}.yaml").read_text()), catalog, index,
                           models["zero-shot"], test_q, sorted(q for q in test_qrels if q in test_q), corpus)
    scores: dict[str, dict] = {}
    filters = {}
    for name, m in models.items():
        harness.log(f"scoring {name}")
        scores[name], extra = score_model(m, catalog, test_q, test_qrels, proxies, corpus_ids, judged)
        if name == "zero-shot":
            filters = extra
    # the filters, decided by the zero-shot model (what a run has before anything trains)
    sim = filters["similarity"]
    cut = float(np.percentile(list(sim.values()), 70))
    keep = {"easy-dropped": {q for q, v in sim.items() if v <= cut},
            "round-trip": {q for q, r in filters["rank"].items() if r < 20}}
    for name in scores:
        for f, qs in keep.items():
            scores[name][f] = {q: v for q, v in scores[name]["ict-removed"].items() if q in qs}
    units = {q: document_id(qs[1]) for p in proxies.values() for q, qs in p.items()}
    units.update({q: q for q in test_q})  # a log query is its own unit
    out.update({"models": models, "easiness_cut": round(cut, 4), "per_query": {n: s for n, s in scores.items()}})
    if prior is not None:
        out = merged(prior, out)
    analyse(out, units, args.trials)
    harness.write_json(args.out, out)


def first_name(runs) -> str:
    return next(n for n, *_ in runs if n not in CONTRIEVER)


def merged(prior: dict, new: dict) -> dict:
    """An earlier result with the new runs' models added. The zero-shot model, scored again here on proxies made
    again, must score as it did there: otherwise the held-out documents or the proxies differ."""
    before, again = prior["per_query"]["zero-shot"], new["per_query"]["zero-shot"]
    unfiltered = [p for p in before if p not in FILTERS]
    assert all(set(before[p]) == set(again[p]) for p in unfiltered), "the proxies' queries differ from the earlier's"
    drift = {p: max(abs(before[p][q] - again[p][q]) for q in before[p]) for p in unfiltered}
    assert max(drift.values()) < 1e-3, f"the zero-shot model scores differently than in the earlier result: {drift}"
    for scores in new["per_query"].values():  # the earlier result's filters (a query at the cut may tip over)
        for f, source in FILTERS.items():
            scores[f] = {q: v for q, v in scores[source].items() if q in before[f]}
    out = dict(prior)
    out["added"] = {"started": new["started"], "machine": new["machine"], "runs": new["runs"],
                    "zero_shot_max_difference": {p: round(v, 6) for p, v in drift.items()}}
    if "added" in prior:  # an earlier addition: kept, with the runs it made
        out["added_before"] = [*prior.get("added_before", []), prior["added"]]
    out["runs_config"] = prior["runs_config"] + [r for r in new["runs_config"] if r[0] not in prior["runs"]]
    # a run the earlier result has (run again here for its index, cached) keeps the earlier record
    out["runs"] = {**new["runs"], **prior["runs"]}
    out["models"] = {**prior["models"], **{k: v for k, v in new["models"].items() if k not in prior["models"]}}
    out["per_query"] = {**prior["per_query"],
                        **{k: v for k, v in new["per_query"].items() if k not in prior["per_query"]}}
    return out


def run_candidates(models: dict, run_name: str) -> tuple[str, list[str]]:
    """(the model a run started from, the trained models its selection chooses among: its own, and for a run that
    kept its students, the final one it shares with another run)."""
    start = "gpl-log-120" if run_name == "continued" else "zero-shot"
    return start, [n for n, m in models.items() if (m["run"] == run_name and not m["start"]) or n == KEPT.get(run_name)]


def stored_units(out: dict) -> dict[str, str]:
    """query -> evaluation unit, from a result's stored per-query scores: a proxy query's id is <passage id>-<kind>,
    its unit the held-out document; a log query (the real test queries' ids) is its own unit."""
    from irflow.sources.corpus_sources import document_id

    test_ids = set(out["per_query"]["zero-shot"]["real"])
    return {q: (q if q in test_ids else document_id(q.rsplit("-", 1)[0]))
            for s in out["per_query"].values() for per in s.values() for q in per}


def caveated(proxy: str, source: str) -> bool:
    """Whether a run trained on ``source`` queries keeps its start under this proxy whatever it scores: the
    recipe's same-kind caveat (``same_kind``) between the proxy's query source and the run's generate.source."""
    return same_kind(PROXY_SOURCE[proxy], own_corpus.GENERATE[source]["source"])


def analyse(out: dict, units: dict, trials: int) -> None:
    """Per proxy, from the models' per-query scores: tau, regret, what the selection ships (per run as the run
    applies it, with its same-kind caveat; and without the caveat), false selection at k = 5."""
    from irflow.decide.selection import select

    scores, models = out["per_query"], out["models"]
    runs = out["runs_config"]
    source = {name: src for name, src, *_ in runs}
    real = {n: mean(s["real"]) for n, s in scores.items()}
    real_best = max(real, key=real.get)
    table, summary = [], {}
    for p in PROXIES:
        proxy = {n: mean(s[p]) for n, s in scores.items()}
        pick = max(proxy, key=proxy.get)
        eligible = {n: s[p] for n, s in scores.items() if n == "zero-shot" or not caveated(p, source[models[n]["run"]])}
        everything = select(eligible, "zero-shot", f"proxy {p}", units=units, unit_name="held-out documents")
        per_run = {}
        for run_name, *_ in runs:
            start, trained = run_candidates(models, run_name)
            cands = {n: scores[n][p] for n in trained}
            bare = select({start: scores[start][p], **cands}, start, f"proxy {p}", units=units,
                          unit_name="held-out documents")
            ships = start if caveated(p, source[run_name]) else bare.system
            per_run[run_name] = {"start": start, "selected": ships, "p": bare.p_value,
                                 "real_vs_start": round(real[ships] - real[start], 4),
                                 "without_caveat": bare.system,
                                 "without_caveat_real_vs_start": round(real[bare.system] - real[start], 4)}
        trained_best = max((n for n in models if n != "zero-shot"), key=real.get)
        null = selection_null.simulate(scores["zero-shot"][p], scores[trained_best][p],
                                       {q: units[q] for q in scores["zero-shot"][p]}, 5, trials, seed=5)
        cont = {k: round(mean(scores["gpl-continued"][k]) - mean(scores["gpl-log-120"][k]), 4)
                if "gpl-continued" in scores else float("nan") for k in (p, "real")}
        summary[p] = {
            "queries": len(scores["zero-shot"][p]), "kendall_tau": kendall(proxy, real),
            "kendall_tau_trained": kendall({n: v for n, v in proxy.items() if n != "zero-shot"},
                                           {n: v for n, v in real.items() if n != "zero-shot"}),
            # among the models the rule may ship under this proxy (the same-kind caveat leaves the others out)
            "kendall_tau_eligible": kendall({n: v for n, v in proxy.items() if n in eligible},
                                            {n: v for n, v in real.items() if n in eligible}),
            "proxy_best": pick, "regret": round(real[real_best] - real[pick], 4),
            "selected_of_all": everything.system, "selected_p": everything.p_value,
            "selected_real_vs_start": round(real[everything.system] - real["zero-shot"], 4),
            "per_run": per_run, "false_selection_k5": null["false_selection"],
            "continued_minus_log120": cont, "proxy_ndcg@10": {n: round(v, 4) for n, v in proxy.items()},
            "significant_pairs": significant_pairs({n: s["real"] for n, s in scores.items()}, proxy),
            "regret_resampled": regret_resampled({n: s["real"] for n, s in scores.items()},
                                                 {n: s[p] for n, s in scores.items()})}
        worst = min(r["real_vs_start"] for r in per_run.values())
        bare_worst = min(r["without_caveat_real_vs_start"] for r in per_run.values())
        table.append([p, summary[p]["queries"], summary[p]["kendall_tau"], summary[p]["kendall_tau_trained"], pick,
                      f"{summary[p]['regret']:.4f} ({summary[p]['regret_resampled']['90%'][0]:.4f}-"
                      f"{summary[p]['regret_resampled']['90%'][1]:.4f}; "
                      f"{summary[p]['regret_resampled']['at_most_0.005']:.0%} <= 0.005)", everything.system, f"{summary[p]['selected_real_vs_start']:+.4f}",
                      f"{worst:+.4f}", f"{bare_worst:+.4f}", f"{null['false_selection']:.3f}",
                      f"{cont[p]:+.4f} / {cont['real']:+.4f}",
                      f"{summary[p]['significant_pairs']['ordered_as_the_qrels']} of {summary[p]['significant_pairs']['pairs']}"])
    out.update({"real_ndcg@10": {n: round(v, 4) for n, v in real.items()}, "real_best": real_best,
                "proxies": summary, "real_reliability": real_reliability({n: s["real"] for n, s in scores.items()})})
    print("the test qrels' own reliability:", out["real_reliability"])
    harness.table(["model", "real nDCG@10"] + list(PROXIES),
                  [[n, f"{real[n]:.4f}"] + [f"{summary[p]['proxy_ndcg@10'][n]:.4f}" for p in PROXIES]
                   for n in sorted(real, key=real.get, reverse=True)])
    harness.table(["proxy", "queries", "tau", "tau trained", "proxy best", "regret (90%; resamples <= 0.005)", f"ships (of {len(models) - 1})",
                   "real vs start", "worst run vs start", "the same without the caveat", "false sel. k=5",
                   "continued: proxy / real", "significant pairs ordered right"], table)


def reanalyse(path: str, trials: int) -> None:
    """``--analyse JSON``: the analysis again on a result's stored per-query scores (no model is re-scored)."""
    import json

    out = json.loads(Path(path).read_text())
    analyse(out, stored_units(out), trials)
    harness.write_json(path, out)


if __name__ == "__main__":
    main()
