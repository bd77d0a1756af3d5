"""Session-wide test set-up: offline, a project-local Prefect, one Prefect test harness per session."""

import os
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # each pytest-xdist worker has a Prefect (test server) of its own
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"irflow-prefect-home-{os.environ['PYTEST_XDIST_WORKER']}-")
else:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="irflow-prefect-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import yaml  # noqa: E402

from irflow.dev.testing import (  # noqa: E402
    SHARED_DATASETS,
    beir_slice,
    gpl_sample_config,
    make_tiny_bi_encoder,
    make_tiny_cross_encoder,
)


def pytest_sessionstart(session):
    # Tests run on real data; missing data is an error, never a silent skip.
    for name in ("scifact.zip", "nfcorpus.zip"):
        if not (SHARED_DATASETS / name).exists():
            raise pytest.UsageError(f"real BEIR data not found: {SHARED_DATASETS / name} "
                                    "(../shared/datasets beside the checkout, or set IRFLOW_SHARED_DATASETS)")


# `make test` runs the tests on 2 pytest-xdist workers, a test file per worker (-n 2 --dist loadfile):
# most tests use one core (runtime.threads: 1, tiny models), so the other core would idle. By file, not
# by test: the Ray tests count the machine's Ray processes, so one worker runs them all. (--dist
# loadgroup would group by mark, but xdist 3.8 renames item._nodeid, which pytest 9 no longer reads.)
#
# A session fixture lives in one worker: the files that read the same sample run (below) would each
# make it again in their own worker. So they are one unit of work, sent to one worker together.
SAMPLE_RUN_FIXTURES = ("gpl_sample", "rocketqa_sample")
SAMPLE_RUN_FILES = ("test_gpl_flow.py", "test_inside.py", "test_report.py", "test_rocketqa.py")


# The longest units of work go out first (a worker that takes a long unit last finishes alone), and the
# two that each start a process tree (Ray's cluster; the kill -9 test's runs, each with its own Prefect
# server and JVM) start on different workers, not side by side at the end. Measured with --durations in
# `make test` on 2 Intel cores: test_ray.py ~500 s, the sample runs' files ~610 s, test_crash.py ~300 s,
# test_training.py ~140 s, test_onnx.py ~120 s, test_flows.py ~80 s, test_shards.py ~50 s; every other file
# after, by name. Alone, after the trims that followed: test_ray.py 331 s, the sample runs' files 423 s.
LONGEST_FIRST = ("test_ray.py", "sample-runs", "test_crash.py", "test_schedules.py", "test_shards.py", "test_onnx.py", "test_flows.py",
                 "test_training.py")


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for any other --dist

    from xdist.scheduler import LoadFileScheduling

    class ByFileSampleRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(super()._split_scope(nodeid))

        def schedule(self) -> None:
            # the collection's order (pytest_collection_modifyitems, below), not xdist's most-tests-first
            self.config.option.loadscopereorder = False
            super().schedule()

    return ByFileSampleRunsTogether(config, log)


def _unit(path: str) -> str:
    """A test file's unit of work: "sample-runs" for SAMPLE_RUN_FILES, else its own file name."""
    name = Path(path).name
    return "sample-runs" if name in SAMPLE_RUN_FILES else name


def _rank(item) -> int:
    """The item's unit's place in LONGEST_FIRST (after them all: not listed)."""
    unit = _unit(item.path.name)
    return LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: a file's tests keep their order; every worker collects the same order
    # A new file that reads a sample run must join SAMPLE_RUN_FILES, or its worker makes the run again.
    strays = sorted({item.path.name for item in items
                     if set(getattr(item, "fixturenames", ())) & set(SAMPLE_RUN_FIXTURES)
                     and item.path.name not in SAMPLE_RUN_FILES})
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} use(s) a sample run ({', '.join(SAMPLE_RUN_FIXTURES)}): "
                                "add it to SAMPLE_RUN_FILES in tests/conftest.py, so that one worker makes the run")


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    return SHARED_DATASETS


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (starting one costs ~10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# ---- sample runs shared by several test files ------------------------------------------------------
# A recipe's cold run on a real slice costs minutes: the files that read what one made (the recipe's own
# tests, tests/test_inside.py) share it, whichever of them runs first.
@pytest.fixture(scope="session")
def gpl_sample(tmp_path_factory, shared_datasets, prefect_harness):
    """GPL on a real SciFact slice with tiny local models in place of the paper's hub models: config and store."""
    root = tmp_path_factory.mktemp("gpl")
    config = gpl_sample_config(root, shared_datasets / "scifact.zip")
    ce_b = make_tiny_cross_encoder(root / "ce-b", seed=1)
    return {"config": config, "store": root / "store", "ce_b": ce_b}


@pytest.fixture(scope="session")
def gpl_sample_run(gpl_sample):
    """The first run of ``gpl_sample``'s config in its store (every stage computed)."""
    from irflow import api

    return api.run(gpl_sample["config"], [], store=gpl_sample["store"])


ROCKETQA_TRAIN = {"batch_size": 8, "steps": 2, "query_max_length": 16, "passage_max_length": 48,
                  "checkpoint_every": 0}


@pytest.fixture(scope="session")
def rocketqa_sample(tmp_path_factory, shared_datasets, prefect_harness):
    """RocketQA (every teacher, augmentation and ablation) and ANCE on a real SciFact slice with tiny
    local models: configs and their store."""
    root = tmp_path_factory.mktemp("rocketqa")
    data = beir_slice(shared_datasets / "scifact.zip", root / "slice", n_test_queries=6, n_train_queries=20,
                      n_extra_docs=50, seed=11)
    bi = make_tiny_bi_encoder(root / "bi", normalize=True)
    ce = make_tiny_cross_encoder(root / "ce")
    common = {"dataset": {"name": "slice", "source": str(data), "split": "test"}, "base_model": str(bi),
              "bm25": {"variants": ["flat"], "depth": 100}, "dense": {"batch_size": 32, "depth": 100},
              "runtime": {"threads": 1}}
    rocketqa = {"flow": "rocketqa", **common, "dual_encoder": dict(ROCKETQA_TRAIN), "retrieve": {"depth": 60},
                "cross_encoder": {"model": str(bi), "steps": 2, "batch_size": 8, "max_length": 64,
                                  "depth": 30, "rerank": {"depth": 20, "batch_size": 16}},
                "denoise": {"teachers": ["cross_encoder", "fusion"], "depth": 10, "fill_ranks": [11, 60]},
                "augment": {"enabled": True, "queries": {"source": "ict"}, "limit": 15, "depth": 10,
                            "positive_threshold": 0.5, "negative_threshold": 0.49},
                "student": dict(ROCKETQA_TRAIN, negative_lines=2),
                "ablations": {"bm25_negatives": True, "undenoised": True, "listwise": True, "list_size": 4}}
    ance = {"flow": "ance", **common, "warmup": dict(ROCKETQA_TRAIN, bm25_depth=30), "rounds": 2,
            "round": dict(ROCKETQA_TRAIN, depth=30, negatives_per_query=5)}
    paths = {}
    for name, cfg in (("rocketqa", rocketqa), ("ance", ance)):
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(cfg))
    return {"root": root, "data": data, "bi": bi, "ce": ce, "store": root / "store", **paths}


@pytest.fixture(scope="session")
def rocketqa_sample_run(rocketqa_sample):
    """The first run of ``rocketqa_sample``'s RocketQA config in its store (every stage computed)."""
    from irflow import api

    return api.run(rocketqa_sample["rocketqa"], [], store=rocketqa_sample["store"])
