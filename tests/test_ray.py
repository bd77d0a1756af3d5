"""executor ray: a local Ray cluster with 2 workers runs the sharded stages of the baselines and of a
GPL slice (real SciFact text, tiny local models) with the same datasets and metrics as the
in-process executor, and runs their independent branches at once (BM25 beside the dense system); a
failing branch fails the run naming its stage; a run that ends, is interrupted or is killed leaves no
Ray process; a worker killed mid-stage is retried within the run."""

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from irflow import api
from irflow.dev.testing import beir_slice, make_tiny_bi_encoder, make_tiny_cross_encoder, make_tiny_t5
from irflow.engine.catalog import Catalog
from irflow.engine.errors import ConfigError, DataError, StageFailed

RAY = ["runtime.executor=ray", "runtime.ray.workers=2"]
_RAY_NAMES = ("raylet", "gcs_server", "ray::", "irflow.engine.executors.ray_cluster", "default_worker.py", "dashboard/agent.py",
              "runtime_env/agent")


def ray_processes() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(n in cmd for n in _RAY_NAMES):
                out.add(int(d.name))
    return out


def wait_gone(before: set[int], seconds: float = 180) -> set[int]:
    """Ray processes started since ``before`` that are still alive after ``seconds`` (empty: none)."""
    deadline = time.monotonic() + seconds
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def spans(result) -> dict[str, tuple[datetime, datetime]]:
    """When each computed stage ran, from the catalog (started, started + seconds)."""
    out = {}
    for s in result.stages:
        if s.status == "computed":
            start = datetime.fromisoformat(s.started)
            out[s.name] = (start, start + timedelta(seconds=s.seconds))
    return out


def overlap(x, y) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def ids(result) -> dict:
    # Lucene's index files differ from build to build (the one output whose id is not its content's);
    # the searches of two builds agree, and so does everything after them.
    return {s.name: s.outputs for s in result.stages if not s.name.startswith("bm25_index")}


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_datasets, prefect_harness):
    root = tmp_path_factory.mktemp("ray")
    return {"root": root, "before": ray_processes(),
            "slice": beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=12, n_extra_docs=60),
            "bi": make_tiny_bi_encoder(root / "bi", seed=0, normalize=True)}


@pytest.fixture(scope="module")
def baselines(data):
    cfg = {"flow": "baselines", "dataset": {"name": "scifact-slice", "source": str(data["slice"]), "split": "test"},
           "bm25": {"variants": ["flat"], "depth": 50},
           "dense": {"model": str(data["bi"]), "batch_size": 16, "depth": 50}, "runtime": {"threads": 2}}
    config = data["root"] / "baselines.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def test_baselines_on_ray_equal_the_local_run_and_leave_no_ray_process(data, baselines):
    local = api.run(baselines, store=data["root"] / "local")
    sharded = api.run(baselines, RAY + ["runtime.shard_rows=20"], store=data["root"] / "on-ray")
    assert ids(sharded) == ids(local) and sharded.metrics == local.metrics
    enc = sharded.stage("encode_corpus[zero-shot]")
    assert len(enc.shards) == 4 and {s["status"] for s in enc.shards} == {"computed"}
    pids = {s["pid"] for st in sharded.stages for s in st.shards}
    assert len(pids) == 2 and os.getpid() not in pids  # two Ray workers did the shards, not this process
    assert enc.runtime["executor"] == "ray" and enc.runtime["shards"] == 4
    # The BM25 branch and the dense branch ran at once (runtime.ray.concurrent_stages, default 4);
    # the local executor ran its stages one after another.
    ran = spans(sharded)
    bm25 = [v for k, v in ran.items() if k.startswith("bm25_")]
    dense = [v for k, v in ran.items() if k.startswith(("encode_corpus", "dense_search"))]
    assert len(bm25) == 2 and len(dense) == 2 and any(overlap(x, y) for x in bm25 for y in dense), ran
    one_by_one = list(spans(local).values())
    assert not any(overlap(x, y) for i, x in enumerate(one_by_one) for y in one_by_one[i + 1:])
    assert not wait_gone(data["before"]), "Ray processes left after the run"
    # Runtime is never keyed: the in-process executor finds everything the Ray run computed.
    again = api.run(baselines, ["runtime.shard_rows=3"], store=data["root"] / "on-ray")
    assert again.computed == set()


def test_a_failing_branch_on_ray_fails_the_run_naming_its_stage(data, baselines, monkeypatch):
    from irflow.stages.bm25 import bm25_index

    def broken(p, rt, *, corpus):
        time.sleep(2)  # while the dense branch encodes on the workers
        raise DataError("the index broke on purpose")

    monkeypatch.setattr(bm25_index, "fn", broken)  # bm25_index runs in the flow's process
    store = data["root"] / "branch-fails"
    with pytest.raises(StageFailed, match=r"^bm25_index\[flat\]: the index broke on purpose$"):
        api.run(baselines, RAY + ["runtime.shard_rows=20"], store=store, run_id="branch-fails")
    catalog = Catalog(store / "catalog.duckdb")
    row = catalog.run("branch-fails")
    assert row["status"] == "failed" and row["failed_stage"]["name"] == "bm25_index[flat]"
    done = {s["name"]: s["status"] for s in catalog.stage_runs("branch-fails")}
    # the other branch's stage that was under way finished and is kept for the next run; nothing that
    # needed the failed stage ran
    assert done["encode_corpus[zero-shot]"] == "computed"
    assert "bm25_search[flat]" not in done and "evaluate[bm25-flat]" not in done
    assert not wait_gone(data["before"])


def test_gpl_slice_on_ray_equals_the_local_run(data):
    t5 = make_tiny_t5(data["root"] / "t5")
    ce = make_tiny_cross_encoder(data["root"] / "ce", seed=0)
    cfg = {"flow": "gpl", "dataset": {"name": "slice", "source": str(data["slice"]), "split": "test"},
           "generate": {"source": "t5", "model": str(t5), "queries_per_passage": 1,
                        "max_length": 12},
           "mine": {"miners": [{"name": "bm25", "type": "bm25"},
                               {"name": "bi", "type": "dense", "model": str(data["bi"])}], "depth": 10},
           "teacher": {"type": "cross_encoder", "model": str(ce), "batch_size": 16, "max_length": 64},
           "label": {"negatives_per_positive": 1},
           "train": {"model": str(data["bi"]), "similarity": "dot", "batch_size": 8, "max_seq_length": 48,
                     "warmup_steps": 1, "steps": 3, "qgen": {"enabled": False}},
           "bm25": {"variants": ["flat"], "depth": 50}, "dense": {"batch_size": 32, "depth": 50},
           # what this test is about is the sharded stages; the QGen student, the hybrid and doc2query
           # add unsharded stages only (and minutes: this test ran 200 s of CI's 24 min)
           "hybrid": {"enabled": False}, "doc2query": {"enabled": False}, "runtime": {"threads": 2}}
    config = data["root"] / "gpl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    local = api.run(config, store=data["root"] / "gpl-local")
    sharded = api.run(config, RAY + ["runtime.shard_rows=16"], store=data["root"] / "gpl-ray")
    sharded_stages = {s.name for s in sharded.stages if len(s.shards) > 1}
    assert "bm25_search[miner-bm25]" in sharded_stages  # the generated queries, in shards of 16
    assert "label_scores" in sharded_stages  # the teacher, too
    assert any(n.startswith("encode_corpus") for n in sharded_stages)
    # T5 generation too, in shards of 16 passages (whole batches of 16) on the Ray workers: its queries
    # and qrels (and so everything after them) are the ones generated unsharded here
    gen = sharded.stage("generate_queries[t5]")
    assert len(gen.shards) > 1 and os.getpid() not in {s["pid"] for s in gen.shards}
    assert ids(sharded) == ids(local)
    for a, b in zip(sharded.metrics, local.metrics):
        assert a["system"] == b["system"] and round(a["ndcg@10"], 4) == round(b["ndcg@10"], 4)
    assert not wait_gone(data["before"])


def test_warnings_of_shards_on_ray_workers_reach_the_run(data, shared_datasets):
    """A sharded stage's warning is logged in a Ray worker's process; the run still reports it (once per
    distinct message, naming the shards) in RunResult.warnings, as it does with the local executor."""
    root = data["root"] / "warns"
    corpus = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=4, n_train_queries=12,
                        n_extra_docs=40)
    ce = make_tiny_cross_encoder(root / "ce", seed=0)
    # Unlabelled train queries: positive = the teacher's top-1, negatives from teacher ranks 3-30. One
    # miner's top 2 gives each query 2 candidates, so label_scores skips every query, and says so.
    cfg = {"flow": "gpl", "dataset": {"name": "warns", "source": str(corpus), "split": "test"},
           "generate": {"source": "unlabelled", "split": "train"},
           "mine": {"miners": [{"name": "bm25", "type": "bm25"}], "depth": 2},
           "teacher": {"type": "cross_encoder", "model": str(ce), "batch_size": 16, "max_length": 64},
           "label": {"rank_range": [3, 30]},
           "train": {"model": str(data["bi"]), "steps": 1, "qgen": {"enabled": False}},
           "hybrid": {"enabled": False}, "doc2query": {"enabled": False}, "runtime": {"threads": 2}}
    config = root / "gpl.yaml"
    config.write_text(yaml.safe_dump(cfg))
    skipped = re.compile(r"^label_scores: (\d+) quer\(ies\) with fewer than 3 candidates skipped")

    local = api.run(config, ["runtime.shard_rows=8"], store=root / "local", to=["label_scores"])
    assert sum(int(skipped.match(w)[1]) for w in local.warnings if skipped.match(w)) == 12

    on_ray = api.run(config, [*RAY, "runtime.shard_rows=8"], store=root / "ray", to=["label_scores"])
    scores = on_ray.stage("label_scores")
    assert len(scores.shards) == 2 and os.getpid() not in {s["pid"] for s in scores.shards}
    relayed = [w for w in on_ray.warnings if skipped.match(w)]
    assert relayed, on_ray.warnings
    assert sum(int(skipped.match(w)[1]) for w in relayed) == 12  # shards of 8 and 4 queries
    assert all(re.search(r"\(label_scores: shards? of rows [\d, -]+(and \d+ more)?, on a Ray worker\)$", w)
               for w in relayed), relayed
    # recorded with the dataset, as the local run's are
    catalog = Catalog(root / "ray" / "catalog.duckdb")
    assert catalog.warnings_of([scores.outputs["out"]]) == [(w, on_ray.run_id) for w in relayed]
    assert not wait_gone(data["before"])


def cli_run(config, store, *sets) -> subprocess.Popen:
    """``irflow run`` as a user starts it, pointed at the session's Prefect test server: what these tests
    are about is Ray's processes, and a temporary server of its own costs each run ~10-15 s on 2 cores
    (tests/test_crash.py kills runs that start their own)."""
    from prefect.settings import PREFECT_API_URL

    args = [sys.executable, "-m", "irflow.cli", "run", str(config), "--store", str(store)]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})


def wait_for_parts(store: Path, n: int, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while len(list(store.glob("partial/*/part-*"))) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no shard finished in time"
        time.sleep(0.3)


@pytest.mark.parametrize("how", ["ctrl-c", "kill-9"])
def test_an_interrupted_or_killed_run_leaves_no_ray_process(data, baselines, how):
    store = data["root"] / f"stopped-{how}"
    proc = cli_run(baselines, store, *RAY, "runtime.shard_rows=2")
    wait_for_parts(store, 2, proc)
    proc.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
    # what this checks is that nothing is left, not how fast: one CI run on a loaded machine (load 4 on
    # 2 cores) took over 120 s to stop (71 s for the whole test on a quieter one)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert not wait_gone(data["before"]), f"Ray processes left after {how}"


def test_a_worker_killed_mid_stage_is_retried_within_the_run(data, baselines):
    """A lost worker is not a failed run: its shard is computed again (the record says retried), the run
    completes with the local run's datasets and metrics, and no Ray process is left."""
    store = data["root"] / "worker-killed"
    sets = [*RAY, "runtime.shard_rows=4"]  # ~20 shards of encoding: a killed worker leaves most still to do
    proc = cli_run(baselines, store, *sets)
    wait_for_parts(store, 3, proc)
    workers = [p for p in ray_processes() - data["before"] if "ray::" in Path(f"/proc/{p}/cmdline").read_text()
               and "Agent" not in Path(f"/proc/{p}/cmdline").read_text()]
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "lost its worker" in err and "computing it again" in err
    catalog = Catalog(store / "catalog.duckdb")
    with catalog.connect() as con:
        [(run_id,)] = con.execute("SELECT run_id FROM runs").fetchall()
    statuses = [s["status"] for st in catalog.stage_runs(run_id) for s in st["shards"]]
    assert "retried" in statuses, statuses
    again = api.run(baselines, sets, store=store)
    assert not again.computed  # the retried run published everything
    assert ids(again) == ids(api.run(baselines, store=data["root"] / "local"))
    assert not wait_gone(data["before"])


def test_bad_ray_settings_are_one_line_before_any_stage(data, baselines):
    with pytest.raises(ConfigError, match=r"runtime.ray.address: cannot reach a Ray cluster at ray://127.0.0.1:9"):
        api.run(baselines, [*RAY, "runtime.ray.address=ray://127.0.0.1:9"], store=data["root"] / "bad")
    assert not (data["root"] / "bad").exists()  # refused before the store was made
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="runtime.ray.gpus_per_shard: 0.5, but this machine has no CUDA GPU"):
            api.run(baselines, [*RAY, "runtime.ray.gpus_per_shard=0.5"], store=data["root"] / "bad")
    proc = cli_run(baselines, data["root"] / "bad", *RAY, "runtime.ray.address=10.255.255.1:6379")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "runtime.ray.address" in err and len(err.strip().splitlines()) == 1, err
