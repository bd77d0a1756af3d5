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

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    if not (SHARED / "scifact.zip").exists():
        pytest.fail(f"real BEIR data not found at {SHARED} (CI puts ../shared beside the checkout)")
    return SHARED


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (starting one costs ~10-20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
