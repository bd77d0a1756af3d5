"""The ``runtime.ray`` section: where ``executor: ray`` runs shards. Apart from ``ray.py`` so that reading a
config (``irflow.engine.runtime``) never imports Ray or the shard machinery."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from irflow.engine.params import Params


class RayConfig(Params):
    """Where ``executor: ray`` runs shards (``runtime.ray.*``)."""

    address: str | None = Field(None, description="null: start a local Ray cluster for this run and stop it "
                                                  "when the run ends (also on Ctrl-C or kill -9 of the run); "
                                                  "'auto', 'host:6379' or 'ray://host:10001': join an existing "
                                                  "cluster (it is left running)")
    workers: PositiveInt | None = Field(None, description="local cluster: CPU slots, i.e. shards running at "
                                                          "once (null: every CPU of this process)")
    threads_per_worker: PositiveInt | None = Field(None, description="torch/faiss threads in each shard task "
                                                                     "(null: CPUs divided by workers, at least 1)")
    gpus_per_shard: float = Field(0.0, ge=0, description="GPUs each shard of a device stage asks Ray for "
                                                         "(Ray's num_gpus; fractions share a GPU; 0: CPU)")
    concurrent_stages: PositiveInt = Field(4, description="stages that do not read each other's outputs run at "
                                                          "the same time, at most this many (their shards share "
                                                          "the workers; stages that compute with torch in the "
                                                          "run's process take turns); 1: one after another")
