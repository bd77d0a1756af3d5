"""A store you can trust: digests checked on every reuse and read, read-only objects, `irflow verify`,
`irflow gc`, interrupted runs, and one computation per cache key across processes."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pydantic import Field

from irflow.dev.testing import SHARED_DATASETS, run_cli, scifact_docs
from irflow.engine.catalog import Catalog
from irflow.engine.errors import StageFailed
from irflow.engine.params import Params
from irflow.engine.runner import Run
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import TABLE_FILE, DatasetRef, Store, make_writable

SCIFACT = SHARED_DATASETS / "scifact.zip"


class Suffix(Params):
    suffix: str = Field("!", description="appended to every text")


def make_upper(calls: list):
    @stage("toy_upper", version="1", outputs=Output("out", "corpus"))
    def toy_upper(p: Suffix, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        calls.append(p)
        t = docs.table()
        return t.set_column(2, "text", pc.binary_join_element_wise(pc.utf8_upper(t["text"]), pa.scalar(p.suffix), ""))

    return toy_upper


def make_count(calls: list):
    @stage("toy_count", version="1", outputs=Output("out", "corpus"))
    def toy_count(p: Suffix, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        calls.append(p)
        return docs.table().slice(0, 3)

    return toy_count


@pytest.fixture(scope="module")
def docs() -> pa.Table:
    """The first 200 real SciFact documents as a corpus table."""
    return scifact_docs(200)


@pytest.fixture
def run(tmp_path) -> Run:
    return Run(str(tmp_path / "store"), "run-1")


def overwrite(path: Path, data: bytes, offset: int | None = None) -> None:
    """Tamper with a (read-only) stored file, as a careless user or a bad disk would."""
    make_writable(path.parent)
    path.chmod(0o644)
    if offset is None:
        path.write_bytes(data)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)


def statuses(run: Run) -> list[str]:
    return [s["status"] for s in run.catalog.stage_runs(run.run_id)]


# ---- digests ---------------------------------------------------------------------------------------
def test_published_objects_are_read_only_and_their_digest_is_recorded(run, docs):
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    out = make_upper([]).run(run, Suffix(), docs=src)
    obj = Path(out.path)
    assert stat.S_IMODE(obj.stat().st_mode) == 0o555
    assert stat.S_IMODE((obj / TABLE_FILE).stat().st_mode) == 0o444
    info = run.catalog.dataset(out.id)
    assert len(info["digest"]) == 64 and info["digest"].startswith(out.id.rsplit("-", 1)[1])


@pytest.mark.parametrize("damage", ["swapped", "flipped", "truncated"])
def test_a_damaged_cache_hit_is_named_set_aside_and_recomputed(run, docs, damage, caplog):
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    calls: list = []
    upper = make_upper(calls)
    good = upper.run(run, Suffix(), docs=src)
    other = upper.run(run, Suffix(suffix="?"), docs=src)  # another valid output, to swap in
    expected = good.table()
    f = Path(good.parquet)
    if damage == "swapped":
        overwrite(f, Path(other.parquet).read_bytes())
    elif damage == "flipped":
        overwrite(f, bytes(64), offset=f.stat().st_size // 2)
    else:
        overwrite(f, f.read_bytes()[:-100])

    run2 = Run(run.store_root, "run-2")
    with caplog.at_level(logging.WARNING, logger="irflow"):
        again = upper.run(run2, Suffix(), docs=src)
    assert len(calls) == 3 and statuses(run2) == ["computed"]  # never used: recomputed
    assert any(good.id in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert again.id == good.id and again.table().equals(expected)  # the fresh copy took its place
    assert Run(run.store_root, "run-3").store.check(again) is None
    aside = list((Path(run.store_root) / "tmp").glob(f"damaged-{good.id}-*"))
    assert len(aside) == 1  # kept for a look, until `irflow gc`
    with run2.catalog.connect() as con:
        detail = json.loads(con.execute("SELECT detail FROM stage_runs WHERE run_id = 'run-2'").fetchone()[0])
    assert good.id in detail["recomputed"][0]


def test_status_reports_a_damaged_output_as_stale(run, docs):
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    upper = make_upper([])
    good = upper.run(run, Suffix(), docs=src)
    overwrite(Path(good.parquet), bytes(64), offset=100)
    dry = Run(run.store_root, "status", dry_run=True)
    upper.run(dry, Suffix(), docs=src)
    assert dry.plan[0]["status"] == "stale" and good.id in dry.plan[0]["why"][0] and "damaged" in dry.plan[0]["why"][0]
    assert Path(good.path).exists()  # a dry run changes nothing


def test_a_damaged_input_is_never_read(run, docs):
    """An input whose files changed after it was published stops the stage, naming the input."""
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    calls: list = []
    upper = make_upper([])
    mid = upper.run(run, Suffix(), docs=src)
    overwrite(Path(mid.parquet), bytes(64), offset=200)
    with pytest.raises(StageFailed, match=rf"input docs {mid.id} is damaged") as e:
        make_count(calls).run(Run(run.store_root, "run-2"), Suffix(), docs=mid)
    assert calls == [] and e.value.user_error
    assert not Path(mid.path).exists()  # set aside: the next run recomputes it
    again = upper.run(Run(run.store_root, "run-3"), Suffix(), docs=src)
    assert again.id == mid.id and make_count(calls).run(Run(run.store_root, "run-3"), Suffix(), docs=again)


def test_publish_replaces_a_damaged_copy(tmp_path, docs):
    store = Store(tmp_path / "store")
    ref, _ = store.publish_table("corpus", "corpus", docs)
    overwrite(Path(ref.parquet), b"garbage")
    again, _ = store.publish_table("corpus", "corpus", docs)
    assert again.id == ref.id and store.check(again) is None and again.table().equals(docs)
    # an intact copy is kept as it is (same content)
    inode = Path(again.parquet).stat().st_ino
    store.publish_table("corpus", "corpus", docs)
    assert Path(again.parquet).stat().st_ino == inode


def test_unreadable_table_names_the_dataset(tmp_path, docs):
    ref, _ = Store(tmp_path / "store").publish_table("corpus", "corpus", docs)
    overwrite(Path(ref.parquet), b"PAR1" + bytes(64))
    from irflow.engine.errors import DataError

    with pytest.raises(DataError, match=ref.id):
        ref.table()


# ---- verify and gc --------------------------------------------------------------------------------
def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_verify_and_gc(run, docs):
    root = Path(run.store_root)
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    run.external(src, {"source": "test"})
    calls: list = []
    a = make_upper(calls).run(run, Suffix(), docs=src)
    b = make_count(calls).run(run, Suffix(), docs=a)
    code, out, _ = run_cli("verify", "--store", root)
    assert code == 0 and "3 objects" in out and "0 damaged" in out, out

    overwrite(Path(b.parquet), bytes(16), offset=10)
    stray = root / "objects" / "stray-0123456789abcdef"
    stray.mkdir()
    (stray / "x").write_text("x")
    code, out, _ = run_cli("verify", "--store", root)
    assert code == 1 and f"DAMAGED  {b.id}" in out and f"UNKNOWN  {stray.name}" in out and "1 damaged" in out
    code, out, _ = run_cli("verify", "--store", root, "--json")
    rep = json.loads(out)
    assert rep["ok"] is False and rep["damaged"][0].startswith(b.id) and rep["checked"] == 3

    # leftovers: a dead process's staging, a live one's, checkpoints of a finished key and of an unfinished one
    dead = root / "tmp" / f"{dead_pid()}-{'a' * 32}"
    live = root / "tmp" / f"{os.getpid()}-{'b' * 32}"
    for d in (dead, live):
        d.mkdir()
        (d / "half.bin").write_bytes(bytes(1000))
    key_done = run.catalog.stage_runs("run-1")[0]["cache_key"]
    (root / "partial" / key_done).mkdir(parents=True)
    (root / "partial" / ("f" * 64)).mkdir()
    make_count(calls).run(Run(str(root), "run-2"), Suffix(), docs=a)  # sets the damaged copy aside
    aside = list((root / "tmp").glob("damaged-*"))
    assert len(aside) == 1

    code, out, _ = run_cli("gc", "--store", root, "--dry-run")
    assert code == 0 and "would remove" in out
    assert stray.exists() and dead.exists() and aside[0].exists()  # dry run: nothing removed
    code, out, _ = run_cli("gc", "--store", root)
    assert code == 0
    for gone in (stray, dead, aside[0], root / "partial" / key_done):
        assert not gone.exists(), gone
    for kept in (live, root / "partial" / ("f" * 64), Path(a.path), Path(b.path), Path(src.path)):
        assert kept.exists(), kept
    code, out, _ = run_cli("verify", "--store", root)
    assert code == 0 and "0 damaged, 0 missing, 0 unreferenced" in out


def test_verify_on_a_missing_store_is_one_line(tmp_path):
    code, out, err = run_cli("verify", "--store", tmp_path / "nothing")
    assert code == 2 and "no irflow store" in err and not (tmp_path / "nothing").exists()


def test_a_run_staging_is_reclaimed_and_a_dead_run_marked_interrupted(tmp_path):
    root = tmp_path / "store"
    store = Store(root)
    cat = Catalog(store.catalog_path)
    cat.start_run("killed", "toy", None, {})
    with cat.connect() as con:  # as if its process had been killed
        con.execute("UPDATE runs SET pid = ? WHERE run_id = 'killed'", [dead_pid()])
    left = root / "tmp" / f"{dead_pid()}-{'c' * 32}"
    left.mkdir()
    (left / "index.bin").write_bytes(bytes(4096))
    assert store.reclaim() == 4096 and not left.exists()
    assert cat.start_run("next", "toy", None, {}) == ["killed"]
    with cat.connect() as con:
        rows = dict(con.execute("SELECT run_id, status FROM runs").fetchall())
    assert rows == {"killed": "interrupted", "next": "running"}


def test_a_ctrl_c_converted_while_staging_outputs_is_an_interrupt_not_a_failure(run, docs, monkeypatch):
    """A Ctrl-C can land after the stage's function returned, in the DuckDB query of the output's contract
    check, which turns it into its own InvalidInputException. The run is interrupted there: the stage
    is not recorded as failed (nor as run), and nothing is left staged or published."""
    import duckdb

    from irflow import data_contracts
    from irflow.engine import processes

    src, _ = run.store.publish_table("corpus", "corpus", docs)
    query = data_contracts._query

    def ctrl_c_in_the_query(table, sql):
        processes._interrupted = True  # what the CLI's SIGINT handler does
        raise duckdb.InvalidInputException("Invalid Input Error: query interrupted")

    monkeypatch.setattr(processes, "_interrupted", False)
    monkeypatch.setattr(data_contracts, "_query", ctrl_c_in_the_query)
    with pytest.raises(KeyboardInterrupt):
        make_upper([]).run(run, Suffix(), docs=src)
    assert run.error is None and run.failed is None and statuses(run) == []
    assert not list((run.store.root / "tmp").iterdir())
    # the same error without a Ctrl-C is the stage's failure, recorded for the run's graph
    monkeypatch.setattr(processes, "_interrupted", False)
    monkeypatch.setattr(data_contracts, "_query", lambda table, sql: query(table, sql + " AND no_such_column"))
    with pytest.raises(duckdb.BinderException):
        make_upper([]).run(run, Suffix(), docs=src)
    assert run.failed["name"] == "toy_upper" and isinstance(run.error, duckdb.BinderException)


def test_a_catalog_left_attached_by_an_interrupted_access_is_attached_again(tmp_path):
    """A Ctrl-C between the catalog's ATTACH and its bookkeeping (or inside its DETACH) leaves the file
    attached under an alias no access knows; DuckDB then refuses to attach it again ("already attached"),
    which failed every later access of the run, its 'interrupted' row included."""
    from irflow.engine import memdb

    cat = Catalog(tmp_path / "catalog.duckdb")
    cat.start_run("r", "toy", None, {})
    memdb.cursor().execute(f"ATTACH '{cat.path}' AS catalog_orphan")  # what the interrupted access left
    cat.finish_run("r", "interrupted", None, [], [])
    with cat.connect() as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]
    attached = [r[0] for r in memdb.cursor().execute("SELECT database_name FROM duckdb_databases()").fetchall()]
    assert "catalog_orphan" not in attached


# ---- one computation per key ------------------------------------------------------------------------
SLOW_STAGE = textwrap.dedent('''
    import logging, sys, time
    import pyarrow as pa
    from irflow.engine.params import Params
    from irflow.engine.runtime import StageRuntime
    from irflow.engine.stage import Output, stage
    from irflow.engine.runner import Run
    from irflow.engine.store import DatasetRef, Store

    from pydantic import Field

    class P(Params):
        n: int = Field(3, description="rows kept")

    @stage("slow_head", version="1", outputs=Output("out", "corpus"))
    def slow_head(p: P, rt: StageRuntime, *, docs: DatasetRef) -> pa.Table:
        with open(sys.argv[3], "a") as f:
            f.write("computed\\n")
        time.sleep(3)
        return docs.table().slice(0, p.n)

    logging.basicConfig(level=logging.INFO)
    root, src_id = sys.argv[1], sys.argv[2]
    run = Run(root, "run-" + sys.argv[4])
    src = run.catalog.dataset(src_id)
    ref = DatasetRef(src_id, "corpus", "table", "corpus", src["path"], src["digest"])
    out = slow_head.run(run, P(), docs=ref)
    print(out.id, [s["status"] for s in run.catalog.stage_runs(run.run_id)])
''')


def test_identical_runs_started_together_compute_once(run, docs, tmp_path):
    src, _ = run.store.publish_table("corpus", "corpus", docs)
    run.catalog.record_outputs(stage="ingest", cache_key="k0", code_version="1", params={}, run_id="run-1",
                               outputs={"out": (src, docs.num_rows, 0)}, parents={})
    script, log_file = tmp_path / "slow.py", tmp_path / "computed.log"
    script.write_text(SLOW_STAGE)
    procs = [subprocess.Popen([sys.executable, str(script), run.store_root, src.id, str(log_file), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert log_file.read_text().count("computed") == 1
    ids = {o.split()[0] for o, _ in outs}
    assert len(ids) == 1
    assert sorted(o.split(" ", 1)[1].strip() for o, _ in outs) == ["['cached']", "['computed']"]
    waited = [e for _, e in outs if "waiting for another process computing the same stage" in e]
    assert len(waited) == 1, outs
    with Catalog(Path(run.store_root) / "catalog.duckdb").connect() as con:
        n_edges = con.execute("SELECT count(*) FROM edges WHERE child_id = ?", [ids.pop()]).fetchone()[0]
    assert n_edges == 1
