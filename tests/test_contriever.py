"""The contriever recipe (irflow.recipes.contriever): crop pairs from the corpus alone, InfoNCE with MoCo, the
trained model evaluated and promotable, then GPL's students starting from it (pre-training before GPL). On
a small real SciFact slice with a tiny local BERT."""
import json

import pytest

from irflow import api
from irflow.dev.testing import SHARED_DATASETS, beir_slice, make_tiny_bi_encoder
from irflow.engine.errors import ConfigError
from irflow.learn.generation import crop_queries
from irflow.stages.train_student import TrainStudentParams, positive_texts

SCIFACT = SHARED_DATASETS / "scifact.zip"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("contriever")
    folder = beir_slice(SCIFACT, root / "slice", n_test_queries=6, n_train_queries=8, n_extra_docs=40, seed=5)
    return {"root": root, "folder": folder, "bert": make_tiny_bi_encoder(root / "bert", dropout=0.0)}


def config(data, **train) -> dict:
    return {"flow": "contriever",
            "dataset": {"name": "slice", "source": str(data["folder"]), "split": "test"},
            "train": {"model": str(data["bert"]), "steps": 4, "batch_size": 8, "warmup_steps": 0, "lr": 1e-3,
                      "max_seq_length": 64, "checkpoint_every": 0, "moco": {"queue_size": 16, "momentum": 0.9},
                      **train},
            "bm25": {"variants": ["flat"]}, "dense": {"batch_size": 16, "max_seq_length": 64},
            "hybrid": {"enabled": False}, "runtime": {"threads": 1}}


def test_defaults_are_contriever_s_and_bad_settings_are_refused_by_key(data):
    c = api.load_config({"flow": "contriever", "dataset": {"name": "slice", "source": str(data["folder"])}})
    assert c.generate.source == "crop" and c.train.loss == "mnrl"
    assert c.train.moco.enabled and c.train.model == "bert-base-uncased"
    with pytest.raises(ConfigError) as err:
        api.load_config(config(data, loss="margin_mse", batch_size=12))
    msg = str(err.value)
    assert "train.loss" in msg and "train" in msg and "Traceback" not in msg
    with pytest.raises(ConfigError, match=r"moco.queue_size: 16 is not a multiple of batch_size 12"):
        api.load_config(config(data, batch_size=12))
    with pytest.raises(ConfigError, match=r"dense.similarity"):
        api.load_config({**config(data), "dense": {"similarity": "dot"}})
    # the evaluation follows the trained similarity unless set
    dot = config(data)
    dot["train"] = {**dot["train"], "similarity": "dot"}
    assert api.load_config(dot).dense.similarity == "dot"
    # a proxy of crop queries would judge a model trained on crop pairs: refused
    own = {**config(data), "dataset": {"name": "docs", "source": str(data["folder"] / "corpus.jsonl"),
                                       "proxy": {"documents": 10, "queries": {"source": "crop"}}}}
    with pytest.raises(ConfigError, match=r"dataset.proxy.queries: crop queries are of the kind of generate.source \(crop\)"):
        api.load_config(own)


def test_contriever_trains_with_moco_evaluates_and_pretrains_gpl(data, prefect_harness):
    store = data["root"] / "store"
    cfg = {**config(data), "promote": {"alias": "contriever"}}
    first = api.run(cfg, store=store)
    assert first.status == "completed"
    assert {"generate_queries[crop]", "train_student[contriever]", "evaluate[contriever]"} <= first.computed
    assert {m["system"] for m in first.metrics} == {"bm25-flat", "dense-bert", "contriever"}
    train = next(s for s in first.stages if s.name == "train_student[contriever]")
    params = json.loads(api.catalog(store).dataset(train.outputs["student"])["params"])  # the stored model's key
    assert params["moco"] == {"enabled": True, "queue_size": 16, "momentum": 0.9, "temperature": None}
    assert params["loss"] == "mnrl"
    assert first.promotion["alias"] == "contriever" and first.promotion["current"] is not None
    student = train.outputs["student"]

    again = api.run(cfg, store=store)
    assert again.computed == set()  # nothing changed: nothing computed
    # cropped keys are another training: keyed once set (left out of the key at their default)
    cropped = {s.name: s for s in api.status({**cfg, "train": {**cfg["train"], "crop_positives": [0.1, 0.5]}},
                                             store=store)}
    assert cropped["train_student[contriever]"].status != "cached"
    assert cropped["generate_queries[crop]"].status == "cached"

    # pre-training before GPL: a GPL config whose students start from an alias's model. The run promoted
    # what it selected (4 steps of a tiny model may not beat its start); the trained model itself is put
    # under an alias of its own, as `irflow models` would after a longer run
    api.catalog(store).set_alias("pretrained", student, reason="the contriever run's model")
    gpl = {"flow": "gpl", "dataset": {"name": "slice", "source": str(data["folder"]), "split": "test"},
           "generate": {"source": "unlabelled", "split": "train"},
           "mine": {"miners": [{"name": "bm25", "type": "bm25"}], "depth": 10},
           "teacher": {"type": "fusion", "weights": {"bm25": 1.0}},
           "label": {"negatives_per_positive": 1, "rank_range": [2, 10]},
           "train": {"model": str(data["bert"]), "init": "pretrained", "steps": 2, "batch_size": 4,
                     "max_seq_length": 64, "warmup_steps": 0, "similarity": "cos", "qgen": {"enabled": False}},
           "bm25": {"variants": ["flat"]}, "dense": {"max_seq_length": 64}, "hybrid": {"enabled": False}}
    plan = {s.name: s for s in api.status(gpl, store=store)}
    assert "encode_corpus[pretrained]" in plan, sorted(plan)  # the alias's model evaluated as the start
    assert plan["train_student[gpl]"].inputs["base_model"] == [student]


def test_cropped_positives_are_spans_of_their_passage_other_than_the_query():
    passage = " ".join(f"w{i}" for i in range(100))
    ex = {"q": ["crop-1", "crop-2"], "p": ["d1", "d1"]}
    whole = positive_texts(ex, {"d1": passage}, None, seed=3)
    assert whole == [passage, passage]
    spans = positive_texts(ex, {"d1": passage}, (0.1, 0.5), seed=3)
    assert spans == positive_texts(ex, {"d1": passage}, (0.1, 0.5), seed=3)  # drawn from seed and pair
    for span in spans:
        assert span in passage and 10 <= len(span.split()) <= 50
    assert spans[0] != spans[1]  # the two pairs of one passage get their own spans
    query = crop_queries("d1", passage, 1, 3)[0]  # the crop source's span of the passage, same seed
    assert query not in spans
    with pytest.raises(ValueError, match="crop_positives: crops the positives"):
        TrainStudentParams(loss="margin_mse", crop_positives=(0.1, 0.5))
    with pytest.raises(ValueError, match=r"crop_positives: \[0.6, 0.2\]"):
        TrainStudentParams(loss="mnrl", crop_positives=(0.6, 0.2))
