"""Config errors through the real command: does every bad config fail fast, cleanly, and say why?

    .venv/bin/python bench/config_errors.py [--out bench/results/config_errors.json] [--only SUBSTRING]
                                            [--timeout 300] [--keep-stores]

Runs ``.venv/bin/irflow run CONFIG [--set ...] [--from ...] --store <fresh tmp dir>`` as a subprocess
(HF_HUB_OFFLINE=1, no PREFECT_API_URL) once per case:

- every case of the ``BAD`` list in tests/test_config.py (bad keys, types, ranges, enum values, the
  GPL recipe's cross-stage rules, malformed ``--set``), read from that file with ``ast`` (not
  imported), each with the message fragments the test expects;
- ``--from bm25_serach`` (an unknown stage);
- models that cannot be had: a model directory that does not exist (``train.model``,
  ``mine.miners.1.model``, ``dense.model`` of the baselines recipe) and a hub id offline;
- ``runtime.device=cuda`` (when torch sees no CUDA device);
- config files that are not configs: missing, invalid YAML, no ``flow`` key.

Per case it records the command, the exit code, the seconds until the process exited, whether
stderr holds a Python traceback, whether the store directory was created (and what is in it), the
message (the stderr lines starting ``irflow: error:`` and the indented lines after each) and, where
the test gives them, whether the message holds the expected fragments. Expected: exit code 2, no
traceback, the fragments present. Prints a markdown table (case | rc | s | message) and a summary;
writes the JSON. Cheap: each case is one irflow start-up (a few seconds), nothing is computed.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import harness
from harness import ROOT

DEMO = str(ROOT / "configs" / "demo.yaml")
BASELINES = str(ROOT / "configs" / "demo_baselines.yaml")
TEST_FILE = ROOT / "tests" / "test_config.py"


def bad_cases_from_tests() -> list[dict]:
    """The BAD list of tests/test_config.py: [(config, overrides, fragments)]. The file is parsed, not
    imported; BAD is evaluated with the file's own top-level constants before it (``ROCKETQA =
    str(REPO / "configs" / ...)``, with REPO this checkout), so a config the tests add is found here too."""
    tree = ast.parse(TEST_FILE.read_text())
    names: dict = {"REPO": ROOT}
    for node in tree.body:
        if not isinstance(node, ast.Assign) or not all(isinstance(t, ast.Name) for t in node.targets):
            continue
        targets = [t.id for t in node.targets]
        try:
            value = eval(compile(ast.Expression(node.value), str(TEST_FILE), "eval"),  # noqa: S307 -- our own file
                         {"__builtins__": {"str": str}}, names)
        except Exception:
            if "BAD" in targets:
                raise
            continue  # a top-level value that needs more than paths (REPO's own, fixtures): not one BAD uses
        if "BAD" in targets:
            return [{"config": cfg, "sets": list(sets), "from": [], "expect": list(frags), "origin": "tests BAD"}
                    for cfg, sets, frags in value]
        names.update(dict.fromkeys(targets, value))
    raise SystemExit(f"{TEST_FILE}: no BAD list found")


def extra_cases(tmp: Path) -> list[dict]:
    invalid_yaml = tmp / "invalid.yaml"
    invalid_yaml.write_text("flow: gpl\ntrain: {lr: 2e-5\n")
    no_flow = tmp / "no_flow.yaml"
    no_flow.write_text("dataset: {source: irflow/samples/scifact-sample.zip}\n")
    cases = [
        {"config": DEMO, "sets": [], "from": ["bm25_serach"],
         "expect": ["--from bm25_serach (did you mean bm25_search?)", "pseudo_label"]},
        {"config": DEMO, "sets": ["train.model=/no/such/model"], "from": [],
         "expect": ["train.model: model directory '/no/such/model' does not exist"]},
        {"config": DEMO, "sets": ["mine.miners.1.model=/no/such/model"], "from": [],
         "expect": ["mine.miners.1.model: model directory"]},
        {"config": BASELINES, "sets": ["dense.model=./no/such/model"], "from": [],
         "expect": ["dense.model: model directory './no/such/model' does not exist"]},
        {"config": DEMO, "sets": ["train.model=BeIR/no-such-model"], "from": [],
         "expect": ["train.model: model 'BeIR/no-such-model' is not available here"]},
        {"config": DEMO, "sets": ["runtime.device=cuda"], "from": [],
         "expect": ["runtime.device: 'cuda', but torch sees no CUDA device"]},
        {"config": str(tmp / "no_such_config.yaml"), "sets": [], "from": [], "expect": ["no such config file"]},
        {"config": str(invalid_yaml), "sets": [], "from": [], "expect": ["invalid YAML"]},
        {"config": str(no_flow), "sets": [], "from": [], "expect": ["flow"]},
    ]
    for c in cases:
        c["origin"] = "bench"
    return cases


def case_name(c: dict) -> str:
    parts = [Path(c["config"]).name] + [f"--set {s}" for s in c["sets"]] + [f"--from {f}" for f in c["from"]]
    return " ".join(parts)


def error_message(stderr: str) -> list[str]:
    """Each `irflow: error:` line and the indented lines right after it."""
    out, inside = [], False
    for line in stderr.splitlines():
        if line.startswith("irflow: error:"):
            out.append(line)
            inside = True
        elif inside and line[:1] in (" ", "\t") and line.strip():
            out.append(line)
        else:
            inside = False
    return out


def run_case(c: dict, work: Path, index: int, timeout: float, env: dict) -> dict:
    store = work / f"case{index:02d}" / "store"
    cmd = [str(harness.IRFLOW), "run", c["config"]]
    for s in c["sets"]:
        cmd += ["--set", s]
    for f in c["from"]:
        cmd += ["--from", f]
    cmd += ["--store", str(store)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    seconds = time.perf_counter() - t0
    message = error_message(stderr)
    text = "\n".join(message)
    missing = [f for f in c["expect"] if f not in text]
    created = store.exists()
    row = {
        "case": case_name(c), "origin": c["origin"], "command": cmd, "rc": rc, "seconds": round(seconds, 2),
        "traceback": "Traceback (most recent call last)" in stderr, "store_created": created,
        "store_contents": sorted(str(p.relative_to(store)) for p in store.rglob("*")) if created else [],
        "message": message, "expected_fragments": c["expect"], "missing_fragments": missing,
        "error_lines": sum(ln.startswith("irflow: error:") for ln in stderr.splitlines()),
    }
    row["ok"] = rc == 2 and not row["traceback"] and not missing and row["error_lines"] == 1
    if not row["ok"]:
        row["stderr_tail"] = stderr[-4000:]
        row["stdout_tail"] = stdout[-2000:]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "config_errors.json"))
    ap.add_argument("--only", help="run only the cases whose name contains this")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a case is killed")
    ap.add_argument("--keep-stores", action="store_true", help="keep the temporary stores (to inspect them)")
    args = ap.parse_args()

    env = harness.cli_env()
    work = Path(tempfile.mkdtemp(prefix="irflow-config-errors-"))
    try:
        cases = bad_cases_from_tests() + extra_cases(work)
        if args.only:
            cases = [c for c in cases if args.only in case_name(c)]
        rows = []
        for i, c in enumerate(cases):
            row = run_case(c, work, i, args.timeout, env)
            rows.append(row)
            harness.log(f"[{i + 1}/{len(cases)}] rc={row['rc']} {row['seconds']:.1f}s {'ok ' if row['ok'] else 'BAD'} "
                        f"{row['case']}")
    finally:
        if not args.keep_stores:
            shutil.rmtree(work, ignore_errors=True)

    bad = [r for r in rows if not r["ok"]]
    report = {
        "benchmark": "config_errors",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "irflow run CONFIG [--set ...] [--from ...] --store <fresh dir>  (HF_HUB_OFFLINE=1)",
        "expected": "rc 2, no traceback, one 'irflow: error:' line (indented continuation lines allowed), "
                    "the test's expected fragments in the message",
        "cases": len(rows), "ok": len(rows) - len(bad), "not_ok": [r["case"] for r in bad],
        "store_created": [r["case"] for r in rows if r["store_created"]],
        "seconds": {"min": min((r["seconds"] for r in rows), default=None),
                    "max": max((r["seconds"] for r in rows), default=None),
                    "total": round(sum(r["seconds"] for r in rows), 1)},
        "loadavg_end": harness.loadavg(),
        "rows": rows,
    }
    out = harness.write_json(args.out, report)

    harness.table(["case", "rc", "s", "message"],
                  [[r["case"], r["rc"], f"{r['seconds']:.1f}",
                    "\n".join(m.removeprefix("irflow: error: ") for m in r["message"]) or "(no irflow: error line)"]
                   for r in rows])
    print(f"\n{report['ok']} of {len(rows)} cases exit 2 with one error message, no traceback and the expected "
          f"fragments.")
    for r in bad:
        why = []
        if r["rc"] != 2:
            why.append(f"rc {r['rc']}")
        if r["traceback"]:
            why.append("traceback on stderr")
        if r["error_lines"] != 1:
            why.append(f"{r['error_lines']} 'irflow: error:' lines")
        if r["missing_fragments"]:
            why.append(f"missing {r['missing_fragments']}")
        print(f"NOT OK: {r['case']}: {'; '.join(why)}")
    if report["store_created"]:
        print(f"store directory created (nothing computed) by {len(report['store_created'])} case(s): "
              + "; ".join(report["store_created"]))
    print(f"wrote {out}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
