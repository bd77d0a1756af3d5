"""Whether a run keeps to its estimate: the measured seconds of the stages done, and of those still
computing, against what the estimate gave them. Once they were estimated at a twentieth of the run (at least
``JUDGE_FROM`` seconds; when the estimate found the cores busy, ``JUDGE_FROM_BUSY`` of them or ``MEASURED_BUSY``
seconds measured) and took more than ``OVERRUN`` times that, the run says so once, with the finishing time at the pace it is going; and
again only if the pace becomes ``AGAIN`` times slower than it said (another run taking the cores half-way).

A stage still computing counts as soon as it outlasts its estimate (its estimate covered, every second
beyond it measured), so a long stage that is slow is said while it runs, not only when it ends: a watcher
looks every ``WATCH_EVERY`` seconds. A stage that reports its progress (``progress``: the training loop, its
steps done; a corpus encoding, its batches) counts before that: the share of its estimate its progress has
covered since its first report, against the seconds since, so a run whose training is slow is said early in
the training, and a stage's start-up (its model loaded, a first step) is not taken for its pace; once such a
stage outlasts its estimate, it counts at that pace when it is slower than the seconds it has taken (a slow
first step outlasts a short estimate before the steps after it cover enough to judge).

``irflow run`` registers the estimate of the run it is about to start (``expect``); the runner reports each
stage it starts computing (``stage_started``) and each it computed (``stage_done``). A run started another
way (``irflow.api.run``) has no estimate and is not paced.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from datetime import datetime, timedelta

log = logging.getLogger("irflow.engine.pace")
OVERRUN = 1.5  # a run this much slower than its estimate is said to overrun
AGAIN = 2.0  # said again once the pace is this many times slower than it last said
_JUDGE_AFTER = 1 / 20  # the share of the estimated run the stages done must cover before judging the pace
JUDGE_FROM = 10.0  # seconds of the estimate covered at least: less says more of fixed costs (8 s said an idle run
# 1.5x at 13 s that ended at 0.93x; bench/estimates.py --replay-pace over the idle and loaded series)
JUDGE_FROM_BUSY = 5.0  # the same when the estimate found the cores busy (its load warning): the run is expected
# slow, and a twentieth of it at 1.5x or more passes after its first tenth
MEASURED_BUSY = 15.0  # or, then, this many seconds measured: a run going 8x covers 5 s of its estimate in 40
WATCH_EVERY = 5.0  # seconds between two looks at the stages still computing
_PACES: dict[str, "Pace"] = {}
# (run id, stage label, the share of the stage done before this part, the part's share) of the stage computing
# in this thread: where a progress report belongs, and what it is a share of
_COMPUTING: contextvars.ContextVar[tuple[str, str, float, float] | None] = contextvars.ContextVar("irflow_pace",
                                                                                                default=None)
_WATCHERS: dict[str, threading.Event] = {}
_LOCK = threading.Lock()


class Pace:
    def __init__(self, expected: dict[str, float], started: float | None = None, busy: bool = False):
        self.expected = dict(expected)
        self.total = sum(self.expected.values())
        # judged once this much estimated work is covered, or (cores busy at the estimate) this much measured
        self.judge_from = JUDGE_FROM_BUSY if busy else max(JUDGE_FROM, self.total * _JUDGE_AFTER)
        self.judge_measured = MEASURED_BUSY if busy else None
        self.started = time.time() if started is None else started
        self.done_estimated = self.done_measured = 0.0
        self.running: dict[str, float] = {}  # label -> when it started computing
        self.progress: dict[str, float] = {}  # label -> the share of its work a running stage has done
        self.first: dict[str, tuple[float, float]] = {}  # label -> (when, share) of its first progress report
        self.said: str | None = None  # the last overrun message
        self.said_ratio = 0.0  # the pace it said

    def stage_started(self, label: str, now: float | None = None) -> None:
        if label in self.expected:
            self.running[label] = time.time() if now is None else now

    def stage_progress(self, label: str, share: float, now: float | None = None) -> str | None:
        """A running stage has done ``share`` of its work; the overrun message when that shows it."""
        if label not in self.running:
            return None
        self.progress[label] = min(1.0, max(0.0, share))
        self.first.setdefault(label, (time.time() if now is None else now, self.progress[label]))
        return self.check(now)

    def stage_done(self, label: str, seconds: float, now: float | None = None) -> str | None:
        """Count a computed stage; the overrun message when this stage is the one that shows it."""
        self.running.pop(label, None)
        self.progress.pop(label, None)
        self.first.pop(label, None)
        estimated = self.expected.pop(label, None)
        if estimated is None:
            return None
        self.done_estimated += estimated
        self.done_measured += seconds
        return self.check(now)

    def check(self, now: float | None = None) -> str | None:
        """The overrun message when the stages done and those computing beyond their estimate show it: once, and
        again only when the pace has since become ``AGAIN`` times slower than it said (its finishing time no
        longer holds)."""
        now = time.time() if now is None else now
        estimated, measured = self.done_estimated, self.done_measured
        done_work = self.done_estimated  # the estimate of the work done: what is left is the rest, at the pace
        for label, since in self.running.items():
            took, est = now - since, self.expected.get(label, 0.0)
            # the share of its estimate its progress covers since its first report, against the seconds since:
            # its start-up (a model loaded, texts tokenised, a first step warming up) is counted once the stage
            # is done, not extrapolated over the rest
            share = self.progress.get(label)  # of its work done; None: no progress report yet
            first = self.first.get(label)  # (when, share) of its first progress report
            covered = est * (share - first[1]) if first else 0.0
            spent = now - first[0] if first else 0.0
            done_work += est * share if share is not None else est if took > est else 0.0
            if took > est:  # outlasted its estimate: the estimate covered, every second measured, at least; its
                # pace since its first report when that is slower (a slow start outlasts a short estimate
                # before its progress covers enough to judge, and says little of the pace after it)
                pace = spent / covered if covered > 0 else 0.0
                estimated, measured = estimated + est, measured + max(took, est * pace)
            elif covered > 0:
                estimated, measured = estimated + covered, measured + spent
        enough = estimated >= self.judge_from or (
            self.judge_measured is not None and measured >= self.judge_measured and estimated > 0)
        if not enough:
            return None
        ratio = measured / estimated
        if ratio <= OVERRUN or (self.said is not None and ratio < AGAIN * self.said_ratio):
            return None
        left = max(0.0, self.total - done_work) * ratio
        finish, planned = (datetime.fromtimestamp(t) for t in (now + left, self.started + self.total))
        again = "now " if self.said is not None else ""
        self.said_ratio = ratio
        self.said = (f"this run is {again}going {ratio:.1f}x slower than its estimate (judged on "
                     f"{_span(estimated)} of estimated work): at this pace it ends about "
                     f"{finish:%H:%M}{_day(finish, planned)}, not {planned:%H:%M}{_load()}")
        return self.said


def _load() -> str:
    """What the machine's load says of the cores: the likeliest cause of a slow run, and what to do."""
    from irflow.engine.runtime import available_cpus, load_average

    load, cores = load_average(), available_cpus()
    if load is None:
        return ""
    if load <= cores * 1.25:  # this run's own threads and a little more
        return f" (load {load:.1f} on {cores} cores)"
    return (f" (load {load:.1f} on {cores} cores: other work shares them; another torch run on every core slows "
            f"both many times over, so give each fewer threads: --set runtime.threads=N)")


def _span(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _day(t: datetime, ref: datetime) -> str:
    days = (t.date() - ref.date()).days
    return f" (+{days} day{'s' if days > 1 else ''})" if days > 0 else ""


def expect(run_id: str, expected: dict[str, float], busy: bool = False) -> None:
    """The estimate (stage label -> seconds) of a run about to start in this process; a watcher looks at its
    stages still computing until ``forget``. ``busy``: the estimate found other work on the cores it assumed
    free (``JUDGE_FROM_BUSY``)."""
    stop = threading.Event()
    with _LOCK:
        _PACES[run_id] = Pace(expected, busy=busy)
        _WATCHERS[run_id] = stop
    threading.Thread(target=_watch, args=(run_id, stop), daemon=True, name=f"pace-{run_id}").start()


def _watch(run_id: str, stop: threading.Event) -> None:
    while not stop.wait(WATCH_EVERY):
        _say(run_id, lambda p: p.check())


def _say(run_id: str, step) -> None:
    with _LOCK:
        pace = _PACES.get(run_id)
        message = step(pace) if pace is not None else None
    if message:
        log.warning(message)


def stage_started(run_id: str, label: str) -> None:
    _say(run_id, lambda p: p.stage_started(label))


@contextlib.contextmanager
def computing(run_id: str, label: str):
    """Around a stage's computation in this thread: its ``progress`` reports are the pace's of this stage."""
    token = _COMPUTING.set((run_id, label, 0.0, 1.0))
    try:
        yield
    finally:
        _COMPUTING.reset(token)


@contextlib.contextmanager
def part(index: int, parts: int):
    """Around the ``index``-th of ``parts`` even parts of the stage computing in this thread (a shard run here):
    its ``progress`` reports are shares of that part."""
    where = _COMPUTING.get()
    if where is None:
        yield
        return
    token = _COMPUTING.set((where[0], where[1], where[2] + where[3] * index / parts, where[3] / parts))
    try:
        yield
    finally:
        _COMPUTING.reset(token)


def progress(share: float) -> None:
    """The stage (or part, ``part``) computing in this thread has done ``share`` (0-1) of its work; nothing
    outside a paced run."""
    where = _COMPUTING.get()
    if where is not None and where[0] in _PACES:
        run_id, label, before, span = where
        _say(run_id, lambda p: p.stage_progress(label, before + span * share))


def stage_done(run_id: str, label: str, seconds: float) -> None:
    _say(run_id, lambda p: p.stage_done(label, seconds))


def forget(run_id: str) -> None:
    with _LOCK:
        _PACES.pop(run_id, None)
        stop = _WATCHERS.pop(run_id, None)
    if stop is not None:
        stop.set()
