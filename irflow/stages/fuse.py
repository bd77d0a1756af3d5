"""Hybrid retrieval without training: fuse ranked runs (``irflow.learn.fusion`` has the methods and papers).

Weights are by system name (``{bm25-flat: 0.3, dense-all-MiniLM-L6-v2: 0.7}``); null weights are
equal. The same function scores candidates for ``pseudo_label``'s fusion teacher.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn.fusion import FusionSettings, fuse_runs


class FuseSettings(FusionSettings):
    depth: PositiveInt = Field(1000, description="how many passages per query the fused ranking holds")


class FuseParams(FuseSettings):
    weights: dict[str, float] | None = Field(None, description="weight per run, by system name (null: equal)")
    system: str = Field(min_length=1, description="system name of the fused run")


@stage("fuse", version="2", outputs=Output("run", "run"))
def fuse(p: FuseParams, rt: StageRuntime, *, rankings: list[DatasetRef]) -> pa.Table:
    """The fused run of ``rankings`` (each holding one or more systems)."""
    fused = fuse_runs([r.table() for r in rankings], method=p.method, weights=p.weights, rrf_k=p.rrf_k,
                      input_depth=p.input_depth, depth=p.depth, system=p.system)
    return fused.set_column(fused.schema.get_field_index("score"), "score", fused.column("score").cast(pa.float32()))
