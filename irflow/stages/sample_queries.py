"""A seeded sample of a query set: bounds how many unlabelled queries a teacher must read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field, PositiveInt

from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.sampling import sample


class SampleQueriesParams(Params):
    n: PositiveInt = Field(description="queries kept (all of them if there are fewer)")
    seed: int = Field(42, description="sampling seed")


@stage("sample_queries", version="1", outputs=Output("queries", "queries"))
def sample_queries(p: SampleQueriesParams, rt: StageRuntime, *, queries: DatasetRef) -> pa.Table:
    """``n`` queries of ``queries`` drawn without replacement (independent of row order), by id order."""
    t = queries.table()
    keep = sorted(sample(t.column("query_id").to_pylist(), p.n, p.seed, "sample_queries"))
    t = t.filter(pc.is_in(t.column("query_id"), pa.array(keep, pa.string())))
    return t.take(pc.sort_indices(t, [("query_id", "ascending")]))
