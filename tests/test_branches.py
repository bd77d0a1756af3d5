"""Stage calls at once (irflow.engine.branches), without Ray: toy stages that sleep, submitted as Prefect tasks to
the run's thread pool. Independent stages overlap in the catalog (at most ``limit`` at once) and give the
ids of the same calls run one after another; a key called twice at once is computed once; the first
failure fails the run naming its stage while the stages already running finish; a Ctrl-C stops a running
stage at its next check without waiting for it; a call that --to skips stays synchronous. (The same on a
Ray cluster, on a real recipe: test_ray.)"""

import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from pydantic import Field

from irflow.engine.branches import Branches, Deferred
from irflow.engine.errors import DataError, StageFailed
from irflow.engine.params import Params
from irflow.engine.processes import check_interrupted
from irflow.engine.runner import Run
from irflow.engine.stage import PENDING, Output, stage


class Nap(Params):
    seconds: float = Field(description="how long the stage sleeps")
    label: str = Field(description="what it writes")
    fail: bool = Field(False, description="raise instead of writing")


def _write(rt, name: str, text: str) -> Path:
    d = rt.workdir / name
    d.mkdir()
    (d / "v.txt").write_text(text)
    return d


def _read(ref) -> str:
    return (Path(ref.path) / "v.txt").read_text() if ref is not None else ""


THREADS: dict[str, threading.Thread] = {}  # label -> the thread that ran it


@stage("toy_nap", version="1", outputs=Output("out", kind="index"))
def toy_nap(p: Nap, rt, *, src=None):
    THREADS[p.label] = threading.current_thread()
    deadline = time.monotonic() + p.seconds
    while time.monotonic() < deadline:  # a stage that notices a Ctrl-C, as the trainers do
        time.sleep(0.02)
        check_interrupted()
    if p.fail:
        raise DataError(f"{p.label} failed on purpose")
    return _write(rt, "out", p.label + "<" + _read(src))


@stage("toy_pair", version="1", outputs=[Output("left", kind="index"), Output("right", kind="index")])
def toy_pair(p: Nap, rt, *, src):
    time.sleep(p.seconds)
    return {"left": _write(rt, "left", "L" + _read(src)), "right": _write(rt, "right", "R" + _read(src))}


def body(run: Run) -> dict:
    a = toy_nap(run, Nap(seconds=1.5, label="a"), tag="a")
    b = toy_nap(run, Nap(seconds=1.5, label="b"), tag="b")
    d = toy_nap(run, Nap(seconds=1.5, label="d"), tag="d")
    pair = toy_pair(run, Nap(seconds=0.1, label="p"), src=b)
    c = toy_nap(run, Nap(seconds=0.1, label="c"), tag="c", src=pair["left"])
    return {"a": a, "b": b, "d": d, "right": pair["right"], "c": c}


def intervals(run: Run) -> dict[str, tuple[datetime, datetime]]:
    return {s["name"]: (datetime.fromisoformat(s["started"]),
                        datetime.fromisoformat(s["started"]) + timedelta(seconds=s["seconds"]))
            for s in run.catalog.stage_runs(run.run_id) if s["status"] == "computed"}


def overlap(x, y) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def test_independent_stages_overlap_at_most_limit_at_once_with_the_ids_of_one_after_another(tmp_path,
                                                                                            prefect_harness):
    one_by_one = Run(tmp_path / "sync", "sync")
    expected = {k: v.id for k, v in body(one_by_one).items()}

    run = Run(tmp_path / "at-once", "at-once")
    with Branches(run, limit=2):
        got = body(run)
        assert all(isinstance(v, Deferred) for v in got.values())  # the body did not wait
        assert "toy_nap[c]" not in {s["name"] for s in run.catalog.stage_runs(run.run_id)}
    assert run.branches is None
    assert {k: v.id for k, v in got.items()} == expected
    assert _read(got["c"].value()) == "c<Lb<"

    spans = intervals(run)
    assert set(spans) == {"toy_nap[a]", "toy_nap[b]", "toy_nap[d]", "toy_pair", "toy_nap[c]"}
    naps = [spans[f"toy_nap[{t}]"] for t in "abd"]
    assert any(overlap(x, y) for i, x in enumerate(naps) for y in naps[i + 1:])  # two of them ran at once
    # never more than 2 at once: at each start, count the stages running
    for name, (start, _) in spans.items():
        assert sum(s <= start < e for s, e in spans.values()) <= 2, (name, spans)
    # one after another, none overlapped
    sync = list(intervals(one_by_one).values())
    assert not any(overlap(x, y) for i, x in enumerate(sync) for y in sync[i + 1:])


def test_one_key_called_twice_at_once_is_computed_once(tmp_path, prefect_harness):
    run = Run(tmp_path / "store", "twice")
    with Branches(run, limit=3):
        first = toy_nap(run, Nap(seconds=1.5, label="same"), tag="first")
        second = toy_nap(run, Nap(seconds=1.5, label="same"), tag="second")
    assert first.id == second.id
    statuses = {s["name"]: s["status"] for s in run.catalog.stage_runs(run.run_id)}
    assert sorted(statuses.values()) == ["cached", "computed"], statuses
    cached = next(s for s in run.catalog.stage_runs(run.run_id) if s["status"] == "cached")
    assert cached["seconds"] < 1.0  # its wait for the other call is not counted as its run


def test_the_first_failure_fails_the_run_and_running_stages_finish(tmp_path, prefect_harness):
    run = Run(tmp_path / "store", "fails")
    t0 = time.monotonic()
    with pytest.raises(StageFailed, match=r"toy_nap\[bad\]: bad failed on purpose") as err:
        with Branches(run, limit=3):
            slow = toy_nap(run, Nap(seconds=3.0, label="slow"), tag="slow")
            bad = toy_nap(run, Nap(seconds=0.3, label="bad", fail=True), tag="bad")
            toy_nap(run, Nap(seconds=0.1, label="after"), tag="after", src=bad)
            slow.id  # the body reads a value: it gets the failure as soon as it happens
    assert err.value.stage == "toy_nap[bad]" and run.failed["name"] == "toy_nap[bad]"
    assert time.monotonic() - t0 >= 3.0  # the stage already running was waited for ...
    names = {s["name"]: s["status"] for s in run.catalog.stage_runs(run.run_id)}
    assert names == {"toy_nap[slow]": "computed"}  # ... and recorded; the downstream one never ran
    # a stage call after the failure fails at once, naming the first failure
    with pytest.raises(StageFailed, match=r"toy_nap\[bad\]"):
        with Branches(run, limit=3):
            toy_nap(run, Nap(seconds=0.1, label="later"), tag="later")


def test_a_ctrl_c_stops_the_running_stages_without_waiting_for_them(tmp_path, prefect_harness):
    run = Run(tmp_path / "store", "ctrl-c")
    THREADS.pop("long", None)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with Branches(run, limit=2):
            toy_nap(run, Nap(seconds=20, label="long"), tag="long")
            # the Ctrl-C must land while the stage runs: on a loaded machine its thread may take over a
            # second to start, so wait for it rather than for a fixed time
            while "long" not in THREADS and time.monotonic() - t0 < 15:
                time.sleep(0.05)
            started = time.monotonic()
            raise KeyboardInterrupt  # what the signal handler raises in the main thread
    assert "long" in THREADS, "the stage never started"
    assert time.monotonic() - started < 9  # as before: 10 s from the start, of which 1 s was the wait
    THREADS["long"].join(timeout=10)
    assert not THREADS["long"].is_alive(), "the stage's thread did not stop"
    assert run.catalog.stage_runs(run.run_id) == []  # interrupted: nothing recorded, nothing published
    check_interrupted()  # the run's stop does not outlive it


def test_a_call_that_to_skips_is_synchronous_and_names_its_inputs(tmp_path, prefect_harness):
    run = Run(tmp_path / "store", "to", only={"toy_nap[a]"})
    with Branches(run, limit=2):
        a = toy_nap(run, Nap(seconds=0.5, label="a"), tag="a")
        skipped = toy_nap(run, Nap(seconds=0.1, label="c"), tag="c", src=a)
        assert not isinstance(skipped, Deferred) and skipped.kind == PENDING  # a placeholder, at once
    assert run.skipped == [{"name": "toy_nap[c]", "inputs": {"src": [a.id]},
                            "outputs": {"out": "<toy_nap[c]:out>"}}]
    assert [s["name"] for s in run.catalog.stage_runs(run.run_id)] == ["toy_nap[a]"]
