"""Every data-contract check catches its violation and accepts valid (real SciFact) tables."""

from __future__ import annotations

import json
import zipfile

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from irflow import data_contracts as dc
from irflow.data_contracts import ContractError
from irflow.dev.testing import SHARED_DATASETS

SCIFACT = SHARED_DATASETS / "scifact.zip"


@pytest.fixture(scope="module")
def real() -> dict[str, pa.Table]:
    """Real SciFact tables: 200 documents, all queries, test+train qrels, and a run built from qrels."""
    with zipfile.ZipFile(SCIFACT) as z:
        docs = []
        with z.open("scifact/corpus.jsonl") as f:
            for line in f:
                d = json.loads(line)
                docs.append((str(d["_id"]), d.get("title") or "", d["text"]))
                if len(docs) == 200:
                    break
        queries = [json.loads(ln) for ln in z.read("scifact/queries.jsonl").decode().splitlines() if ln.strip()]
        qrels = []
        for split in ("test", "train"):
            for ln in z.read(f"scifact/qrels/{split}.tsv").decode().splitlines()[1:]:
                if ln.strip():
                    q, d, s = ln.split("\t")
                    qrels.append((q, d, int(s), split))
    corpus = pa.table({"doc_id": [d[0] for d in docs], "title": [d[1] for d in docs], "text": [d[2] for d in docs]})
    qt = pa.table({"query_id": [str(q["_id"]) for q in queries], "text": [q["text"] for q in queries]})
    qr = pa.table({"query_id": [r[0] for r in qrels], "doc_id": [r[1] for r in qrels],
                   "score": pa.array([r[2] for r in qrels], pa.int32()), "split": [r[3] for r in qrels]})
    # a run: per test query, its judged docs then the first corpus docs, ranked 1..n (ints are int64 here)
    rows = []
    test = qr.filter(pc.equal(qr["split"], "test"))
    by_q: dict[str, list[str]] = {}
    for q, d in zip(test["query_id"].to_pylist(), test["doc_id"].to_pylist()):
        by_q.setdefault(q, []).append(d)
    for q, judged in list(by_q.items())[:20]:
        ranked = judged + [d for d in corpus["doc_id"].to_pylist()[:5] if d not in judged]
        rows += [(q, d, i + 1, 10.0 - i, "bm25") for i, d in enumerate(ranked)]
    run = pa.table({"query_id": [r[0] for r in rows], "doc_id": [r[1] for r in rows], "rank": [r[2] for r in rows],
                    "score": [r[3] for r in rows], "system": [r[4] for r in rows]})
    return {"corpus": corpus, "queries": qt, "qrels": qr, "run": run}


def replace(t: pa.Table, col: str, values, type=None) -> pa.Table:
    i = t.schema.get_field_index(col)
    return t.set_column(i, col, pa.array(values, type or t.schema.field(col).type))


def set_row(t: pa.Table, col: str, row: int, value) -> pa.Table:
    vals = t[col].to_pylist()
    vals[row] = value
    return replace(t, col, vals)


# ---- valid tables ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["corpus", "queries", "qrels", "run"])
def test_valid_real_tables_pass(real, name):
    t = real[name]
    out = dc.get(name).validate(t)
    assert out.schema.equals(dc.get(name).schema)
    assert out.num_rows == t.num_rows
    # int64 ranks / float64 scores from Python are cast to the contract's types
    if name == "run":
        assert t.schema.field("rank").type == pa.int64() and out.schema.field("rank").type == pa.int32()
        assert out["rank"].to_pylist() == t["rank"].to_pylist()


def test_columns_are_reordered_to_the_contract(real):
    t = real["corpus"].select(["text", "doc_id", "title"])
    assert dc.CORPUS.validate(t).column_names == ["doc_id", "title", "text"]


def test_empty_title_is_allowed(real):
    dc.CORPUS.validate(replace(real["corpus"], "title", [""] * real["corpus"].num_rows))


# ---- ids ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", None], ids=["empty", "null"])
@pytest.mark.parametrize("name,col", [("corpus", "doc_id"), ("queries", "query_id")])
def test_empty_or_null_id(real, name, col, value):
    t = set_row(set_row(real[name], col, 3, value), col, 7, value)
    with pytest.raises(ContractError, match=rf"contract '{name}' violated: 2 row\(s\) with an empty or null {col}"):
        dc.get(name).validate(t)


@pytest.mark.parametrize("name,col", [("corpus", "doc_id"), ("queries", "query_id")])
def test_duplicate_ids(real, name, col):
    t = real[name]
    a, b = t[col][0].as_py(), t[col][1].as_py()
    t = set_row(set_row(set_row(t, col, 10, a), col, 11, a), col, 12, b)
    with pytest.raises(ContractError, match=rf"2 duplicate {col} value\(s\)") as e:
        dc.get(name).validate(t)
    assert a in str(e.value) and b in str(e.value)  # examples are named


# ---- nulls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,col", [("corpus", "text"), ("corpus", "title"), ("queries", "text"),
                                      ("qrels", "score"), ("qrels", "split"), ("run", "score")])
def test_null_values(real, name, col):
    t = set_row(real[name], col, 1, None)
    with pytest.raises(ContractError, match=rf"1 row\(s\) with a null {col}"):
        dc.get(name).validate(t)


def test_empty_tables(real):
    for name in ("corpus", "queries"):
        with pytest.raises(ContractError, match="no rows"):
            dc.get(name).validate(real[name].slice(0, 0))
    dc.QRELS.validate(real["qrels"].slice(0, 0))  # an empty qrels table is well formed


# ---- ranks ----------------------------------------------------------------------------------
def _ranks_of_first_query(run: pa.Table) -> int:
    q0 = run["query_id"][0].as_py()
    return sum(1 for q in run["query_id"].to_pylist() if q == q0)


@pytest.mark.parametrize("change", ["gap", "repeat", "starts_at_0"])
def test_non_contiguous_ranks(real, change):
    run = real["run"]
    n = _ranks_of_first_query(run)
    ranks = run["rank"].to_pylist()
    if change == "gap":
        ranks[n - 1] = n + 1  # 1..n-1, n+1
    elif change == "repeat":
        ranks[1] = 1  # 1, 1, 3, ...
    else:
        ranks[:n] = [r - 1 for r in ranks[:n]]  # 0..n-1
    with pytest.raises(ContractError, match="not contiguous"):
        dc.RUN.validate(replace(run, "rank", ranks))


def test_ranks_are_per_system_and_query(real):
    run = real["run"]
    # the same ranked lists under a second system name: 1..n again for every (system, query)
    both = pa.concat_tables([run, replace(run, "system", ["dense"] * run.num_rows)])
    dc.RUN.validate(both)
    # but one system's lists may not continue the other's
    shifted = replace(run, "rank", [r + 100 for r in run["rank"].to_pylist()])
    with pytest.raises(ContractError, match="not contiguous"):
        dc.RUN.validate(pa.concat_tables([run, shifted]))
    # row order does not matter
    dc.RUN.validate(run.take(pa.array(list(range(run.num_rows))[::-1])))


# ---- qrels / negatives pairs ----------------------------------------------------------------
def test_duplicate_qrels_pairs(real):
    qr = real["qrels"]
    dup = pa.concat_tables([qr, qr.slice(4, 2)])
    with pytest.raises(ContractError, match=r"2 duplicate \(split, query_id, doc_id\) pair"):
        dc.QRELS.validate(dup)
    # the same pair judged in another split is fine
    other_split = replace(qr.slice(4, 2), "split", ["dev", "dev"])
    dc.QRELS.validate(pa.concat_tables([qr, other_split]))


def test_duplicate_negatives_per_miner(real):
    qr = real["qrels"].slice(0, 30)
    neg = pa.table({"query_id": qr["query_id"], "doc_id": qr["doc_id"], "miner": ["bm25"] * 30,
                    "rank": list(range(1, 31))})
    dc.NEGATIVES.validate(neg)
    dc.NEGATIVES.validate(pa.concat_tables([neg, replace(neg, "miner", ["dense"] * 30)]))
    with pytest.raises(ContractError, match="duplicate"):
        dc.NEGATIVES.validate(pa.concat_tables([neg, neg.slice(0, 1)]))


# ---- schema ---------------------------------------------------------------------------------
def test_wrong_column_types(real):
    qr = real["qrels"]
    with pytest.raises(ContractError, match="wrong column types"):  # a score that is not a number
        dc.QRELS.validate(replace(qr, "score", ["relevant"] * qr.num_rows, pa.string()))
    with pytest.raises(ContractError, match="wrong column types"):  # a fractional score into int32
        dc.QRELS.validate(replace(qr, "score", [1.5] * qr.num_rows, pa.float64()))
    c = real["corpus"]
    with pytest.raises(ContractError, match="wrong column types"):  # text as a list of strings
        dc.CORPUS.validate(replace(c, "text", [[s] for s in c["text"].to_pylist()], pa.list_(pa.string())))
    run = real["run"]
    with pytest.raises(ContractError, match="wrong column types"):  # a rank that overflows int32
        dc.RUN.validate(replace(run, "rank", [2**40] * run.num_rows, pa.int64()))


def test_extra_column(real):
    t = real["queries"].append_column("lang", pa.array(["en"] * real["queries"].num_rows))
    with pytest.raises(ContractError, match=r"unexpected \['lang'\]"):
        dc.QUERIES.validate(t)


def test_missing_column(real):
    with pytest.raises(ContractError, match=r"missing \['title'\]"):
        dc.CORPUS.validate(real["corpus"].drop_columns(["title"]))
    with pytest.raises(ContractError, match=r"missing \['split'\]"):
        dc.QRELS.validate(real["qrels"].drop_columns(["split"]))


def test_several_problems_reported_together(real):
    t = set_row(set_row(real["corpus"], "doc_id", 0, ""), "text", 5, None)
    with pytest.raises(ContractError) as e:
        dc.CORPUS.validate(t)
    assert "empty or null doc_id" in str(e.value) and "null text" in str(e.value)


# ---- registry + dangling qrels --------------------------------------------------------------
def test_registry():
    assert {"corpus", "queries", "qrels", "run", "embeddings", "negatives", "pseudo_labels"} <= set(dc.CONTRACTS)
    with pytest.raises(KeyError, match="unknown data contract 'nope'"):
        dc.get("nope")
    c = dc.register(dc.Contract("test_pairs_tmp", pa.schema([("a", pa.string())]), (dc.check_unique_nonempty("a"),)))
    try:
        assert dc.get("test_pairs_tmp") is c
        with pytest.raises(ContractError, match="test_pairs_tmp"):
            c.validate(pa.table({"a": ["x", "x"]}))
    finally:
        del dc.CONTRACTS["test_pairs_tmp"]


def test_dangling_qrels_counts_and_order(real):
    qr, queries, corpus = real["qrels"], real["queries"], real["corpus"]
    kept, counts = dc.dangling_qrels(qr, queries, corpus)
    docs, qids = set(corpus["doc_id"].to_pylist()), set(queries["query_id"].to_pylist())
    rows = list(zip(qr["query_id"].to_pylist(), qr["doc_id"].to_pylist(), qr["score"].to_pylist(),
                    qr["split"].to_pylist()))
    expected = [r for r in rows if r[0] in qids and r[1] in docs]
    assert counts == {"missing_query": sum(r[0] not in qids for r in rows),
                      "missing_doc": sum(r[1] not in docs for r in rows),
                      "dangling": len(rows) - len(expected)}
    assert counts["missing_doc"] > 0  # only 200 of SciFact's docs are in this corpus
    # kept rows are the valid rows, in their original order, even for a multi-chunk table
    chunked = pa.concat_tables([qr.slice(i, 97) for i in range(0, qr.num_rows, 97)])
    for table in (qr, chunked):
        kept, _ = dc.dangling_qrels(table, queries, corpus)
        assert list(zip(*(kept[c].to_pylist() for c in ("query_id", "doc_id", "score", "split")))) == expected


def test_queries_without_judged_doc(real):
    """Per split, the judged queries none of whose judged documents (any score) is in the corpus."""
    qr, corpus = real["qrels"], real["corpus"]
    docs = set(corpus["doc_id"].to_pylist())
    expected: dict[str, dict[str, bool]] = {}
    for q, d, s in zip(qr["query_id"].to_pylist(), qr["doc_id"].to_pylist(), qr["split"].to_pylist()):
        expected.setdefault(s, {})
        expected[s][q] = expected[s].get(q, False) or d in docs
    got = dc.queries_without_judged_doc(qr, corpus)
    assert got == {s: {q for q, has in qs.items() if not has} for s, qs in expected.items()}
    assert any(got.values())  # only 200 of SciFact's docs are in this corpus
    split = sorted(got)[0]
    some = set(sorted(expected[split])[:5])
    assert dc.queries_without_judged_doc(qr, corpus, split, among=some) == {split: got[split] & some}
    # a toy case by hand: q1 has one judged doc present, q2 none (a 0-score judgement counts as judged)
    toy = pa.table({"query_id": ["q1", "q1", "q2", "q3"], "doc_id": ["a", "x", "y", "b"],
                    "score": pa.array([1, 1, 1, 0], pa.int32()), "split": ["test"] * 4})
    assert dc.queries_without_judged_doc(toy, pa.table({"doc_id": ["a", "b"]})) == {"test": {"q2"}}
    assert dc.queries_without_judged_doc(toy, pa.table({"doc_id": ["a", "b"]}), "train") == {}
