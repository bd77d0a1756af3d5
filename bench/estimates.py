"""`irflow new`'s estimates against what a run measured, stage by stage.

For a finished run (its store and run id): the estimate ``irflow.tools.estimate`` gives for each stage the run
computed, on the run's own config and corpus, beside the seconds the catalog recorded; the ratio per
stage and in all. With ``--new CORPUS``, first writes a config with `irflow new gpl` (a query log with
``--query-log``) and runs it, so the whole path a user takes is measured.

    python bench/estimates.py --new irflow/samples/scifact-sample/corpus.jsonl --query-log log.txt \\
        --budget-minutes 5 --store /tmp/est --out bench/results/estimates_sample.json
    python bench/estimates.py --store /work/bench-own/scifact --run RUN_ID --out bench/results/estimates_scifact.json

With ``--series``, the runs of ``SERIES`` one after another in one fresh store, each started with ``irflow run`` as a
user starts it: the first calibrates the store (the estimate after it uses the rates this store measured
here), the others are scored: each computed stage's printed estimate (the catalog's ``estimates``: what the
user read before the run) against its measured seconds, with the load it ran under, when the run said it
would overrun (``overrun_said_at_share``) and the load warning its estimate printed; the JSON is rewritten after
every run. ``--compete CMD`` runs it beside one competing run (started after the calibration run, on free
cores; stopped after the last run).

    python bench/estimates.py --series --store /tmp/est-series --out bench/results/estimates_series_idle.json
    python bench/estimates.py --series "gpl, 80 steps, no qgen" ance --store /tmp/est-loaded \
        --compete "python -m irflow.cli run configs/demo.yaml --store /tmp/rival --set train.steps=3000" --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (sets the offline environment first)


def compare(store: Path, run_id: str) -> dict:
    from irflow import api
    from irflow.tools import estimate

    catalog = api.catalog(store)
    run = catalog.run(run_id)
    config = run["config"] if isinstance(run["config"], dict) else json.loads(run["config"])
    c = api.load_config(config)
    # every stage of the run, with the seconds of the run that computed it (this one, or an earlier one whose
    # result it reused: a bench run that was restarted)
    computed, params, queries, loads, inputs, keys = {}, {}, {}, {}, {}, set()
    with catalog.connect() as con:
        for s in catalog.stage_runs(run_id):
            if s["cache_key"] in keys:  # a second label of one computation (the first one's seconds are its)
                continue
            keys.add(s["cache_key"])
            row = con.execute("SELECT seconds, detail, runtime FROM stage_runs WHERE cache_key = ? AND status = "
                              "'computed' ORDER BY started_at DESC LIMIT 1", [s["cache_key"]]).fetchone()
            if row:
                computed[s["name"]] = row[0]
                loads[s["name"]] = (json.loads(row[2]) if row[2] else {}).get("load")  # [at start, at end]
                detail = json.loads(row[1])
                params[s["name"]] = detail.get("cfg") or {}
                # as the plan gave them before the run: a dataset one of its stages made is "<stage:name>"
                inputs[s["name"]] = {role: [planned(catalog, i) for i in ids]
                                     for role, ids in (detail.get("inputs") or {}).items()}
                ids = detail.get("inputs", {}).get("queries") or []
                if len(ids) == 1 and (d := catalog.dataset(ids[0])):
                    queries[s["name"]] = d["num_rows"]
    hw = estimate.hardware()
    size = estimate.corpus_size(c.dataset, model=estimate.student_model(c))
    rows = estimate.estimate(c, list(computed), size, hw, params, queries, inputs)
    print(estimate.format_estimates(rows, hw, computed))
    total_est = sum(r.seconds for r in rows)
    total = sum(computed.values())
    heavy = [r for r in rows if r.seconds >= 30 or computed[r.stage] >= 30]
    return {"run_id": run_id, "hardware": hw.__dict__, "corpus": {"passages": size.passages, "mean_words": size.mean_words,
                                                             "queries": size.queries, "train_pairs": size.train_pairs(),
                                                             "train_queries": len(size.train_positives)},
            "stages": [{"stage": r.stage, "estimate_s": r.seconds, "measured_s": computed[r.stage],
                        "ratio": round(computed[r.stage] / r.seconds, 2) if r.seconds else None, "work": r.work,
                        "estimate_peak_mb": r.peak_mb, "load": loads.get(r.stage)} for r in rows],
            "total": {"estimate_s": round(total_est, 1), "measured_s": round(total, 1),
                      "ratio": round(total / total_est, 2) if total_est else None},
            "stages_over_30s": [{"stage": r.stage, "ratio": round(computed[r.stage] / r.seconds, 2)} for r in heavy]}


def planned(catalog, dataset_id: str) -> str:
    """A stored dataset's id as a plan names it before it is made: ``<train_student[gpl]:student>``."""
    row = catalog.dataset(dataset_id)
    return f"<{row['stage']}:{row['name']}>" if row and row.get("stage") not in (None, "external") else dataset_id


SAMPLE = "irflow/samples/scifact-sample.zip"
ON_SAMPLE = [f"dataset={{name: scifact-sample, source: {SAMPLE}, split: test}}"]
# (name, config, --set overrides): recipes and sizes a user of the sample runs, the shorter first; the first
# calibrates
SERIES = [
    ("calibration: gpl demo", "configs/demo.yaml", []),
    ("baselines", "configs/demo_baselines.yaml", []),
    ("gpl, 80 steps, no qgen", "configs/demo.yaml", ["train.steps=80", "train.qgen.enabled=false"]),
    ("gpl, listwise loss", "configs/demo.yaml", ["train.loss=listwise_kl", "train.qgen.enabled=false"]),
    ("contriever", "configs/contriever_scifact.yaml", ON_SAMPLE + ["train.steps=40", "train.moco.queue_size=256"]),
    ("gpl, own documents (irflow new --budget-minutes 4)", "new:4", []),
    ("gpl, ict queries", "configs/demo.yaml", ["generate={source: ict, queries_per_passage: 1}", "train.steps=40",
                                               "train.qgen.enabled=false"]),
    ("star + adore", "configs/star_scifact.yaml", ON_SAMPLE + ["star.epochs=1", "adore.epochs=1"]),
    ("ance", "configs/ance_demo.yaml", ["rounds=1"]),
    ("rocketqa", "configs/rocketqa_demo.yaml", []),
]


def printed(store: Path, run_id: str) -> dict:
    """Each stage the run computed: the estimate ``irflow run`` printed before it (calibrated, when the store had
    measured this hardware) against the seconds it took, and the load average at its start and end."""
    from irflow import api

    catalog = api.catalog(store)
    with catalog.connect(read_only=True) as con:
        rows = con.execute("SELECT e.stage, e.seconds, e.prior, s.seconds, s.runtime, e.load FROM estimates e JOIN "
                           "stage_runs s ON e.run_id = s.run_id AND e.stage = s.stage WHERE e.run_id = ? AND "
                           "s.status = 'computed' ORDER BY s.started_at", [run_id]).fetchall()
    stages = [{"stage": st, "estimate_s": est, "prior_s": prior, "measured_s": round(sec, 1),
               "ratio": round(sec / est, 2) if est else None, "load": (json.loads(rt) if rt else {}).get("load")}
              for st, est, prior, sec, rt, _ in rows]
    total_est, total = sum(s["estimate_s"] for s in stages), sum(s["measured_s"] for s in stages)
    return {"run_id": run_id, "load_at_estimate": rows[0][5] if rows else None, "stages": stages,
            "total": {"estimate_s": round(total_est, 1), "measured_s": round(total, 1),
                      "ratio": round(total / total_est, 2) if total_est else None}}


def run_series(store: Path, out_path: str, only: list[str] | None = None, compete: str | None = None,
               also_set: list[str] | None = None, compete_wait: float = 30.0) -> dict:
    """``compete``: a shell command started after the calibration run (on free cores), ``compete_wait`` seconds
    before the next run, and stopped after the last run: the series beside one competing run. ``also_set``:
    settings added to every run but the calibration (another cache key for the same work, or the threads)."""
    import shlex
    import signal
    import subprocess

    cmd = [sys.executable, "-m", "irflow.cli"]
    out = {"machine": harness.machine(), "store": str(store), "runs": [], "competing": compete}
    rival = None
    try:
        for name, config, sets in SERIES:
            if only and name not in only and not name.startswith("calibration"):
                continue
            if compete and rival is None and not name.startswith("calibration"):
                rival = subprocess.Popen(shlex.split(compete), env=harness.cli_env(), cwd=harness.ROOT,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
                time.sleep(compete_wait)  # the competitor past its start-up, at its steady load
            extra = [] if name.startswith("calibration") else list(also_set or [])
            _series_run(store, out, out_path, cmd, name + "".join(f" [{s}]" for s in extra), config, sets + extra)
    finally:
        if rival is not None:
            os.killpg(rival.pid, signal.SIGTERM)
            rival.wait()
    return out


def _series_run(store: Path, out: dict, out_path: str, cmd: list[str], name: str, config: str,
                sets: list[str]) -> None:
    """One run of the series, as a user starts it, its printed estimate against its stages' seconds."""
    import subprocess
    import tempfile
    import zipfile

    if config.startswith("new:"):  # your own documents: the sample's corpus as a file, `irflow new` sizes it
        docs = Path(tempfile.mkdtemp()) / "corpus.jsonl"
        with zipfile.ZipFile(harness.ROOT / SAMPLE) as z:
            docs.write_bytes(z.read(next(n for n in z.namelist() if n.endswith("corpus.jsonl"))))
        budget, config = config.split(":")[1], str(store.parent / f"{store.name}-new.yaml")
        subprocess.run(cmd + ["new", "gpl", "--corpus", str(docs), "--budget-minutes", budget, "--out", config,
                              "--force", "--store", str(store)], check=True, env=harness.cli_env(),
                       cwd=harness.ROOT)
    argv = cmd + ["run", config, "--store", str(store), "--json"] + [a for s in sets for a in ("--set", s)]
    load_before = harness.loadavg()
    done = run_watched(argv)
    if done["returncode"]:
        print(done["stderr"][-3000:])
        out["runs"].append({"name": name, "failed": done["stderr"][-1500:]})
        return
    run_id = json.loads(done["stdout"].strip().splitlines()[-1])["run_id"]
    row = {"name": name, "config": config, "set": sets, "wall_s": done["wall_s"], "load_before": load_before,
           "load_after": harness.loadavg(), **{k: done[k] for k in WATCHED}, **printed(store, run_id)}
    out["runs"].append(row)
    print(f"{name}: {len(row['stages'])} stages, estimate {row['total']['estimate_s']} s, measured "
          f"{row['total']['measured_s']} s ({row['total']['ratio']}x), load {load_before} -> {row['load_after']}")
    summarise_series(store, out)
    harness.write_json(out_path, out)


WATCHED = ("overrun_said_at_s", "overrun_said_at_share", "overrun_message", "load_warning")


def run_watched(argv: list[str]) -> dict:
    """``irflow run`` as a user runs it, its stderr read as it comes: when (seconds from the start, share of the
    run) it first said it would overrun its estimate, and the load warning its estimate printed."""
    import subprocess
    import threading

    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=harness.cli_env(),
                            cwd=harness.ROOT)
    lines: list[str] = []
    said: list[tuple[float, str]] = []

    def watch() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "slower than its estimate" in line and not said:  # after a progress bar's text on its line
                said.append((round(time.time() - t0, 1), line[line.find("this run is going"):].strip()))
    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    stdout = proc.stdout.read()
    proc.wait()
    reader.join(5)
    wall = time.time() - t0
    warning = next((ln.strip() for ln in lines if "other processes keep" in ln), None)
    return {"returncode": proc.returncode, "stdout": stdout, "stderr": "".join(lines), "wall_s": round(wall, 1),
            "overrun_said_at_s": said[0][0] if said else None,
            "overrun_said_at_share": round(said[0][0] / wall, 3) if said else None,
            "overrun_message": said[0][1] if said else None, "load_warning": warning}


def replayed_calibration(store: Path, runs: list[dict], now: bool = False) -> dict:
    """Each scored run's stages estimated as the calibration would have estimated them from the runs before it in
    the store (the first, the calibration run, included): ``estimate.calibration_from`` over the earlier stage
    runs. The estimate-time check is left out (``load`` None): before ``runtime.others_busy`` it read the
    one-minute load average, in which the run just before still counted. ``now``: every stage's prior as this
    checkout's estimate makes it from the stage's stored params (``compare``), not as the run printed it."""
    from irflow import api
    from irflow.tools import estimate as est

    cores = est.hardware().cores
    with api.catalog(store).connect(read_only=True) as con:
        rows = con.execute("SELECT e.run_id, e.stage, e.kind, e.prior, s.seconds, s.runtime FROM estimates e JOIN "
                           "stage_runs s ON e.run_id = s.run_id AND e.stage = s.stage WHERE s.status = 'computed' "
                           "ORDER BY s.started_at").fetchall()
    names = {r["run_id"]: r["name"] for r in runs if r.get("stages") and not r["name"].startswith("calibration")}
    if now:
        priors = {(x["run_id"], st["stage"]): st["estimate_s"]
                  for x in (compare(store, r) for r in dict.fromkeys(x[0] for x in rows)) for st in x["stages"]}
        rows = [(r_id, stage, kind, priors.get((r_id, stage), prior), sec, rt)
                for r_id, stage, kind, prior, sec, rt in rows]
    seen: list[dict] = []
    out = {}
    for run_id in dict.fromkeys(x[0] for x in rows):  # every run of the store, in the order they ran
        mine = [{"stage": stage, "kind": kind, "prior": prior, "measured": sec, "load": None,
                 "runtime": json.loads(rt) if rt else {}} for r_id, stage, kind, prior, sec, rt in rows if r_id == run_id]
        if run_id in names:
            calibrated = est.calibration_from(seen, cores)
            stages = []
            for r in mine:
                figure = r["prior"] * (f[1] if calibrated and (
                    f := calibrated.factor(est.StageEstimate(r["stage"], r["prior"], 0, "", r["kind"]))) else 1.0)
                stages.append({"stage": r["stage"], "kind": r["kind"], "estimate_s": round(figure, 1),
                               "measured_s": round(r["measured"], 1),
                               "ratio": round(r["measured"] / figure, 2) if figure else None})
            total = {"estimate_s": round(sum(x["estimate_s"] for x in stages), 1),
                     "measured_s": round(sum(x["measured_s"] for x in stages), 1)}
            total["ratio"] = round(total["measured_s"] / total["estimate_s"], 2) if total["estimate_s"] else None
            out[names[run_id]] = {"factors": {k: round(v, 2) for k, (v, _) in (calibrated.factors.items()
                                                                               if calibrated else ())},
                                  "stages": stages, "total": total}
        seen += mine  # what the runs after it calibrate by
    return out


def summarise(runs: list[dict], key: str = "run_id") -> dict:
    """Over several runs: the median measured / estimated of the stages that took 10 s or more (either way) and
    how many lie within the goal's 0.8-1.25, each run's total ratio (by ``key``) and how many lie within
    0.67-1.5, and the mean load the stages ran under (the load average at their start and end)."""
    import statistics

    stages = [s for r in runs for s in r["stages"] if s["ratio"] and max(s["measured_s"], s["estimate_s"]) >= 10]
    loads = [sum(s["load"]) / 2 for s in stages if s.get("load") and None not in s["load"]]
    totals = {r[key]: r["total"]["ratio"] for r in runs}
    return {"runs": len(runs), "stages_10s_or_more": len(stages),
            "median_stage_ratio": round(statistics.median(s["ratio"] for s in stages), 2) if stages else None,
            "stages_within_0.8_1.25": sum(0.8 <= s["ratio"] <= 1.25 for s in stages),
            "totals": totals, "totals_within_0.67_1.5": sum(0.67 <= t <= 1.5 for t in totals.values() if t),
            "mean_load_of_those_stages": round(sum(loads) / len(loads), 2) if loads else None}


def summarise_series(store: Path, out: dict) -> None:
    """The series' summaries: of the scored runs as printed, and as the calibration would have estimated them."""
    scored = [r for r in out["runs"] if "stages" in r and not r["name"].startswith("calibration")]
    out["summary"] = summarise(scored, key="name")
    # when each run said it would overrun (a share of its wall time; None: it did not), and its load warning
    out["summary"]["overrun_said_at_share"] = {r["name"]: r.get("overrun_said_at_share") for r in scored}
    out["summary"]["load_warned"] = sum(bool(r.get("load_warning")) for r in scored)
    out["replayed_calibration"] = replayed_calibration(store, out["runs"])
    out["summary_replayed_calibration"] = summarise([{"name": n, **v} for n, v in out["replayed_calibration"].items()],
                                                    key="name")
    out["replayed_calibration_now"] = replayed_calibration(store, out["runs"], now=True)
    out["summary_replayed_calibration_now"] = summarise(
        [{"name": n, **v} for n, v in out["replayed_calibration_now"].items()], key="name")


def replay_pace(store: Path, run_id: str) -> dict:
    """When ``irflow.engine.pace`` says the overrun, replayed on a finished run's recorded stage starts and
    seconds against the estimate the run was given (the catalog's ``estimates``), second by second: the
    rule as it is now, on a run measured before it changed. A training reports its steps as it goes: replayed
    as steps at an even pace over its recorded seconds."""
    from irflow import api
    from irflow.engine import pace

    catalog = api.catalog(store)
    with catalog.connect(read_only=True) as con:
        expected = dict(con.execute("SELECT stage, seconds FROM estimates WHERE run_id = ?", [run_id]).fetchall())
        rows = con.execute("SELECT stage, epoch(started_at), seconds FROM stage_runs WHERE run_id = ? AND status = "
                           "'computed' ORDER BY started_at", [run_id]).fetchall()
        begun, ended = con.execute("SELECT epoch(started_at), epoch(finished_at) FROM runs WHERE run_id = ?",
                                   [run_id]).fetchone()
    p = pace.Pace(expected, started=begun)
    events = sorted([(t0, "start", st, 0.0) for st, t0, _ in rows] + [(t0 + sec, "done", st, sec) for st, t0, sec in rows])
    t, said_at = begun, None
    while t <= ended and said_at is None:
        while events and events[0][0] <= t:
            _, kind, st, sec = events.pop(0)
            said = p.stage_started(st, now=t) if kind == "start" else p.stage_done(st, sec, now=t)
            if said:
                said_at = t
        for st, t0, sec in rows:
            if said_at is None and st.startswith("train_") and t0 <= t < t0 + sec and st in p.running:
                said_at = t if p.stage_progress(st, (t - t0) / sec, now=t) else None
        if said_at is None and p.check(now=t):
            said_at = t
        t += 1.0
    wall = ended - begun
    return {"run_id": run_id, "wall_s": round(wall, 1), "said_at_s": round(said_at - begun, 1) if said_at else None,
            "said_at_share": round((said_at - begun) / wall, 3) if said_at else None, "message": p.said}


def run_as_a_user(corpus: str, query_log: str | None, budget: float, store: Path) -> dict:
    """`irflow new gpl --budget-minutes N --store STORE` (calibrated by what the store measured here), then
    `irflow run`, as a user runs them: the whole run's wall time against the budget, and when (if ever) the run
    said it would overrun, as seconds from its start and as a share of the run."""
    import subprocess

    cfg = store.parent / f"{store.name}-new.yaml"
    cmd = [sys.executable, "-m", "irflow.cli"]
    new = cmd + ["new", "gpl", "--corpus", corpus, "--budget-minutes", str(budget), "--out", str(cfg), "--force",
                 "--store", str(store)] + (["--query-log", query_log] if query_log else [])
    made = subprocess.run(new, capture_output=True, text=True, env=harness.cli_env(), cwd=harness.ROOT)
    print(made.stdout[-3000:], made.stderr[-2000:])
    made.check_returncode()
    load_before = harness.loadavg()
    done = run_watched(cmd + ["run", str(cfg), "--store", str(store), "--json"])
    if done["returncode"]:
        raise SystemExit(done["stderr"][-6000:])
    out, wall = done["stdout"], done["wall_s"]
    result = json.loads(out.strip().splitlines()[-1])
    return {"run_id": result["run_id"], "budget_s": budget * 60, "wall_s": round(wall, 1),
            "wall_vs_budget": round(wall / (budget * 60), 2), "load_before": load_before,
            "load_after": harness.loadavg(), **{k: done[k] for k in WATCHED}, "new_output": made.stdout[-4000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", nargs="+", help="finished runs' ids (default: with --new, the run it makes); several: "
                                            "each compared, then summarised together")
    ap.add_argument("--new", metavar="CORPUS", help="`irflow new gpl --corpus CORPUS --store STORE` then `irflow "
                                                    "run`, as a user runs them")
    ap.add_argument("--query-log")
    ap.add_argument("--budget-minutes", type=float, default=10)
    ap.add_argument("--replay-pace", action="store_true", help="with --run: when the overrun rule as it is now "
                                                                 "would have spoken, replayed on the run's records")
    ap.add_argument("--series", nargs="*", metavar="NAME", help="the SERIES of runs (or those named, after the "
                                                                "calibration) in one store, estimate vs measured")
    ap.add_argument("--compete", metavar="CMD", help="with --series: a competing command, started after the "
                                                     "calibration run and stopped after the last run")
    ap.add_argument("--also-set", nargs="+", metavar="KEY=VALUE", help="with --series: settings added to every "
                                                                         "run but the calibration")
    ap.add_argument("--compete-wait", type=float, default=30.0, help="with --compete: seconds between starting "
                                                                    "the competitor and the next run")
    ap.add_argument("--resummarise", action="store_true", help="with --out of a --series run: its summaries again")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    store = Path(args.store)
    if args.resummarise:  # the series' summaries again on its stored runs (the store must still be there)
        out = json.loads(Path(args.out).read_text())
        summarise_series(store, out)
        harness.write_json(args.out, out)
        print(json.dumps({k: out[k] for k in ("summary", "summary_replayed_calibration",
                                              "summary_replayed_calibration_now")}, indent=1))
        return
    if args.series is not None:
        out = run_series(store, args.out, args.series or None, args.compete, args.also_set, args.compete_wait)
        print(json.dumps(out.get("summary"), indent=1))
        return
    if args.replay_pace:
        out = {"replays": [replay_pace(store, r) for r in args.run], "machine": harness.machine()}
        harness.write_json(args.out, out)
        print(json.dumps(out["replays"], indent=1))
        return
    user = None
    if args.new:
        user = run_as_a_user(args.new, args.query_log, args.budget_minutes, store)
        args.run = [user["run_id"]]
    if len(args.run) > 1:
        runs = [compare(store, r) for r in args.run]
        out = {"runs": runs, "summary": summarise(runs), "machine": harness.machine()}
        harness.write_json(args.out, out)
        print(json.dumps(out["summary"], indent=1))
        return
    out = compare(store, args.run[0])
    if user:
        out["as_a_user"] = user
        print(f"whole run: {user['wall_s']} s for a budget of {user['budget_s']:.0f} s "
              f"({user['wall_vs_budget']}x); overrun said at {user['overrun_said_at_s']} s "
              f"({user['overrun_said_at_share']} of the run); load {user['load_before']} -> {user['load_after']}")
    out["machine"] = harness.machine()
    harness.write_json(args.out, out)
    print(f"total: estimate {out['total']['estimate_s']} s, measured {out['total']['measured_s']} s "
          f"(ratio {out['total']['ratio']})")


if __name__ == "__main__":
    main()
