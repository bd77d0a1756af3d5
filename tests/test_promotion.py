"""Promotion to a named alias (irflow.decide.promotion) and training continued from the model in use (GPL's
train.init), on real text: the bundled SciFact sample's documents as your own corpus (no labels: the proxy
evaluation), a tiny random bi-encoder as the poor model and MiniLM (packaged, offline) as the good one.

One store for the module, the runs in order (each fixture builds on the one before; a test asks for the
state it checks):
  tiny      baselines, dense-bi, alias empty           -> first promotion (production = the tiny model)
  minilm    baselines, MiniLM: first interrupted inside the promotion's transaction (production stays
            the tiny model), then again (cached)       -> promoted over the tiny model, evaluated as `production`
  worse     the tiny config again, promote.alpha set   -> only the `production` system computes; kept
  continued GPL with train.init: production            -> training starts from MiniLM
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from irflow import api
from irflow.decide.promotion import KEPT, PROMOTED, decide
from irflow.dev.testing import make_tiny_bi_encoder, run_cli
from irflow.engine.catalog import Catalog

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "irflow" / "samples" / "scifact-sample.zip"
N_DOCS = 120
MINILM = "all-MiniLM-L6-v2"
DENSE = {"max_seq_length": 32, "batch_size": 32}


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    root = tmp_path_factory.mktemp("promotion")
    with zipfile.ZipFile(SAMPLE) as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        lines = z.read(name).decode().splitlines()[:N_DOCS]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    store = root / "store"
    return {"root": root, "store": store, "docs": [json.loads(ln) for ln in lines],
            "bi": make_tiny_bi_encoder(root / "bi", normalize=True), "catalog": lambda: Catalog(store / "catalog.duckdb")}


def _baselines(own, model) -> dict:
    return {"flow": "baselines", "dataset": {"source": str(own["root"] / "docs.jsonl"), "proxy": {"fraction": 0.2}},
            "dense": {"model": str(model), **DENSE}, "promote": {"alias": "production"}, "runtime": {"threads": 1}}


@pytest.fixture(scope="module")
def tiny(own):
    return api.run(_baselines(own, own["bi"]), store=own["store"])


@pytest.fixture(scope="module")
def minilm(own, tiny):
    from irflow.engine import catalog_decisions as catalog_module

    def ctrl_c(*args):  # a Ctrl-C after the INSERT, before the COMMIT
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(catalog_module, "check_interrupted", ctrl_c)
        with pytest.raises((KeyboardInterrupt, RuntimeError)):
            api.run(_baselines(own, MINILM), store=own["store"], run_id="minilm-interrupted")
    c = own["catalog"]()
    after_interrupt = {"alias": c.alias("production"), "history": c.alias_history("production"),
                       "run": c.run("minilm-interrupted")}
    return {"result": api.run(_baselines(own, MINILM), store=own["store"]), "after_interrupt": after_interrupt}


@pytest.fixture(scope="module")
def worse(own, minilm):
    import yaml

    cfg = own["root"] / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(_baselines(own, own["bi"])))
    code, out, err = run_cli("run", cfg, "--store", own["store"], "--set", "promote.alpha=0.01", "--json")
    assert code == 0, err[-3000:]
    return {"result": json.loads(out.strip().splitlines()[-1]), "out": out}


def test_decide_needs_a_gain_beyond_noise_and_min_gain():
    rng = np.random.default_rng(0)
    base = {f"q{i}": float(v) for i, v in enumerate(rng.uniform(0.2, 0.8, 60))}
    better = {q: v + 0.1 + float(rng.normal(0, 0.02)) for q, v in base.items()}
    noisy = {q: v + float(rng.normal(0, 0.3)) for q, v in base.items()}
    current = ("m-old", "production", base)
    assert decide("production", ("gpl", "m-new", better), current, "labelled").decision == PROMOTED
    assert decide("production", ("gpl", "m-new", better), current, "labelled", min_gain=0.2).decision == KEPT
    kept = decide("production", ("gpl", "m-new", noisy), current, "labelled")
    assert kept.decision == KEPT and "production kept" in kept.reason
    # 60 queries spread by noise 0.3: a real gain under about (2.0 + 0.85) * 0.3 / sqrt(60) ~ 0.11 goes unseen
    gain = float(kept.reason.split("a real gain of about ")[1].split()[0])
    assert 0.08 < gain < 0.14, kept.reason
    assert decide("production", ("gpl", "m-new", better), None, "labelled").reason.startswith("first promotion")
    assert decide("production", ("gpl", "m-old", base), current, "labelled").reason.startswith("already in")
    assert decide("production", ("gpl", "m-new", better), ("m-old", None, None), "labelled").decision == KEPT


def test_an_empty_alias_takes_the_selected_model(own, tiny):
    p = tiny.promotion
    assert p["decision"] == PROMOTED and p["reason"].startswith("first promotion") and p["previous"] is None
    assert p["model_id"] == tiny.selected["model_id"] == own["catalog"]().alias("production")["model_id"]
    assert "production" not in {m["system"] for m in tiny.metrics}  # nothing to compare with: no extra system


def test_a_better_model_is_promoted_and_an_interrupted_promotion_changes_nothing(own, tiny, minilm):
    # interrupted inside the transaction: the alias still holds the tiny model, no row of that run
    before = minilm["after_interrupt"]
    assert before["alias"]["model_id"] == tiny.selected["model_id"]
    assert [h["run_id"] for h in before["history"]] == [tiny.run_id]
    assert before["run"]["status"] == "interrupted"
    # the same run again (every stage cached): the alias's model was evaluated as system `production`, and lost
    r = minilm["result"]
    assert not r.computed
    p = r.promotion
    assert p["decision"] == PROMOTED and p["previous"] == tiny.selected["model_id"], p
    assert p["previous_system"] == "production" and "production" in {m["system"] for m in r.metrics}
    assert p["value"] > p["previous_value"] and p["p_value"] < 0.05
    assert own["catalog"]().alias("production")["model_id"] == r.selected["model_id"] == p["current"]
    assert own["catalog"]().promotion("minilm-interrupted") is None


def test_a_worse_model_is_kept_out_and_promote_is_not_keyed(own, minilm, worse):
    # the tiny config again with other promote settings: its stages are cached; only the alias's system is new
    r = worse["result"]
    assert {s["name"] for s in r["stages"] if s["status"] == "computed"} == {"dense_search[production]",
                                                                            "evaluate[production]"}
    p = r["promotion"]
    assert p["decision"] == KEPT and "not better" in p["reason"] and p["value"] < p["previous_value"]
    assert f"promotion (kept): {p['reason']}" in worse["out"]
    assert own["catalog"]().alias("production")["model_id"] == minilm["result"].selected["model_id"]
    history = own["catalog"]().alias_history("production")
    assert [h["decision"] for h in history] == [PROMOTED, PROMOTED, KEPT]
    # the CLI: the alias with its model, the history with the reason
    code, out, err = run_cli("models", "--store", own["store"])
    assert code == 0, err
    assert "aliases" in out and f"production     {p['previous'][:16]}" in out
    code, out, err = run_cli("models", "--store", own["store"], "--history")
    assert code == 0 and out.count("production") >= 3 and p["reason"] in out


def test_an_alias_set_by_hand_leaves_the_others_alone(own, tiny, minilm, worse):
    """A roll-back by hand (Catalog.set_alias): the run that evaluated the model stands for it."""
    c = own["catalog"]()
    c.set_alias("rollback", tiny.selected["model_id"])
    row = c.alias("rollback")
    assert row["model_id"] == tiny.selected["model_id"] and row["system"] == "dense-bi"
    assert c.selection(row["run_id"])["models"]["dense-bi"] == row["model_id"]
    assert c.alias("production")["model_id"] == minilm["result"].selected["model_id"]
    assert [a["alias"] for a in c.aliases()] == ["production", "rollback"]


def test_export_of_the_alias_loads_offline(own, minilm, worse):
    from sentence_transformers import SentenceTransformer

    out_dir = own["root"] / "production-model"
    code, out, err = run_cli("export", "production", "--out", out_dir, "--store", own["store"])
    assert code == 0, err
    texts = [d["text"] for d in own["docs"][:4]]
    held = minilm["result"].selected["model_id"]
    stored = own["catalog"]().dataset(held)["path"]
    # the exported folder encodes as the run evaluated the model: at dense.max_seq_length, not MiniLM's 256
    evaluated = SentenceTransformer(stored, device="cpu")
    evaluated.max_seq_length = DENSE["max_seq_length"]
    np.testing.assert_allclose(SentenceTransformer(str(out_dir), device="cpu").encode(texts), evaluated.encode(texts),
                               atol=1e-6)
    card = (out_dir / "README.md").read_text()
    assert f"Promoted to `production` by run {minilm['result'].run_id}" in card


def test_training_continues_from_the_alias_model(own, minilm, worse):
    held = own["catalog"]().alias("production")["model_id"]
    # seconds of work: a dense miner and a fusion teacher (no JVM, no cross-encoder); cos, as the baselines
    # above, so the zero-shot and MiniLM corpus embeddings are theirs (cached)
    cfg = {"flow": "gpl", "dataset": {"source": str(own["root"] / "docs.jsonl"), "proxy": {"fraction": 0.2}},
           "generate": {"source": "crop"}, "mine": {"miners": [{"type": "dense", "model": str(own["bi"]),
                                                                "name": "bi"}], "depth": 10},
           "teacher": {"type": "fusion"}, "label": {"negatives_per_positive": 1},
           "train": {"model": str(own["bi"]), "init": "production", "similarity": "cos", "steps": 2,
                     "batch_size": 4, "max_seq_length": 32, "warmup_steps": 1, "qgen": {"enabled": False}},
           "dense": DENSE, "hybrid": {"enabled": False}, "promote": {"alias": "production"},
           "runtime": {"threads": 1}}
    # an alias with no model yet: training starts from train.model (planned only)
    plan = {p.name: p for p in api.status(cfg, ["train.init=staging"], store=own["store"])}
    assert plan["train_student[gpl]"].inputs["base_model"] == plan["encode_corpus[zero-shot]"].inputs["model"]
    r = api.run(cfg, store=own["store"])
    inputs = {s["name"]: s["inputs"] for s in own["catalog"]().stage_runs(r.run_id, with_inputs=True)}
    assert inputs["train_student[gpl]"]["base_model"] == [held]
    assert r.selected["start"] == "production" and r.selected["models"]["production"] == held
    # the alias's model is the run's start: the promotion compares with its own values, no extra system
    assert r.promotion["previous_system"] == "production" and r.promotion["decision"] == KEPT
