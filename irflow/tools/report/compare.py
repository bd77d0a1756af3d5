"""What differs between two runs: their configs (by dotted key), what each computed or reused, and
the metrics of the systems both evaluated, query by query (B against A).

    diff = compare_runs(catalog, "gpl-2026...-a", "gpl-2026...-b", metric="ndcg@10")
    diff.config    # [ConfigChange("train.lr", 2e-05, 3e-05)]
    print(format_compare(diff))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from irflow.engine.catalog import Catalog
from irflow.learn import stats
from irflow.tools.report import runs as R

ABSENT = "(absent)"  # how a key that one config lacks is shown


@dataclass
class ConfigChange:
    key: str  # dotted, list items by index (mine.miners.1.model), as --set takes it
    a: Any
    b: Any


@dataclass
class StageChange:
    name: str
    a: str | None  # computed | cached | None (the run had no such stage, or did not get to it)
    b: str | None
    same_outputs: bool | None  # both runs' outputs are the same datasets (None: not in both)


@dataclass
class SystemChange:
    system: str
    a: float | None  # the metrics table's value (None: the run recorded no metrics)
    b: float | None
    stats: stats.Paired  # B against A over the queries both evaluated


@dataclass
class RunComparison:
    a: dict  # run_id, flow, status, started_at
    b: dict
    metric: str
    config: list[ConfigChange]
    stages: list[StageChange]
    systems: list[SystemChange]
    only_a: list[str]  # systems only A evaluated
    only_b: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """dotted key -> leaf value; sections and list items are walked (an empty one is a leaf)."""
    if isinstance(config, dict) and config:
        items = config.items()
    elif isinstance(config, list) and config:
        items = enumerate(config)
    else:
        return {prefix.rstrip("."): config}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def config_changes(a: dict, b: dict) -> list[ConfigChange]:
    fa, fb = flatten(a), flatten(b)
    return [ConfigChange(k, fa.get(k, ABSENT), fb.get(k, ABSENT)) for k in sorted(set(fa) | set(fb))
            if fa.get(k, ABSENT) != fb.get(k, ABSENT)]


def _by_label(stages: list[dict]) -> dict[str, dict]:
    """label -> the stage run; a label a run called twice (one cache key: computed once, then cached) is
    computed if either call computed it."""
    out: dict[str, dict] = {}
    for s in stages:
        if s["name"] not in out or s["status"] == "computed":
            out[s["name"]] = s
    return out


def stage_changes(a: list[dict], b: list[dict]) -> list[StageChange]:
    """Every stage of either run, in A's order and then B's new ones."""
    by_a, by_b = _by_label(a), _by_label(b)
    names = list(by_a) + [n for n in by_b if n not in by_a]
    out = []
    for n in names:
        sa, sb = by_a.get(n), by_b.get(n)
        out.append(StageChange(n, sa and sa["status"], sb and sb["status"],
                               sa["outputs"] == sb["outputs"] if sa and sb else None))
    return out


def _values(catalog: Catalog, run_id: str, metric: str) -> dict[str, dict[str, float]]:
    out = {}
    for ev in R.evaluations(catalog, run_id):
        out.update(R.per_query_values(catalog, ev["per_query"], metric))
    return out


def compare_runs(catalog: Catalog, run_a: str, run_b: str, metric: str = "ndcg@10") -> RunComparison:
    """Run B against run A (ids, unique prefixes or ``latest``); raises UnknownRun naming recent runs."""
    ids = [R.resolve_run(catalog, r) for r in (run_a, run_b)]
    rows = [R.run_row(catalog, r) for r in ids]
    values = [_values(catalog, r, metric) for r in ids]
    table = [{m["system"]: m.get(metric) for m in R.metric_rows(catalog, r)} for r in ids]
    both = [s for s in values[0] if s in values[1]]
    systems = [SystemChange(s, table[0].get(s), table[1].get(s), stats.paired(values[0][s], values[1][s]))
               for s in both]
    head = [{k: r[k] for k in ("run_id", "flow", "status", "started_at", "config_path")} for r in rows]
    return RunComparison(
        a=head[0], b=head[1], metric=metric, config=config_changes(rows[0]["config"], rows[1]["config"]),
        stages=stage_changes(*(R.stage_runs(catalog, r) for r in ids)), systems=systems,
        only_a=[s for s in values[0] if s not in values[1]], only_b=[s for s in values[1] if s not in values[0]])


def _v(x) -> str:
    return "-" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def _p(x: float) -> str:
    return f"{x:.2e}" if x < 1e-3 else f"{x:.3f}"


def format_compare(c: RunComparison) -> str:
    """The comparison as text for a terminal."""
    lines = [f"A: {c.a['run_id']} ({c.a['flow']}, {c.a['status']})",
             f"B: {c.b['run_id']} ({c.b['flow']}, {c.b['status']})", "", "config (A -> B):"]
    lines += [f"  {ch.key}: {ch.a!r} -> {ch.b!r}" for ch in c.config] or ["  the same"]
    width = max([len(s.name) for s in c.stages] + [5])
    lines += ["", f"stages:{'':<{width - 5}}  {'A':<9} {'B':<9} outputs"]
    for s in c.stages:
        same = {True: "same", False: "differ", None: ""}[s.same_outputs]
        lines.append(f"  {s.name:<{width}}  {s.a or '-':<9} {s.b or '-':<9} {same}")
    if c.systems:
        sw = max(len(s.system) for s in c.systems)
        lines += ["", f"{c.metric}, B against A, query by query:",
                  f"  {'system':<{sw}}  {'A':>7} {'B':>7} {'B - A':>8} {'queries':>7} {'wins':>5} {'ties':>5} "
                  f"{'losses':>6} {'t-test p':>9} {'Wilcoxon p':>10}"]
        for s in c.systems:
            st = s.stats
            diff = f"{s.b - s.a:+.4f}" if s.a is not None and s.b is not None else f"{st.mean_diff:+.4f}"
            lines.append(f"  {s.system:<{sw}}  {_v(s.a):>7} {_v(s.b):>7} {diff:>8} {st.n:>7} {st.wins:>5} "
                         f"{st.ties:>5} {st.losses:>6} {_p(st.t_pvalue):>9} {_p(st.wilcoxon_pvalue):>10}")
    else:
        lines += ["", "no system evaluated in both runs"]
    for who, names in (("A", c.only_a), ("B", c.only_b)):
        if names:
            lines.append(f"only {who} evaluated: {', '.join(names)}")
    return "\n".join(lines)
