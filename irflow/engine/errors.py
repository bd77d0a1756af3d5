"""Errors a user can act on, and how a failed stage is reported.

``UserError`` and its subclasses mean "the config or the data asks for something that cannot be
done": the CLI prints their message on one line and exits 2, with no traceback (``--debug`` shows
it). Any other exception is a bug or an environment problem (out of memory, a crashed JVM): the
CLI prints one line naming the stage and exits 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix: a config value, a missing file, data that cannot support the run."""


class ConfigError(UserError, ValueError):
    """A config that does not validate. The message lists every problem by dotted path."""


class DataError(UserError, ValueError):
    """The data given to a stage cannot support what its params ask (e.g. no queries in a split)."""


class StageFailed(Exception):
    """A stage raised. Carries the stage's label (``generate_queries[unlabelled]``) and the cause.

    Every exception that leaves a stage is wrapped in this, so a run's failure always names the
    stage it happened in, whether or not Prefect is involved.
    """

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        self.cause = cause
        super().__init__(f"{stage}: {cause}")

    @property
    def user_error(self) -> bool:
        # (a shard's user error is raised as the stage's own: irflow.engine.runner._compute_shards)
        return isinstance(self.cause, UserError)

    def one_line(self) -> str:
        if self.user_error:
            return f"stage {self.stage}: {self.cause}"
        return f"stage {self.stage} failed: {type(self.cause).__name__}: {self.cause}"
