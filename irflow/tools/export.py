"""Hand a model out of the store: ``irflow export`` and ``irflow models``.

``export`` copies a run's model (by default the one the run selected, ``irflow.decide.selection``; or, by
``export_alias``, the model an alias holds, ``irflow.decide.promotion``) into a
self-contained sentence-transformers folder that ``SentenceTransformer(DIR)`` loads offline, and writes
its model card (``README.md``): the base model, the recipe, the corpus it was adapted to, the config, the
metrics with what they were measured on (labelled, or a proxy), training steps and time, the irflow id
for ``irflow lineage``, and the command that reproduces it. ``fmt="onnx"`` adds ``onnx/`` (irflow's
ONNX export, ``irflow.learn.onnx_inference``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from irflow.decide.selection import NO_EVALUATION
from irflow.engine.catalog import Catalog
from irflow.engine.errors import UserError
from irflow.engine.labels import stage_name

ROUTER_CONFIG = "router_config.json"  # a sentence-transformers Router's: an asymmetric model (irflow.learn.adore)


@dataclass
class Exported:
    out: Path
    run_id: str
    system: str
    model_id: str
    selected: bool
    onnx: Path | None = None


def _model_of(catalog: Catalog, run_id: str, system: str | None) -> tuple[str, str, dict]:
    sel = catalog.selection(run_id)
    if sel is None:
        raise UserError(f"run {run_id} selected no model (it evaluated no dense model, or was made before irflow "
                        f"recorded selections): run its config again, or name a stored model with irflow lineage")
    if system is None:
        return sel["system"], sel["model_id"], sel
    if system not in sel["models"]:
        raise UserError(f"--system {system}: not a dense model of run {run_id}; its dense models: "
                        f"{', '.join(sorted(sel['models']))}")
    return system, sel["models"][system], sel


def _base_models(catalog: Catalog, model_id: str) -> list[str]:
    """The external models at the root of a model's lineage (what it was trained from)."""
    return sorted({d["name"] for d in catalog.lineage(model_id)[1:]
                   if d.get("stage") == "external" and d.get("kind") == "model"})


def _training(catalog: Catalog, model_id: str) -> dict | None:
    info = catalog.dataset(model_id)
    if info is None or info.get("stage") in (None, "external"):
        return None
    params = json.loads(info["params"]) if isinstance(info.get("params"), str) else (info.get("params") or {})
    seconds = None
    for r in catalog.stage_runs(info["run_id"]):
        if model_id in (r.get("outputs") or {}).values() and r["status"] == "computed":
            seconds = r["seconds"]
    return {"stage": info["stage"], "steps": params.get("steps"), "seconds": seconds, "run_id": info["run_id"],
            "params": params}


def _corpus(catalog: Catalog, run_id: str) -> dict | None:
    """The run's dataset source (its content fingerprint) and the corpus ingested from it."""
    for r in catalog.stage_runs(run_id, with_inputs=True):
        if stage_name(r["name"]) in ("ingest", "ingest_corpus"):
            out = r["outputs"].get("corpus")
            src = next((ids[0] for ids in (r.get("inputs") or {}).values() if ids), None)
            rows = (catalog.dataset(out) or {}).get("num_rows") if out else None
            source = (catalog.dataset(src) or {}) if src else {}
            return {"source": source.get("path") or source.get("name"), "fingerprint": src, "corpus_id": out,
                    "passages": rows}
    return None


def inference_settings(catalog: Catalog, run_id: str, model_id: str) -> dict | None:
    """How run ``run_id`` encoded ``model_id`` when it evaluated it: the params of its ``dense_search``
    (max_seq_length: tokens read, null: the model's own limit; similarity: cos normalises). None: the run
    searched nothing with it (nothing evaluated)."""
    for r in catalog.stage_runs(run_id, with_inputs=True):
        if stage_name(r["name"]) == "dense_search" and (r.get("inputs") or {}).get("model") == [model_id]:
            info = catalog.dataset(r["outputs"].get("run", "")) or {}
            params = json.loads(info["params"]) if isinstance(info.get("params"), str) else (info.get("params") or {})
            return {"max_seq_length": params.get("max_seq_length"), "similarity": params.get("similarity", "cos"),
                    "search": r["name"]}
    return None


def _normalize_type() -> str:
    """The Normalize module's type as this sentence-transformers writes it in modules.json."""
    from sentence_transformers.sentence_transformer.modules import Normalize

    return f"{Normalize.__module__}.{Normalize.__qualname__}"


def apply_inference_settings(folder: Path, settings: dict) -> list[str]:
    """Make the sentence-transformers folder encode as the evaluation did: its ``max_seq_length`` and, for
    cos, a Normalize module (so ``encode`` returns the unit vectors the run searched). Returns what changed."""
    changed = []
    config = folder / "sentence_bert_config.json"
    tokenizer = folder / "tokenizer_config.json"  # sentence-transformers 6 keeps the length there when unset above
    want = settings.get("max_seq_length")
    if want is not None and config.is_file():
        c = json.loads(config.read_text())
        t = json.loads(tokenizer.read_text()) if tokenizer.is_file() else {}
        was = c.get("max_seq_length") or t.get("model_max_length")
        if was != want:
            changed.append(f"max_seq_length {was or 'unset'} -> {want} (the run evaluated it at {want} tokens)")
            config.write_text(json.dumps({**c, "max_seq_length": int(want)}, indent=2))
            if "model_max_length" in t:
                tokenizer.write_text(json.dumps({**t, "model_max_length": int(want)}, indent=2))
    modules_file = folder / "modules.json"
    modules = json.loads(modules_file.read_text())
    if settings.get("similarity") == "cos" and not any(str(m.get("type")).rsplit(".", 1)[-1] == "Normalize"
                                                       for m in modules) \
            and not (folder / ROUTER_CONFIG).is_file():
        n = len(modules)
        modules.append({"idx": n, "name": str(n), "path": f"{n}_Normalize", "type": _normalize_type()})
        (folder / f"{n}_Normalize").mkdir(exist_ok=True)
        modules_file.write_text(json.dumps(modules, indent=2))
        changed.append("a Normalize module added (the run compared unit vectors: similarity cos)")
    return changed


def model_card(catalog: Catalog, run_id: str, system: str, model_id: str, sel: dict,
               settings: dict | None = None, changed: list[str] = ()) -> str:
    run = catalog.run(run_id) or {}
    config = run.get("config")
    config = json.loads(config) if isinstance(config, str) else (config or {})
    metrics = [m for m in catalog.run_metrics(run_id) if m["system"] in sel["models"] or m["system"] == system]
    train = _training(catalog, model_id)
    corpus = _corpus(catalog, run_id)
    bases = _base_models(catalog, model_id) or [model_id]
    proxy = sel["evaluation"] != "labelled"
    measured = sel["evaluation"] != NO_EVALUATION
    lines = [f"# {system}", "",
             f"A dense retriever (sentence-transformers) made by irflow's `{run.get('flow')}` recipe, run "
             f"`{run_id}`.", "",
             "```python", "from sentence_transformers import SentenceTransformer",
             "model = SentenceTransformer(\"path/to/this/folder\")", "```", "",
             "## Where it comes from", "",
             f"- base model: {', '.join(bases)}",
             f"- recipe: {run.get('flow')}; irflow model id `{model_id}` (`irflow lineage {model_id[:20]}`)"]
    if corpus:
        lines.append(f"- corpus: {corpus['source']} ({corpus['passages']} passages; source fingerprint "
                     f"`{corpus['fingerprint']}`)")
    if train:
        steps = f"{train['steps']} steps" if train["steps"] is not None else "trained"
        took = f", {train['seconds']:.0f} s" if train["seconds"] else ""
        lines.append(f"- training: {train['stage']}, {steps}{took} (run {train['run_id']})")
    else:
        lines.append("- training: none here: this is the model the run started from")
    info = catalog.dataset(model_id) or {}
    if info.get("path") and (Path(info["path"]) / ROUTER_CONFIG).is_file():
        lines += ["", "An asymmetric model: a query encoder beside a frozen document encoder (a sentence-transformers "
                  "`Router`). Encode queries with `model.encode_query(...)` and passages with "
                  "`model.encode_document(...)` (plain `encode` takes the document route)."]
    lines += ["", "## Why this model", "", sel["reason"] if sel["system"] == system else
              f"Exported by name (--system); the run selected {sel['system']}: {sel['reason']}", ""]
    for a in catalog.aliases():
        if a["model_id"] == model_id:
            by = f"by run {a['run_id']}" if a["run_id"] else "by hand"
            lines += [f"Promoted to `{a['alias']}` {by} ({a['decided_at']:%Y-%m-%d %H:%M:%S} UTC): {a['reason']}", ""]
    if settings:
        length = settings["max_seq_length"] or "the model's own limit"
        lines += ["## Inference settings", "",
                  f"This folder encodes as the run evaluated it: passages and queries truncated at {length} tokens, "
                  f"similarity {settings['similarity']}" + (" (unit vectors)" if settings["similarity"] == "cos" else "")
                  + f", passages as `title + \" \" + text`. Measured by `{settings['search']}` of run `{run_id}`."
                  + (" Set at export: " + "; ".join(changed) + "." if changed else ""), ""]
    if not measured:
        lines += ["## Metrics", "", "**Not measured.** " + sel["reason"] + ". Check it on queries of your own before "
                  "you rely on it.", ""]
        metrics = []
    else:
        lines += ["## Metrics", "",
              (f"Measured on a **proxy**: {sel['evaluation']}. Not relevance labels: generated queries whose one "
               "relevant passage is the one they were made from. Read it as a comparison between systems, not as "
               "the quality users will see." if proxy else "Measured on labelled queries (the dataset's qrels)."),
              "", "| system | dataset | split | ndcg@10 | recall@100 |", "|---|---|---|---|---|"]
    for m in metrics:
        cells = ["" if m.get(k) is None else f"{m[k]:.4f}" for k in ("ndcg@10", "recall@100")]
        lines.append(f"| {m['system']} | {m['dataset']} | {m['split']} | {cells[0]} | {cells[1]} |")
    store = str(catalog.root)
    lines += ["", "## Reproduce", "", "```bash",
              f"irflow run {run.get('config_path') or 'CONFIG.yaml'} --store {store}",
              f"irflow export {run_id} --system {system} --out DIR --store {store}", "```", "",
              "## Config", "", "```yaml", yaml.safe_dump(config, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


EXPORT_MARK = "irflow_export.json"  # what an exported folder holds: which run, system and model it is


def check_replaceable(out: Path) -> None:
    """--force replaces only a folder that an earlier ``irflow export`` wrote (it holds ``EXPORT_MARK``) or an
    empty one: never whatever a mistyped --out names."""
    if out.is_file() or out.is_symlink():
        raise UserError(f"--out {out}: is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARK).is_file():
        raise UserError(f"--out {out}: not an earlier irflow export (no {EXPORT_MARK} in it); --force replaces only "
                        "exported folders: choose another folder, or empty this one yourself")


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (out.is_file() or any(out.iterdir())):
        if not force:
            raise UserError(f"--out {out}: exists and is not empty (choose another folder, or --force to replace an "
                            "earlier export)")
        check_replaceable(out)


def export(catalog: Catalog, run_id: str, out: str | Path, system: str | None = None, fmt: str = "st",
           force: bool = False) -> Exported:
    out = Path(out)
    _check_out(out, force)
    system, model_id, sel = _model_of(catalog, run_id, system)
    return _write(catalog, run_id, system, model_id, sel, out, fmt)


def export_alias(catalog: Catalog, alias: str, out: str | Path, fmt: str = "st", force: bool = False) -> Exported:
    """The model ``alias`` holds (its latest promotion), with the model card of the run that promoted it."""
    out = Path(out)
    _check_out(out, force)
    row = catalog.alias(alias)
    if row is None:
        raise UserError(f"alias {alias} holds no model yet (irflow models --history says what was decided)")
    model_id, run_id = row["model_id"], row["run_id"]
    sel = catalog.selection(run_id) if run_id else None
    system = row["system"] or next((s for s, m in ((sel or {}).get("models") or {}).items() if m == model_id), None)
    if sel is None or (sel["models"].get(system) != model_id):
        raise UserError(f"alias {alias} holds model {model_id}, which no recorded run evaluated here: "
                        f"irflow lineage {model_id[:20]} says where it came from")
    return _write(catalog, run_id, system, model_id, sel, out, fmt)


def _write(catalog: Catalog, run_id: str, system: str, model_id: str, sel: dict, out: Path, fmt: str) -> Exported:
    info = catalog.dataset(model_id)
    path = Path(info["path"]) if info and info.get("path") else None
    if path is None or not (path / "modules.json").is_file():
        raise UserError(f"model {model_id} ({system}) is not a sentence-transformers folder in this store "
                        f"({path}); was it removed by irflow gc?")
    if fmt == "onnx" and (path / ROUTER_CONFIG).is_file():
        raise UserError(f"--format onnx: {system} is an asymmetric model (a query and a document encoder); irflow's "
                        "ONNX export takes one encoder: export it with --format st")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(path, staging, ignore=shutil.ignore_patterns("checkpoints", "irflow_*.json", "README.md"))
    settings = inference_settings(catalog, run_id, model_id)
    changed = apply_inference_settings(staging, settings) if settings else []
    mark = {"run_id": run_id, "system": system, "model_id": model_id, **({"inference": settings} if settings else {})}
    (staging / EXPORT_MARK).write_text(json.dumps(mark, indent=2))
    (staging / "README.md").write_text(model_card(catalog, run_id, system, model_id, sel, settings, changed))
    onnx = None
    if fmt == "onnx":
        from irflow.learn import onnx_inference

        onnx_inference.export(str(staging), staging / "onnx", "embed")
        onnx = out / "onnx"
        with open(staging / "README.md", "a") as card:
            card.write("\n## ONNX\n\n`onnx/` is irflow's export of this model (fp32, checked against torch on a sample "
                       "batch; `onnx/irflow_onnx.json` says its inputs, pooling and normalisation). It runs without "
                       "torch on ONNX Runtime:\n\n```python\nfrom irflow.learn.encoding import encode_texts\n"
                       "from irflow.learn.onnx_inference import load\nmodel = load(\"path/to/this/folder/onnx\", threads=2)\n"
                       "vectors = encode_texts(model, [\"a query\"], batch_size=32, normalize=False)\n```\n")
    if out.exists():
        check_replaceable(out)
        shutil.rmtree(out)
    staging.rename(out)  # the folder appears whole, or not at all
    return Exported(out, run_id, system, model_id, sel["system"] == system, onnx)


def models(catalog: Catalog) -> list[dict]:
    """Every model a run evaluated and recorded in a selection: id, run, system, recipe, nDCG@10, evaluation,
    whether that run selected it, and the aliases that hold it now; newest run last."""
    out = []
    held: dict[str, list[str]] = {}
    for a in catalog.aliases():
        held.setdefault(a["model_id"], []).append(a["alias"])
    for s in catalog.selections():
        metrics = {m["system"]: m.get(s["metric"]) for m in catalog.run_metrics(s["run_id"])}
        for system, model_id in s["models"].items():
            info = catalog.dataset(model_id) or {}
            out.append({"model_id": model_id, "run_id": s["run_id"], "system": system, "recipe": s["flow"],
                        s["metric"]: metrics.get(system), "evaluation": s["evaluation"],
                        "selected": system == s["system"], "trained": info.get("stage") not in (None, "external"),
                        "aliases": held.get(model_id, [])})
    return out
