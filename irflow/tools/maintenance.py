"""Store maintenance: `irflow verify` (is every object intact?) and `irflow gc` (what can go?).

Neither changes anything a run relies on: verify only reads (damaged objects are set aside by the
next run that needs them, which recomputes them); gc removes only what nothing refers to:

- objects/<id> dirs that the catalog does not know (published by a run killed before it recorded
  them; or left by hand) -- only while no run is in progress, since a live run records its objects
  a moment after publishing them;
- tmp/ dirs of processes that no longer exist, and damaged copies set aside under tmp/damaged-*;
- partial/<key> dirs (checkpoints of resumable stages) whose key has finished;
- lock files nobody holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from irflow.engine.catalog import Catalog
from irflow.engine.processes import locked_elsewhere
from irflow.engine.store import Store, remove_tree, tree_size


@dataclass
class VerifyReport:
    store: str
    checked: int = 0
    bytes: int = 0
    seconds: float = 0.0
    damaged: list[str] = field(default_factory=list)  # "<id>: <what is wrong>"
    missing: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)  # object dirs the catalog does not know

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.missing


def verify(store_root: str) -> VerifyReport:
    store = Store(store_root)
    catalog = Catalog(store.catalog_path)
    rep = VerifyReport(str(store.root))
    t0 = time.perf_counter()
    known = set()
    for ref in catalog.stored_objects():
        known.add(ref.id)
        problem = store.check(ref, rehash=True)  # verify trusts no earlier check
        if problem == "missing":
            rep.missing.append(ref.id)
            continue
        rep.checked += 1
        rep.bytes += tree_size(ref.path)
        if problem:
            rep.damaged.append(f"{ref.id}: {problem}")
    rep.unreferenced = sorted(p.name for p in (store.root / "objects").iterdir() if p.name not in known)
    rep.seconds = round(time.perf_counter() - t0, 3)
    return rep


@dataclass
class GcReport:
    store: str
    dry_run: bool
    removed: list[tuple[str, str, int]] = field(default_factory=list)  # (path, why, bytes)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (path, why not removed)

    @property
    def bytes(self) -> int:
        return sum(b for _, _, b in self.removed)


def gc(store_root: str, dry_run: bool = False) -> GcReport:
    store = Store(store_root)
    catalog = Catalog(store.catalog_path)
    catalog.mark_interrupted()
    live_runs = _live_runs(catalog)
    rep = GcReport(str(store.root), dry_run)

    def remove(path: Path, why: str) -> None:
        rep.removed.append((str(path.relative_to(store.root)), why, tree_size(path)))
        if not dry_run:
            remove_tree(path) if path.is_dir() else path.unlink(missing_ok=True)

    known = {ref.id for ref in catalog.stored_objects()}
    for p in sorted((store.root / "objects").iterdir()):
        if p.name in known:
            continue
        if live_runs:
            rep.kept.append((str(p.relative_to(store.root)), f"unreferenced, but run(s) {', '.join(live_runs)} "
                                                             f"are in progress and may be about to record it"))
        else:
            remove(p, "not in the catalog")
    for p in store.dead_staging():
        remove(p, "staging dir of a process that no longer exists")
    for p in sorted((store.root / "tmp").glob("damaged-*")):
        remove(p, "damaged copy set aside")
    finished = catalog.finished_keys()
    partial = store.root / "partial"
    if partial.is_dir():
        for p in sorted(partial.iterdir()):
            if p.name in finished:
                remove(p, "checkpoints of a stage that has finished")
    locks = store.root / "locks"
    if locks.is_dir() and not live_runs:  # a run may be opening one right now
        for p in sorted(locks.glob("*.lock")):
            if not locked_elsewhere(p):
                remove(p, "lock file nobody holds")
    return rep


def _live_runs(catalog: Catalog) -> list[str]:
    with catalog.connect() as con:
        return [r[0] for r in con.execute("SELECT run_id FROM runs WHERE status = 'running'").fetchall()]
