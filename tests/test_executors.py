"""Executors behind one protocol (irflow.engine.executors): a third executor is one class, and the engine compares
no executor names outside that package."""

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from irflow import api
from irflow.dev.testing import beir_slice, make_tiny_bi_encoder
from irflow.engine.executors import EXECUTORS, register
from irflow.engine.executors.local import LocalExecutor

ROOT = Path(__file__).resolve().parents[1]


class ThreadsExecutor(LocalExecutor):
    """Shards on a pool of two threads in this process."""

    name = "threads"
    used = 0

    def map_shards(self, stage, label, jobs, rt):
        from irflow.engine.shards import run_shard

        type(self).used += len(jobs)
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(run_shard, jobs))

    def worker_threads(self, rt):
        return 1


@pytest.fixture
def threads_executor():
    register(ThreadsExecutor)
    yield ThreadsExecutor
    EXECUTORS.pop("threads")


def test_a_thread_pool_executor_is_one_class_and_runs_the_baselines_alike(tmp_path, shared_datasets,
                                                                            threads_executor, prefect_harness):
    data = beir_slice(shared_datasets / "scifact.zip", tmp_path / "slice", n_test_queries=6, n_extra_docs=40, seed=2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "flow": "baselines", "dataset": {"name": "slice", "source": str(data)}, "bm25": {"variants": ["flat"]},
        "dense": {"model": str(make_tiny_bi_encoder(tmp_path / "bi", normalize=True)), "max_seq_length": 48},
        "runtime": {"threads": 1, "shard_rows": 16}}))
    local = api.run(cfg, store=tmp_path / "local")
    threads = api.run(cfg, ["runtime.executor=threads"], store=tmp_path / "threads")
    assert threads_executor.used >= 3  # the corpus's shards went through the pool
    assert threads.metrics == local.metrics
    # every dataset the same (a Lucene index is never byte-identical; the BM25 runs searched from it are)
    outputs = lambda r: {s.name: s.outputs for s in r.stages if not s.name.startswith("bm25_index")}  # noqa: E731
    assert outputs(threads) == outputs(local)


def test_an_unknown_executor_is_refused_naming_the_known_ones():
    from irflow.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"runtime.executor: .*'rey' is not an executor \(local, ray\)"):
        api.load_config(ROOT / "configs" / "demo_baselines.yaml", ["runtime.executor=rey"])


def test_an_executor_reads_its_own_runtime_section_and_one_without_settings_reads_none():
    from irflow.engine.executors import executor_for

    c = api.load_config(ROOT / "configs" / "demo_baselines.yaml", ["runtime.ray.concurrent_stages=3"])
    ray = executor_for(c.runtime.model_copy(update={"executor": "ray"}))
    assert ray.settings_of(c.runtime).concurrent_stages == 3
    assert executor_for(c.runtime).settings_of(c.runtime) is None  # local: no runtime.local section


def test_no_module_but_the_executors_compares_executor_names():
    compares = re.compile(r"""executor\s*[!=]=\s*["']""")
    package = ROOT / "irflow" / "engine" / "executors"
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "irflow").rglob("*.py")
                 if p.parent != package and compares.search(p.read_text())]
    assert offenders == []
