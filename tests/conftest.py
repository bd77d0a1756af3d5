"""Session-wide test set-up: offline, a project-local Prefect, one Prefect test harness per session."""

import os
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="irflow-prefect-home-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from irflow.testing import SHARED_DATASETS  # noqa: E402


def pytest_sessionstart(session):
    # Tests run on real data; missing data is an error, never a silent skip.
    for name in ("scifact.zip", "nfcorpus.zip"):
        if not (SHARED_DATASETS / name).exists():
            raise pytest.UsageError(f"real BEIR data not found: {SHARED_DATASETS / name} "
                                    "(../shared/datasets beside the checkout, or set IRFLOW_SHARED_DATASETS)")


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    return SHARED_DATASETS


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (starting one costs ~10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
