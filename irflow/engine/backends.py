"""Which backend runs a model under ``runtime.backend: auto``, decided once per store: the probe's seconds
(``irflow.learn.backend_probe``, registered with the runner by the export_onnx stage) and the decision,
remembered in ``backend_probes.json`` per CPU, thread count, model, task and length. ONNX Runtime is
chosen only when it is at least ``MARGIN`` times faster (torch is the reference path, and a probe has
noise)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

from irflow.engine.processes import file_lock

log = logging.getLogger("irflow.backend")
MARGIN = 1.1
PROBES_FILE = "backend_probes.json"


def choose(store_root: str | Path, key: str, measure) -> dict:
    """The remembered decision for ``key`` in this store, else ``measure()`` (-> {"torch": s, "onnx": s})
    decided and remembered: {"backend", "torch", "onnx", "speedup", "measured_at"}."""
    path = Path(store_root) / PROBES_FILE
    with file_lock(path.with_suffix(".lock")):
        known = json.loads(path.read_text()) if path.exists() else {}
        if key in known:
            return known[key]
        seconds = measure()
        speedup = seconds["torch"] / max(seconds["onnx"], 1e-9)
        known[key] = decision = {"backend": "onnx" if speedup >= MARGIN else "torch", **seconds,
                                 "speedup": round(speedup, 2), "measured_at": datetime.now().isoformat(timespec="seconds")}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        tmp.replace(path)
    log.info("runtime.backend auto: %s for %s here (probe of %s passages: torch %.2f s, onnx %.2f s; onnx "
             "%.2fx; remembered in %s)", decision["backend"], key.split(" | ")[1], decision.get("texts", "its"),
             decision["torch"], decision["onnx"], speedup, path)
    return decision
