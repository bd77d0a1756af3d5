"""kill -9 at several points of a real run (`irflow run` as a user starts it, with its own temporary
Prefect server): during ingest, BM25 indexing (the Java indexer running), corpus encoding and student
training. After each kill no process of the killed run survives; the next run marks the killed one
interrupted, reclaims its staging and goes on; the run that finally completes publishes the same
dataset ids and metrics as an uninterrupted run on another store (a Lucene index is the one output
that is never byte-identical; the BM25 runs searched from it are)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from irflow.dev.testing import beir_slice, make_tiny_bi_encoder
from irflow.engine.catalog import Catalog
from irflow.engine.processes import pid_alive as alive

IRFLOW = [sys.executable, "-m", "irflow.cli"]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc's ppid links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out




def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # its own temporary server
    e.update(HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1")
    return e


def start(config: Path, store: Path) -> subprocess.Popen:
    return subprocess.Popen([*IRFLOW, "run", str(config), "--store", str(store), "--json"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=config.parent)


def finish(config: Path, store: Path) -> dict:
    p = start(config, store)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def kill_when(config: Path, store: Path, ready) -> tuple[list[str], dict[int, str]]:
    """Start a run; SIGKILL it once ``ready(lines, pid)`` says so. Returns (stderr lines, the processes
    that were below it at the moment of the kill)."""
    p = start(config, store)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not ready(lines, p.pid):
        assert p.poll() is None, "the run ended before the kill point:\n" + "".join(lines[-30:])
        assert time.monotonic() < deadline, "kill point never reached:\n" + "".join(lines[-30:])
        time.sleep(0.05)
    below = {c: cmdline(c) for c in descendants(p.pid)}
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    reader.join(timeout=10)
    p.stdout.close()
    p.stderr.close()
    return lines, below


def computing(stage: str, after: float = 0.0):
    seen: dict[str, float] = {}

    def ready(lines, pid):
        if stage not in seen and any(f"{stage}: computing" in ln for ln in lines):
            seen[stage] = time.monotonic()
        return stage in seen and time.monotonic() - seen[stage] >= after

    return ready


def progress_bar_of(stage: str, desc: str):
    """Ready once the stage has started and its progress bar (``desc``) has been drawn after that."""
    def ready(lines, pid):
        start = next((i for i, ln in enumerate(lines) if f"{stage}: computing" in ln), None)
        return start is not None and any(ln.lstrip("\r").startswith(desc) and "%|" in ln for ln in lines[start:])

    return ready


def java_indexing(lines, pid) -> bool:
    return any("IndexCollection" in cmdline(c) for c in descendants(pid))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_datasets):
    root = tmp_path_factory.mktemp("crash")
    # ~1,100 passages: the tiny encoder takes ~5 s over them on 2 cores, long enough to be killed in
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=20, n_train_queries=150,
                      n_extra_docs=1000, seed=1)
    bi = make_tiny_bi_encoder(root / "bi", normalize=True)
    cfg = {"flow": "gpl", "dataset": {"name": "slice", "source": str(data), "split": "test"},
           "generate": {"source": "unlabelled", "split": "train"},
           "mine": {"miners": [{"name": "bm25", "type": "bm25"}, {"name": "bi", "type": "dense", "model": str(bi)}],
                    "depth": 20},
           "teacher": {"type": "fusion", "method": "zscore", "weights": {"bm25": 0.5, "bi": 0.5}},
           "label": {"negatives_per_positive": 2, "rank_range": [2, 20]},
           "train": {"model": str(bi), "similarity": "dot", "batch_size": 8, "max_seq_length": 64,
                     "warmup_steps": 1, "steps": 80, "checkpoint_every": 20, "qgen": {"steps": 2}},
           "bm25": {"variants": ["flat"], "depth": 100}, "dense": {"batch_size": 64, "depth": 100},
           "runtime": {"threads": 1}}
    config = root / "gpl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config, root


def test_kill_9_at_four_points_then_the_same_results(setup, prefect_harness):
    config, root = setup
    store = root / "store"
    points = [("ingest", computing("ingest")),
              ("bm25_index[flat]", java_indexing),
              ("encode_corpus[miner-bi]", computing("encode_corpus[miner-bi]", after=1.0)),
              ("train_student[gpl]", computing("train_student[gpl]", after=1.5))]
    killed_runs = []
    for stage, ready in points:
        lines, below = kill_when(config, store, ready)
        # nothing of the killed run survives: not its Prefect server, not the Java indexer
        deadline = time.monotonic() + 15
        while any(alive(c) for c in below) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {c: cmdline(c) for c in below if alive(c)}
        assert not survivors, f"killed during {stage}; still running: {survivors}"
        if stage == "bm25_index[flat]":
            assert any("IndexCollection" in c for c in below.values())  # the indexer was running, and is gone
        assert any("uvicorn" in c for c in below.values())  # so was its temporary Prefect server
        cat = Catalog(store / "catalog.duckdb")
        with cat.connect() as con:
            run_id, status = con.execute("SELECT run_id, status FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
            done = {r[0] for r in con.execute("SELECT stage FROM stage_runs WHERE run_id = ?", [run_id]).fetchall()}
        assert status == "running" and stage not in done, f"the kill did not land during {stage}: {sorted(done)}"
        killed_runs.append(run_id)

    resumed = finish(config, store)
    with Catalog(store / "catalog.duckdb").connect() as con:
        statuses = dict(con.execute("SELECT run_id, status FROM runs").fetchall())
    assert [statuses[r] for r in killed_runs] == ["interrupted"] * 4
    assert [p.name for p in (store / "tmp").iterdir()] == []  # killed runs' staging reclaimed

    # never interrupted; in this process (the session's test server), which computes the same keys as the
    # command: what is compared is the datasets and metrics, and a run of the command costs ~15 s more
    from irflow import api

    reference = json.loads(json.dumps(api.run(config, store=root / "reference").to_dict(), default=str))
    # Every stage's output is byte-identical, except Lucene's index files (each segment gets a random id,
    # so an index is never byte-deterministic); the BM25 runs searched from them are identical.
    ids = lambda r: {s["name"]: s["outputs"] for s in r["stages"] if not s["name"].startswith("bm25_index")}  # noqa: E731
    # 29 stages with outputs (besides the index): pseudo-labelling is label_scores then pseudo_label; BM25
    # fused with each student (hybrid.students) is a fuse and an evaluate per student
    assert ids(resumed) == ids(reference) and len(ids(resumed)) == 29
    assert ids(resumed)["bm25_search[miner-bm25]"] == ids(reference)["bm25_search[miner-bm25]"]
    assert resumed["metrics"] == reference["metrics"]


def test_ctrl_c_is_one_line_and_leaves_nothing_running(setup):
    """SIGINT to the run's process group (what a terminal's Ctrl-C does) while the JVM and torch are both
    loaded in the process: one line, exit 130, the run row says interrupted, no child left."""
    config, root = setup
    store = root / "ctrl-c"
    p = subprocess.Popen([*IRFLOW, "run", str(config), "--store", str(store)], env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=config.parent, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    # Interrupts are cooperative (checked between batches), so a SIGINT landing while the stage still loads
    # its model lets that model's log line out first. Wait for the encode bar itself: the model is loaded,
    # the JVM too (BM25 search ran before), and the next thing the run does is check for the interrupt.
    ready = progress_bar_of("encode_corpus[miner-bi]", "encode corpus")
    deadline = time.monotonic() + 300
    while not ready(lines, p.pid):
        assert p.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
        time.sleep(0.05)
    below = {c: cmdline(c) for c in descendants(p.pid)}
    n = len(lines)
    os.killpg(p.pid, signal.SIGINT)
    rc = p.wait(timeout=60)
    reader.join(timeout=10)
    assert rc == 130, "".join(lines[n:])[-4000:]
    p.stdout.close()
    p.stderr.close()
    after = [ln for ln in lines[n:] if "%|" not in ln]  # progress bars redraw their line; not messages
    assert after == ["irflow: error: interrupted\n"], after
    time.sleep(1)
    assert not [c for c in below if alive(c)]
    with Catalog(store / "catalog.duckdb").connect() as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("interrupted",)]


def test_a_ctrl_c_swallowed_by_a_finaliser_still_stops_the_run(monkeypatch, capsys):
    """Python raises a Ctrl-C's KeyboardInterrupt wherever the main thread is; inside a finaliser
    (``__del__`` run by the garbage collector) it is printed as "ignored" and lost. The CLI's handler
    remembers it: the next stage boundary raises it again."""
    from irflow.engine import processes

    class Finaliser:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the handler runs here, its exception is swallowed

    monkeypatch.setattr(processes, "_interrupted", False)
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own: prints to stderr
    previous = signal.getsignal(signal.SIGINT)
    try:
        processes.install_interrupt_handler()
        processes.check_interrupted()  # nothing yet
        f = Finaliser()
        del f  # the exception is swallowed here: the run would go on
        with pytest.raises(KeyboardInterrupt):
            processes.check_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
    # ... and its "Exception ignored in ..." traceback is not printed (the CLI says "interrupted" once)
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["clean-up", "converted"])
def test_a_ctrl_c_landing_outside_the_run_is_still_one_line_and_130(where, monkeypatch, capsys):
    """The KeyboardInterrupt lands wherever the main thread is: in main's own clean-up (it must not
    escape main: the process would die by SIGINT with a traceback), or inside a library that turns it
    into its own error (it must not be reported as a failure)."""
    import gc

    from irflow import cli
    from irflow.engine import processes

    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    if where == "clean-up":
        def collect(*_):
            raise KeyboardInterrupt
        monkeypatch.setattr(gc, "collect", collect)
    else:
        def show_config(args):
            processes._interrupted = True  # the handler ran, and some C extension raised its own error
            raise RuntimeError("interrupted by signal")
        monkeypatch.setattr(cli, "cmd_config", show_config)  # build_parser reads it when main calls it
    monkeypatch.setattr(processes, "_interrupted", False)
    previous, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        code = cli.main(["config", config])
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
    assert code == 130
    assert capsys.readouterr().err.splitlines()[-1:] == ["irflow: error: interrupted"]


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "preexec-fallback"])
@pytest.mark.parametrize("own_session", [False, True])
def test_a_child_dies_when_the_thread_that_started_it_ends(setpriv, own_session, monkeypatch):
    """What a kill -9 of a run relies on (the indexer, torchrun, a Ray cluster, the Prefect server):
    the kernel signals the child when its starting thread is gone. With setpriv no Python runs in the
    forked child; without it (not Linux's util-linux) a preexec_fn sets the signal."""
    import shutil

    from irflow.engine import processes

    if not setpriv:
        monkeypatch.setattr(shutil, "which", lambda name: None)
    started, release = {}, threading.Event()

    def start():
        argv, kwargs = processes.dying_with_parent(["sleep", "60"], signal.SIGKILL, own_session=own_session)
        started["argv"], started["kwargs"] = argv, kwargs
        started["p"] = p = subprocess.Popen(argv, **kwargs)
        started["sid"] = os.getsid(p.pid)
        release.wait(10)  # the thread lives on until released: the child with it

    thread = threading.Thread(target=start)
    thread.start()
    time.sleep(0.5)
    p = started["p"]
    assert p.poll() is None  # alive while its thread is
    assert (started["sid"] == p.pid) is own_session  # its own session: the terminal's Ctrl-C is not for it
    assert ("preexec_fn" in started["kwargs"]) is not setpriv
    assert (started["argv"][1:4] == ["--pdeathsig", "KILL", "--"]) is setpriv
    release.set()
    thread.join()
    assert p.wait(timeout=10) == -signal.SIGKILL


def test_prefect_failure_records_of_a_converted_ctrl_c_stay_off_the_console(monkeypatch):
    """CI once saw a Ctrl-C land inside a DuckDB query: DuckDB raised its own InvalidInputException
    ("... failed: KeyboardInterrupt"), and Prefect logged the task and the flow as failed, four lines
    above the CLI's "interrupted". After a Ctrl-C, Prefect's records stay off the console; before it,
    and for irflow's own loggers, they are shown."""
    import io
    import logging

    from irflow.engine import orchestration, processes

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(orchestration._QuietPrefect())
    failed = 'Task run failed with exception: InvalidInputException("offering a filter to the source failed")'

    def emit(name: str, msg: str) -> None:
        handler.handle(logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None))

    monkeypatch.setattr(processes, "_interrupted", False)
    emit("prefect.task_runs", failed)
    assert out.getvalue().splitlines() == [failed]  # a real failure is shown
    monkeypatch.setattr(processes, "_interrupted", True)
    emit("prefect.task_runs", failed)
    emit("prefect.flow_runs", "Finished in state Failed('Flow run encountered an exception')")
    emit("irflow", "run interrupted; staging reclaimed")
    assert out.getvalue().splitlines() == [failed, "run interrupted; staging reclaimed"]


def test_spawned_children_need_nothing_of_the_callers_main_module(tmp_path):
    """BM25 runs in a spawned child. A script read on standard input (`python - <<EOF`) used to kill that
    child (BrokenProcessPool: it re-imports `<stdin>`), and a script without a `__main__` guard ran again,
    whole, in the child."""
    import subprocess
    import sys

    body = ("import os\nfrom irflow.engine.processes import run_in_spawned_child\nprint('script ran')\n"
            "print('child', run_in_spawned_child(os.getpid) != os.getpid())\n")
    piped = subprocess.run([sys.executable, "-"], input=body, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "child True" in piped.stdout, piped.stderr[-2000:]
    script = tmp_path / "unguarded.py"
    script.write_text(body)
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.count("script ran") == 1, ran.stdout + ran.stderr[-2000:]
