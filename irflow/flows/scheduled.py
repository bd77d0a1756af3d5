"""A flow that runs any irflow config: what `irflow serve --cron` and `prefect.yaml`'s deployments run."""

from __future__ import annotations

from prefect import flow


@flow(name="irflow-scheduled", log_prints=True)
def scheduled_flow(config_path: str, overrides: list[str] | None = None, store: str = "store") -> int:
    """`irflow run config_path --store store [--set o ...]`; a non-zero exit fails the flow run."""
    from irflow.cli import main

    args = ["run", config_path, "--store", store]
    for o in overrides or []:
        args += ["--set", o]
    rc = main(args)
    if rc != 0:
        raise RuntimeError(f"irflow run {config_path} exited with status {rc} (see the log above)")
    return rc
