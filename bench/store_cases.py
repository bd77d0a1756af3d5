"""The store's robustness cases, each run the way a user would, against a checkout of irflow: run it
on a checkout from before a change (`--checkout DIR`, e.g. a git worktree) and on this one to get a
before -> after table.

    .venv/bin/python bench/store_cases.py [--checkout DIR] [--cases swap,flip,...] --out bench/results/store_cases_after.json

Every case uses the baselines flow on a small real SciFact slice (20 test queries, 400 documents)
with a tiny local bi-encoder, so a cold run takes ~30 s: the behaviour, not the scale, is the point.
Each case prints one line: what happened.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import yaml

import harness

PY = sys.executable


class Cli:
    def __init__(self, checkout: Path, work: Path):
        self.checkout, self.work = checkout, work

    def env(self) -> dict:
        return {**harness.cli_env(), "PYTHONPATH": str(self.checkout), "PYTHONUNBUFFERED": "1"}

    def cmd(self, *args) -> list[str]:
        return [PY, "-m", "irflow.cli", *map(str, args)]

    def __call__(self, *args, timeout=900) -> tuple[int, str, str]:
        p = subprocess.run(self.cmd(*args), env=self.env(), cwd=self.work, capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout, p.stderr

    def popen(self, *args, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(*args), env=self.env(), cwd=self.work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def run_json(self, config, store, *extra) -> dict:
        code, out, err = self("run", config, "--store", store, "--json", *extra)
        if code != 0:
            return {"rc": code, "error": err.strip().splitlines()[-1] if err.strip() else ""}
        r = json.loads(out.strip().splitlines()[-1])
        r["rc"], r["stderr"] = 0, err
        return r


def ndcg(result: dict, system: str) -> float | None:
    return next((m["ndcg@10"] for m in result.get("metrics", []) if m["system"] == system), None)


def computed(result: dict) -> int:
    return sum(s["status"] == "computed" for s in result.get("stages", []))


def chmod_w(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def object_of(result: dict, stage: str) -> str:
    return next(iter(next(s for s in result["stages"] if s["name"] == stage)["outputs"].values()))


def descendants(pid: int) -> dict[int, str]:
    out = {}
    for c in harness.descendants(pid):
        try:
            out[c] = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            out[c] = "?"
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(p: subprocess.Popen, pred, timeout=300) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(p.stderr.readline, "")), daemon=True).start()
    t0 = time.monotonic()
    while not pred(lines, p.pid) and time.monotonic() - t0 < timeout and p.poll() is None:
        time.sleep(0.05)
    return lines


# ---- cases ------------------------------------------------------------------------------------------
def case_swap(cli, fx):
    s = fx.work / "swap"
    cold = cli.run_json(fx.config, s)
    bm25, dense = object_of(cold, "bm25_search[flat]"), object_of(cold, "dense_search[zero-shot]")
    f = s / "objects" / bm25 / "data.parquet"
    chmod_w(s / "objects" / bm25)
    shutil.copy(s / "objects" / dense / "data.parquet", f)
    again = cli.run_json(fx.config, s)
    forced = cli.run_json(fx.config, s, "--from", "bm25_search")
    from irflow.engine.store import fingerprint_dir
    intact = fingerprint_dir(s / "objects" / bm25).startswith(bm25.rsplit("-", 1)[1])
    warned = "damaged" in again.get("stderr", "")
    def show(r):
        v = ndcg(r, "bm25-flat")
        return f"{v:.4f}" if v is not None else f"rc {r['rc']} {r.get('error', '')[:100]}"

    return (f"bm25-flat nDCG@10 {show(cold)} cold; after swapping in the dense run's file: "
            f"{show(again)} ({'warned, recomputed' if warned else 'no warning'}); "
            f"--from bm25_search: {show(forced)}, stored copy {'intact' if intact else 'still tampered'}")


def case_flip(cli, fx):
    s = fx.work / "flip"
    cold = cli.run_json(fx.config, s)
    bm25 = object_of(cold, "bm25_search[flat]")
    f = s / "objects" / bm25 / "data.parquet"
    chmod_w(s / "objects" / bm25)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        fh.write(bytes(64))
    again = cli.run_json(fx.config, s)
    if again["rc"]:
        return f"rc {again['rc']}: {again['error'][:160]}"
    warned = [ln for ln in again["stderr"].splitlines() if "damaged" in ln]
    return (f"rc 0, bm25-flat {ndcg(again, 'bm25-flat'):.4f} (cold {ndcg(cold, 'bm25-flat'):.4f}); "
            f"{warned[0].split('irflow ', 1)[-1][:150] if warned else 'no warning'}")


def case_read_only(cli, fx):
    s = fx.work / "ro"
    cold = cli.run_json(fx.config, s)
    f = s / "objects" / object_of(cold, "bm25_search[flat]") / "data.parquet"
    return f"stored data.parquet mode {oct(f.stat().st_mode & 0o777)}"


def case_move(cli, fx):
    s = fx.work / "mv"
    cli.run_json(fx.config, s)
    moved = fx.work / "mv-moved"
    shutil.move(str(s), str(moved))
    again = cli.run_json(fx.config, moved)
    return f"after mv: {computed(again)} of {len(again.get('stages', []))} stages recomputed (rc {again['rc']})"


def case_copy(cli, fx):
    s = fx.work / "cp"
    cold = cli.run_json(fx.config, s)
    copy = fx.work / "cp-copy"
    subprocess.run(["cp", "-a", str(s), str(copy)], check=True)
    code, out, _ = cli("sql", f"SELECT count(*) FILTER (WHERE path LIKE '{s}/%') AS into_original, "
                              f"count(*) FILTER (WHERE path LIKE 'objects/%') AS relative FROM datasets",
                       "--store", copy, "--json")
    rows = json.loads(out.strip().splitlines()[-1]) if code == 0 else [{}]
    chmod_w(s)
    shutil.rmtree(s)
    again = cli.run_json(fx.config, copy)
    return (f"copy's catalog: {rows[0].get('into_original')} paths into the original, {rows[0].get('relative')} "
            f"relative; original deleted, run on the copy: rc {again['rc']}, {computed(again)} recomputed, "
            f"nDCG {ndcg(again, 'bm25-flat')} vs {ndcg(cold, 'bm25-flat')}")


def case_kill(cli, fx):
    s = fx.work / "kill"
    p = cli.popen("run", fx.config, "--store", s)
    wait_for(p, lambda lines, pid: any("IndexCollection" in c for c in descendants(pid).values()))
    below = descendants(p.pid)
    p.kill()
    p.wait()
    time.sleep(5)
    survivors = [c for pid, c in below.items() if alive(pid)]
    tmp = sum(f.stat().st_size for f in (s / "tmp").rglob("*") if f.is_file())
    for pid in below:  # clean up what the old code leaves
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    again = cli.run_json(fx.config, s)
    left = sum(f.stat().st_size for f in (s / "tmp").rglob("*") if f.is_file())
    code, out, _ = cli("sql", "SELECT status, count(*) AS n FROM runs GROUP BY 1 ORDER BY 1", "--store", s, "--json")
    names = ", ".join("java (indexer)" if "IndexCollection" in c else "uvicorn (Prefect server)" if "uvicorn" in c
                      else c[:40] for c in survivors)
    return (f"{len(survivors)} of {len(below)} child processes survived 5 s ({names}); "
            f"tmp/ {tmp / 1e6:.2f} MB after the kill, {left / 1e6:.2f} MB after the next run (rc {again['rc']}); "
            f"runs: {json.loads(out.strip().splitlines()[-1]) if code == 0 else out}")


def case_concurrent(cli, fx):
    s = fx.work / "conc"
    a = cli.popen("run", fx.config, "--store", s, "--json")
    time.sleep(2)
    b = cli.popen("run", fx.config, "--store", s, "--json")
    outs = [p.communicate(timeout=900) for p in (a, b)]
    res = []
    for p, (out, err) in zip((a, b), outs):
        try:
            res.append(json.loads(out.strip().splitlines()[-1]))
        except (IndexError, json.JSONDecodeError):
            res.append({"rc": p.returncode, "error": err.strip().splitlines()[-1:] if err else ""})
    n_index = len(list((s / "objects").glob("bm25_index-*")))
    code, out, _ = cli("sql", "SELECT count(*) - count(DISTINCT (child_id, parent_id, role)) AS dup FROM edges",
                       "--store", s, "--json")
    dup = json.loads(out.strip().splitlines()[-1])[0]["dup"] if code == 0 else "?"
    per_run = [f"rc {p.returncode}, {computed(r)} computed" for p, r in zip((a, b), res)]
    return f"run 1: {per_run[0]}; run 2: {per_run[1]}; bm25_index objects: {n_index}; duplicate lineage edges: {dup}"


def _one_line(code, err) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return f"rc {code}, {len(lines)} stderr lines; last: {lines[-1][:170] if lines else ''}"


def case_no_split_qrels(cli, fx):
    d = fx.work / "nosplit"
    shutil.copytree(fx.data, d)
    (d / "qrels" / "test.tsv").unlink()
    cfg = fx.config_with(dataset={"name": "nosplit", "source": str(d), "split": "test"})
    return _one_line(*cli("run", cfg, "--store", fx.work / "nosplit-store")[::2])


def case_all_dangling(cli, fx):
    d = fx.work / "dangling"
    shutil.copytree(fx.data, d)
    lines = (d / "qrels" / "test.tsv").read_text().splitlines()
    (d / "qrels" / "test.tsv").write_text("\n".join([lines[0]] + [f"{ln.split()[0]}\tmissing-{i}\t1"
                                                                  for i, ln in enumerate(lines[1:])]) + "\n")
    cfg = fx.config_with(dataset={"name": "dangling", "source": str(d), "split": "test"})
    s = fx.work / "dangling-store"
    code, out, err = cli("run", cfg, "--store", s)
    n = len(list((s / "objects").glob("qrels-*"))) if (s / "objects").exists() else 0
    return _one_line(code, err) + f"; qrels objects published: {n}"


def case_md5(cli, fx):
    code, out, err = cli("config", fx.config, "--set", "dataset.md5=01234567890123456789012345678901", "--json")
    if code:
        return _one_line(code, err)
    return f"dataset.md5 = {json.loads(out)['dataset']['md5']!r}"


def case_two_datasets(cli, fx):
    z = fx.work / "two.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for name, src in (("scifact", fx.data), ("other", fx.data2)):
            for f in src.rglob("*"):
                if f.is_file():
                    zf.write(f, f"{name}/{f.relative_to(src)}")
    cfg = fx.config_with(dataset={"name": "two", "source": str(z), "split": "test"})
    s = fx.work / "two-store"
    code, out, err = cli("run", cfg, "--store", s)
    if code == 0:
        return f"rc 0: ran on a mix of both ({out.strip().splitlines()[-1][:120]})"
    return _one_line(code, err)


def case_lineage_missing(cli, fx):
    s = fx.work / "no-such-store"
    code, out, err = cli("lineage", "abc", "--store", s)
    return _one_line(code, err) + f"; store created: {s.exists()}"


def case_sql_multi(cli, fx):
    s = fx.work / "ro"
    code, out, err = cli("sql", "SELECT 1 AS first; SELECT 2 AS second", "--store", s, "--json")
    return f"rc {code}; printed: {' | '.join(out.strip().splitlines())[:120]}"


def case_sigint(cli, fx):
    s = fx.work / "sigint"
    p = cli.popen("run", fx.config, "--store", s, start_new_session=True)
    t0 = time.monotonic()
    lines = wait_for(p, lambda lines, pid: any("encode_corpus[zero-shot]: computing" in ln for ln in lines))
    time.sleep(0.5)
    n = len(lines)
    os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(timeout=60)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc = "hung > 60 s, killed"
    time.sleep(1)
    after = [ln for ln in lines[n:] if "%|" not in ln]
    return f"rc {rc}; {len(after)} stderr lines after Ctrl-C: {' / '.join(ln.strip() for ln in after[:3])[:160]}"


def case_dangling_default(cli, fx):
    d = fx.work / "some-dangling"
    shutil.copytree(fx.data, d)
    qrels = [ln.split("\t") for ln in (d / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    victims = sorted({q for q, _, _ in qrels})[:2]  # two queries lose every judged document
    gone = {doc for q, doc, _ in qrels if q in victims}
    corpus = [ln for ln in (d / "corpus.jsonl").read_text().splitlines() if json.loads(ln)["_id"] not in gone]
    (d / "corpus.jsonl").write_text("\n".join(corpus) + "\n")
    cfg = fx.config_with(dataset={"name": "some-dangling", "source": str(d), "split": "test"})
    r = cli.run_json(cfg, fx.work / "sd-store")
    m = next((m for m in r.get("metrics", []) if m["system"] == "bm25-flat"), {})
    return (f"bm25-flat nDCG@10 {m.get('ndcg@10')} over {m.get('num_queries')} queries "
            f"(no judged doc in corpus: {m.get('no_judged_doc', 'not reported')})")


CASES = {k[5:]: v for k, v in globals().items() if k.startswith("case_")}


class Fixture:
    def __init__(self, work: Path):
        from irflow.dev.testing import beir_slice, make_tiny_bi_encoder

        self.work = work
        shared = harness.DATASETS
        self.data = beir_slice(shared / "scifact.zip", work / "slice", n_test_queries=20, n_extra_docs=400, seed=2)
        self.data2 = beir_slice(shared / "nfcorpus.zip", work / "slice2", n_test_queries=5, n_extra_docs=20, seed=2)
        self.model = make_tiny_bi_encoder(work / "bi", normalize=True)
        self.base = {"flow": "baselines", "dataset": {"name": "slice", "source": str(self.data), "split": "test"},
                     "bm25": {"variants": ["flat"], "depth": 100},
                     "dense": {"model": str(self.model), "batch_size": 64, "depth": 100},
                     "runtime": {"threads": 1}}
        self.config = self.config_with()

    def config_with(self, **sections) -> Path:
        cfg = {**self.base, **sections}
        path = self.work / f"cfg-{abs(hash(json.dumps(cfg, sort_keys=True))) % 10**8}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", default=str(harness.ROOT), help="the irflow checkout whose CLI is tried")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="irflow-cases-"))
    fx = Fixture(work)
    cli = Cli(Path(args.checkout).resolve(), work)
    commit = subprocess.run(["git", "-C", args.checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results = {}
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = CASES[name](cli, fx)
        except Exception as e:  # noqa: BLE001 -- a case that breaks is a result too
            results[name] = f"case failed: {type(e).__name__}: {e}"[:300]
        print(f"{name:<16} {results[name]}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    if args.out:
        print(f"wrote {harness.write_json(args.out, {'commit': commit, 'cases': results})}")


if __name__ == "__main__":
    main()
