"""The `irflow` command.

    irflow run CONFIG [--set key=value ...] [--store DIR] [--from STAGE] [--json]
    irflow status CONFIG [--set ...] [--store DIR]      what would recompute, and why
    irflow lineage ID [--store DIR]                     where a dataset or model came from
    irflow sql "SELECT ..." [--store DIR] [--json]      DuckDB SQL over the catalog and every dataset
    irflow serve CONFIG --cron "0 3 * * *" [--set ...]  run on a schedule (needs a Prefect server)
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import secrets
import sys
import time
from datetime import datetime
from pathlib import Path

from irflow import runtime
from irflow.config import ConfigError, load
from irflow.store import DEFAULT_STORE

# flow name (the config's `flow:` key) -> (module, function)
FLOWS = {
    "baselines": ("irflow.flows.baselines", "baselines"),
    "gpl": ("irflow.flows.gpl", "gpl"),
}


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _store_root(args) -> str:
    return str(Path(args.store or os.environ.get("IRFLOW_STORE") or DEFAULT_STORE).resolve())


def _catalog(args):
    from irflow.catalog import Catalog
    from irflow.store import Store

    return Catalog(Store(_store_root(args)).catalog_path)


def _flow_fn(cfg: dict):
    name = cfg["flow"]
    if name not in FLOWS:
        raise UserError(f"unknown flow '{name}' (known: {', '.join(sorted(FLOWS))})")
    module, fn = FLOWS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UserError(f"flow '{name}' is not available in this version ({e})") from None
    return getattr(mod, fn), getattr(mod, fn + "_flow")


def models_in_config(cfg: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(config path, value) of every model named in the config (keys `model` or `*_model`)."""
    out = []
    for k, v in cfg.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out += models_in_config(v, path + ".")
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, dict):
                    out += models_in_config(item, f"{path}.{i}.")
        elif isinstance(v, str) and (k == "model" or k.endswith("_model")):
            out.append((path, v))
    return out


def preflight(cfg: dict, store_root: str) -> None:
    """Fail fast, before any stage runs, if a model named in the config cannot be loaded here."""
    from irflow.models import ModelNotAvailable, check_available, resolve

    for path, name in models_in_config(cfg):
        try:
            check_available(resolve(name, store_root), path)
        except ModelNotAvailable as e:
            raise UserError(str(e)) from None


def _new_run_id(flow: str) -> str:
    return f"{flow}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def cmd_run(args) -> int:
    store_root = _store_root(args)
    runtime.configure(store_root)
    cfg = load(args.config, args.set)
    preflight(cfg, store_root)
    from irflow.stage import RunContext
    from irflow.tasks.report import format_table

    fn, flow_obj = _flow_fn(cfg)
    run_id = _new_run_id(cfg["flow"])
    ctx = RunContext(store_root, run_id, force=set(args.from_stage or []))
    catalog = ctx.catalog
    catalog.start_run(run_id, cfg["flow"], str(Path(args.config).resolve()), cfg)
    t0 = time.perf_counter()
    status, flow_run_id = "failed", None
    try:
        state = flow_obj.with_options(flow_run_name=run_id)(cfg, ctx, return_state=True)
        flow_run_id = str(state.state_details.flow_run_id) if state.state_details else None
        rows = state.result(raise_on_failure=True)
        status = "completed"
    finally:
        catalog.finish_run(run_id, status, flow_run_id)
    seconds = time.perf_counter() - t0
    stages = catalog.stage_runs(run_id)
    print()
    print(format_table(rows))
    computed = sum(s["status"] == "computed" for s in stages)
    print(f"\nrun {run_id}: {len(stages)} stages, {computed} computed, {len(stages) - computed} cached, "
          f"{seconds:.1f}s; store {store_root}")
    if args.json:
        print(json.dumps({
            "run_id": run_id,
            "seconds": round(seconds, 3),
            "stages": [{"name": s["name"], "status": s["status"],
                        "dataset_id": next(iter(s["outputs"].values()), None) if len(s["outputs"]) == 1
                        else s["outputs"], "seconds": s["seconds"]} for s in stages],
            "metrics": rows,
        }))
    return 0


def cmd_status(args) -> int:
    store_root = _store_root(args)
    runtime.configure(store_root)
    cfg = load(args.config, args.set)
    from irflow.stage import RunContext

    fn, _ = _flow_fn(cfg)
    ctx = RunContext(store_root, "status", force=set(args.from_stage or []), dry_run=True)
    fn(cfg, ctx)
    if args.json:
        print(json.dumps(ctx.plan))
        return 0
    width = max(len(p["name"]) for p in ctx.plan)
    for p in ctx.plan:
        why = ("  <- " + "; ".join(p["why"])) if p["why"] else ""
        print(f"{p['name']:<{width}}  {p['status']:<7}{why}")
    stale = sum(p["status"] == "stale" for p in ctx.plan)
    print(f"\n{stale} of {len(ctx.plan)} stages would recompute")
    return 0


def _fmt_params(params) -> str:
    if params is None:
        return "{}"
    p = json.loads(params) if isinstance(params, str) else params
    return json.dumps(p, sort_keys=True)


def cmd_lineage(args) -> int:
    catalog = _catalog(args)
    try:
        did = catalog.resolve(args.id)
    except KeyError as e:
        raise UserError(str(e)) from None
    chain = catalog.lineage(did)
    if args.json:
        print(json.dumps(chain, default=str))
        return 0
    for node in chain:
        pad = "  " * node["depth"]
        if node.get("missing"):
            print(f"{pad}{node['dataset_id']}  (not in the catalog)")
            continue
        rows = "" if node["num_rows"] is None else f", {node['num_rows']} rows"
        print(f"{pad}{node['dataset_id']}  [{node['kind']}{rows}]")
        print(f"{pad}  stage {node['stage']} (code v{node['code_version']}), run {node['run_id']}, "
              f"created {node['created_at']:%Y-%m-%d %H:%M:%S}")
        print(f"{pad}  config {_fmt_params(node['params'])}")
        for parent in node["parents"]:
            print(f"{pad}  <- {parent['role']}: {parent['dataset_id']}")
    return 0


def cmd_sql(args) -> int:
    con = _catalog(args).connect_with_views()
    try:
        rel = con.sql(args.query)
    except Exception as e:  # noqa: BLE001 -- DuckDB's message is the useful part
        raise UserError(f"SQL error: {e}") from None
    if rel is None:
        return 0
    if args.json:
        cols = rel.columns
        print(json.dumps([dict(zip(cols, r)) for r in rel.fetchall()], default=str))
    else:
        rel.show(max_width=200, max_rows=args.max_rows)
    return 0


def cmd_serve(args) -> int:
    store_root = _store_root(args)
    runtime.configure(store_root)
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("schedules need a running Prefect server: start one with `make prefect-server` "
                        "(prefect server start --host 127.0.0.1) and set PREFECT_API_URL=http://127.0.0.1:4200/api")
    cfg = load(args.config, args.set)
    preflight(cfg, store_root)
    from irflow.flows.scheduled import scheduled_flow

    name = args.name or Path(args.config).stem
    scheduled_flow.serve(name=name, cron=args.cron, parameters={
        "config_path": str(Path(args.config).resolve()), "overrides": args.set or [], "store": store_root})
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="irflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, config=True):
        if config:
            sp.add_argument("config", help="a YAML config (see configs/)")
            sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
        sp.add_argument("--store", help=f"store directory (default: $IRFLOW_STORE or ./{DEFAULT_STORE})")

    r = sub.add_parser("run", help="run a flow")
    common(r)
    r.add_argument("--from", dest="from_stage", action="append", metavar="STAGE",
                   help="recompute this stage (name or name[label]) and everything downstream of it")
    r.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="which stages of a config are cached or stale, and why")
    common(s)
    s.add_argument("--from", dest="from_stage", action="append", metavar="STAGE")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    lin = sub.add_parser("lineage", help="the upstream chain of a dataset or model id (a unique prefix is enough)")
    lin.add_argument("id")
    common(lin, config=False)
    lin.add_argument("--json", action="store_true")
    lin.set_defaults(func=cmd_lineage)

    q = sub.add_parser("sql", help="DuckDB SQL over the catalog tables and views of every stored dataset")
    q.add_argument("query")
    common(q, config=False)
    q.add_argument("--json", action="store_true")
    q.add_argument("--max-rows", type=int, default=40)
    q.set_defaults(func=cmd_sql)

    sv = sub.add_parser("serve", help="serve a config as a Prefect deployment on a cron schedule")
    common(sv)
    sv.add_argument("--cron", required=True)
    sv.add_argument("--name")
    sv.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    try:
        return args.func(args)
    except (UserError, ConfigError) as e:
        print(f"irflow: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- stage errors: say which, briefly; Prefect logged the traceback
        from irflow.catalog import CatalogLocked
        from irflow.data_contracts import ContractError
        from irflow.models import ModelNotAvailable
        from irflow.tasks.ingest import IngestError

        if isinstance(e, (IngestError, ContractError, ModelNotAvailable, CatalogLocked)):
            print(f"irflow: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
