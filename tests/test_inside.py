"""What a run's report shows of its inside: trainers' loss histories as datasets with lineage, and the
figures of irflow.tools.inside (losses, GPL's margins, RocketQA's denoising by rank bucket) on the sample GPL
and RocketQA runs the recipes' own tests make (tests/conftest.py), checked against the stored tables."""

import base64
import io
import json
import re
from html import unescape

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from PIL import Image

from irflow import api
from irflow.data_contracts import ContractError, get
from irflow.engine.catalog import Catalog
from irflow.engine.store import TABLE_FILE, Store
from irflow.tools.inside import inside_sections

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]\d+)?"  # as "{:.4g}" writes it


def _open(store_dir) -> tuple[Catalog, Store]:
    store = Store(store_dir)
    return Catalog(store.catalog_path), store


def _stored(store: Store, dataset_id: str) -> pa.Table:
    return pq.read_table(store.object_dir(dataset_id) / TABLE_FILE)


def _pairwise_aucs(scores: pa.Table) -> tuple[list[float], list[float]]:
    """Per query with a judged positive and another candidate among the retrieved ones (rank 1 to the
    deepest unjudged rank): the share of (positive, other) pairs the teacher's score, and the list's
    rank, put the right way round (ties half)."""
    rows = scores.to_pylist()
    depth = max(r["rank"] for r in rows if not r["positive"])
    lists: dict[str, list[dict]] = {}
    for r in rows:
        if 1 <= r["rank"] <= depth:
            lists.setdefault(r["query_id"], []).append(r)
    teacher, listed = [], []
    for rs in lists.values():
        pos = [r for r in rs if r["positive"]]
        neg = [r for r in rs if not r["positive"]]
        if pos and neg:
            pairs = [(p, n) for p in pos for n in neg]
            teacher.append(sum((p["score"] > n["score"]) + 0.5 * (p["score"] == n["score"]) for p, n in pairs)
                           / len(pairs))
            listed.append(sum(p["rank"] < n["rank"] for p, n in pairs) / len(pairs))
    return teacher, listed


def _section(sections, starts: str) -> str:
    [html] = [h for t, h in sections if t.startswith(starts)]
    return html


def _pngs(html: str) -> list[bytes]:
    """Every inlined image, decoded: a PNG (signature) that an image library reads, of some size."""
    out = []
    for data in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html):
        png = base64.b64decode(data, validate=True)
        assert png.startswith(PNG_SIGNATURE) and len(png) > 0
        with Image.open(io.BytesIO(png)) as im:
            im.load()
            assert im.format == "PNG" and im.width > 100 and im.height > 100
        out.append(png)
    return out


def _table_rows(html: str) -> list[list[str]]:
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", html)]


def _assert_losses_are_the_models_history(store: Store, catalog: Catalog, outputs: dict[str, str]):
    """A trainer's training_losses: one row per step, equal to the loss history saved with its model,
    and in the catalog with the trainer's lineage."""
    model_id = next(i for name, i in outputs.items() if name != "training_losses")
    history = json.loads((store.object_dir(model_id) / "irflow_training.json").read_text())["history"]
    losses = _stored(store, outputs["training_losses"])
    assert losses.num_rows == len(history) > 0
    assert losses.to_pylist() == [{k: h.get(k) for k in ("step", "loss", "lr", "candidates")} for h in history]
    row, model = catalog.dataset(outputs["training_losses"]), catalog.dataset(model_id)
    assert row["contract"] == "training_losses" and row["num_rows"] == len(history)
    assert (row["stage"], row["cache_key"]) == (model["stage"], model["cache_key"])  # made by the same execution
    me, *ancestors = catalog.lineage(outputs["training_losses"])
    model_lineage = catalog.lineage(model_id)[1:]
    assert me["parents"] and {a["dataset_id"] for a in ancestors} == {a["dataset_id"] for a in model_lineage}


def test_a_loss_history_with_a_gap_breaks_its_contract():
    contract = get("training_losses")
    ok = pa.table({"step": [1, 2, 3], "loss": [0.9, 0.7, 0.6], "lr": [1e-5, 2e-5, 1e-5], "candidates": [None] * 3})
    assert contract.validate(ok).num_rows == 3
    with pytest.raises(ContractError, match="not contiguous"):
        contract.validate(ok.filter(pc.not_equal(ok.column("step"), 2)))


def test_gpl_sections_show_the_losses_and_the_teachers_margins(gpl_sample, gpl_sample_run):
    catalog, store = _open(gpl_sample["store"])
    result = gpl_sample_run
    trainers = {s.name: s.outputs for s in result.stages if s.name.startswith("train_student")}
    assert set(trainers) == {"train_student[gpl]", "train_student[qgen]"}
    for outputs in trainers.values():
        _assert_losses_are_the_models_history(store, catalog, outputs)
    # the GPL student's losses descend from the teacher's labels
    labels_id = result.stage("pseudo_label").outputs["pseudo_labels"]
    assert labels_id in {a["dataset_id"] for a in catalog.lineage(trainers["train_student[gpl]"]["training_losses"])}

    sections = inside_sections(catalog, store, result.run_id)
    assert [t for t, _ in sections] == ["Training losses", "GPL teacher: pseudo-label margins (pseudo_label)"]
    losses_html = _section(sections, "Training losses")
    assert len(_pngs(losses_html)) == 1
    rows = {r[0]: r for r in _table_rows(losses_html)}
    for name, outputs in trainers.items():
        t = _stored(store, outputs["training_losses"])
        assert rows[name][1] == str(t.num_rows) and rows[name][5] == outputs["training_losses"]
        assert float(rows[name][3]) == pytest.approx(t.column("loss")[-1].as_py(), rel=1e-3)
    assert (rows["train_student[gpl]"][1], rows["train_student[qgen]"][1]) == ("3", "2")  # train.steps, qgen.steps

    # The margins' caption quotes what the stored pseudo-label table holds.
    margins_html = _section(sections, "GPL teacher")
    assert len(_pngs(margins_html)) == 1
    caption = re.search(r"<figcaption>(\d+) \(query, positive, negative\) triples labelled by the cross_encoder "
                        rf"teacher: mean margin ({NUMBER}), median ({NUMBER}); (\d+) \(", margins_html)
    assert caption, margins_html[-600:]
    margin = _stored(store, labels_id).column("margin")
    assert int(caption[1]) == len(margin) > 0
    # (4 significant digits: the tiny teacher's margins are ~1e-5, where fixed decimals would read 0)
    assert float(caption[2]) == pytest.approx(pc.mean(margin).as_py(), rel=1e-3)
    assert float(caption[3]) == pytest.approx(pc.quantile(margin, q=0.5)[0].as_py(), rel=1e-3)
    assert int(caption[4]) == pc.sum(pc.less_equal(margin, 0)).as_py()

    # A cached re-run publishes nothing new: the same loss datasets, the same report.
    first = api.run(gpl_sample["config"], [], store=gpl_sample["store"])
    again = api.run(gpl_sample["config"], [], store=gpl_sample["store"])
    assert again.computed == set()
    for name in trainers:
        assert again.stage(name).outputs == first.stage(name).outputs
    assert inside_sections(catalog, store, again.run_id) == inside_sections(catalog, store, first.run_id)
    assert inside_sections(catalog, store, "run-that-never-was") == []


def test_rocketqa_sections_count_per_bucket_what_denoising_dropped_and_kept(rocketqa_sample, rocketqa_sample_run):
    catalog, store = _open(rocketqa_sample["store"])
    result = rocketqa_sample_run
    trainers = {s.name: s.outputs for s in result.stages if s.name.startswith(("train_dual_encoder",
                                                                                "train_cross_encoder"))}
    assert {"train_dual_encoder[md0]", "train_cross_encoder", "train_dual_encoder[md1-ce]",
            "train_dual_encoder[md1-listwise]", "train_dual_encoder[md2]"} <= set(trainers)
    for outputs in trainers.values():
        _assert_losses_are_the_models_history(store, catalog, outputs)

    sections = inside_sections(catalog, store, result.run_id)
    assert [t for t, _ in sections] == ["Training losses",
                                        "RocketQA teacher: probabilities by rank bucket (denoise[ce])",
                                        "RocketQA teacher: probabilities by rank bucket (denoise[fusion])"]
    losses_html = _section(sections, "Training losses")
    assert {r[0] for r in _table_rows(losses_html)} == set(trainers)  # every trainer of the run, one curve each
    assert len(_pngs(losses_html)) == 1

    for tag in ("ce", "fusion"):
        html = _section(sections, f"RocketQA teacher: probabilities by rank bucket (denoise[{tag}])")
        assert len(_pngs(html)) == 1
        outputs = result.stage(f"denoise[{tag}]").outputs
        audit = _stored(store, outputs["audit"])
        sums = audit.group_by("bucket").aggregate([(c, "sum") for c in ("candidates", "known_positives", "dropped",
                                                                         "kept")])
        expected = {r["bucket"]: [str(r[f"{c}_sum"]) for c in ("candidates", "known_positives", "dropped", "kept")]
                    for r in sums.to_pylist()}
        shown = {r[0]: r[1:5] for r in _table_rows(html)}
        assert shown == expected and set(shown) == {"1-5", "6-10", "11-20", "21-50"}
        threshold = json.loads(catalog.dataset(outputs["audit"])["params"])["negative_threshold"]
        total = {c: pc.sum(audit.column(c)).as_py() for c in ("candidates", "dropped", "kept")}
        assert (f"{total['dropped']} of {total['candidates']} retrieved candidates dropped as likely false negatives "
                f"(teacher probability &gt;= {threshold:g}") in html
        assert f"{total['kept']} kept as negatives" in html
        # the kept negatives are the denoise stage's negatives mined from the lists (the rest is the fill)
        negatives = _stored(store, outputs["negatives"])
        assert total["kept"] == pc.sum(pc.equal(negatives.column("miner"), "denoised")).as_py()
        # the teacher's order of the labelled lists, counted pair by pair from the stored scores
        teacher, listed = _pairwise_aucs(_stored(store, outputs["scores"]))
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        text = unescape(html)
        # said once: in the warning's sentence when the check fails, else in the caption's own
        from irflow.learn.teachers import teacher_scores_check

        warned = teacher_scores_check(_stored(store, outputs["scores"])).problem() is not None
        assert text.count("mean AUC") == 1 and ("Warning: the teacher" in text) == warned
        assert (f"mean AUC {mean(teacher):.3f} over {len(teacher)} labelled lists" in text
                and f"the retriever's own order {mean(listed):.3f}" in text)
