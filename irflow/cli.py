"""The `irflow` command: a thin layer over ``irflow.api``.

    irflow run CONFIG [--set key=value ...] [--store DIR] [--from STAGE] [--to STAGE] [--json]
    irflow status CONFIG [--set ...] [--store DIR] [--from STAGE] [--to STAGE] [--graph OUT.svg]
                                                           what would recompute, and why
    irflow dag RUN_ID [--store DIR] [--out OUT.svg]        a finished run's graph as SVG
    irflow config CONFIG [--set ...] [--explain]           the validated config, defaults filled in
    irflow lineage ID [--store DIR]                        where a dataset or model came from
    irflow sql "SELECT ..." [--store DIR] [--json]         DuckDB SQL over the catalog and every dataset
    irflow report [RUN_ID | latest] --out DIR [--baseline NAME ...] [--metric M]   one HTML page about a run
    irflow compare RUN_A RUN_B [--metric M] [--json]      what differs between two runs (B against A)
    irflow dev-split SOURCE OUT [--share 0.2]              a BEIR folder whose train queries are cut into train and dev
    irflow verify [--store DIR] [--json]                   re-hash every stored object; exit 1 if any is damaged
    irflow gc [--store DIR] [--dry-run]                    remove what nothing refers to (see irflow.tools.maintenance)
    irflow serve CONFIG --cron "0 3 * * *" [--set ...]     run on a schedule (needs a Prefect server)
    irflow export [RUN_ID | latest | ALIAS] --out DIR [--system NAME] [--format st|onnx]
                                                           a run's (or an alias's) model as a sentence-transformers folder
    irflow models [--store DIR] [--json] [--history]       the models runs evaluated, which they selected, the aliases
    irflow new RECIPE --corpus PATH [--queries P --qrels P] [--query-log P] --out CONFIG
                                                           a commented config for your documents, with estimates

Errors the user can fix (a config value, a missing file, data that cannot support the run, a stage
that says so) print one line and exit 2; other failures print one line naming the stage and exit 1.
``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

from irflow import api
from irflow.engine import orchestration, pace
from irflow.engine.errors import StageFailed, UserError
from irflow.engine.store import DEFAULT_STORE

log = logging.getLogger("irflow")


def _catalog(args, must_exist: bool = True):
    return api.catalog(args.store, must_exist)


def _model(model_id: str) -> str:
    """A model id as a user reads it: a hub id whole, a stored model's or a directory's cut to what tells them apart."""
    if model_id.startswith("hub:"):
        return model_id
    return model_id[:24] if model_id.startswith("dir:") else model_id[:16]


def cmd_run(args) -> int:
    from irflow.stages.report import format_table

    c = api.load_config(args.config, args.set)  # a bad config fails here, before Prefect or the store is touched
    if not getattr(args, "debug", False):
        orchestration.quiet_prefect(api.store_root(args.store))
    run_id = api.new_run_id(c.flow)
    estimated = None if args.no_estimate else _estimate(args)
    if estimated:
        pace.expect(run_id, {e.stage: e.seconds for e in estimated.rows}, busy=estimated.busy)
    try:
        result = api.run(args.config, args.set, args.store, args.from_stage or [], to=args.to_stage or [],
                         run_id=run_id)
    finally:
        pace.forget(run_id)
    print()
    print(format_table(result.metrics))
    if estimated:
        measured = {s.name: s.seconds for s in result.stages if s.status == "computed"}
        print("\n" + estimated.table(measured))
        try:
            estimated.record(result.run_id, result.store)
        except Exception as err:  # noqa: BLE001 -- the run is done; the next estimate is then uncalibrated
            print(f"irflow: the estimate was not recorded ({type(err).__name__}: {err})", file=sys.stderr)
    computed = sum(1 for s in result.stages if s.status == "computed")  # as the catalog counts: per stage run
    print(f"\nrun {result.run_id}: {len(result.stages)} stages, {computed} computed, "
          f"{len(result.stages) - computed} cached, {result.seconds:.1f}s; store {result.store}")
    changed = result.corpus_changes()
    if changed:
        print(changed)
    if result.skipped:
        print(f"not run (--to {', '.join(args.to_stage)}): {', '.join(result.skipped)}")
    if result.evaluation.startswith("none"):
        print(f"evaluation: {result.evaluation} -- nothing was measured")
    elif result.evaluation != "labelled":
        print(f"evaluation: {result.evaluation} -- a proxy, not relevance labels")
    if result.selected:
        sel = result.selected
        print(f"selected: {sel['system']} (model {_model(sel['model_id'])}): {sel['reason']}")
        print(f"  hand it out: irflow export {result.run_id} --out DIR --store {result.store}")
    if result.promotion:
        p = result.promotion
        print(f"promotion ({p['decision']}): {p['reason']}")
        if p["current"]:
            print(f"  {p['alias']} holds model {_model(p['current'])}: irflow export {p['alias']} --out DIR "
                  f"--store {result.store}")
    if result.warnings:
        # Said again at the end: in place they scroll away among a long run's progress lines.
        print(f"\n{len(result.warnings)} warning(s) during the run (in place in the log above):")
        for message in result.warnings:
            print(f"- {message}")
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    return 0


def _estimate(args) -> "api.RunEstimate | None":
    """Before a run: what its stale stages will take here (``api.estimate``), printed; None when nothing is
    stale, or when the estimate cannot be made (it says why in one line; the run goes on)."""
    try:
        estimated = api.estimate(args.config, args.set, args.store, args.from_stage or [], to=args.to_stage or [])
    except UserError:  # a bad config or corpus: the run reports it next, before anything starts
        return None
    except Exception as e:  # noqa: BLE001 -- an estimate never stops a run; it says why it is missing
        print(f"irflow: no estimate ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
              "the run goes on", file=sys.stderr)
        return None
    if estimated:
        print(estimated.table(), file=sys.stderr)
    return estimated


def cmd_status(args) -> int:
    plan = api.status(args.config, args.set, args.store, args.from_stage or [], to=args.to_stage or [])
    if args.graph:
        from irflow.tools import dag

        sets = "".join(f" --set {s}" for s in args.set or [])
        _write(args.graph, dag.to_svg(dag.planned_graph(plan, _catalog(args, must_exist=False),
                                                        title=f"irflow status {args.config}{sets}"), args.engine,
                                    args.direction))
    if args.json:
        print(json.dumps([vars(p) for p in plan]))
        return 0
    width = max(len(p.name) for p in plan)
    for p in plan:
        why = ("  <- " + "; ".join(p.why)) if p.why else ""
        print(f"{p.name:<{width}}  {p.status:<7}{why}")
    stale = sum(p.status == "stale" for p in plan)
    print(f"\n{stale} of {len(plan)} stages would recompute")
    if args.graph and args.graph != "-":
        print(f"graph: {args.graph}")
    return 0


def _write(out: str, text: str) -> None:
    """``-``: stdout; else the file (its directory must exist: a typo is not silently created)."""
    if out == "-":
        sys.stdout.write(text + "\n")
        return
    path = Path(out)
    if not path.parent.is_dir():
        raise UserError(f"cannot write {out}: no directory {path.parent}")
    path.write_text(text + "\n")


def cmd_dag(args) -> int:
    from irflow.tools import dag
    from irflow.tools.report.runs import resolve_run

    catalog = _catalog(args)
    run_id = resolve_run(catalog, args.run_id)  # an id, a unique prefix, or latest; else names recent runs
    _write(args.out, dag.to_svg(dag.run_graph(catalog, run_id), args.engine, args.direction))
    if args.out != "-":
        print(f"{run_id}: {args.out}")
    return 0


def cmd_config(args) -> int:
    import yaml

    c = api.load_config(args.config, args.set)
    for w in c.advice():
        print(f"warning: {w}", file=sys.stderr)
    if args.explain:
        rows = type(c).explain()
        width = max(len(k) for k, _, _ in rows)
        for key, default, doc in rows:
            print(f"{key:<{width}}  {default:<24} {doc}")
        return 0
    dump = c.model_dump(mode="json")
    dump["promote"] = dump.pop("promote")  # sections in the order a user reads them; promote, runtime last
    dump["runtime"] = dump.pop("runtime")
    print(json.dumps(dump, indent=2) if args.json else yaml.safe_dump(dump, sort_keys=False), end="")
    return 0


def _fmt_json(value) -> str:
    if value is None:
        return "{}"
    v = json.loads(value) if isinstance(value, str) else value
    return json.dumps(v, sort_keys=True)


def _fmt_runtime(value) -> str | None:
    if not value:
        return None
    rt = json.loads(value) if isinstance(value, str) else value
    parts = [f"{rt.get('device')}", f"{rt.get('precision')}", f"{rt.get('threads')} threads"]
    if rt.get("work") == "train" and (rt.get("train_processes") or 1) > 1:
        parts.append(f"{rt['train_processes']} training processes")
    if rt.get("gpu"):
        parts.append(rt["gpu"])
    if rt.get("backend", "torch") != "torch" or rt.get("onnx_models"):  # runtime.backend, int8 models
        parts.append(f"backend {rt.get('backend', 'torch')}" + "".join(
            f", {Path(src).name} ran as {dst}" for src, dst in (rt.get("onnx_models") or {}).items()))
    if rt.get("executor"):
        parts.append(f"executor {rt['executor']}, {rt.get('shards')} shard(s) of {rt.get('shard_rows')} rows")
    versions = rt.get("versions") or {}
    libs = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "sentence-transformers", "pyserini")
                     + (("onnxruntime",) if rt.get("onnx_models") else ()) if k in versions)
    return ", ".join(parts) + (f"; {libs}" if libs else "")


def cmd_dev_split(args) -> int:
    from irflow.sources.beir import train_dev_split

    try:
        counts = train_dev_split(args.source, args.out, train_split=args.train_split, dev_share=args.share,
                                 seed=args.seed, max_dev_queries=args.max_dev_queries)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"{args.out}: {counts['fit_queries']} train (fit) queries / {counts['fit_qrels']} judgements, "
          f"{counts['dev_queries']} dev queries / {counts['dev_qrels']} judgements; no other split")
    print(f"run a config on it: irflow run CONFIG --set dataset.source={args.out} --set dataset.split=dev "
          f"--set dataset.md5=null")
    return 0


def cmd_lineage(args) -> int:
    catalog = _catalog(args)
    try:
        did = catalog.resolve(args.id)
    except KeyError as e:
        raise UserError(str(e).strip("'\"")) from None
    chain = catalog.lineage(did)
    if args.json:
        print(json.dumps(chain, default=str))
        return 0
    for node in chain:
        pad = "  " * node["depth"]
        if node.get("missing"):
            print(f"{pad}{node['dataset_id']}  (not in the catalog)")
            continue
        if node["stage"] == "external":
            print(f"{pad}{node['dataset_id']}  [{node['kind']}, external] {_fmt_json(node['params'])}")
            continue
        rows = "" if node["num_rows"] is None else f", {node['num_rows']} rows"
        print(f"{pad}{node['dataset_id']}  [{node['kind']}{rows}]")
        print(f"{pad}  stage {node['stage']} (code v{node['code_version']}), run {node['run_id']}, "
              f"created {node['created_at']:%Y-%m-%d %H:%M:%S}")
        print(f"{pad}  params {_fmt_json(node['params'])}")
        rt = _fmt_runtime(node.get("runtime"))
        if rt:
            print(f"{pad}  runtime {rt}")
        for message in json.loads(node.get("warnings") or "[]"):
            print(f"{pad}  warned: {message}")
        reuse = node.get("rows") or {}
        if reuse.get("reused"):
            print(f"{pad}  rows: {reuse['computed']} of {reuse['input']} input rows computed, {reuse['reused']} "
                  f"reused (from run {', '.join(reuse.get('reused_from', {}))})")
        shards = node.get("shards") or []
        if len(shards) > 1 or any(s["status"] != "computed" for s in shards):
            print(f"{pad}  {len(shards)} shards:")
            for s in shards:
                where = f"{s['host']} pid {s['pid']}, {s['device']}, {s['seconds']:.1f}s" if s["pid"] else "earlier run"
                print(f"{pad}    {s['index']}: rows {s['rows'][0]}-{s['rows'][1]} {s['status']} ({where})")
        for parent in node["parents"]:
            print(f"{pad}  <- {parent['role']}: {parent['dataset_id']}")
    return 0


def cmd_sql(args) -> int:
    con = _catalog(args).connect_with_views()
    try:
        statements = con.extract_statements(args.query)
    except Exception as e:  # noqa: BLE001 -- DuckDB's message is the useful part
        raise UserError(f"SQL error: {e}") from None
    for st in statements:  # every statement's result, not only the last one's
        try:
            rel = con.sql(st.query)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"SQL error in {st.query.strip()!r}: {e}") from None
        if rel is None:
            continue
        if args.json:
            cols = rel.columns
            print(json.dumps([dict(zip(cols, r)) for r in rel.fetchall()], default=str))
        else:
            rel.show(max_width=200, max_rows=args.max_rows)
    return 0


def cmd_report(args) -> int:
    result = api.report(args.run_id, args.out, args.store, args.baseline or (), args.metric)
    d = result.data
    print(f"{result.path}: run {result.run_id} ({d.run['status']}), {len(d.systems)} systems, "
          f"{len(d.comparisons)} comparisons against {', '.join(d.baselines) or 'no baseline'}")
    for note in d.notes:
        print(f"note: {note}")
    return 0


def cmd_compare(args) -> int:
    from irflow.tools.report.compare import format_compare

    diff = api.compare(args.run_a, args.run_b, args.store, args.metric)
    print(json.dumps(diff.to_dict(), default=str) if args.json else format_compare(diff))
    return 0


def cmd_verify(args) -> int:
    from irflow.tools import maintenance

    _catalog(args)  # an existing store, or one line saying there is none
    rep = maintenance.verify(api.store_root(args.store))
    if args.json:
        print(json.dumps(vars(rep) | {"ok": rep.ok}))
    else:
        for line in rep.damaged:
            print(f"DAMAGED  {line}")
        for did in rep.missing:
            print(f"MISSING  {did}: in the catalog, not in objects/")
        for did in rep.unreferenced:
            print(f"UNKNOWN  {did}: in objects/, not in the catalog (irflow gc removes it)")
        rate = rep.bytes / rep.seconds / 1e6 if rep.seconds else 0
        print(f"{rep.checked} objects, {rep.bytes / 1e6:.1f} MB re-hashed in {rep.seconds:.2f} s ({rate:.0f} MB/s): "
              f"{len(rep.damaged)} damaged, {len(rep.missing)} missing, {len(rep.unreferenced)} unreferenced")
        if not rep.ok:
            print("a run that needs a damaged or missing object recomputes it (damaged copies are set aside first)")
    return 0 if rep.ok else 1


def cmd_gc(args) -> int:
    from irflow.tools import maintenance

    _catalog(args)
    rep = maintenance.gc(api.store_root(args.store), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path, why, size in rep.removed:
        print(f"{verb}  {path}  ({size / 1e6:.1f} MB; {why})")
    for path, why in rep.kept:
        print(f"kept     {path}  ({why})")
    print(f"{verb} {len(rep.removed)} entries, {rep.bytes / 1e6:.1f} MB")
    return 0


def cmd_serve(args) -> int:
    from irflow.recipes.base import get_recipe

    store_root = api.store_root(args.store)
    orchestration.configure(store_root)
    if not os.environ.get("PREFECT_API_URL"):
        raise UserError("schedules need a running Prefect server: start one with `make prefect-server` "
                        "(prefect server start --host 127.0.0.1) and set PREFECT_API_URL=http://127.0.0.1:4200/api")
    c = api.load_config(args.config, args.set)
    api.preflight(c, store_root)
    name = args.name or Path(args.config).stem
    orchestration.prefect_home()
    get_recipe(c.flow).flow.serve(name=name, cron=args.cron, parameters={
        "config": str(Path(args.config).resolve()), "overrides": args.set or [], "store": store_root})
    return 0


def cmd_export(args) -> int:
    from irflow.tools import export
    from irflow.tools.report.runs import resolve_run

    catalog = _catalog(args)
    if args.run_id != "latest" and catalog.alias(args.run_id):  # an alias name, before run ids and prefixes
        if args.system:
            raise UserError(f"--system: {args.run_id} is an alias; it holds one model (export a run to choose "
                            f"another of its models)")
        done = export.export_alias(catalog, args.run_id, args.out, args.format, args.force)
        print(f"{done.system} (held by {args.run_id}; model {_model(done.model_id)}, from run {done.run_id}) -> "
              f"{done.out}")
    else:
        run_id = resolve_run(catalog, args.run_id)
        done = export.export(catalog, run_id, args.out, args.system, args.format, args.force)
        which = "selected by the run" if done.selected else "named with --system"
        print(f"{done.system} ({which}; model {_model(done.model_id)}) of run {run_id} -> {done.out}")
    if done.onnx:
        print(f"ONNX: {done.onnx}")
    print(f'load it: SentenceTransformer("{done.out}"); its model card: {done.out / "README.md"}')
    return 0


def cmd_models(args) -> int:
    from irflow.tools import export

    catalog = _catalog(args)
    if args.history:
        history = catalog.alias_history()
        if args.json:
            print(json.dumps(history, default=str))
            return 0
        if not history:
            print("no alias yet (set promote.alias in a config)")
        for h in history:
            model = _model(h["model_id"]) if h["model_id"] else "-"
            print(f"{h['decided_at']:%Y-%m-%d %H:%M:%S}  {h['alias']:<14} {h['decision']:<9} {model:<18} "
                  f"{h['run_id'] or '(by hand)'}: {h['reason']}")
        return 0
    rows = export.models(catalog)
    if args.json:
        print(json.dumps(rows, default=str))
        return 0
    if not rows:
        print("no run has selected a model yet")
        return 0
    w = max([18] + [len(_model(r["model_id"])) + 2 for r in rows])
    print(f"{'model':<{w}} {'run':<28} {'system':<28} {'recipe':<10} {'ndcg@10':>8}  evaluation")
    for r in rows:
        mark = "* " if r["selected"] else "  "
        value = "" if r.get("ndcg@10") is None else f"{r['ndcg@10']:.4f}"
        held = f"  <- {', '.join(r['aliases'])}" if r["aliases"] else ""
        print(f"{_model(r['model_id']):<{w}} {r['run_id']:<28} {mark + r['system']:<28} {r['recipe']:<10} {value:>8}  "
              f"{r['evaluation']}{held}")
    print("\n* the model its run selected (irflow export RUN_ID hands it out)")
    aliases = catalog.aliases()
    if aliases:
        print("\naliases (irflow export ALIAS hands out its model; --history: every decision):")
        for a in aliases:
            print(f"  {a['alias']:<14} {_model(a['model_id']):<18} {a['system'] or '':<20} promoted by "
                  f"{a['run_id'] or 'hand'} at {a['decided_at']:%Y-%m-%d %H:%M:%S}")
    return 0


def _calibration(store: str | None):
    """What the store (when there is one) measured on this hardware: irflow new's estimates use it."""
    from irflow.tools import estimate

    try:
        catalog = api.catalog(store)
    except UserError:  # no store yet: the shipped rates
        return None
    return estimate.calibration(catalog, estimate.hardware())


def cmd_new(args) -> int:
    import shlex

    from irflow.tools import scaffold

    fields = dict(f.split("=", 1) for f in args.field or []) or None
    command = "irflow " + " ".join(shlex.quote(a) for a in getattr(args, "argv", []))
    text, table, choices = scaffold.new_config(args.recipe, args.corpus, queries=args.queries, qrels=args.qrels,
                                               query_log=args.query_log, model=args.model, generator=args.generator,
                                               teacher=args.teacher, fields=fields,
                                               budget_minutes=args.budget_minutes, command=command,
                                               calibrated=_calibration(args.store))
    out = scaffold.write(args.out, text, args.force)
    for line in choices.lines:
        print(line)
    for w in choices.warnings:
        print(f"warning: {w}")
    print()
    print(table)
    print(f"\nwrote {out}: irflow run {out}")
    return 0


def _common(sp, config=True, store=True):
    if config:
        sp.add_argument("config", help="a YAML config (see configs/)")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (dotted key; the value is YAML)")
    if store:
        sp.add_argument("--store", help=f"store directory (default: $IRFLOW_STORE or ./{DEFAULT_STORE})")
    sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _json_flag(sp, help="print the result as JSON instead of a table"):
    sp.add_argument("--json", action="store_true", help=help)


def _engine_flag(sp):
    sp.add_argument("--engine", choices=("plain", "dot"), default="plain",
                    help="graph layout: plain (built in) or dot (Graphviz's dot on PATH)")
    sp.add_argument("--direction", choices=("LR", "TB"), default="LR",
                    help="graph direction: LR (left to right) or TB (top to bottom, for wide graphs)")


def _parser_run(sub) -> None:
    r = sub.add_parser("run", help="run a recipe")
    _common(r)
    r.add_argument("--from", dest="from_stage", action="append", metavar="STAGE",
                   help="recompute this stage (name or name[label]; repeatable) and everything downstream of it")
    r.add_argument("--to", dest="to_stage", action="append", metavar="STAGE",
                   help="stop after this stage (name or name[label]; repeatable): run only it and the stages it needs")
    _json_flag(r, help="print the run's result as JSON (last line of stdout)")
    r.add_argument("--no-estimate", action="store_true",
                   help="skip the estimate of each stale stage's time and memory printed before the run")
    r.set_defaults(func=cmd_run)


def _parser_status(sub) -> None:
    s = sub.add_parser("status", help="which stages of a config are cached or stale, and why")
    _common(s)
    s.add_argument("--from", dest="from_stage", action="append", metavar="STAGE",
                   help="as run's --from: this stage and everything downstream count as stale (repeatable)")
    s.add_argument("--to", dest="to_stage", action="append", metavar="STAGE",
                   help="only this stage and the stages it needs (the others: skipped; repeatable)")
    s.add_argument("--graph", metavar="OUT.svg", help="also draw the plan as SVG (stale stages with their reasons)")
    _engine_flag(s)
    _json_flag(s)
    s.set_defaults(func=cmd_status)


def _parser_dag(sub) -> None:
    d = sub.add_parser("dag", help="a run's graph as SVG: stages (computed/cached/failed/skipped, seconds), "
                                   "datasets, models' lineage")
    d.add_argument("run_id", help="a run id (a unique prefix is enough)")
    d.add_argument("--out", default="-", metavar="OUT.svg", help="where to write the SVG (default: stdout)")
    _engine_flag(d)
    _common(d, config=False)
    d.set_defaults(func=cmd_dag)


def _parser_config(sub) -> None:
    c = sub.add_parser("config", help="the validated config with every default filled in")
    _common(c, store=False)
    c.add_argument("--explain", action="store_true", help="every key with its default and what it does")
    _json_flag(c)
    c.set_defaults(func=cmd_config)


def _parser_dev_split(sub) -> None:
    ds = sub.add_parser("dev-split", help="a BEIR folder for choosing settings without test: the train split's "
                                          "judged queries cut into train (fit) and dev; no test query in it")
    ds.add_argument("source", help="a BEIR folder or .zip")
    ds.add_argument("out", help="the folder to write (replaced if it exists)")
    ds.add_argument("--train-split", default="train", help="the labelled split to cut (default: train)")
    ds.add_argument("--share", type=float, default=0.2, help="share of its queries that go to dev (default 0.2)")
    ds.add_argument("--max-dev-queries", type=int, default=None, help="at most this many dev queries")
    ds.add_argument("--seed", type=int, default=7, help="seed of the cut (default 7)")
    ds.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    ds.set_defaults(func=cmd_dev_split)


def _parser_lineage(sub) -> None:
    lin = sub.add_parser("lineage", help="the upstream chain of a dataset or model id (a unique prefix is enough)")
    lin.add_argument("id", help="a dataset or model id (or a unique prefix of one), e.g. from irflow models")
    _common(lin, config=False)
    _json_flag(lin)
    lin.set_defaults(func=cmd_lineage)


def _parser_sql(sub) -> None:
    q = sub.add_parser("sql", help="DuckDB SQL over the catalog tables and views of every stored dataset")
    q.add_argument("query", help="one SQL statement, e.g. \"SELECT * FROM runs\" (tables: runs, stage_runs, "
                                 "datasets, metrics, selections, aliases; every stored dataset is a view)")
    _common(q, config=False)
    _json_flag(q)
    q.add_argument("--max-rows", type=int, default=40, help="print at most this many rows (default 40)")
    q.set_defaults(func=cmd_sql)


def _parser_report(sub) -> None:
    rp = sub.add_parser("report", help="one self-contained HTML page about a run: metrics with confidence "
                                       "intervals, each system against baselines, per-query plots")
    rp.add_argument("run_id", nargs="?", default="latest", metavar="RUN_ID",
                    help="a run id, a unique prefix of one, or latest (default)")
    rp.add_argument("--out", required=True, metavar="DIR", help="directory to write index.html into")
    rp.add_argument("--baseline", action="append", metavar="NAME",
                    help="a system to compare every other with (repeatable; default: the zero-shot dense "
                         "system and BM25 flat, those the run has)")
    rp.add_argument("--metric", default="ndcg@10", help="the per-query metric compared (default ndcg@10)")
    _common(rp, config=False)
    rp.set_defaults(func=cmd_report)


def _parser_compare(sub) -> None:
    cp = sub.add_parser("compare", help="what differs between two runs: config, stages, metrics (B against A)")
    cp.add_argument("run_a", metavar="RUN_A", help="the run compared against (a run id or a unique prefix)")
    cp.add_argument("run_b", metavar="RUN_B", help="the run compared (a run id, a unique prefix, or latest)")
    cp.add_argument("--metric", default="ndcg@10", help="the per-query metric compared (default ndcg@10)")
    _common(cp, config=False)
    _json_flag(cp)
    cp.set_defaults(func=cmd_compare)


def _parser_verify(sub) -> None:
    v = sub.add_parser("verify", help="re-hash every stored object against its recorded digest")
    _common(v, config=False)
    _json_flag(v)
    v.set_defaults(func=cmd_verify)


def _parser_gc(sub) -> None:
    g = sub.add_parser("gc", help="remove unreferenced objects, staging of dead runs, finished checkpoints")
    _common(g, config=False)
    g.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    g.set_defaults(func=cmd_gc)


def _parser_serve(sub) -> None:
    sv = sub.add_parser("serve", help="serve a config as a Prefect deployment on a cron schedule")
    _common(sv)
    sv.add_argument("--cron", required=True, help="when to run, as a cron expression in UTC, e.g. \"0 2 * * *\" "
                                                   "(every night at 02:00)")
    sv.add_argument("--name", help="the deployment's name (default: the config file's name)")
    sv.set_defaults(func=cmd_serve)


def _parser_export(sub) -> None:
    ex = sub.add_parser("export", help="a run's model (default: the one it selected) as a self-contained "
                                       "sentence-transformers folder with a model card")
    ex.add_argument("run_id", nargs="?", default="latest", metavar="RUN_ID",
                    help="a run id, a unique prefix of one, latest (default), or an alias name (promote.alias: "
                         "the model it holds)")
    ex.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, or be empty)")
    ex.add_argument("--system", help="another dense model of the run, by system name (see irflow models)")
    ex.add_argument("--format", choices=("st", "onnx"), default="st",
                    help="st: sentence-transformers (default); onnx: also onnx/ (irflow's ONNX export)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _common(ex, config=False)
    ex.set_defaults(func=cmd_export)


def _parser_new(sub) -> None:
    nw = sub.add_parser("new", help="a commented config for your own documents and this machine, with each "
                                    "stage's estimated time and memory",
                        description="Write a config for your own documents. Every document longer than the encoder "
                                    "reads (256 tokens) is cut into passages; without labels a share of the documents "
                                    "(by their ids' hashes, with their duplicates) is held out of training for a "
                                    "synthetic evaluation (a proxy), sized to the corpus (none when the corpus is too "
                                    "small: the config says so). Prints what it chose and why.")
    nw.add_argument("recipe", choices=("gpl", "baselines"), help="gpl (adapt a model) or baselines (BM25, zero-shot)")
    nw.add_argument("--corpus", required=True, help="your documents: .jsonl(.gz), .parquet (or a folder of them), "
                                                    ".csv, .tsv, or a folder of .txt / .md / .html")
    nw.add_argument("--queries", help="labelled test queries (with --qrels)")
    nw.add_argument("--qrels", help="their judgements: TSV query_id, doc_id, relevance (or TREC qrels)")
    nw.add_argument("--query-log", help="query texts without labels (a search log): GPL's best offline source")
    nw.add_argument("--model", default="all-MiniLM-L6-v2", help="the model to adapt (default all-MiniLM-L6-v2)")
    nw.add_argument("--generator", help="a T5 query generator (local folder or hub id)")
    nw.add_argument("--teacher", help="a cross-encoder teacher (local folder or hub id)")
    nw.add_argument("--field", action="append", metavar="NAME=COLUMN",
                    help="the corpus column for id, title or text (repeatable: --field text=body)")
    nw.add_argument("--budget-minutes", type=float, default=60.0,
                    help="size training to fit this many minutes here, with the rest of the run (default 60)")
    nw.add_argument("--out", required=True, help="the config file to write")
    nw.add_argument("--store", help="the store whose earlier runs on this machine calibrate the estimate and the "
                                    f"budget (default: $IRFLOW_STORE or ./{DEFAULT_STORE}, where it exists)")
    nw.add_argument("--force", action="store_true", help="replace --out")
    nw.set_defaults(func=cmd_new)


def _parser_models(sub) -> None:
    ms = sub.add_parser("models", help="the models runs evaluated: id, run, system, recipe, metric, selected; and "
                                       "the aliases (promote.alias) with the model each holds")
    _common(ms, config=False)
    _json_flag(ms)
    ms.add_argument("--history", action="store_true", help="every promotion decision (promoted or kept, and why)")
    ms.set_defaults(func=cmd_models)


# each adds its subcommand, in the order `irflow --help` lists them
SUBCOMMANDS = (_parser_run, _parser_status, _parser_dag, _parser_config, _parser_dev_split, _parser_lineage,
               _parser_sql, _parser_report, _parser_compare, _parser_verify, _parser_gc, _parser_serve,
               _parser_export, _parser_new, _parser_models)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="irflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def _error(msg: str) -> None:
    print(f"irflow: error: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    from irflow.engine.processes import install_interrupt_handler, interrupted

    install_interrupt_handler()
    orchestration.console_logging()
    said = False
    try:
        try:
            return args.func(args)
        except KeyboardInterrupt:
            said = True
            _error("interrupted")
            return 130
        except Exception as e:  # noqa: BLE001 -- every failure ends in one line (and a traceback with --debug)
            if interrupted():  # a Ctrl-C some library turned into its own error on the way out
                said = True
                _error("interrupted")
                return 130
            return _report_failure(e, args.debug)
        finally:
            # Objects that C extensions own (DuckDB connections, via nanobind) must die before the
            # interpreter does, or each one prints a "leaked" line at exit: drop the frames that a caught
            # exception keeps alive, then collect.
            sys.last_traceback = sys.last_value = sys.last_type = None
            gc.collect()
    except KeyboardInterrupt:
        # Python raises a Ctrl-C's KeyboardInterrupt at whatever bytecode the main thread is on, which
        # can be the error handling or the clean-up above; escaping main it would kill the process by
        # SIGINT with a traceback (CI once saw exit -2 instead of 130). The run is stopped either way.
        if not said:
            _error("interrupted")
        return 130


def _report_failure(e: Exception, debug: bool) -> int:
    from irflow.data_contracts import ContractError
    from irflow.engine.catalog import CatalogLocked

    if debug:
        import traceback

        traceback.print_exception(e)
    if isinstance(e, StageFailed):
        if e.user_error:
            _error(e.one_line())
            return 2
        _error(e.one_line() + ("" if debug else " (run with --debug for the traceback)"))
        return 1
    if isinstance(e, (UserError, CatalogLocked, ContractError)):
        _error(str(e))
        return 2
    _error(f"{type(e).__name__}: {e}" + ("" if debug else " (run with --debug for the traceback)"))
    return 1


def entry() -> None:
    """The console script: main's code as the exit status; a Ctrl-C between main returning and the exit
    is still exit 130, never a death by SIGINT."""
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    if code == 130:
        _exit_after_interrupt(code)
    raise SystemExit(code)


def _exit_after_interrupt(code: int) -> None:
    """After a Ctrl-C, once the run is recorded as interrupted and its one line printed, exit without the
    interpreter's teardown: an interrupted stage can leave DuckDB objects referenced from its frames, and
    DuckDB's bindings (nanobind) can then print ~40 lines of "leaked instance" at teardown, after our one
    line (tests/test_crash.py). Nothing of ours runs at teardown.

    The exit handlers run first (Prefect's temporary server stops there, temporary folders go) -- unless a
    stage thread lingers: a Ray run's thread still blocked in ``ray.get`` on a shard (or on the future of a
    stage that will never run) can keep the interpreter from exiting for ever. Then exit at once, skipping the handlers, as a kill would; what the run
    started dies with it (the Ray cluster's watchdog, the children's parent-death signal), as after a
    kill -9 (tests/test_ray.py)."""
    import atexit
    import threading

    if not any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        atexit._run_exitfuncs()  # what interpreter shutdown would run first; then only the teardown is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
