"""Process-wide settings, applied before Prefect is imported.

Prefect runs in its local mode (a temporary API server started by the flow run itself) with a
project-local ``PREFECT_HOME`` inside the store, analytics off (its background writes cause
"database is locked" noise with the local SQLite database). Users who have a Prefect server set
``PREFECT_API_URL`` and everything goes there instead.
"""

from __future__ import annotations

import os
from pathlib import Path


def configure(store_root: str | Path) -> None:
    home = Path(store_root).resolve() / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OPENAI_API_KEY", "not-used-by-irflow")  # see irflow.java
