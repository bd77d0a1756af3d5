"""DeepCT (irflow.learn.deepct, irflow.stages.deepct, the baselines recipe's deepct section) on a small real SciFact
slice with train queries and a tiny local BERT: the arithmetic by hand, a few training steps, the weighted
corpus, the config rules and the recipe's wiring."""

import math
from collections import Counter

import pyarrow.compute as pc
import pytest
from pydantic import ValidationError

from irflow import api
from irflow.dev.testing import SHARED_DATASETS, beir_slice, ingest_folder, make_tiny_bi_encoder, model
from irflow.engine.errors import ConfigError, DataError
from irflow.engine.runner import Run
from irflow.engine.runtime import RuntimeConfig, StageRuntime
from irflow.engine.worker import torch_threads
from irflow.learn import deepct
from irflow.learn.text import passage_text
from irflow.stages.deepct import DeepCTWeightParams, TrainDeepCTParams, deepct_weight, train_deepct, training_windows

SCIFACT = SHARED_DATASETS / "scifact.zip"
RUNTIME = RuntimeConfig(device="cpu", threads=1)
MAX_LENGTH = 48  # short windows: several per SciFact abstract, so the windowing is exercised


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A SciFact slice (4 test, 12 train queries, their passages and 8 others), ingested; a tiny BERT."""
    root = tmp_path_factory.mktemp("deepct")
    folder = beir_slice(SCIFACT, root / "slice", n_test_queries=4, n_train_queries=12, n_extra_docs=8, seed=3)
    ctx = Run(str(root / "store"), "r", runtime=RUNTIME)
    refs = ingest_folder(ctx, folder)
    bert = make_tiny_bi_encoder(root / "bert", dropout=0.0)
    return {"root": root, "folder": folder, "ctx": ctx, "refs": refs, "bert": bert}


def train_params(**kw) -> TrainDeepCTParams:
    return TrainDeepCTParams(**{"steps": 24, "batch_size": 8, "lr": 1e-3, "warmup": 0.0, "max_length": MAX_LENGTH,
                                "checkpoint_every": 0, "seed": 0, **kw})


@pytest.fixture(scope="module")
def trained(data):
    ctx, refs = data["ctx"], data["refs"]
    return train_deepct.run(ctx, train_params(), corpus=refs["corpus"], queries=refs["queries"], qrels=refs["qrels"],
                            model=model(ctx, data["bert"]))


# ---- the arithmetic, by hand -------------------------------------------------------------------------
def test_query_term_recall_and_word_targets_by_hand():
    assert deepct.words("COVID-19 Vaccines, e.g. mRNA-1273!") == ["covid", "19", "vaccines", "e", "g", "mrna", "1273"]
    # two relevant queries, one has "vaccine": 0.5; both have "covid": 1; a word twice in a query counts once
    recall = deepct.query_term_recall(["covid vaccine vaccine safety", "COVID mortality"])
    assert recall == {"covid": 1.0, "vaccine": 0.5, "safety": 0.5, "mortality": 0.5}
    # every relevant query counts in |Q_d|, a query without words too
    assert deepct.query_term_recall(["covid", "", "covid trials"]) == {"covid": 2 / 3, "trials": 1 / 3}
    assert deepct.query_term_recall([]) == {}
    passage = deepct.words("The vaccine reduced COVID mortality; the vaccine is safe.")
    assert deepct.word_targets(passage, recall) == [0.0, 0.5, 0.0, 1.0, 0.5, 0.0, 0.5, 0.0, 0.0]


def test_term_frequencies_from_weights_and_the_weighted_text():
    assert deepct.tf_from_weight(-0.3) == 0 and deepct.tf_from_weight(0.0) == 0 and deepct.tf_from_weight(0.004) == 0
    assert deepct.tf_from_weight(0.2) == 20 and deepct.tf_from_weight(0.2, scale=10) == 2
    assert deepct.tf_from_weight(0.125) == 12 and deepct.tf_from_weight(0.375) == 38  # 12.5, 37.5: half to even
    assert deepct.tf_from_weight(0.016) == 2 and deepct.tf_from_weight(math.nan) == 0
    words = ["vaccine", "the", "covid", "vaccine", "trial", "odd"]
    # per word the largest tf' of its occurrences; tf' 0 and no weight (None) leave a word out
    tfs = deepct.term_frequencies(words, [0.02, -1.0, 0.031, 0.05, 0.001, None])
    assert tfs == {"vaccine": 5, "covid": 3}
    assert deepct.weighted_text(tfs) == "vaccine vaccine vaccine vaccine vaccine covid covid covid"
    assert deepct.weighted_text({}) == ""
    with pytest.raises(ValueError):
        deepct.term_frequencies(words, [0.1])


def test_word_windows_cut_at_word_boundaries():
    assert deepct.word_windows([1, 2, 1, 3, 1], 4) == [(0, 3), (3, 5)]
    assert deepct.word_windows([1, 6, 1], 4) == [(0, 1), (1, 2), (2, 3)]  # a word too long: a window of its own
    assert deepct.word_windows([0, 1, 0], 1) == [(0, 3)]  # words without pieces ride along
    assert deepct.word_windows([], 4) == []


def test_targets_sit_on_each_words_first_wordpiece(data):
    tok = deepct.load_tokenizer(str(data["bert"]))
    enc, firsts = deepct.encode_windows(tok, [["unbelievably", "cat"], ["cat"]], 16)
    tokens = enc.tokens(0)
    assert [tokens[i] for i, _ in firsts[0]] == ["un", "cat"] and [w for _, w in firsts[0]] == [0, 1]
    assert tokens[2].startswith("##")  # "unbelievably"'s other pieces: masked out
    assert firsts[1] == [(1, 0)]
    # windows of a long passage: each fits max_length with [CLS] and [SEP], and they cover every word
    passage = deepct.words(" ".join(["unbelievably tiny cat"] * 12))
    (spans,) = deepct.passage_windows(tok, [passage], 16)
    assert spans[0][0] == 0 and spans[-1][1] == len(passage) and len(spans) > 2
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))
    enc, _ = deepct.encode_windows(tok, [passage[a:b] for a, b in spans], 16)
    assert enc["input_ids"].shape[1] <= 16


# ---- train_deepct --------------------------------------------------------------------------------------
def test_training_windows_are_the_passages_with_relevant_train_queries(data):
    refs = data["refs"]
    corpus, queries, qrels = refs["corpus"].table(), refs["queries"].table(), refs["qrels"].table()
    tok = deepct.load_tokenizer(str(data["bert"]))
    examples, passages = training_windows(corpus, queries, qrels, "train", tok, MAX_LENGTH)
    train = qrels.filter(pc.equal(qrels.column("split"), "train"))
    relevant_docs = set(train.column("doc_id").to_pylist()) & set(corpus.column("doc_id").to_pylist())
    assert passages == len(relevant_docs) > 5 and len(examples) > passages  # long abstracts: several windows
    assert all(len(ex["words"]) == len(ex["targets"]) > 0 for ex in examples)
    assert all(0.0 <= t <= 1.0 for ex in examples for t in ex["targets"])
    assert any(t == 1.0 for ex in examples for t in ex["targets"])  # a query word in its passage
    with pytest.raises(DataError, match="no positive qrels in split 'dev'"):
        training_windows(corpus, queries, qrels, "dev", tok, MAX_LENGTH)


def test_a_few_training_steps_reduce_the_loss_and_save_a_model_that_loads(data, trained):
    from transformers import AutoModelForTokenClassification

    losses = trained["training_losses"].table().column("loss").to_pylist()
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses  # measured: 0.61 x
    path = trained["deepct_model"].path
    net = AutoModelForTokenClassification.from_pretrained(path)
    assert net.config.num_labels == 1 and deepct.load_tokenizer(path).is_fast
    # cached on its params and inputs: the same call computes nothing
    ctx, refs = data["ctx"], data["refs"]
    again = train_deepct.run(ctx, train_params(), corpus=refs["corpus"], queries=refs["queries"], qrels=refs["qrels"],
                             model=model(ctx, data["bert"]))
    assert ctx.catalog.stage_runs(ctx.run_id)[-1]["status"] == "cached"
    assert again["deepct_model"].id == trained["deepct_model"].id
    with pytest.raises(ValidationError, match="warmup"):
        TrainDeepCTParams(warmup=1.0)
    with pytest.raises(ValidationError, match="extra"):
        TrainDeepCTParams(lrr=1e-3)


# ---- deepct_weight ---------------------------------------------------------------------------------------
def test_weighted_corpus_repeats_each_word_by_its_predicted_tf(data, trained):
    import torch
    from transformers import AutoModelForTokenClassification

    ctx, corpus = data["ctx"], data["refs"]["corpus"]
    params = DeepCTWeightParams(max_length=MAX_LENGTH, batch_size=4)
    out = deepct_weight.run(ctx, params, corpus=corpus, model=trained["deepct_model"])  # validated as a corpus
    assert out.contract == "corpus"
    t, c = out.table(), corpus.table()
    assert t.column("doc_id").to_pylist() == c.column("doc_id").to_pylist()
    assert set(t.column("title").to_pylist()) == {""}
    texts = t.column("text").to_pylist()
    assert sum(len(x.split()) for x in texts) > 5 * len(texts)  # the model gives words weight
    # By hand: each passage's words, one window at a time (no batch), first wordpiece's output -> tf'.
    path = trained["deepct_model"].path
    tok, net = deepct.load_tokenizer(path), AutoModelForTokenClassification.from_pretrained(path).eval()
    checked = 0
    with torch_threads(1):  # one intra-op thread: on a busy shared CPU it avoids OpenMP spin-waiting
        for title, text, new in zip(c.column("title").to_pylist(), c.column("text").to_pylist(), texts):
            words = deepct.words(passage_text(title, text))
            expected: dict[str, int] = {}
            for a, b in deepct.passage_windows(tok, [words], MAX_LENGTH)[0]:
                enc = tok([words[a:b]], is_split_into_words=True, truncation=True, max_length=MAX_LENGTH,
                          return_tensors="pt")
                with torch.inference_mode():
                    pred = net(**enc).logits[0, :, 0].tolist()
                seen = set()
                for i, wid in enumerate(enc.word_ids(0)):
                    if wid is not None and wid not in seen:
                        seen.add(wid)
                        tf = round(max(0.0, pred[i]) * 100)
                        if tf > expected.get(words[a + wid], 0):
                            expected[words[a + wid]] = tf
            assert Counter(new.split()) == expected
            assert set(new.split()) <= set(words)
            checked += 1
    assert checked == c.num_rows
    # scale is keyed: another corpus, each tf' a tenth (as rounded)
    tenth = deepct_weight.run(ctx, DeepCTWeightParams(max_length=MAX_LENGTH, batch_size=4, scale=10), corpus=corpus,
                              model=trained["deepct_model"])
    assert tenth.id != out.id
    assert sum(len(x.split()) for x in tenth.table().column("text").to_pylist()) < sum(len(x.split()) for x in texts)


def test_weighting_in_shards_gives_the_corpus_of_one_shard(data, trained):
    corpus = data["refs"]["corpus"]
    params = DeepCTWeightParams(max_length=MAX_LENGTH, batch_size=4)
    whole = deepct_weight.run(data["ctx"], params, corpus=corpus, model=trained["deepct_model"])
    ctx = Run(str(data["root"] / "store-sharded"), "r", runtime=RUNTIME.model_copy(update={"shard_rows": 6}))
    sharded = deepct_weight.run(ctx, params, corpus=corpus, model=trained["deepct_model"])
    assert sharded.table().equals(whole.table()) and sharded.id == whole.id


def test_weighting_with_a_model_without_a_head_is_refused(data):
    with pytest.raises(DataError, match="no token-regression head"):
        deepct_weight.fn(DeepCTWeightParams(), StageRuntime(), corpus=data["refs"]["corpus"],
                         model=model(data["ctx"], data["bert"]))


# ---- the baselines recipe ------------------------------------------------------------------------------------
def baselines_config(data, **deepct) -> dict:
    return {"flow": "baselines", "dataset": {"name": "slice", "source": str(data["folder"]), "split": "test"},
            "bm25": {"variants": ["flat"], "depth": 100}, "dense": {"enabled": False},
            "deepct": deepct, "runtime": {"threads": 1}}


def test_baselines_config_with_deepct(data, tmp_path):
    off = api.load_config(baselines_config(data))
    assert off.deepct.enabled is False and off.deepct.model is None  # nothing to load (nor check offline)
    assert api.load_config({k: v for k, v in baselines_config(data).items() if k != "deepct"}).deepct == off.deepct
    on = api.load_config(baselines_config(data, enabled=True, steps=5))
    assert on.deepct.model == "bert-base-uncased" and on.deepct.steps == 5  # the paper's encoder, by hub id
    explained = {key: default for key, default, _ in type(on).explain()}
    assert explained["deepct.model"].startswith("= bert-base-uncased when deepct.enabled")
    assert explained["deepct.enabled"] == "False" and explained["deepct.scale"] == "100"
    # refused: training on the evaluated split, a split the dataset lacks, and a dataset with no train split
    with pytest.raises(ConfigError, match=r"deepct\.split: 'test' is the evaluated split"):
        api.load_config(baselines_config(data, enabled=True, split="test"))
    with pytest.raises(ConfigError, match=r"deepct\.enabled: .* no split 'dev'"):
        api.load_config(baselines_config(data, enabled=True, split="dev"))
    no_train = beir_slice(SCIFACT, tmp_path / "no-train", n_test_queries=3, n_extra_docs=5)
    cfg = baselines_config(data, enabled=True)
    cfg["dataset"]["source"] = str(no_train)
    with pytest.raises(ConfigError) as err:
        api.load_config(cfg)
    assert "deepct.enabled: DeepCT learns term weights from the queries judged in a train split" in str(err.value)
    assert "no split 'train'" in str(err.value) and "its qrels: test" in str(err.value)
    cfg["deepct"]["enabled"] = False
    api.load_config(cfg)  # off: fine without a train split
    with pytest.raises(ConfigError, match=r"deepct\.scale"):
        api.load_config(baselines_config(data, scale=0))


def test_baselines_plan_with_deepct_trains_weights_indexes_and_evaluates_it(data, tmp_path):
    cfg = baselines_config(data, enabled=True, model=str(data["bert"]), steps=2, max_length=MAX_LENGTH)
    labels = [s.name for s in api.status(cfg, store=tmp_path / "store")]
    assert {"train_deepct", "deepct_weight", "bm25_index[flat-deepct]", "bm25_search[flat-deepct]",
            "evaluate[bm25-deepct]", "bm25_search[flat]", "evaluate[bm25-flat]"} <= set(labels)
    assert labels.index("train_deepct") < labels.index("deepct_weight") < labels.index("bm25_index[flat-deepct]")
    off = [s.name for s in api.status(baselines_config(data), store=tmp_path / "store")]
    assert not any("deepct" in name for name in off)


def test_baselines_run_with_deepct_evaluates_bm25_over_the_weighted_corpus(data, tmp_path, prefect_harness):
    """The recipe end to end on the slice (a few seconds of tiny-model work, two Lucene indexes)."""
    cfg = baselines_config(data, enabled=True, model=str(data["bert"]), steps=4, batch_size=8, lr=1e-3,
                           max_length=MAX_LENGTH, k1=1.2)
    result = api.run(cfg, store=tmp_path / "store")
    assert result.status == "completed"
    assert {"train_deepct", "deepct_weight", "bm25_index[flat-deepct]", "bm25_search[flat-deepct]",
            "evaluate[bm25-deepct]"} <= result.computed
    assert {m["system"] for m in result.metrics} == {"bm25-flat", "bm25-deepct"}
    assert 0.0 <= result.metric("bm25-deepct") <= 1.0
