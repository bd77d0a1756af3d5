"""Prefect in this process: its environment, its temporary server, and what its log lines look like.

``configure`` comes first, before Prefect is imported; ``prefect_home`` and ``start_prefect_server``
just before a flow runs (the API, the CLI, a recipe's flow entry). ``console_logging`` and
``quiet_prefect`` are the CLI's: one line per record, and a failure said once, by the CLI.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from irflow.engine.errors import StageFailed, UserError
from irflow.engine.processes import interrupted


# ---- process environment --------------------------------------------------------------------
def configure(store_root: str | Path) -> None:
    """Process-wide settings, applied before Prefect is imported.

    Prefect runs in its local mode (a temporary API server started by the flow run itself) with a
    project-local ``PREFECT_HOME`` inside the store, analytics off (its background writes cause
    "database is locked" noise with the local SQLite database). Users who have a Prefect server set
    ``PREFECT_API_URL`` and everything goes there instead. On a busy machine the temporary server
    needs more than Prefect's default 20 s to answer; we give it 180 s
    (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` overrides).
    """
    # Created only when a flow is about to run (prefect_home): a run refused by its checks leaves no store.
    os.environ.setdefault("PREFECT_HOME", str(Path(store_root).resolve() / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OPENAI_API_KEY", "not-used-by-irflow")  # see irflow.engine.java
    # Importing Prefect tries to create PREFECT_HOME (without its parents) and warns when the store
    # does not exist yet; prefect_home() creates it before any flow runs, so the warning is noise.
    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory", category=UserWarning)


def prefect_home() -> None:
    """Create Prefect's home (``configure`` set it): Prefect does not, and its temporary server
    then never answers."""
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)


def start_prefect_server() -> None:
    """Prefect's temporary server, started by us (it dies with this process, and runs started
    together do not race on its database: see irflow.engine.processes), unless a Prefect API is set."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    from irflow.engine.processes import start_prefect_server as start

    start(Path(os.environ["PREFECT_HOME"]))


def api_url() -> str | None:
    """The Prefect API this process reports to: PREFECT_API_URL, else its temporary server's (or None
    when neither is up). Ray shard workers are given it, so that they report to the same place."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return PREFECT_API_URL.value()
    from prefect.server.api import server as prefect_server

    srv = prefect_server.SubprocessASGIServer()
    return srv.api_url if srv.running else None


# ---- the console ----------------------------------------------------------------------------
class _Console(logging.Formatter):
    """One line per record; a warning or an error says so (it must not read like progress)."""

    def format(self, record: logging.LogRecord) -> str:
        record.mark = "" if record.levelno < logging.WARNING else record.levelname.lower() + ": "
        return super().format(record)


def console_logging() -> None:
    """Log records on stderr, one line each, at INFO."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Console("%(asctime)s %(name)s %(mark)s%(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    # faiss-cpu's wheel tries its AVX-512 and AVX2 builds first and logs, at INFO, a ModuleNotFoundError for
    # each one it lacks before it loads the generic one: it reads like a failure, and is not one
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)


_USER_ERROR_NAMES = ("StageFailed", "ConfigError", "DataError", "IngestError", "ModelNotAvailable", "UserError")


class _QuietPrefect(logging.Filter):
    """On the console, without --debug: a failed stage is reported once, by the CLI, in one line.
    Prefect's own records of the same failure (task failed, flow failed, with tracebacks) are
    dropped; tracebacks of anything else are left out of the console (the Prefect API keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (StageFailed, UserError)):
            return False
        # "Finished in state Failed('... StageFailed: ...')" comes at INFO or ERROR: the CLI says it once
        msg = record.getMessage()
        if any(n in msg for n in _USER_ERROR_NAMES):
            return False
        # Ctrl-C: the CLI says "interrupted" once; Prefect's crash records of every run say it again
        if "aborted by an interrupt signal" in msg or msg.startswith("Stopping temporary server"):
            return False
        # ... and so do its "failed" records when a library turned the KeyboardInterrupt into its own
        # error on the way out (CI once saw DuckDB's "InvalidInputException: offering a filter to the
        # source ... failed: KeyboardInterrupt" from a query the Ctrl-C landed in)
        if record.name.startswith("prefect") and interrupted():
            return False
        return True


class _NoTraceback(logging.Formatter):
    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def quiet_prefect(store_root: str | Path) -> None:
    """Filter Prefect's console handlers (and the root logger's) as ``_QuietPrefect`` says, and drop
    tracebacks from their lines (``configure`` runs first: this imports Prefect)."""
    configure(store_root)
    import prefect  # noqa: F401 -- its logging set-up must exist before we adjust its console handlers

    loggers = [logging.getLogger()] + [lg for name, lg in logging.Logger.manager.loggerDict.items()
                                       if name.startswith("prefect") and isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not any(isinstance(f, _QuietPrefect) for f in h.filters):
                h.addFilter(_QuietPrefect())
                h.setFormatter(_NoTraceback(h.formatter))
