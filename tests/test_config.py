"""Configs are validated as a whole before anything runs: typos at every depth, wrong types, out-of-range
and unknown enum values, the recipes' cross-stage rules, unknown ``--from`` stages. Each bad input gives
one readable message naming the dotted path (and, for typos, the key meant), and nothing is computed.
The CLI turns them into one line per problem and exit 2; a user error raised inside a stage names the
stage, exits 2, and prints no traceback (``--debug`` shows it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from irflow import api
from irflow.dev.testing import run_cli
from irflow.engine.errors import ConfigError, UserError
from irflow.engine.params import Params

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")
ROCKETQA = str(REPO / "configs" / "rocketqa_demo.yaml")
ANCE = str(REPO / "configs" / "ance_demo.yaml")
BASELINES = str(REPO / "configs" / "demo_baselines.yaml")

# (config, --set overrides, fragments every one of which the message must contain)
BAD = [
    (DEMO, ["train.lrr=3e-5"], ["train.lrr: unknown key", "did you mean 'lr'"]),
    (BASELINES, ["dense.modle=x"], ["dense.modle: unknown key", "did you mean 'model'"]),
    (DEMO, ["traim.steps=5"], ["traim: unknown section", "did you mean 'train'"]),
    (DEMO, ["teacher.wieghts.bm25=0.5"], ["teacher.wieghts: unknown key", "did you mean 'weights'"]),
    (DEMO, ["bm25.k1x=1"], ["bm25.k1x: unknown key", "did you mean 'k1'"]),
    (DEMO, ["dataset.splt=dev"], ["dataset.splt: unknown key", "did you mean 'split'"]),
    (DEMO, ["mine.miners.0.nmae=x"], ["mine.miners.0.nmae: unknown key", "did you mean 'name'"]),
    (DEMO, ["bm25.k1=abc"], ["bm25.k1: 'abc'", "valid number"]),
    (DEMO, ["bm25.depth=0"], ["bm25.depth: 0", "greater than 0"]),
    (DEMO, ["bm25.variants=[multifeld]"], ["bm25.variants.0: 'multifeld'", "'flat' or 'multifield'"]),
    (DEMO, ["bm25=5"], ["bm25: expected a section", "got 5"]),
    (DEMO, ["train.steps=-5"], ["train.steps: -5", "greater than 0"]),
    (DEMO, ["hybrid.sparse_weight=1.5"], ["hybrid.sparse_weight: 1.5", "less than or equal to 1"]),
    (DEMO, ["runtime.precision=bf8"], ["runtime.precision: 'bf8'", "'auto', 'bf16-native', 'fp32', 'bf16' or 'fp16'"]),
    (DEMO, ["runtime.device=gpu"], ["runtime.device: 'gpu' is not a device"]),
    (DEMO, ["generate.source=t5x"], ["generate:", "'t5x' is not one of", "'unlabelled'"]),
    (DEMO, ["teacher.type=crossencoder"], ["teacher:", "'crossencoder' is not one of", "'cross_encoder'"]),
    (DEMO, ["evaluate.metrics=[ndcg@x]"], ["evaluate.metrics:", "'ndcg@x'", "ndcg@10"]),
    (DEMO, ["flow=gplx"], ["unknown recipe 'gplx'", "did you mean 'gpl'"]),
    # renamed / moved keys say where they went
    (DEMO, ["train.bf16_autocast=true"], ["train.bf16_autocast: unknown key", "runtime.precision"]),
    (DEMO, ["mine.top_k=10"], ["mine.top_k: unknown key", "depth"]),
    (DEMO, ["bm25.top_k=10"], ["bm25.top_k: unknown key", "depth"]),
    (DEMO, ["bm25.hits=100"], ["bm25.hits: unknown key", "renamed: depth"]),
    (DEMO, ["mine.num_negatives=3"], ["mine.num_negatives: unknown key", "renamed: negatives_per_miner"]),
    (DEMO, ["teacher.type=fusion", "teacher.depth=20"], ["teacher.depth: unknown key", "renamed: input_depth"]),
    (ROCKETQA, ["student.negatives_per_query=2"], ["student.negatives_per_query: unknown key",
                                                   "renamed: negatives_per_line"]),
    (ROCKETQA, ["cross_encoder.negatives_depth=50"], ["cross_encoder.negatives_depth: unknown key", "renamed: depth"]),
    (ANCE, ["round.mined_per_query=5"], ["round.mined_per_query: unknown key", "renamed: negatives_per_query"]),
    (ANCE, ["warmup.bm25_skip_top=100"], ["warmup.bm25_skip_top: 100 leaves none of BM25's top 100"]),
    (ANCE, ["round.skip_top=250"], ["round.skip_top: 250 leaves none of the model's top 200"]),
    (ROCKETQA, ["dual_encoder.bm25_depth=30", "dual_encoder.bm25_skip_top=40"],
     ["dual_encoder.bm25_skip_top: 40 leaves none of BM25's top 30"]),
    (ANCE, ["warmup.negatives_per_query=2"], ["warmup.negatives_per_query: unknown key", "negatives_per_line"]),
    # the denoising fill lies below what the teacher judged and within M_D0's list
    (ROCKETQA, ["denoise.fill_ranks=[11,200]"], ["denoise.fill_ranks: [11, 200] must lie below the teacher's top 20"]),
    (ROCKETQA, ["denoise.fill_ranks=[21,500]"], ["denoise.fill_ranks: [21, 500]", "M_D0's list of 200"]),
    # cross-stage rules of the GPL recipe
    (DEMO, ["generate.split=test"], ["generate.split", "test queries must not be used for training"]),
    (DEMO, ["generate.split=dev"], ["generate.split: 'dev' is not a split", "test, train"]),
    (DEMO, ["label.positive=qrels"], ["label.positive: qrels needs the source passage"]),
    (DEMO, ["doc2query.enabled=true"], ["doc2query.enabled:", "not t5"]),
    (DEMO, ["teacher.weights.bm2=0.5"], ["teacher.weights: one weight per miner", "bm2"]),
    (DEMO, ["mine.strategy=range"], ["mine.rank_range: required with strategy range"]),
    (DEMO, ["label.rank_range=[1,30]"], ["label.rank_range:", "rank 1 is the positive"]),
    (DEMO, ["dense.similarity=dot"], ["dense.similarity: the evaluated students use train.similarity"]),
    (DEMO, ["train.loss=mnrl"], ["train.loss:", "margin_mse or listwise_kl"]),
    (DEMO, ["train.loss=listwise_kl", "label.scale=null"], ["train.loss: listwise_kl", "set label.scale"]),
    (DEMO, ["rounds=2", "mine.miners.1.model=other-model"], ["rounds: 2 replaces", "no miner has it"]),
    (DEMO, ["rounds=0"], ["rounds: 0", "greater than 0"]),
    (DEMO, ["teacher.score_every_candidate=true", "teacher.input_depth=20"],
     ["teacher.input_depth: with score_every_candidate"]),
    (DEMO, ["teacher.score_every_candidate=true", "mine.miners.0.variant=multifield"],
     ["teacher.score_every_candidate:", "multifield"]),
    (DEMO, ["dataset.split=validation"], ["dataset.split", "'validation'"]),
    # malformed --set
    (DEMO, ["train.lr"], ["--set 'train.lr': expected key=value"]),
    (DEMO, ["train.lr.x=1"], ["'train.lr' is a value"]),
    (DEMO, ["mine.miners.7.model=x"], ["mine.miners is a list of 2 items (0..1); no item '7'"]),
]


@pytest.mark.parametrize("config,overrides,fragments", BAD, ids=[" ".join(o) for _, o, _ in BAD])
def test_bad_config_is_reported_by_path(config, overrides, fragments):
    with pytest.raises(ConfigError) as err:
        api.load_config(config, overrides)
    msg = str(err.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in:\n{msg}"
    assert "Traceback" not in msg and "pydantic" not in msg.lower()


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        api.load_config(DEMO, ["train.lrr=1", "bm25.k1=abc", "traim.steps=5"])
    msg = str(err.value)
    assert "3 problems" in msg
    assert "train.lrr" in msg and "bm25.k1" in msg and "traim" in msg


def test_a_key_given_twice_is_refused_not_dropped(tmp_path):
    """YAML keeps only one of two equal keys (PyYAML, the last, silently). A typo that turns `rounds: 2`
    into a second `round:` section, or a section written twice, would drop settings: refused, with both
    lines, by the file, by `irflow run` (exit 2, nothing created) and in a --set value."""
    text = Path(ANCE).read_text()
    assert text.count("\nrounds: 2\n") == 1 and text.count("\nround:\n") == 1
    typo = tmp_path / "typo.yaml"
    typo.write_text(text.replace("\nrounds: 2\n", "\nround: 2\n"))
    lines = typo.read_text().splitlines()
    first, second = lines.index("round: 2") + 1, lines.index("round:") + 1
    with pytest.raises(ConfigError) as err:
        api.load_config(typo)
    assert f"line {second}: key 'round' is given twice (first on line {first})" in str(err.value)

    store = tmp_path / "never-created"
    code, _, err = run_cli("run", typo, "--store", store)
    assert code == 2 and "key 'round' is given twice" in err and "Traceback" not in err
    assert not store.exists()

    # nested: a key twice inside one section
    twice = tmp_path / "twice.yaml"
    twice.write_text(text.replace("  epochs: 1\n", "  epochs: 1\n  epochs: 3\n", 1))
    with pytest.raises(ConfigError, match="key 'epochs' is given twice"):
        api.load_config(twice)
    with pytest.raises(ConfigError, match=r"--set 'round=\{epochs: 1, epochs: 3\}': key 'epochs' is given twice"):
        api.load_config(ANCE, ["round={epochs: 1, epochs: 3}"])
    # what YAML allows stays allowed: merge keys override, and the fixed file loads
    assert api.load_config(ANCE).rounds == 2
    assert api.load_config(ANCE, ["round={<<: {epochs: 1}, epochs: 3}"]).round.epochs == 3


def test_invalid_yaml_says_where_in_one_line(tmp_path):
    tab = tmp_path / "tab.yaml"
    tab.write_text(Path(DEMO).read_text().replace("\n  split: test", "\n\tsplit: test", 1))
    assert "\t" in tab.read_text()
    line = next(i for i, t in enumerate(tab.read_text().splitlines(), 1) if t.startswith("\t"))
    with pytest.raises(ConfigError) as err:
        api.load_config(tab)
    msg = str(err.value)
    assert f"invalid YAML: line {line}, column 1:" in msg and "not tabs" in msg
    assert "\n" not in msg and "<unicode string>" not in msg


def test_missing_models_fail_before_any_work(tmp_path):
    with pytest.raises(UserError, match=r"train.model: model directory '/no/such/model' does not exist"):
        api.status(DEMO, ["train.model=/no/such/model"], store=tmp_path / "store")
    with pytest.raises(UserError, match=r"mine.miners.1.model: model directory"):
        api.status(DEMO, ["mine.miners.1.model=/nope"], store=tmp_path / "store")
    # a hub id offline names the model and how to give a local directory instead
    with pytest.raises(UserError, match=r"train.model: model 'BeIR/no-such-model' is not available here"):
        api.status(DEMO, ["train.model=BeIR/no-such-model"], store=tmp_path / "store")
    assert not (tmp_path / "store").exists()  # a refused run leaves no store behind


def test_cuda_asked_where_there_is_none(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match="runtime.device: 'cuda', but torch sees no CUDA device"):
        api.status(DEMO, ["runtime.device=cuda"], store=tmp_path / "store")


def test_unknown_from_lists_the_stages(tmp_path):
    with pytest.raises(ConfigError) as err:
        api.status(DEMO, force=["bm25_serach"], store=tmp_path / "store")
    msg = str(err.value)
    assert "--from bm25_serach (did you mean bm25_search?)" in msg
    assert "pseudo_label" in msg and "train_student[gpl]" in msg
    assert not (tmp_path / "store").exists()


def test_defaults_are_filled_in_and_overrides_typed():
    c = api.load_config(DEMO, ["train.lr=3e-5", "bm25.k1=1.2"])
    assert c.train.lr == 3e-5 and c.bm25.k1 == 1.2
    # a value the file does not give comes from the stage's own params model, written once
    from irflow.stages.bm25 import BM25Weights

    assert c.bm25.b == BM25Weights().b
    # the config is frozen: a recipe cannot be changed behind the cache key's back
    with pytest.raises(Exception):
        c.train.lr = 1.0


def test_follows_take_the_key_they_follow_unless_set():
    """Declared once per recipe (RecipeConfig.follows): resolved before validation, shown by --explain."""
    rq = api.load_config(ROCKETQA, ["train_split=train", "dual_encoder.similarity=dot", "student.similarity=dot"])
    assert rq.denoise.split == rq.cross_encoder.split == "train" and rq.student.splits == ("train",)
    assert rq.dense.similarity == "dot"  # follows dual_encoder.similarity
    assert rq.cross_encoder.rerank.max_length == rq.cross_encoder.max_length == 128
    assert rq.ablations.list_size == rq.student.list_size == 8
    # the fill follows denoise.depth and retrieve.depth where the config leaves it out; null is kept (no fill)
    assert api.load_config(ROCKETQA, ["denoise.fill_ranks=null"]).denoise.fill_ranks is None
    import yaml

    raw = yaml.safe_load(Path(ROCKETQA).read_text())
    del raw["denoise"]["fill_ranks"]
    assert api.load_config(raw, ["retrieve.depth=300"]).denoise.fill_ranks == (21, 300)
    # what the config sets wins (and the recipe's rules then judge it)
    assert api.load_config(ROCKETQA, ["cross_encoder.rerank.max_length=64"]).cross_encoder.rerank.max_length == 64
    # defaults written once: the students' hard negatives and lines come from their own sections' models
    assert (rq.student.negatives_per_line, rq.student.negative_lines) == (1, 1)  # the demo sets 1 line
    ance = api.load_config(ANCE, ["warmup.similarity=dot", "round.similarity=dot"])
    assert ance.dense.similarity == "dot" and ance.round.splits == ("train",)
    gpl = api.load_config(DEMO, ["label.scale=auto", "train.max_seq_length=100"])
    assert gpl.label.scale.max_seq_length == 100 and gpl.label.positive == "teacher_top1"  # unlabelled queries
    ict = api.load_config(DEMO, ["generate={source: ict}"])
    assert ict.label.positive == "qrels" and ict.doc2query.enabled is False
    explained = {key: default for key, default, _ in type(rq).explain()}
    assert explained["denoise.split"] == "= train_split"
    assert explained["denoise.fill_ranks"] == "= [denoise.depth + 1, retrieve.depth]"
    assert explained["student.negative_lines"] == "4"


def test_every_field_of_every_params_model_is_described():
    import importlib
    import pkgutil

    import irflow.recipes
    import irflow.stages

    for pkg in (irflow.stages, irflow.recipes):
        for m in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{m.name}")

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    models = list(subclasses(Params))
    assert len(models) > 20
    for cls in models:
        assert cls.model_config.get("extra") == "forbid", cls
        assert cls.model_config.get("frozen"), cls
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"
    # ... and a class that forgets one is refused when it is defined
    from pydantic import Field

    with pytest.raises(TypeError, match="needs a description"):
        class Bad(Params):  # noqa: F841
            x: int = Field(1)


def test_cli_config_prints_the_resolved_config():
    code, out, err = run_cli("config", DEMO, "--set", "train.lr=3e-5")
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["train"]["lr"] == 3e-5
    assert cfg["bm25"]["k1"] is not None and "b" in cfg["bm25"]  # defaults filled in
    assert list(cfg)[-1] == "runtime"
    code, out, _ = run_cli("config", DEMO, "--explain")
    assert code == 0
    assert any(line.startswith("train.lr ") and "learning rate" in line.lower() for line in out.splitlines())


def test_cli_bad_config_one_line_per_problem_exit_2(tmp_path):
    store = tmp_path / "never-created"
    code, out, err = run_cli("run", DEMO, "--set", "train.lrr=3e-5", "--store", store)
    assert code == 2
    assert "irflow: error:" in err and "train.lrr: unknown key (did you mean 'lr'?)" in err
    assert "Traceback" not in err
    assert not store.exists()
    # refused after validation (a missing model, an unknown --from): still nothing created
    for args in (["--set", "train.model=/no/such/model"], ["--from", "bm25_serach"]):
        code, _, err = run_cli("run", DEMO, *args, "--store", store)
        assert code == 2 and "Traceback" not in err, err
        assert not store.exists(), args


def _bad_corpus(tmp_path: Path) -> Path:
    """A real SciFact slice whose corpus has one malformed line: it passes config validation (the
    splits exist) and fails in the ingest stage."""
    from irflow.dev.testing import SHARED_DATASETS, beir_slice

    src = beir_slice(SHARED_DATASETS / "scifact.zip", tmp_path / "bad", n_test_queries=3, n_extra_docs=5)
    with open(src / "corpus.jsonl", "a") as f:
        f.write('{"_id": "x", "text": oops}\n')
    return src


def test_user_error_in_a_stage_is_one_line_exit_2(tmp_path, prefect_harness):
    """Through the real command (a subprocess, as a user runs it): no Prefect tracebacks, no
    binding-leak noise at exit; --debug shows the traceback."""
    src = _bad_corpus(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"flow": "baselines", "dataset": {"name": "bad", "source": str(src)},
                                   "bm25": {"variants": ["flat"]}, "dense": {"enabled": False}}))
    env = dict(os.environ, IRFLOW_STORE=str(tmp_path / "store"), PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "irflow.cli", "run", str(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "leaked" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [ln for ln in errors if ln.startswith("irflow: error:")], errors
    assert len([ln for ln in p.stderr.splitlines() if ln.startswith("irflow: error:")]) == 1
    assert "irflow: error: stage ingest: " in p.stderr and "corpus.jsonl:" in p.stderr and "malformed JSON" in p.stderr

    # --debug against the session's test server (the temporary server's quiet exit was checked above;
    # starting one costs ~10-15 s)
    from prefect.settings import PREFECT_API_URL

    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    p = subprocess.run(cmd[:3] + ["--debug"] + cmd[3:], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2
    assert "Traceback" in p.stderr


@pytest.mark.parametrize("config, extra", [(DEMO, []), (ANCE, ["hybrid.enabled=true"]),
                                           (ROCKETQA, ["hybrid.enabled=true"])])
@pytest.mark.parametrize("variants", [("multifield", "flat"), ("flat", "multifield")])
def test_each_recipes_hybrid_fuses_the_first_bm25_variant(tmp_path, config, extra, variants):
    """With two BM25 variants, `hybrid` and every `hybrid-<model>` fuse the one listed first (its system
    name is `c.bm25.first_system`, not whichever run a dict happens to hold first)."""
    plan = {s.name: s for s in api.status(config, [f"bm25.variants=[{','.join(variants)}]", *extra],
                                          store=tmp_path / "store")}
    first, second = (plan[f"bm25_search[{v}]"].outputs["run"] for v in variants)
    fused = {n: s.inputs["rankings"] for n, s in plan.items() if n.startswith("fuse[hybrid")}
    assert "fuse[hybrid]" in fused and len(fused) > 1  # the zero-shot hybrid and at least one student's
    for name, rankings in fused.items():
        assert first in rankings and second not in rankings, name


def test_result_to_dict_is_json(tmp_path):
    # RunResult is what the CLI's --json prints and bench/ reads; check it on a config error-free status
    plan = api.status(BASELINES, store=tmp_path / "store")
    assert plan and all(p.status == "stale" for p in plan)
    assert json.dumps([vars(p) for p in plan])


def test_an_all_digit_md5_keeps_its_leading_zeros():
    md5 = "0" * 20 + "123456789012"
    c = api.load_config(DEMO, [f"dataset.md5={md5}"])
    assert c.dataset.md5 == md5


def test_a_fresh_store_gives_no_prefect_home_warning(tmp_path):
    """Prefect's import tries to create PREFECT_HOME (inside a store that does not exist yet) and warns;
    irflow creates it itself before a flow runs, so an API user sees no warning."""
    store = tmp_path / "not-yet" / "store"
    code = ("import warnings; warnings.simplefilter('error', UserWarning); from irflow.engine import orchestration; "
            f"orchestration.configure({str(store)!r}); import prefect; orchestration.prefect_home(); print('ok')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert "Prefect home" not in r.stderr and (store / "prefect").is_dir()


def test_model_free_queries_are_warned_about_before_anything_runs(tmp_path):
    """GPL on ICT / cropping queries was measured to lower the student below zero-shot: the recipe says
    so, with the numbers, before a run (preflight: what `irflow run` and `status` log) and in `irflow
    config`; the demo's own query source gets no warning. The numbers it cites are the benchmark's."""
    from irflow.recipes.gpl import model_free_measured

    results = json.loads((REPO / "bench" / "results" / "model_free.json").read_text())["runs"]
    measured = {src: {(r["dataset"], r["teacher"], r["metrics"]["dense-all-MiniLM-L6-v2"]["ndcg@10"],
                       r["metrics"]["gpl-student"]["ndcg@10"], r["metrics"]["gpl-student"]["vs_zero_shot"]["t_pvalue"])
                      for r in results if r["source"] == src
                      # runtime settings (threads) change no result: they are not keyed
                      and [o for o in r["overrides"] if not o.startswith("runtime.")]
                      == [f"generate={{source: {src}}}", "train.qgen.enabled=false"]}
                for src in ("ict", "crop")}
    shipped = {src: {(r["dataset"], r["teacher"], r["zero_shot"], r["student"], r["t_pvalue"]) for r in rows}
               for src, rows in model_free_measured()["rows"].items()}
    assert shipped == measured
    losing = [src for src, rows in measured.items() if any(student < zero for _, _, zero, student, _ in rows)]
    assert "ict" in losing  # SciFact: 0.6451 -> 0.6214
    for src in ("ict", "crop"):
        code, out, err = run_cli("config", DEMO, "--set", f"generate={{source: {src}}}")
        assert code == 0 and yaml.safe_load(out)["generate"]["source"] == src
        warned = [ln for ln in err.splitlines() if ln.startswith(f"warning: generate.source: {src}")]
        if src not in losing:
            assert not warned, err
            continue
        assert len(warned) == 1, err
        for ds, teacher, zero, student, p in measured[src]:
            assert f"{ds} {zero:.4f} -> {student:.4f}" in warned[0] and f"p {p:.2f}" in warned[0]
        # both fusion teachers were measured on SciFact, and the warning tells them apart
        assert {t for _, t, *_ in measured[src]} == {"own", "every"} and "teacher scoring every candidate" in warned[0]
        assert "source: unlabelled" in warned[0] and "t5" in warned[0] and "hybrid" in warned[0]
        warnings = api.preflight(api.load_config(DEMO, [f"generate={{source: {src}}}"]), str(tmp_path / "s"))
        assert warnings and warnings[0] == warned[0].removeprefix("warning: ")
    code, _, err = run_cli("config", DEMO)
    assert code == 0 and "warning" not in err
    assert not api.preflight(api.load_config(DEMO), str(tmp_path / "s"))


def test_the_console_log_has_no_faiss_loader_lines():
    """faiss-cpu logs, at INFO, a ModuleNotFoundError for each CPU build it lacks (AVX-512, AVX2) before it
    loads another: on a run's console that reads like a failure. The console log leaves them out and
    keeps irflow's own INFO lines."""
    code = ("from irflow.engine.orchestration import console_logging; console_logging(); import faiss, logging; "
            "faiss.IndexFlatIP(4); logging.getLogger('irflow').info('ready')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "irflow ready" in p.stderr
    assert "faiss.loader" not in p.stderr and "ModuleNotFoundError" not in p.stderr, p.stderr


def test_a_query_log_proxy_needs_the_log_and_a_recipe_whose_teacher_judges(tmp_path):
    """dataset.proxy.queries: log holds out a part of the query log for the teacher to judge: without a log,
    or in a recipe with no teacher (baselines), the config says so by its path."""
    (tmp_path / "docs.jsonl").write_text('{"_id": "a", "text": "a passage"}\n')
    (tmp_path / "log.txt").write_text("a query\n")
    own = {"source": str(tmp_path / "docs.jsonl"), "proxy": {"queries": {"source": "log"}}}
    with pytest.raises(ConfigError, match=r"dataset.proxy.queries.source: log holds out a part of the query log: "
                                          r"set query_log"):
        api.load_config({"flow": "gpl", "dataset": own})
    with pytest.raises(ConfigError, match=r"recipe baselines has none \(gpl has\)"):
        api.load_config({"flow": "baselines", "dataset": {**own, "query_log": str(tmp_path / "log.txt")}})
    c = api.load_config({"flow": "gpl", "generate": {"source": "unlabelled"},
                         "dataset": {**own, "query_log": str(tmp_path / "log.txt")}})
    assert c.dataset.proxy.judged and "teacher's top 1 judged relevant" in c.dataset.proxy.describe()
    assert not [a for a in c.advice() if "the judge is partly the start" in a]  # a cross-encoder judges (default)
    fusion = api.load_config({"flow": "gpl", "generate": {"source": "unlabelled"}, "train": {"model": "m"},
                              "mine": {"miners": [{"name": "bm25", "type": "bm25"},
                                                  {"name": "m", "type": "dense", "model": "m"}]},
                              "teacher": {"type": "fusion", "weights": {"bm25": 0.3, "m": 0.7}},
                              "dataset": {**own, "query_log": str(tmp_path / "log.txt")}})
    judged = [a for a in fusion.advice() if "the judge is partly the start, so the proxy favours it" in a]
    # the ranks it quotes are the proxy bench's: the start on the judged log and on the real qrels
    bench = json.loads((REPO / "bench" / "results" / "proxy_agreement_nfcorpus.json").read_text())
    proxy, real = bench["proxies"]["log-teacher"]["proxy_ndcg@10"], bench["real_ndcg@10"]
    rank = lambda scores: sorted(proxy, key=lambda m: -scores[m]).index("zero-shot") + 1  # noqa: E731
    assert len(judged) == 1 and (f"the zero-shot model ranked {rank(proxy)} of {len(proxy)} models on it and "
                                 f"{rank(real)} on the real qrels" in judged[0]), judged
    # spider's windows are cut out of their passage as ICT's sentences are: an ICT proxy would favour them
    with pytest.raises(ConfigError, match=r"ict queries are of the kind of generate.source \(spider\)"):
        api.load_config({"flow": "contriever", "generate": {"source": "spider"}, "dataset": {**own, "proxy": {}}})
