"""Embedding collapse (irflow.learn.collapse): the mean cosine by hand, when it warns, and a STAR run that can
only lower its loss by collapsing, warned about and recorded in the model's training log."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from irflow.dev.testing import make_tiny_bi_encoder, scifact_docs
from irflow.engine.runtime import StageRuntime
from irflow.learn.collapse import collapse_warning, mean_cosine
from irflow.learn.dual_encoder import Job, TrainDualEncoderParams, train


def test_mean_cosine_of_distinct_pairs_by_hand():
    assert mean_cosine([[1, 0], [2, 0], [3, 0]]) == pytest.approx(1.0)  # one direction, any length
    assert mean_cosine([[1, 0], [0, 1]]) == pytest.approx(0.0)
    assert mean_cosine([[1, 0], [-1, 0]]) == pytest.approx(-1.0)
    v = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])  # cosines 0.6, 0.0, 0.8
    assert mean_cosine(v * [[2.0], [1.0], [5.0]]) == pytest.approx((0.6 + 0.0 + 0.8) / 3)
    with pytest.raises(ValueError, match="at least 2 vectors"):
        mean_cosine([[1.0, 2.0]])


def test_a_collapse_is_a_high_cosine_that_left_little_of_the_base_spread():
    assert collapse_warning(0.18, 0.97, "x") is not None  # MiniLM -> STAR on NFCorpus
    assert collapse_warning(0.94, 0.996, "x") is not None  # a random tiny BERT, anisotropic from the start
    assert collapse_warning(0.18, 0.85, "x") is None  # high, not collapsed
    assert collapse_warning(0.80, 0.92, "x") is None  # an anisotropic model that only rose a little
    assert collapse_warning(math.nan, math.nan, "x") is None  # nothing measured
    msg = collapse_warning(0.18, 0.97, "128 training passages", [2.9] * 10 + [0.76] * 10, 0.7625)
    assert "0.97 (base model 0.18)" in msg and "from 2.9 to 0.76 (every score tied: 0.762)" in msg


def test_star_that_can_only_fall_by_collapsing_is_warned_about(tmp_path, caplog):
    """Each line's hard negative is its query's own text, so s(q, n) = 1 whatever the weights: RankNet falls
    only by pulling every positive onto its query, i.e. every embedding onto one direction. The loss ends at
    the tie, (1 + alpha) log 2, and the training log holds the mean cosine before and after."""
    docs = scifact_docs(48)
    titles = docs.column("title").to_pylist()
    texts = [f"{t} {x}" for t, x in zip(titles, docs.column("text").to_pylist())]
    p = TrainDualEncoderParams(loss="star", negatives_per_line=1, steps=12, lr=1e-3, warmup_ratio=0.0,
                               batch_size=8, query_max_length=32, passage_max_length=32, checkpoint_every=0)
    job = Job(model_path=str(make_tiny_bi_encoder(tmp_path / "bi", dropout=0.0)), out_dir=str(tmp_path / "out"),
              params=p.model_dump(mode="json"), queries=titles[:24], positives=texts[24:48],
              negatives=[[t] for t in titles[:24]])
    with caplog.at_level(logging.WARNING, logger="irflow.train"):
        train(job, StageRuntime(workdir=str(tmp_path / "work")))
    log = json.loads((tmp_path / "out" / "irflow_training.json").read_text())
    cos = log["mean_cosine"]
    assert cos["texts"] == 48  # the 24 positives and 24 negatives, all distinct
    assert cos["after"] > 0.99 and 1 - cos["after"] < 0.25 * (1 - cos["before"]), cos
    assert log["history"][-1]["loss"] == pytest.approx(1.1 * math.log(2), rel=0.05)
    warned = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(warned) == 1 and "of 48 training passages" in warned[0] and "every score tied: 0.762" in warned[0]
