"""The time a run is promised: estimates calibrated by what the store measured on this hardware with free
cores, a busy machine said, an overrun announced once with the new finishing time, and the estimate read
from each stage's own params."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest

from irflow.engine import pace
from irflow.engine.catalog import Catalog
from irflow.tools import estimate

ROOT = Path(__file__).resolve().parents[1]
HW = estimate.Hardware("cpu-avx2", 2, None, 8000)


def test_an_overrun_is_announced_once_with_the_finishing_time_at_the_pace_going():
    started = datetime(2026, 12, 5, 22, 0).timestamp()
    p = pace.Pace({"ingest": 2, "encode_corpus[zero-shot]": 200, "train_student[gpl]": 1800}, started=started)
    assert p.stage_done("ingest", 2.5, now=started + 3) is None  # a twentieth of the run must be done first
    said = p.stage_done("encode_corpus[zero-shot]", 500, now=started + 503)
    # 502.5 s for stages estimated at 202 s: 2.5x; training left at that pace ends 4,478 s later
    assert said and "2.5x slower" in said and "ends about 23:23" in said and "not 22:33" in said
    assert p.stage_done("train_student[gpl]", 4000) is None  # said once
    on_time = pace.Pace({"a": 100, "b": 100})
    assert on_time.stage_done("a", 140) is None and on_time.stage_done("b", 140) is None


def _stage(catalog: Catalog, run_id: str, stage: str, seconds: float, load: float, kind: str, prior: float,
           hardware: str, load_then: float = 0.3) -> None:
    catalog.record_stage_run(run_id, stage, "k-" + stage, "computed", {}, seconds, datetime.now(), {},
                             {"threads": 2, "load": [load, load]})
    catalog.record_estimates(run_id, [{"stage": stage, "kind": kind, "prior": prior, "seconds": prior}],
                             hardware, load_then)


def test_estimates_are_calibrated_by_the_stages_this_store_ran_here_with_free_cores(tmp_path):
    catalog = Catalog(tmp_path / "catalog.duckdb")
    catalog.start_run("r1", "gpl", None, {})
    here = estimate.hardware_key(HW)
    assert estimate.calibration(catalog, HW) is None  # nothing measured yet: the shipped rates stand
    _stage(catalog, "r1", "train_student[gpl]", 90, 2.1, "train", 200, here)  # own 2 threads: free cores
    _stage(catalog, "r1", "train_student[qgen]", 110, 2.0, "train", 200, here)
    _stage(catalog, "r1", "encode_corpus[zero-shot]", 400, 6.0, "encode", 100, here)  # 4 other processes: busy
    _stage(catalog, "r1", "encode_corpus[gpl-student]", 300, 2.0, "encode", 100, here, load_then=3.5)  # busy then
    _stage(catalog, "r1", "dense_search[zero-shot]", 30, 2.0, "encode", 3, here)  # too short to tell a rate
    _stage(catalog, "r1", "bm25_search[flat]", 50, 2.0, "bm25", 10, "another CPU / 2 cores")
    c = estimate.calibration(catalog, HW)
    # the stage itself, its kind of stage, its kind of work: each estimate takes the finest measured
    assert c.factors == {"train_student[gpl]": (0.45, 1), "train_student[qgen]": (0.55, 1),
                         "train_student": (0.5, 2), "train": (0.5, 2)}
    rows = [estimate.StageEstimate("train_student[gpl]", 1000, 1, "w", "train"),
            estimate.StageEstimate("train_student[contriever]", 1000, 1, "w", "train"),
            estimate.StageEstimate("train_dual_encoder[star]", 1000, 1, "w", "train"),
            estimate.StageEstimate("encode_corpus[x]", 100, 1, "w", "encode")]
    assert [r.seconds for r in c.apply(rows)] == [450, 500, 500, 100]
    text = estimate.format_estimates(c.apply(rows), HW, calibrated=c, load=0.2)
    assert ("train x0.50 (2 stage runs), train_student x0.50 (2 stage runs), train_student[gpl] x0.45 (1 stage "
            "run)" in text and "qgen" not in text and "warning" not in text)
    busy = estimate.format_estimates(rows, HW, load=3.0)
    assert "other processes keep 3.0 of the 2 cores busy" in busy and "expect about 2.5x" in busy
    assert "--set runtime.threads=1" in busy  # the threads that do not wait on the other run's
    from datetime import datetime

    at_noon = datetime(2026, 12, 6, 12, 0).timestamp()  # 2,600 s of stages at 2.5x: 6,500 s
    note = estimate.load_note(HW, 3.0, None, 2600, now=at_noon)
    assert "(it then ends about 13:48, not 12:43)" in note and "each other; about 19:13)" in note  # 10x: 26,000 s
    given = estimate.format_estimates(rows, HW, load=1.6, threads=1)  # already at the cores left free
    assert "expect about 1.8x" in given and "--set" not in given and "at runtime.threads=1" in given
    # the run's pace is judged as busy exactly when this warning is printed (one threshold), never on a GPU
    from irflow.api import RunEstimate

    gpu = estimate.Hardware("cuda", 16, "H100", 80000)
    for hw, load in [(HW, None), (HW, 0.2), (HW, 1.0), (HW, 1.1), (HW, 3.0), (gpu, 12.0)]:
        warned = "warning" in estimate.format_estimates(rows, hw, load=load)
        assert RunEstimate(rows, rows, hw, None, load).busy is warned is (load is not None and load > 1.0
                                                                              and hw is HW)


def test_the_qgen_baseline_without_steps_of_its_own_is_estimated_at_gpls(tmp_path):
    """train.qgen.steps: null (the QGen baseline trains as long as GPL) is estimated from the stage's params."""
    from irflow.recipes.base import load_config

    c = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), ["train.qgen.steps=null"])
    size = estimate.CorpusSize(5183, 200, 300, 809)
    gpl, qgen = estimate.estimate(c, ["train_student[gpl]", "train_student[qgen]"], size, HW)
    assert gpl.work == qgen.work == "388 steps of 16" and gpl.kind == qgen.kind == "train"
    assert qgen.seconds < gpl.seconds  # MNRL: a (query, positive) pair a row, no negative
    assert pytest.approx(gpl.seconds, rel=0.01) == estimate.estimate(c, ["train_student[gpl]"], size, HW,
                                                                     {"train_student[gpl]": c.train.gpl_params()
                                                                      .model_dump()})[0].seconds
    # scale: auto fits the margins' scale on a sample of 1,000 triples, each encoded by the student
    label = estimate.estimate(c, ["pseudo_label"], size, HW)[0]
    assert label.kind == "encode" and label.work.startswith("1,000 triples (")
    fixed = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), ["label.scale=1.0"])
    assert estimate.estimate(fixed, ["pseudo_label"], size, HW)[0].work == "fixed cost"
    assert label.seconds > 10 * estimate.estimate(fixed, ["pseudo_label"], size, HW)[0].seconds


def test_encoding_generation_and_labelling_are_estimated_from_the_stages_own_params():
    """The plan's params of a stage, not a second copy of the config's, size its work: a shorter encoding
    length, fewer sampled queries per passage, fewer negatives to score, each a smaller estimate."""
    from irflow.recipes.base import load_config

    c = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), [])
    size = estimate.CorpusSize(5183, 300, 300, 809)
    enc = "encode_corpus[zero-shot]"
    long_, short = (estimate.estimate(c, [enc], size, HW, {enc: {"max_seq_length": n}})[0] for n in (350, 64))
    assert short.seconds < long_.seconds and short.work.endswith("x 64 tokens")
    # no length of its own: a planned student is encoded at the length it trains at (it is saved with it)
    student = "encode_corpus[gpl-student]"
    own = estimate.estimate(c, [student], size, HW, {student: {"max_seq_length": None},
                                                     "train_student[gpl]": {"max_seq_length": 200}},
                            inputs={student: {"model": ["<train_student[gpl]:student>"]}})[0]
    assert own.work.endswith("x 200 tokens")
    gen = "generate_queries[t5]"
    one, five = (estimate.estimate(c, [gen], size, HW, {gen: {"queries_per_passage": n}})[0] for n in (1, 5))
    assert (one.work, five.work) == ("5,183 queries sampled", "25,915 queries sampled") and one.seconds < five.seconds
    teacher = {"type": "cross_encoder", "max_length": 350}
    few, many = (estimate.estimate(c, ["label_scores"], size, HW,
                                   {"label_scores": {"teacher": teacher, "negatives_per_positive": n}})[0]
                 for n in (1, 15))
    assert few.kind == many.kind == "score" and few.seconds < many.seconds
    assert few.work == "1,618 (query, passage) pairs scored"  # 809 log queries x (1 + 1)
    # the held-out log's judgements: its queries x the miners' candidates, scored by the cross-encoder
    judged = estimate.estimate(c, ["judge_queries"], size, HW, {"judge_queries": {"teacher": teacher}},
                               {"judge_queries": 160})[0]
    assert judged.kind == "score" and judged.work == "12,000 (query, passage) pairs judged"  # 160 x 50 x 1.5


def test_a_budget_too_small_for_the_run_says_how_long_it_needs(tmp_path):
    """`irflow new --budget-minutes 2` on the sample's 1,358 documents: encoding and searching alone take
    longer, so it says the budget cannot hold and how many minutes would; 60 minutes says nothing."""
    import zipfile

    from irflow.tools import scaffold

    with zipfile.ZipFile(ROOT / "irflow" / "samples" / "scifact-sample.zip") as z:
        name = min((n for n in z.namelist() if n.endswith("corpus.jsonl")), key=len)
        (tmp_path / "corpus.jsonl").write_bytes(z.read(name))
    _, _, tight = scaffold.new_config("gpl", str(tmp_path / "corpus.jsonl"), budget_minutes=2)
    said = [w for w in tight.warnings if "--budget-minutes 2 is less than this run needs" in w]
    assert said and "give it" in said[0]
    _, _, ample = scaffold.new_config("gpl", str(tmp_path / "corpus.jsonl"), budget_minutes=60)
    assert not [w for w in ample.warnings if "less than this run needs" in w]


def test_a_long_stage_running_slow_is_said_while_it_runs():
    """A stage still computing counts once it outlasts its estimate (its estimate covered, every second
    measured): the overrun is said during a slow encoding, not only when it ends; and said again when the pace
    becomes twice as slow as it said (the finishing time it gave no longer holds)."""
    started = datetime(2026, 12, 5, 22, 0).timestamp()
    p = pace.Pace({"bm25_index": 10, "encode_corpus[zero-shot]": 100, "train_student[gpl]": 900}, started=started)
    assert p.stage_done("bm25_index", 12, now=started + 12) is None
    p.stage_started("encode_corpus[zero-shot]", now=started + 12)
    assert p.check(now=started + 12 + 90) is None  # within its estimate: nothing known yet
    assert p.check(now=started + 12 + 150) is None  # (12 + 150) s for (10 + 100) s estimated: 1.47x
    said = p.check(now=started + 12 + 160)  # 172 s for 110 s: 1.56x, the encoding still running
    assert said and "1.6x slower than its estimate" in said
    assert p.check(now=started + 12 + 300) is None  # 2.8x: not twice the pace said, the time said stands
    again = p.stage_done("encode_corpus[zero-shot]", 400)  # 412 s for 110: 3.7x, over twice the 1.6x said
    assert again and "now going 3.7x slower" in again
    assert p.check(now=started + 12 + 500) is None  # said again once, until the pace doubles again


def test_an_encoding_whose_passages_an_earlier_one_encoded_is_estimated_at_the_rest():
    """The zero-shot model's corpus after the miner's training corpus (same model, same settings): the
    held-out fraction is left to encode (the rest is reused row by row); another model encodes it all."""
    from irflow.recipes.base import load_config

    c = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), [])
    size = estimate.CorpusSize(5183, 200, 300, 809)
    enc = {"similarity": "cos", "batch_size": 64, "max_seq_length": None, "quantization": "none"}
    labels = ["encode_corpus[miner-minilm]", "encode_corpus[zero-shot]", "encode_corpus[gpl-student]"]
    inputs = {labels[0]: {"corpus": ["<holdout:train_corpus>"], "model": ["minilm"]},
              labels[1]: {"corpus": ["corpus-1"], "model": ["minilm"]},
              labels[2]: {"corpus": ["corpus-1"], "model": ["<train_student[gpl]:student>"]}}
    miner, zero, student = estimate.estimate(c, labels, size, HW, dict.fromkeys(labels, enc), None, inputs)
    assert miner.work.startswith("5,183 passages") and student.work.startswith("5,183 passages")
    assert zero.work.startswith("518 passages") and zero.seconds < miner.seconds / 5


def test_the_estimate_counts_the_cores_other_processes_keep_busy_now():
    """Not the one-minute load average, in which a run that has just ended still counts: the busy share of
    /proc/stat's ticks over half a second, while this process waits."""
    import subprocess
    import sys

    from irflow.engine import runtime

    assert runtime.busy_between((100, 400), (150, 500), cores=2) == 1.0  # half the ticks busy on 2 cores
    assert runtime.busy_between((100, 400), (100, 400), cores=2) == 0.0
    if runtime.cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        assert runtime.others_busy(0.5) >= 0.5  # a process spinning on one core
    finally:
        spin.kill()
        spin.wait()


def test_listwise_training_is_estimated_with_every_negative_of_a_query():
    """loss listwise_kl encodes a query, its positive and all its negatives each example (the demo: 4), where
    margin_mse encodes one triple: measured 2.3x the margin_mse-shaped estimate (estimates_series_idle.json)."""
    from irflow.recipes.base import load_config

    size = estimate.CorpusSize(1358, 200, 300, 809)
    margin, listwise = (estimate.estimate(load_config(str(ROOT / "configs" / "demo.yaml"), sets),
                                          ["train_student[gpl]"], size, HW)[0]
                        for sets in ([], ["train.loss=listwise_kl"]))
    assert margin.work == listwise.work == "40 steps of 16"
    assert listwise.seconds > 1.7 * margin.seconds


def test_searches_and_pair_scoring_grow_with_their_depth_and_pairs():
    """BM25 search time grows with the hits a query fetches (the evaluation's 1,000 against a miner's 50); the
    teacher's scoring of every candidate with its (query, passage) pairs; a search reading generated training
    queries counts those, one reading the proxy's (generated from held-out passages) the evaluation's."""
    from irflow.recipes.base import load_config

    c = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), [])
    size = estimate.CorpusSize(5183, 200, 300, 809)
    miner, flat = "bm25_search[miner-bm25]", "bm25_search[flat]"
    got = estimate.estimate(c, [miner, flat], size, HW, {miner: {"depth": 50}, flat: {"depth": 1000}},
                            {miner: 809, flat: 809})
    assert got[0].work == "809 queries searched to 50" and got[1].work == "809 queries searched to 1000"
    assert got[1].seconds > 5 * got[0].seconds - 10
    scored = estimate.estimate(c, ["bm25_score[teacher-bm25]", "dense_score[teacher-minilm]"], size, HW, {},
                               {"bm25_score[teacher-bm25]": 100, "dense_score[teacher-minilm]": 100})
    pairs = int(100 * c.mine.depth * 1.5)
    assert [e.work for e in scored] == [f"{pairs:,} (query, passage) pairs scored"] * 2
    assert [e.kind for e in scored] == ["bm25", "encode"]
    inputs = {miner: {"queries": ["<generate_queries[ict]:queries>"]},
              flat: {"queries": ["<generate_queries[proxy]:queries>"]}}
    ict = load_config(str(ROOT / "configs" / "gpl_scifact_offline.yaml"), ["generate={source: ict}"])
    counted = estimate.estimate(ict, [miner, flat], size, HW, {miner: {"depth": 50}, flat: {"depth": 1000}},
                                inputs=inputs)
    assert counted[0].work.startswith("5,183 queries") and counted[1].work.startswith("300 queries")


def test_the_demo_is_estimated_from_its_own_counts_and_a_repeated_computation_is_a_cache_hit(tmp_path):
    """The sample's 100 judged test queries and 300 train queries are counted (not guessed); passages are read at
    their own length up to the cap; the zero-shot model's encoding of the corpus, planned after the miner's
    identical one (same params, same inputs: one cache key), costs nothing."""
    from irflow import api

    size = estimate.corpus_size(api.load_config(str(ROOT / "configs" / "demo.yaml")).dataset)
    assert size.queries == 100 and len(size.train_positives) == 300 and len(size.word_quantiles) == 20
    assert size.tokens(64) == 64 and size.tokens(160) < 160 and size.tokens(10_000) == pytest.approx(
        size.mean_tokens, rel=0.1)
    rows = {r.stage: r for r in api.estimate(str(ROOT / "configs" / "demo.yaml"), store=tmp_path / "s").rows}
    assert rows["encode_corpus[miner-minilm]"].seconds > 10
    assert rows["encode_corpus[zero-shot]"].seconds == 0 and rows["encode_corpus[zero-shot]"].work.startswith(
        "computed above")
    assert rows["bm25_search[flat]"].work == "100 queries searched to 1000"
    assert rows["bm25_search[miner-bm25]"].work == "300 queries searched to 30"
    # RocketQA's cross-encoder reading candidates: the train split's 300 queries x its top 20, the 100 test
    # queries x the re-ranking's top 20 (each measured 17-84 s on the sample)
    rocketqa = {r.stage: r for r in api.estimate(str(ROOT / "configs" / "rocketqa_demo.yaml"),
                                                 store=tmp_path / "s").rows}
    assert rocketqa["score_candidates[ce]"].work == "6,000 (query, passage) pairs scored"
    assert rocketqa["rerank[mc]"].work == "2,000 (query, passage) pairs scored"
    assert rocketqa["score_candidates[fusion]"].work == "fixed cost"


def test_an_encoding_reports_its_progress_to_the_pace_as_a_share_of_its_part(tmp_path):
    """A corpus encoding says how far it is (by its batches' tokens), so a slow one is said before it outlasts its
    estimate; run as the second of two shards here, its shares are of that half of the stage."""
    from irflow.dev.testing import make_tiny_bi_encoder
    from irflow.learn.encoding import encode_texts, load_sentence_transformer

    st = load_sentence_transformer(str(make_tiny_bi_encoder(tmp_path / "m")))
    texts = [" ".join(["word"] * (3 + 7 * i)) for i in range(24)]
    pace.expect("r-enc", {"encode_corpus[x]": 100})
    try:
        pace.stage_started("r-enc", "encode_corpus[x]")
        p, seen = pace._PACES["r-enc"], []
        reported = p.stage_progress
        p.stage_progress = lambda label, share, now=None: seen.append(share) or reported(label, share, now)
        with pace.computing("r-enc", "encode_corpus[x]"), pace.part(1, 2):
            encode_texts(st, texts, batch_size=4, normalize=True)
    finally:
        pace.forget("r-enc")
    assert len(seen) >= 6 and seen[0] == 0.5 and seen == sorted(seen) and seen[-1] < 1.0
    assert p.progress["encode_corpus[x]"] == seen[-1]


def test_a_stages_start_up_is_not_taken_for_its_pace():
    """An encoding whose model took 30 s to load, then encodes at its estimated pace, is not said to overrun: its
    progress counts from its first report; one that then goes 2x slower is."""
    p = pace.Pace({"encode_corpus[x]": 100, "train_student[gpl]": 100}, started=0.0)
    p.stage_started("encode_corpus[x]", now=0.0)
    assert p.stage_progress("encode_corpus[x]", 0.0, now=30.0) is None  # the first batch, after the load
    # 30 s for 30 s estimated since the first batch (counted from the stage's start: 60 s for 30, "2.0x")
    assert p.stage_progress("encode_corpus[x]", 0.3, now=60.0) is None and p.said is None
    slow = pace.Pace({"encode_corpus[x]": 100, "train_student[gpl]": 100}, started=0.0)
    slow.stage_started("encode_corpus[x]", now=0.0)
    slow.stage_progress("encode_corpus[x]", 0.0, now=30.0)
    assert slow.stage_progress("encode_corpus[x]", 0.25, now=80.0) and "2.0x slower" in slow.said


def test_a_run_estimated_on_busy_cores_is_judged_sooner():
    """A training going 1.7x: on cores the estimate found free the pace waits for 10 s of estimated steps; on cores
    it found busy (its load warning), 5 s are enough."""
    said = {}
    for busy in (False, True):
        p = pace.Pace({"train_student[gpl]": 136.0, "encode_corpus[gpl-student]": 28.0}, started=0.0, busy=busy)
        p.stage_started("train_student[gpl]", now=15.0)
        p.stage_progress("train_student[gpl]", 1 / 85, now=18.0)  # the first step, after the model's load
        for step in range(2, 86):
            if p.stage_progress("train_student[gpl]", step / 85, now=18.0 + 1.6 * 1.7 * (step - 1)):
                said[busy] = 18.0 + 1.6 * 1.7 * (step - 1)
                break
    step = 1.6 * 1.7
    assert said[False] == pytest.approx(18.0 + 7 * step) and said[True] == pytest.approx(18.0 + 4 * step)
    # at 8x: on busy cores once 15 s are measured past the first step (2 s of estimate), on free ones not yet
    for busy in (True, False):
        fast = pace.Pace({"train_student[gpl]": 76.0, "encode_corpus[gpl-student]": 20.0}, started=0.0, busy=busy)
        fast.stage_started("train_student[gpl]", now=10.0)
        fast.stage_progress("train_student[gpl]", 1 / 38, now=50.0)  # a first step of 40 s
        assert fast.stage_progress("train_student[gpl]", 1.5 / 38, now=58.0) is None  # 8 s measured
        said_now = fast.stage_progress("train_student[gpl]", 2 / 38, now=66.0)  # 16 s for 2 s estimated
        assert ("8.0x slower" in said_now) if busy else said_now is None


def test_a_training_batch_is_estimated_at_the_length_of_its_longest_passage():
    """An encoding groups passages by length; a training batch's column is padded to its longest: with a few
    long passages among short ones, a batch of 16 reads about the cap, the corpus's mean read far less."""
    words = [60] * 80 + [400] * 20  # 20% of the passages past a 256-token cap
    size = estimate.CorpusSize(100, sum(words) / len(words), word_quantiles=estimate.quantiles(words))
    assert size.tokens(256) == pytest.approx(0.8 * 60 * estimate.WORDS_TO_TOKENS + 0.2 * 256)
    assert size.padded_tokens(256, 16) == 256 and size.padded_tokens(256, 1) < 256
    assert estimate.CorpusSize(100, 100).padded_tokens(256, 16) == estimate.CorpusSize(100, 100).tokens(256)


def test_a_training_token_costs_more_in_a_longer_passage():
    """A step at 200 tokens costs more than 200/160 of one at 160 (attention reads every other token of the
    passage: rates.json's length_cost, measured at both lengths); at the rate's own length, the rate itself."""
    from irflow.recipes.base import load_config

    c = load_config(str(ROOT / "configs" / "demo.yaml"), [])
    size = estimate.CorpusSize(1000, 400)  # every passage past either cap
    label = "train_student[gpl]"
    step = {n: estimate.estimate(c, [label], size, HW, {label: {**c.train.gpl_params().model_dump(), "steps": 100,
                                                                "max_seq_length": n}})[0].seconds for n in (160, 200)}
    load = estimate.rates()["fixed_seconds"]["value"]["model_load"]
    tokens = {n: 16 * estimate.QUERY_TOKENS + 32 * n for n in (160, 200)}
    per_token = {n: (step[n] - load) / tokens[n] for n in (160, 200)}
    assert per_token[160] * 1000 / 100 == pytest.approx(estimate._rate(HW, "train"), rel=0.01)
    assert per_token[200] > 1.1 * per_token[160]


def test_a_corpus_tokens_are_counted_with_the_models_tokenizer():
    """Scientific words split into more word pieces than English prose: a sample of the sample's passages is
    counted with MiniLM's own tokenizer (within 3% of counting them all), and the estimate reads passages and
    padded training batches at that count; a model that is not here leaves the prior's tokens a word."""
    import json
    import zipfile

    from irflow import api

    d = api.load_config(str(ROOT / "configs" / "demo.yaml")).dataset
    size = estimate.corpus_size(d, model="all-MiniLM-L6-v2")
    with zipfile.ZipFile(ROOT / d.source) as z:
        name = next(n for n in z.namelist() if n.endswith("corpus.jsonl"))
        texts = [json.loads(line)["text"] for line in z.read(name).decode().splitlines() if line.strip()]
    tok = estimate.local_tokenizer("all-MiniLM-L6-v2")
    pieces = sum(len(x) for x in tok(texts, add_special_tokens=False)["input_ids"])
    assert size.tokens_per_word == pytest.approx(pieces / sum(len(t.split()) for t in texts), rel=0.03)
    assert size.tokens_per_word > 1.4  # SciFact's abstracts
    prior = estimate.corpus_size(d, model=str(ROOT / "no-such-model"))
    assert prior.tokens_per_word == estimate.WORDS_TO_TOKENS
    assert size.tokens(10_000) == pytest.approx(prior.tokens(10_000) * size.tokens_per_word / prior.tokens_per_word)
    assert size.padded_tokens(100, 16) == prior.padded_tokens(100, 16) == 100  # past the cap either way


def test_an_overrun_on_a_busy_machine_says_the_load_and_what_to_do(monkeypatch):
    """Said with the machine's load: beyond this run's own threads it names the cause (other work on the cores)
    and the setting that helps (fewer threads each)."""
    from irflow.engine import runtime

    monkeypatch.setattr(runtime, "available_cpus", lambda: 2)
    for load, advised in ((4.1, True), (2.0, False)):
        monkeypatch.setattr(runtime, "load_average", lambda load=load: load)
        p = pace.Pace({"a": 100, "b": 100}, started=0.0)
        said = p.stage_done("a", 200, now=200.0)
        assert said and f"load {load:.1f} on 2 cores" in said and ("runtime.threads" in said) == advised


def test_a_stage_that_outlasts_its_estimate_counts_at_its_progress_pace_when_slower():
    """A training whose first step took long (another run took the cores) outlasts its estimate before its
    steps after the first cover enough to judge: it is said at the pace of those steps (10x), not at the
    seconds it has taken against its estimate (1.5x, later)."""
    t0 = datetime(2026, 12, 5, 22, 0).timestamp()
    p = pace.Pace({"train_student[gpl]": 100.0}, started=t0)
    p.stage_started("train_student[gpl]", now=t0)
    assert p.stage_progress("train_student[gpl]", 0.01, now=t0 + 60) is None  # the first step, slow
    for step in range(2, 6):  # each step estimated at 1 s takes 10
        said = p.stage_progress("train_student[gpl]", step / 100, now=t0 + 60 + 10 * (step - 1))
        assert said is None  # 4 s of estimate covered since the first step: too little to judge
    said = p.check(now=t0 + 101)  # outlasted: its pace since the first step, 41 s for 4 s estimated
    # the 95 steps left at 10.25 s each: 974 s after 22:01:41
    assert said and "10.2x slower" in said and "ends about 22:17" in said


def test_a_crop_trained_student_is_estimated_at_its_spans_length_beside_an_ict_proxy():
    """A training query cut from a passage (crop_ratio) is as long as its span, whether or not the synthetic
    evaluation's own queries (generate_queries[proxy], planned first) are generated in the same run."""
    size = estimate.CorpusSize(1000, 300.0)
    train = {"steps": 10, "batch_size": 32, "max_seq_length": 256, "loss": "mnrl"}
    crop = {"generate_queries[crop]": {"source": "crop", "crop_ratio": [0.1, 0.5]}, "train_student[contriever]": train}
    alone = estimate.estimate(None, ["train_student[contriever]"], size, HW, crop)[0].seconds
    with_proxy = estimate.estimate(None, ["train_student[contriever]"], size, HW,
                                   {"generate_queries[proxy]": {"source": "ict"}, **crop})[0].seconds
    plain = estimate.estimate(None, ["train_student[contriever]"], size, HW, {"train_student[contriever]": train})
    assert with_proxy == alone > plain[0].seconds


def test_an_overrun_is_the_runs_warning_not_the_stage_it_was_said_in():
    """Said in a stage's thread (its progress report), the pace's warning is the run's: it is not kept with the
    stage's datasets, so a later reuse of them does not say it again."""
    import logging

    from irflow.engine.worker import warnings_logged

    with warnings_logged(every_thread=True) as run, warnings_logged() as stage:
        logging.getLogger("irflow.engine.pace").warning("this run is going 1.5x slower than its estimate")
        logging.getLogger("irflow.train").warning("a stage's own warning")
    assert stage == ["a stage's own warning"]
    assert run == ["this run is going 1.5x slower than its estimate", "a stage's own warning"]


def test_ict_training_queries_are_estimated_at_the_batchs_longest_sentence():
    """ICT's query column is padded to its longest sentence: in text with some long sentences (docstrings with
    code, legal clauses) most of a passage. The estimate's expected longest of a batch, from the sentences it
    counts, matches the queries ict_queries draws (simulated batches of 16), and an ICT run on such text is
    estimated longer than on text of short sentences, while other query sources read QUERY_TOKENS."""
    import dataclasses
    import random

    from irflow.learn.generation import ict_queries

    rng = random.Random(3)
    word = lambda: rng.choice(["return", "the", "value", "of", "x", "mapping", "sorted", "list"])  # noqa: E731
    sentence = lambda n: " ".join(word() for _ in range(n)) + "."  # noqa: E731
    long_text = [" ".join(sentence(rng.choice([8, 12, 15, 20, 25, 90])) for _ in range(4)) for _ in range(600)]
    short_text = [" ".join(sentence(rng.choice([6, 8, 10, 12])) for _ in range(6)) for _ in range(600)]
    sizes = {}
    for name, texts in (("long", long_text), ("short", short_text)):
        words = [len(t.split()) for t in texts]
        sizes[name] = estimate.CorpusSize(600, sum(words) / 600, word_quantiles=estimate.quantiles(words),
                                          tokens_per_word=1.0,
                                          sentence_quantiles=estimate.sentence_quantiles(texts))
    drawn = [len(q.split()) for i, t in enumerate(long_text) for q in ict_queries(f"d{i}", t, 1, 42)]
    simulated = sum(max(rng.sample(drawn, 16)) for _ in range(3000)) / 3000
    assert sizes["long"].padded_sentence_tokens(200, 16) == pytest.approx(simulated, rel=0.1)
    assert sizes["short"].padded_sentence_tokens(200, 16) < 15
    train = {"train_student[gpl]": {"steps": 50, "batch_size": 16, "max_seq_length": 200}}
    ict = {"generate_queries[ict]": {"source": "ict"}, **train}
    seconds = {n: estimate.estimate(None, ["train_student[gpl]"], s, HW, ict)[0].seconds for n, s in sizes.items()}
    assert seconds["long"] > 1.1 * seconds["short"]
    uncounted = dataclasses.replace(sizes["long"], sentence_quantiles=())
    assert estimate.estimate(None, ["train_student[gpl]"], uncounted, HW, ict)[0].seconds < seconds["long"]
    log = {"generate_queries[unlabelled]": {"source": "unlabelled"}, **train}
    assert (estimate.estimate(None, ["train_student[gpl]"], sizes["long"], HW, log)[0].seconds
            == estimate.estimate(None, ["train_student[gpl]"], uncounted, HW, log)[0].seconds)
