"""A flow that runs any irflow config; what `irflow serve --cron` deploys on a schedule."""

from __future__ import annotations

from prefect import flow


@flow(name="irflow-scheduled", log_prints=True)
def scheduled_flow(config_path: str, overrides: list[str], store: str) -> int:
    from irflow.cli import main

    args = ["run", config_path, "--store", store]
    for o in overrides:
        args += ["--set", o]
    return main(args)
