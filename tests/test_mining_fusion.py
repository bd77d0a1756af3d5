"""fuse (zscore / minmax / rrf) and mine_negatives (topk / range / random / mix): the math on hand-made
runs, then both stages on BM25 runs over a small real SciFact slice."""

from __future__ import annotations

import math
import random
import statistics

import pyarrow as pa
import pytest

from irflow.testing import SHARED_DATASETS

from irflow import data_contracts
from irflow.stage import RunContext
from irflow.tasks.fuse import fuse, fuse_tables, resolve_weights
from irflow.tasks.mine_negatives import mine_negatives, mine_tables

SCIFACT = SHARED_DATASETS / "scifact.zip"


def run_table(system: str, lists: dict[str, list[tuple[str, float]]]) -> pa.Table:
    """A run from {query: [(doc, score), ...]} in rank order."""
    rows = [(q, d, r, s) for q, hits in lists.items() for r, (d, s) in enumerate(hits, start=1)]
    return pa.table({"query_id": [r[0] for r in rows], "doc_id": [r[1] for r in rows],
                     "rank": pa.array([r[2] for r in rows], pa.int32()),
                     "score": pa.array([r[3] for r in rows], pa.float32()), "system": [system] * len(rows)})


def by_query(table: pa.Table) -> dict[str, list[tuple[str, int, float]]]:
    out: dict[str, list] = {}
    for q, d, r, s in zip(*(table.column(c).to_pylist() for c in ("query_id", "doc_id", "rank", "score"))):
        out.setdefault(q, []).append((d, r, s))
    return out


# ---- fusion on a hand-made example --------------------------------------------------------------
RUN_A = run_table("bm25", {"q1": [("d1", 3.0), ("d2", 2.0), ("d3", 1.0)], "q2": [("d1", 5.0), ("d5", 1.0)]})
RUN_B = run_table("dense", {"q1": [("d2", 0.9), ("d4", 0.5)]})  # no list for q2


def expected_normalised(lists, how):
    """Independent reference: per-query normalisation; a missing doc gets the run's minimum."""
    fused: dict[str, dict[str, float]] = {}
    for run, w in lists:
        for q in {"q1", "q2"}:
            hits = run.get(q)
            docs = {d for r, _ in lists for d, _ in r.get(q, [])}
            for d in docs:
                fused.setdefault(q, {}).setdefault(d, 0.0)
            if not hits:
                continue  # the run gives 0 to every doc of a query it has no list for
            scores = [s for _, s in hits]
            if how == "zscore":
                mu, sd = statistics.fmean(scores), statistics.pstdev(scores)
                norm = {d: (s - mu) / sd for d, s in hits}
            else:
                lo, hi = min(scores), max(scores)
                norm = {d: (s - lo) / (hi - lo) for d, s in hits}
            floor = min(norm.values())
            for d in docs:
                fused[q][d] += w * norm.get(d, floor)
    return fused


LISTS_A = {"q1": [("d1", 3.0), ("d2", 2.0), ("d3", 1.0)], "q2": [("d1", 5.0), ("d5", 1.0)]}
LISTS_B = {"q1": [("d2", 0.9), ("d4", 0.5)]}


@pytest.mark.parametrize("method", ["zscore", "minmax"])
def test_score_fusion_matches_an_independent_computation(method):
    alpha = 0.3
    out = fuse_tables([RUN_A, RUN_B], method, alpha=alpha, system="hybrid")
    data_contracts.get("run").validate(out)
    want = expected_normalised([(LISTS_A, alpha), (LISTS_B, 1 - alpha)], method)
    got = by_query(out)
    for q, hits in got.items():
        assert {d: s for d, _, s in hits} == pytest.approx(want[q], abs=1e-5)  # also: the union of docs
        # ranks are 1..n by score descending, ties by doc id
        assert [r for _, r, _ in hits] == list(range(1, len(hits) + 1))
        assert [d for d, _, _ in hits] == sorted(want[q], key=lambda d: (-want[q][d], d))
    assert set(out.column("system").to_pylist()) == {"hybrid"}
    if method == "zscore":
        # spelled out for q1: d2 = 0.3 * 0 + 0.7 * 1; d4 = 0.3 * min_z(A) + 0.7 * (-1)
        z = math.sqrt(1.5)
        assert dict((d, s) for d, _, s in got["q1"]) == pytest.approx(
            {"d1": 0.3 * z - 0.7, "d2": 0.7, "d3": -0.3 * z - 0.7, "d4": -0.3 * z - 0.7}, abs=1e-5)
        assert [d for d, _, _ in got["q1"]] == ["d2", "d1", "d3", "d4"]


def test_rrf_matches_the_formula():
    out = fuse_tables([RUN_A, RUN_B], "rrf", weights=[1.0, 2.0], rrf_k=60)
    got = {q: {d: s for d, _, s in hits} for q, hits in by_query(out).items()}
    assert got["q1"] == pytest.approx({"d1": 1 / 61, "d2": 1 / 62 + 2 / 61, "d3": 1 / 63, "d4": 2 / 62})
    assert got["q2"] == pytest.approx({"d1": 1 / 61, "d5": 1 / 62})
    assert [d for d, _, _ in by_query(out)["q1"]] == ["d2", "d4", "d1", "d3"]


def test_fusion_top_k_weights_and_errors():
    out = fuse_tables([RUN_A, RUN_B], "zscore", top_k=2)
    assert {q: [r for _, r, _ in h] for q, h in by_query(out).items()} == {"q1": [1, 2], "q2": [1, 2]}
    assert resolve_weights(2, alpha=0.25) == [0.25, 0.75]
    assert resolve_weights(4) == [0.25] * 4
    assert resolve_weights(2, method="rrf") == [1.0, 1.0]
    with pytest.raises(ValueError, match="2 run"):
        resolve_weights(3, alpha=0.5)
    with pytest.raises(ValueError, match="weight"):
        fuse_tables([RUN_A, RUN_B], "zscore", weights=[1.0])
    with pytest.raises(ValueError, match="unknown method"):
        fuse_tables([RUN_A], "combmnz")
    # one run fused alone keeps its order
    alone = fuse_tables([RUN_A], "zscore")
    assert [d for d, _, _ in by_query(alone)["q1"]] == ["d1", "d2", "d3"]


# ---- mining on hand-made runs -------------------------------------------------------------------
N_LIST = 120
CORPUS_IDS = [f"d{i}" for i in range(300)]


def mining_runs():
    rng = random.Random(0)
    lists_bm25, lists_dense = {}, {}
    for q in ("q1", "q2"):
        docs = [f"d{i}" for i in range(N_LIST)]
        lists_bm25[q] = [(d, 100.0 - i) for i, d in enumerate(docs)]
        rng.shuffle(docs)
        lists_dense[q] = [(d, 1.0 - i / 1000) for i, d in enumerate(docs)]
    return [run_table("bm25", lists_bm25), run_table("dense", lists_dense)]


QRELS = pa.table({"query_id": ["q1", "q1", "q1", "q2"], "doc_id": ["d3", "d7", "d8", "d0"],
                  "score": pa.array([1, 2, 0, 1], pa.int32()), "split": ["test", "train", "test", "generated"]})
POSITIVES = {("q1", "d3"), ("q1", "d7"), ("q2", "d0")}  # d8 is judged 0: not a positive


def rank_of(runs):
    return {(t.column("system")[i].as_py(), t.column("query_id")[i].as_py(), t.column("doc_id")[i].as_py()):
            t.column("rank")[i].as_py() for t in runs for i in range(t.num_rows)}


def rows(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(c).to_pylist() for c in ("query_id", "doc_id", "miner", "rank"))))


def test_topk_takes_every_non_positive_of_each_top_k():
    runs = mining_runs()
    neg = mine_tables(runs, QRELS, strategy="topk", top_k=10)
    data_contracts.get("negatives").validate(neg)
    ranks = rank_of(runs)
    want = {(q, d, m, r) for (m, q, d), r in ranks.items() if r <= 10 and (q, d) not in POSITIVES}
    assert set(rows(neg)) == want
    assert ("q1", "d8", "bm25", 9) in want  # judged non-relevant (score 0) is a valid negative
    assert not any((q, d) in POSITIVES for q, d, _, _ in rows(neg))


def test_range_and_sampling_respect_the_ranks():
    runs = mining_runs()
    neg = mine_tables(runs, QRELS, strategy="range", rank_range=[10, 100])
    assert all(10 <= r <= 100 for *_, r in rows(neg))
    assert not any((q, d) in POSITIVES for q, d, _, _ in rows(neg))
    ranks = rank_of(runs)
    assert set(rows(neg)) == {(q, d, m, r) for (m, q, d), r in ranks.items()
                              if 10 <= r <= 100 and (q, d) not in POSITIVES}
    sampled = mine_tables(runs, QRELS, strategy="range", rank_range=[10, 100], num_negatives=5, seed=1)
    counts: dict[tuple, int] = {}
    for q, _, m, _ in rows(sampled):
        counts[(q, m)] = counts.get((q, m), 0) + 1
    assert counts == {(q, m): 5 for q in ("q1", "q2") for m in ("bm25", "dense")}
    assert set(rows(sampled)) <= set(rows(neg))
    assert rows(mine_tables(runs, QRELS, strategy="range", rank_range=[10, 100], num_negatives=5, seed=1)) == rows(sampled)
    assert rows(mine_tables(runs, QRELS, strategy="range", rank_range=[10, 100], num_negatives=5, seed=2)) != rows(sampled)
    with pytest.raises(ValueError, match="rank_range"):
        mine_tables(runs, QRELS, strategy="range", rank_range=[50, 10])


def test_mix_ratio_with_corpus_draws():
    runs = mining_runs()
    neg = mine_tables(runs, QRELS, CORPUS_IDS, strategy="mix", top_k=20, mix={"hard": 4, "easy": 6}, seed=3)
    data_contracts.get("negatives").validate(neg)
    for q in ("q1", "q2"):
        mine = [r for r in rows(neg) if r[0] == q]
        hard = [r for r in mine if r[2] != "random"]
        easy = [r for r in mine if r[2] == "random"]
        assert {m: sum(1 for r in hard if r[2] == m) for m in ("bm25", "dense")} == {"bm25": 4, "dense": 4}
        assert all(1 <= r[3] <= 20 for r in hard)
        assert len(easy) == 6 and all(r[3] == 0 and r[1] in CORPUS_IDS for r in easy)
        assert not {r[1] for r in easy} & {r[1] for r in hard}  # an easy draw never repeats a hard one
        assert not any((q, r[1]) in POSITIVES for r in mine)
    again = mine_tables(runs, QRELS, CORPUS_IDS, strategy="mix", top_k=20, mix={"hard": 4, "easy": 6}, seed=3)
    assert again.equals(neg)


def test_mix_without_corpus_takes_easy_ones_from_the_tail():
    runs = mining_runs()
    neg = mine_tables(runs, QRELS, strategy="mix", top_k=20, mix={"hard": 3, "easy": 2}, seed=0)
    for q in ("q1", "q2"):
        for m in ("bm25", "dense"):
            ranks = sorted(r for qq, _, mm, r in rows(neg) if qq == q and mm == m)
            assert len(ranks) == 5
            assert sum(r <= 20 for r in ranks) == 3 and sum(r > 20 for r in ranks) == 2


def test_random_corpus_draws_never_return_positives():
    small_corpus = [f"d{i}" for i in range(10)]  # q1 has 2 positives in it, q2 one
    runs = mining_runs()
    neg = mine_tables(runs, QRELS, small_corpus, strategy="random", num_random=9, seed=5)
    per_q = {q: [d for qq, d, _, _ in rows(neg) if qq == q] for q in ("q1", "q2")}
    assert sorted(per_q["q1"]) == sorted(set(small_corpus) - {"d3", "d7"})  # all that is left
    assert sorted(per_q["q2"]) == sorted(set(small_corpus) - {"d0"})
    assert {m for _, _, m, _ in rows(neg)} == {"random"}


def test_duplicate_miner_names_are_rejected():
    runs = mining_runs()
    with pytest.raises(ValueError, match="distinct"):
        mine_tables([runs[0], runs[0]], QRELS)


# ---- stages on BM25 runs over a real slice ------------------------------------------------------
@pytest.fixture(scope="module")
def bm25_setup(tmp_path_factory):
    if not SCIFACT.exists():
        pytest.skip("needs the SciFact zip")
    from irflow.tasks.bm25 import bm25_index, bm25_search
    from irflow.tasks.generate_queries import generate_queries
    from irflow.tasks.ingest import ingest_beir, ingest_config
    from irflow.testing import beir_slice

    root = tmp_path_factory.mktemp("mf")
    folder = beir_slice(SCIFACT, root / "slice", n_test_queries=5, n_extra_docs=40, seed=2)
    ctx = RunContext(str(root / "store"), "mf")
    data = ingest_beir.run(ctx, cfg=ingest_config({"source": str(folder)}, ctx.store.root / "downloads"))
    gen = generate_queries.run(ctx, cfg={"source": "ict", "queries_per_passage": 1, "seed": 0}, corpus=data["corpus"])
    index = bm25_index.run(ctx, cfg={"variant": "flat", "_threads": 1}, corpus=data["corpus"])
    runs = [bm25_search.run(ctx, cfg={"system": system, "variant": "flat", "k1": k1, "b": b, "top_k": 30,
                                      "_threads": 1}, label=system, bm25_index=index, queries=gen["queries"])
            for system, k1, b in (("bm25", 0.9, 0.4), ("bm25-okapi", 1.2, 0.75))]
    return {"ctx": ctx, "data": data, "gen": gen, "runs": runs}


def test_mine_negatives_stage_on_bm25_runs(bm25_setup):
    ctx, gen, runs = bm25_setup["ctx"], bm25_setup["gen"], bm25_setup["runs"]
    qrels = gen["qrels"].table()
    source = dict(zip(qrels.column("query_id").to_pylist(), qrels.column("doc_id").to_pylist()))
    run = runs[0].table()
    top1 = {q: d for q, d, r in zip(*(run.column(c).to_pylist() for c in ("query_id", "doc_id", "rank"))) if r == 1}
    # The measured weakness of ICT queries holds here too: the source passage is nearly always BM25's top-1.
    assert sum(top1.get(q) == d for q, d in source.items()) / len(source) > 0.8

    cfg = {"strategy": "topk", "top_k": 10, "seed": 0}
    ref = mine_negatives.run(ctx, cfg=cfg, runs=runs, qrels=gen["qrels"])
    neg = ref.table()
    assert neg.num_rows > 0
    assert not any(source[q] == d for q, d in zip(neg.column("query_id").to_pylist(), neg.column("doc_id").to_pylist()))
    assert set(neg.column("miner").to_pylist()) == {"bm25", "bm25-okapi"}
    assert all(1 <= r <= 10 for r in neg.column("rank").to_pylist())
    mine_negatives.run(ctx, cfg=cfg, runs=runs, qrels=gen["qrels"])
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"

    mixed = mine_negatives.run(ctx, cfg={"strategy": "mix", "top_k": 10, "mix": {"hard": 2, "easy": 3}, "seed": 0},
                               runs=runs, qrels=gen["qrels"], corpus=bm25_setup["data"]["corpus"]).table()
    easy = [(q, d) for q, d, m in zip(*(mixed.column(c).to_pylist() for c in ("query_id", "doc_id", "miner")))
            if m == "random"]
    assert len(easy) == 3 * len(source) and not any(source[q] == d for q, d in easy)


def test_fuse_stage_on_bm25_runs(bm25_setup):
    ctx, runs = bm25_setup["ctx"], bm25_setup["runs"]
    cfg = {"method": "rrf", "rrf_k": 60, "top_k": 20, "system": "bm25-rrf"}
    ref = fuse.run(ctx, cfg=cfg, runs=runs)
    fused = ref.table()
    per_q = by_query(fused)
    assert all([r for _, r, _ in hits] == list(range(1, len(hits) + 1)) and len(hits) <= 20 for hits in per_q.values())
    # rrf score = sum of 1 / (60 + rank) over the runs that retrieved the document
    ranks = [{(q, d): r for q, d, r, _ in sum(([(q, *h) for h in hs] for q, hs in by_query(t.table()).items()), [])}
             for t in runs]
    for q, hits in per_q.items():
        for d, _, s in hits:
            want = sum(1 / (60 + rk[(q, d)]) for rk in ranks if (q, d) in rk)
            assert s == pytest.approx(want, rel=1e-6)
    fuse.run(ctx, cfg=cfg, runs=runs)
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
    # a different run order is a different fusion input (the weights follow the order)
    assert fuse.key(cfg, {"runs": runs}) != fuse.key(cfg, {"runs": runs[::-1]})
