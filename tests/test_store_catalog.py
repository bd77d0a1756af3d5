"""The content-addressed store, the cached stage runner and the lineage catalog, on real SciFact rows."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pydantic import Field, ValidationError

from irflow.data_contracts import ContractError
from irflow.dev.testing import SHARED_DATASETS, beir_slice, ingest_folder, scifact_docs
from irflow.engine.catalog import Catalog
from irflow.engine.errors import StageFailed
from irflow.engine.params import NoParams, Params
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.engine.stage import Output, Stage, stage
from irflow.engine.store import TABLE_FILE, DatasetRef, Store, remove_tree

SCIFACT = SHARED_DATASETS / "scifact.zip"


@pytest.fixture(scope="module")
def docs() -> pa.Table:
    """The first 300 real SciFact documents as a corpus table."""
    return scifact_docs(300)


@pytest.fixture
def ctx(tmp_path) -> Run:
    return Run(str(tmp_path / "store"), "run-1")


def objects(root) -> list[str]:
    return sorted(p.name for p in (Path(root) / "objects").iterdir())


def tmp_entries(root) -> list[str]:
    return sorted(p.name for p in (Path(root) / "tmp").iterdir())


def statuses(ctx: Run) -> list[str]:
    return [s["status"] for s in ctx.catalog.stage_runs(ctx.run_id)]


# ---- store ----------------------------------------------------------------------------------
def test_publish_is_content_addressed(tmp_path, docs):
    store = Store(tmp_path / "s")
    ref1, n1 = store.publish_table("corpus", "corpus", docs)
    ref2, n2 = store.publish_table("corpus", "corpus", pa.concat_tables([docs.slice(0, 100), docs.slice(100)]))
    assert ref1 == ref2 and n1 == n2 == docs.num_rows
    assert ref1.id.startswith("corpus-") and len(ref1.id) == len("corpus-") + 16
    assert objects(store.root) == [ref1.id]
    assert tmp_entries(store.root) == []
    assert sorted(p.name for p in Path(ref1.path).iterdir()) == [TABLE_FILE]
    assert ref1.table().equals(docs)
    # different content -> different id, both kept
    ref3, _ = store.publish_table("corpus", "corpus", docs.slice(1))
    assert ref3.id != ref1.id and objects(store.root) == sorted([ref1.id, ref3.id])


def test_same_rows_chunked_differently_get_one_id(tmp_path):
    """Content addressing must not depend on how a producer chunked its table in memory (page
    boundaries follow chunks), nor on whether it hands over a table or a parquet file it wrote."""
    with zipfile.ZipFile(SCIFACT) as z:
        rows = [json.loads(ln) for ln in z.read("scifact/corpus.jsonl").decode().splitlines() if ln.strip()]
    full = pa.table({"doc_id": [str(d["_id"]) for d in rows], "title": [d.get("title") or "" for d in rows],
                     "text": [d["text"] for d in rows]})  # all of SciFact: several MB, many pages
    store = Store(tmp_path / "s")
    f = tmp_path / "streamed.parquet"
    import pyarrow.parquet as pq

    pq.write_table(full, f, row_group_size=1000)
    variants = [full.combine_chunks(), pa.Table.from_batches(full.to_batches(max_chunksize=333)),
                pa.concat_tables([full.slice(0, 1200), full.slice(1200, 7), full.slice(1207)]), f]
    ids = {store.publish_table("corpus", "corpus", v)[0].id for v in variants}
    assert len(ids) == 1
    assert objects(store.root) == sorted(ids)


@pytest.mark.parametrize("bad", ["duplicate", "null_text", "extra_column", "empty"])
def test_publish_rejects_contract_violation_and_leaves_nothing(tmp_path, docs, bad):
    store = Store(tmp_path / "s")
    if bad == "duplicate":
        t = pa.concat_tables([docs, docs.slice(5, 1)])
    elif bad == "null_text":
        t = docs.set_column(2, "text", pa.array([None] + docs["text"].to_pylist()[1:], pa.string()))
    elif bad == "extra_column":
        t = docs.append_column("score", pa.array([1.0] * docs.num_rows))
    else:
        t = docs.slice(0, 0)
    with pytest.raises(ContractError, match="corpus"):
        store.publish_table("corpus", "corpus", t)
    assert objects(store.root) == []
    assert tmp_entries(store.root) == []


# ---- the stage runner -----------------------------------------------------------------------
class ToyParams(Params):
    suffix: str = Field(description="appended to every upper-cased text")
    limit: int | None = Field(None, description="keep the first n rows")


class HeadParams(Params):
    n: int = Field(description="rows kept")


def make_toy(calls: list, version: str = "1", name: str = "toy_upper") -> Stage:
    @stage(name, version=version, outputs=Output("out", "corpus"))
    def toy(p: ToyParams, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        calls.append((p, rt))
        t = docs.table()
        text = pc.binary_join_element_wise(pc.utf8_upper(t["text"]), pa.scalar(p.suffix), "")
        return t.set_column(2, "text", text).slice(0, p.limit or t.num_rows)

    return toy


def test_stage_caching(ctx, docs):
    store = ctx.store
    src, _ = store.publish_table("corpus", "corpus", docs)
    calls: list = []
    toy = make_toy(calls)
    p = ToyParams(suffix="!")

    out = toy.run(ctx, p, docs=src)
    assert out.id.startswith("toy_upper-") and len(calls) == 1
    t = out.table()
    assert t["text"][0].as_py() == docs["text"][0].as_py().upper() + "!"
    assert t.num_rows == docs.num_rows

    again = toy.run(ctx, {"suffix": "!"}, docs=src)  # a dict is validated into the same params
    assert again == out and len(calls) == 1
    assert statuses(ctx) == ["computed", "cached"]

    # the runtime (threads, device, precision) is not keyed: another runtime is a cache hit
    other_rt = Run(ctx.store_root, "run-1", runtime=RuntimeConfig(threads=1, device="cpu", precision="bf16"))
    toy.run(other_rt, p, docs=src)
    assert len(calls) == 1 and statuses(ctx)[-1] == "cached"

    # params change -> recompute, new output
    other = toy.run(ctx, ToyParams(suffix="?"), docs=src)
    assert len(calls) == 2 and statuses(ctx)[-1] == "computed" and other.id != out.id

    # code version change -> recompute; same bytes -> same id (early cut-off)
    v2 = make_toy(calls, version="2").run(ctx, p, docs=src)
    assert len(calls) == 3 and statuses(ctx)[-1] == "computed" and v2.id == out.id

    # input content change -> recompute
    src2, _ = store.publish_table("corpus", "corpus", docs.slice(0, 50))
    small = toy.run(ctx, p, docs=src2)
    assert len(calls) == 4 and statuses(ctx)[-1] == "computed" and small.table().num_rows == 50

    # output deleted from the store -> recompute, and it is back
    remove_tree(out.path)  # objects are read-only
    back = toy.run(ctx, p, docs=src)
    assert len(calls) == 5 and statuses(ctx)[-1] == "computed"
    assert back.id == out.id and Path(back.path, TABLE_FILE).exists()

    # forced by label -> recompute even though cached
    forced_ctx = Run(ctx.store_root, "run-2", force={"toy_upper"})
    toy.run(forced_ctx, p, docs=src)
    assert len(calls) == 6 and statuses(forced_ctx) == ["computed"]

    # a new run with nothing changed: cached, and the catalog keeps the runs apart
    ctx3 = Run(ctx.store_root, "run-3")
    toy.run(ctx3, p, docs=src)
    assert len(calls) == 6 and statuses(ctx3) == ["cached"]
    assert len(statuses(ctx)) == 7
    assert tmp_entries(ctx.store_root) == []


def test_stage_params_are_checked_and_frozen(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    toy = make_toy([])
    with pytest.raises(ValidationError, match="suffx"):
        toy.run(ctx, {"suffx": "!"}, docs=src)  # a typo is an error, never a silent default
    with pytest.raises(ValidationError):
        ToyParams(suffix="!").suffix = "?"  # what a key was made of cannot change
    with pytest.raises(TypeError, match="missing input"):
        toy.run(ctx, ToyParams(suffix="!"))
    with pytest.raises(TypeError, match="unknown input"):
        toy.run(ctx, ToyParams(suffix="!"), docs=src, corpus=src)

    class Section(ToyParams):  # a config section that adds a recipe-level field
        model: str = Field("m", description="not the stage's business")

    with pytest.raises(ValidationError, match="model"):
        toy.run(ctx, Section(suffix="!"), docs=src)  # must be projected with .to(ToyParams), not keyed
    assert toy.run(ctx, Section(suffix="!").to(ToyParams), docs=src).id == toy.run(ctx, ToyParams(suffix="!"),
                                                                                    docs=src).id


def test_every_params_field_is_described():
    with pytest.raises(TypeError, match="description"):
        class Undocumented(Params):
            x: int = 1


def test_runtime_reaches_the_stage_and_is_recorded(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    calls: list = []

    @stage("toy_device", version="1", outputs=Output("out", "corpus"), work="encode")
    def toy_device(p: NoParams, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        calls.append(rt)
        return docs.table()

    run = Run(ctx.store_root, "run-rt", runtime=RuntimeConfig(device={"default": "cpu", "encode": "meta"},
                                                               precision={"encode": "bf16"}, threads=1))
    toy_device.run(run, NoParams(), docs=src)
    [rt] = calls
    assert (rt.device, rt.precision, rt.threads, rt.work) == ("meta", "bf16", 1, "encode")
    [row] = run.catalog.stage_runs("run-rt")
    assert row["runtime"]["device"] == "meta" and row["runtime"]["precision"] == "bf16"
    assert row["runtime"]["versions"]["torch"].startswith("2.")
    with run.catalog.connect() as con:
        recorded = json.loads(con.execute("SELECT runtime FROM datasets WHERE stage = 'toy_device'").fetchone()[0])
    assert recorded["device"] == "meta" and recorded["threads"] == 1


def test_a_failing_stage_is_named(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    from irflow.engine.errors import DataError

    @stage("picky", version="1", outputs=Output("out", "corpus"))
    def picky(p: NoParams, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        raise DataError("no queries are judged in split 'train'")

    with pytest.raises(StageFailed) as e:
        picky.run(ctx, NoParams(), tag="x", docs=src)
    assert e.value.stage == "picky[x]" and e.value.user_error
    assert e.value.one_line() == "stage picky[x]: no queries are judged in split 'train'"


def test_stage_label_and_cache_key_are_per_label(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    calls: list = []
    toy = make_toy(calls)
    toy.run(ctx, ToyParams(suffix="!"), docs=src, tag="a")
    toy.run(ctx, ToyParams(suffix="!"), docs=src, tag="b")  # same key: shared result
    runs = ctx.catalog.stage_runs(ctx.run_id)
    assert [r["name"] for r in runs] == ["toy_upper[a]", "toy_upper[b]"]
    assert [r["status"] for r in runs] == ["computed", "cached"] and len(calls) == 1
    assert runs[0]["cache_key"] == runs[1]["cache_key"]


def test_failing_stage_publishes_nothing(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    before = objects(ctx.store_root)

    @stage("dup_maker", version="1", outputs=Output("out", "corpus"))
    def dup_maker(p: NoParams, rt: StageRuntime, *, docs: DatasetRef):
        t = docs.table()
        return pa.concat_tables([t, t.slice(0, 1)])  # breaks the corpus contract

    @stage("crasher", version="1", outputs=Output("out", "corpus"))
    def crasher(p: NoParams, rt: StageRuntime, *, docs: DatasetRef):
        (rt.workdir / "half.parquet").write_bytes(b"PAR1")
        raise RuntimeError("boom")

    with pytest.raises(ContractError, match="duplicate doc_id"):
        dup_maker.run(ctx, NoParams(), docs=src)
    with pytest.raises(StageFailed, match="boom") as e:
        crasher.run(ctx, NoParams(), docs=src)
    assert isinstance(e.value.cause, RuntimeError) and not e.value.user_error
    assert objects(ctx.store_root) == before
    assert tmp_entries(ctx.store_root) == []
    assert ctx.catalog.stage_runs(ctx.run_id) == []
    with ctx.catalog.connect() as con:
        assert con.execute("SELECT count(*) FROM datasets").fetchone()[0] == 0  # src was published bare


def test_multi_output_stage(ctx, docs):
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)

    @stage("splitter", version="1", outputs=[Output("head", "corpus"), Output("tail", "corpus")])
    def splitter(p: HeadParams, rt: StageRuntime, *, docs: DatasetRef):
        t = docs.table()
        return {"head": t.slice(0, p.n), "tail": t.slice(p.n)}

    refs = splitter.run(ctx, HeadParams(n=10), docs=src)
    assert set(refs) == {"head", "tail"}
    assert refs["head"].id.startswith("head-") and refs["tail"].id.startswith("tail-")
    assert refs["head"].table().num_rows + refs["tail"].table().num_rows == docs.num_rows
    assert splitter.run(ctx, HeadParams(n=10), docs=src) == refs
    assert statuses(ctx) == ["computed", "cached"]


# ---- lineage + SQL --------------------------------------------------------------------------
@pytest.fixture
def chain(ctx, tmp_path):
    """ingest (real SciFact slice) -> toy_upper -> toy_head."""
    sl = beir_slice(SCIFACT, tmp_path / "scifact", n_test_queries=5, n_extra_docs=10, seed=3)
    beir = ingest_folder(ctx, sl)
    upper = make_toy([]).run(ctx, ToyParams(suffix="!"), docs=beir["corpus"])

    @stage("toy_head", version="7", outputs=Output("out", "corpus"))
    def toy_head(p: HeadParams, rt: StageRuntime, *, docs: DatasetRef):
        return docs.table().slice(0, p.n)

    head = toy_head.run(ctx, HeadParams(n=4), docs=upper)
    return beir, upper, head


def test_lineage(ctx, chain):
    beir, upper, head = chain
    lin = ctx.catalog.lineage(head.id)
    source_id = lin[3]["dataset_id"]
    assert [x["dataset_id"] for x in lin] == [head.id, upper.id, beir["corpus"].id, source_id]
    assert [x["depth"] for x in lin] == [0, 1, 2, 3]
    assert [x["stage"] for x in lin] == ["toy_head", "toy_upper", "ingest", "external"]
    # lineage ends at the source, named by its content fingerprint (not its path)
    assert source_id.startswith("sha256:") and lin[3]["kind"] == "source" and lin[3]["parents"] == []
    assert [x["code_version"] for x in lin[:3]] == ["7", "1", "3"]
    assert {x["run_id"] for x in lin[:3]} == {"run-1"}
    assert [x["num_rows"] for x in lin[:3]] == [4, upper.table().num_rows, beir["corpus"].table().num_rows]
    assert json.loads(lin[0]["params"]) == {"n": 4}
    assert json.loads(lin[1]["params"]) == {"suffix": "!", "limit": None}
    assert json.loads(lin[2]["params"]) == {"dangling_qrels": "drop"}
    assert lin[0]["parents"] == [{"role": "docs", "dataset_id": upper.id}]
    assert lin[2]["parents"] == [{"role": "source", "dataset_id": source_id}]
    assert lin[0]["num_bytes"] == Path(head.parquet).stat().st_size
    assert ctx.catalog.resolve(head.id[: len("toy_head-") + 6]) == head.id
    with pytest.raises(KeyError):
        ctx.catalog.resolve("no-such-")


def test_lineage_after_reopening(ctx, chain):
    """The catalog is a file: a fresh Catalog object sees the same lineage."""
    _, _, head = chain
    fresh = Catalog(Path(ctx.store_root) / "catalog.duckdb")
    assert [x["stage"] for x in fresh.lineage(head.id)] == ["toy_head", "toy_upper", "ingest", "external"]


def test_connect_with_views(ctx, chain):
    beir, upper, head = chain
    con = ctx.catalog.connect_with_views()
    try:
        corpus_ids = [beir["corpus"].id, upper.id, head.id]
        n = {i: con.execute(f'SELECT count(*) FROM "{i}"').fetchone()[0] for i in corpus_ids}
        assert n == {beir["corpus"].id: beir["corpus"].table().num_rows, upper.id: upper.table().num_rows,
                     head.id: 4}
        per_ds = dict(con.execute("SELECT dataset_id, count(*) FROM all_corpus GROUP BY 1").fetchall())
        assert per_ds == n
        assert con.execute("SELECT count(*) FROM all_qrels").fetchone()[0] == beir["qrels"].table().num_rows
        assert con.execute("SELECT count(*) FROM all_queries").fetchone()[0] == beir["queries"].table().num_rows
        # a view's rows are the dataset's rows
        t = con.execute(f'SELECT text FROM "{upper.id}" WHERE doc_id = ?',
                        [beir["corpus"].table()["doc_id"][0].as_py()]).fetchone()[0]
        assert t == beir["corpus"].table()["text"][0].as_py().upper() + "!"
        # catalog tables are visible unqualified; SQL lineage joins work
        stages = dict(con.execute("SELECT dataset_id, stage FROM datasets").fetchall())
        assert stages[head.id] == "toy_head" and stages[beir["qrels"].id] == "ingest"
        assert con.execute("SELECT parent_id FROM edges WHERE child_id = ?", [head.id]).fetchall() == [(upper.id,)]
        assert [r[0] for r in con.execute("SELECT status FROM stage_runs ORDER BY position").fetchall()] == \
            ["computed"] * 3
    finally:
        con.close()
    # the catalog is still writable afterwards
    ctx.catalog.record_metrics("run-1", head.id, [{"system": "s", "dataset": "d", "split": "test",
                                                   "metric": "ndcg@10", "value": 0.5}])
    assert ctx.catalog.run_metrics("run-1") == [{"system": "s", "dataset": "d", "split": "test", "ndcg@10": 0.5}]


def test_views_skip_deleted_datasets(ctx, chain):
    beir, upper, head = chain
    remove_tree(upper.path)
    con = ctx.catalog.connect_with_views()
    try:
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        assert upper.id not in views and head.id in views and "all_corpus" in views
        ids = {r[0] for r in con.execute("SELECT DISTINCT dataset_id FROM all_corpus").fetchall()}
        assert ids == {beir["corpus"].id, head.id}
    finally:
        con.close()


def test_multi_output_stage_is_all_or_nothing(ctx, docs):
    """If one output of a stage breaks its contract, none of its outputs is published."""
    src, _ = ctx.store.publish_table("corpus", "corpus", docs)
    before = objects(ctx.store_root)

    @stage("half_good", version="1", outputs=[Output("good", "corpus"), Output("bad", "corpus")])
    def half_good(p: NoParams, rt: StageRuntime, *, docs: DatasetRef):
        t = docs.table()
        return {"good": t.slice(0, 5), "bad": pa.concat_tables([t.slice(0, 2), t.slice(0, 1)])}

    with pytest.raises(ContractError, match="duplicate doc_id"):
        half_good.run(ctx, NoParams(), docs=src)
    assert objects(ctx.store_root) == before
    assert tmp_entries(ctx.store_root) == []


# ---- another process holding the catalog ------------------------------------------------------------
def _hold_catalog(path: Path, seconds: float):
    """A second process that opens the catalog for writing and keeps it for `seconds`."""
    import subprocess
    import sys

    code = ("import duckdb, sys, time; con = duckdb.connect(sys.argv[1]); print('held', flush=True); "
            "time.sleep(float(sys.argv[2])); con.close()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_catalog_waits_for_another_process(tmp_path, monkeypatch):
    path = tmp_path / "catalog.duckdb"
    Catalog(path).start_run("r1", "test", None, {})
    holder = _hold_catalog(path, 1.5)
    monkeypatch.setenv("IRFLOW_CATALOG_LOCK_TIMEOUT", "30")
    Catalog(path).start_run("r2", "test", None, {})  # waits until the holder lets go, then writes
    holder.wait(timeout=30)
    with Catalog(path).connect(read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 2


def test_the_catalog_is_held_only_during_an_access_while_threads_share_the_process_duckdb(tmp_path, docs):
    """Each access ATTACHes the file to the process's in-memory DuckDB (irflow.engine.memdb) and DETACHes it
    after: right after an access another process writes to it; nested accesses share one attachment;
    accesses from several threads, beside contract checks in others (cursors of the same DuckDB), all
    land."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from irflow import data_contracts

    path = tmp_path / "catalog.duckdb"
    cat = Catalog(path)
    with cat.connect() as outer:
        outer.execute("INSERT INTO runs (run_id) VALUES ('outer')")
        with cat.connect() as inner:  # the same attachment: sees the outer write
            assert inner.execute("SELECT run_id FROM runs").fetchall() == [("outer",)]
        outer.execute("INSERT INTO runs (run_id) VALUES ('after-inner')")  # still attached
    code = "import duckdb, sys; c = duckdb.connect(sys.argv[1]); c.execute(\"INSERT INTO runs (run_id) VALUES ('other')\"); c.close()"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)  # not locked by us now

    corpus = data_contracts.get("corpus")
    table = corpus.conform(docs)

    def write(i):
        cat.start_run(f"t{i}", "test", None, {})

    def check(_):
        corpus.check(table)
        with pytest.raises(ContractError, match="doc_id"):
            corpus.check(pa.concat_tables([table, table.slice(0, 1)]))  # a duplicate id, in a cursor of its own

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: write(i) if i % 2 else check(i), range(40)))
    with cat.connect() as con:
        ids = {r[0] for r in con.execute("SELECT run_id FROM runs").fetchall()}
    assert ids == {"outer", "after-inner", "other"} | {f"t{i}" for i in range(1, 40, 2)}


def test_catalog_locked_too_long_is_a_clear_cli_error(tmp_path, monkeypatch):
    from irflow.dev.testing import run_cli

    store = tmp_path / "store"
    store.mkdir()
    Catalog(store / "catalog.duckdb")
    holder = _hold_catalog(store / "catalog.duckdb", 20)
    try:
        monkeypatch.setenv("IRFLOW_CATALOG_LOCK_TIMEOUT", "0.5")
        code, _, err = run_cli("sql", "SELECT count(*) FROM runs", "--store", store)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert f"in use by another process (PID {holder.pid})" in err and "Traceback" not in err


def test_config_changes_name_the_leaf_that_changed():
    from irflow.engine.cache import config_changes

    old = {"teacher": {"type": "fusion", "weights": {"bm25": 0.3, "minilm": 0.7}}, "seed": 42, "gone": 1}
    new = {"teacher": {"weights": {"minilm": 0.5, "bm25": 0.5}, "type": "fusion"}, "seed": 42, "added": [1, 2]}
    assert config_changes(old, new) == [
        ("added", None, [1, 2]), ("gone", 1, None),
        ("teacher.weights.bm25", 0.3, 0.5), ("teacher.weights.minilm", 0.7, 0.5)]
    assert config_changes(new, new) == []
    # a section replaced by a scalar is reported whole
    assert config_changes({"scale": {"a": 1}}, {"scale": "auto"}) == [("scale", {"a": 1}, "auto")]


def test_cache_keys_do_not_drift():
    """A key computed today equals the one computed when this test was written: a change to the payload
    or its hashing would turn every stored result into a miss."""
    from irflow.engine.cache import cache_key

    inputs = {"queries": [DatasetRef("sha256:abc", "queries", "queries", "queries", "/x")],
              "bm25_index": [DatasetRef("sha256:def", "idx", "index", None, "/y"),
                             DatasetRef("sha256:0", "i2", "index", None, "/z")]}
    params = {"hits": 100, "nested": {"b": [1, 2.5, None], "a": "é"}, "path": Path("/tmp/p")}
    assert cache_key("bm25_search", "2", params, inputs) == \
        "45fd93d54d3fba7022b798340731e58e5c0aa5c284211667df7f2911297e0070"
    assert cache_key("s", "1", {}, {}) == "7d0a2abf1a9f03d0b3669c390e2116fdf57b4c675fe056ee6965e341b20396ea"


def test_a_moved_store_hits_its_cache_and_a_copy_reads_its_own_objects(tmp_path, chain):
    """Paths in the catalog are relative to the store root: `mv` keeps every cache hit, and a `cp -a`
    copy reads the copy's objects, never the original's."""
    beir, upper, head = chain
    root = tmp_path / "store"
    with Catalog(root / "catalog.duckdb").connect() as con:
        paths = [r[0] for r in con.execute("SELECT path FROM datasets WHERE stage <> 'external'").fetchall()]
    assert paths and all(p.startswith("objects/") for p in paths), paths

    moved = tmp_path / "moved"
    shutil.move(str(root), str(moved))
    calls: list = []
    run = Run(str(moved), "run-2")
    beir2 = ingest_folder(run, tmp_path / "scifact")
    again = make_toy(calls).run(run, ToyParams(suffix="!"), docs=beir2["corpus"])
    assert calls == [] and {s["status"] for s in run.catalog.stage_runs("run-2")} == {"cached"}
    assert again.id == upper.id and Path(again.path).parent == moved / "objects"
    assert Path(again.parquet).exists()

    copy = tmp_path / "copy"
    shutil.copytree(moved, copy, symlinks=True)
    remove_tree(moved)  # the original is gone: the copy must not need it
    cat = Catalog(copy / "catalog.duckdb")
    info = cat.dataset(head.id)
    assert Path(info["path"]).parent == copy / "objects"
    con = cat.connect_with_views()
    assert con.sql(f'SELECT count(*) FROM "{head.id}"').fetchall()[0][0] == 4


def test_old_absolute_paths_are_made_relative(tmp_path, chain):
    _, _, head = chain
    root = tmp_path / "store"
    with Catalog(root / "catalog.duckdb").connect() as con:
        con.execute("UPDATE datasets SET path = ? || '/objects/' || dataset_id WHERE stage <> 'external'",
                    [str(root)])
    moved = tmp_path / "elsewhere"
    shutil.move(str(root), str(moved))
    cat = Catalog(moved / "catalog.duckdb")  # opening migrates
    assert Path(cat.dataset(head.id)["path"]) == moved / "objects" / head.id


# Cache keys of the demo's first stages as a store made before the engine was split into rooms recorded
# them (commit 9fe3498): a change that moves code must leave them, and so every later key, as they were.
DEMO_KEYS = {
    "ingest": "995b02dc99ba764007661a1061633fe9a7bd0758d61b5e35c8a7a5aaf6fea4ba",
    "select_queries[test]": "96bc50c7ac81cbfcaf6702388388ee4126bb7abfa9e24dbe1111a1a42a3cc2e1",
    "generate_queries[unlabelled]": "bca99516bba1c80a35cb280debfb5d7c9df44456385e77b2f1c34caae881a987",
    "bm25_index[flat]": "d2db4bb0c73910867438738646753060ae0e8437b29201785eb4c3ac7837e316",
}


def test_the_demos_cache_keys_are_those_of_older_stores(tmp_path, prefect_harness):
    from irflow import api

    root = Path(__file__).resolve().parents[1]
    result = api.run(root / "configs" / "demo.yaml", store=tmp_path / "store",
                     to=["select_queries", "generate_queries", "bm25_index"])
    keys = {s["name"]: s["cache_key"] for s in Catalog(tmp_path / "store" / "catalog.duckdb").stage_runs(result.run_id)}
    assert keys == DEMO_KEYS
