"""Whether a run keeps to its estimate: after each computed stage, the measured seconds of the stages done
against what the estimate gave them. Once those stages were estimated at a twentieth of the run and took
more than ``OVERRUN`` times that, the run says so once, with the finishing time at the pace it is going.

``irflow run`` registers the estimate of the run it is about to start (``expect``); the runner reports each
computed stage (``stage_done``). A run started another way (``irflow.api.run``) has no estimate and is not
paced.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta

log = logging.getLogger("irflow.engine.pace")
OVERRUN = 1.5  # a run this much slower than its estimate is said to overrun
_JUDGE_AFTER = 1 / 20  # the share of the estimated run the stages done must cover before judging the pace
_PACES: dict[str, "Pace"] = {}
_LOCK = threading.Lock()


class Pace:
    def __init__(self, expected: dict[str, float], started: float | None = None):
        self.expected = dict(expected)
        self.total = sum(self.expected.values())
        self.started = time.time() if started is None else started
        self.done_estimated = self.done_measured = 0.0
        self.said: str | None = None

    def stage_done(self, label: str, seconds: float, now: float | None = None) -> str | None:
        """Count a computed stage; the overrun message when this stage is the one that shows it."""
        estimated = self.expected.pop(label, None)
        if estimated is None or self.said is not None:
            return None
        self.done_estimated += estimated
        self.done_measured += seconds
        if self.done_estimated < max(30.0, self.total * _JUDGE_AFTER):
            return None
        ratio = self.done_measured / self.done_estimated
        if ratio <= OVERRUN:
            return None
        now = time.time() if now is None else now
        left = (self.total - self.done_estimated) * ratio
        finish, planned = (datetime.fromtimestamp(t) for t in (now + left, self.started + self.total))
        self.said = (f"this run is going {ratio:.1f}x slower than its estimate (stages estimated at "
                     f"{_span(self.done_estimated)} took {_span(self.done_measured)}): at this pace it ends about "
                     f"{finish:%H:%M}{_day(finish, planned)}, not {planned:%H:%M} (busy cores? `uptime` says the load)")
        return self.said


def _span(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _day(t: datetime, ref: datetime) -> str:
    days = (t.date() - ref.date()).days
    return f" (+{days} day{'s' if days > 1 else ''})" if days > 0 else ""


def expect(run_id: str, expected: dict[str, float]) -> None:
    """The estimate (stage label -> seconds) of a run about to start in this process."""
    with _LOCK:
        _PACES[run_id] = Pace(expected)


def stage_done(run_id: str, label: str, seconds: float) -> None:
    with _LOCK:
        pace = _PACES.get(run_id)
        message = pace.stage_done(label, seconds) if pace is not None else None
    if message:
        log.warning(message)


def forget(run_id: str) -> None:
    with _LOCK:
        _PACES.pop(run_id, None)
