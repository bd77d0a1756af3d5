"""DeepCT: term weights learned from query term recall, indexed as BM25 term frequencies.

Dai & Callan (2019), "Context-Aware Sentence/Passage Term Importance Estimation for First Stage
Retrieval": a BERT-style encoder with a token-regression head (a linear layer over each token's last
hidden state, one scalar: ``AutoModelForTokenClassification`` with one label) learns, on the passages
judged relevant to training queries, what fraction of those queries contain each passage word; its
predictions over every passage become new term frequencies, and BM25 indexes the rewritten corpus. A
sparse counterpart of doc2query: it re-weights a passage's own words instead of appending new ones.

Two stages (the arithmetic, the windows and the loss are ``irflow.learn.deepct``'s):

- ``train_deepct``: the model fine-tuned on the ``split`` qrels' positives (score > 0): one training
  example per window of each passage with at least one relevant query (QTR targets); the loop, precision,
  checkpoints and resume are ``irflow.learn.training``'s. Saved with ``save_pretrained`` (model + tokenizer), so
  ``AutoModelForTokenClassification.from_pretrained(path)`` loads it.
- ``deepct_weight``: the corpus with each passage rewritten as its words repeated tf'(t, d) =
  round(max(0, w) * scale) times, the title folded into the text (the model reads ``title + " " + text``,
  as BEIR's passage; the output's title is empty, so a flat BM25 index counts the title's words once, by
  their weights). Sharded by corpus: a passage's text depends on the passage alone, and shards start at
  multiples of ``batch_size`` passages, so the batches (and their padding) are those of one shard.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
from pydantic import Field, PositiveInt

from irflow.engine import distributed
from irflow.engine.errors import DataError
from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn import deepct
from irflow.learn.qrels import positives
from irflow.learn.text import passage_text, query_texts
from irflow.learn.training import TRAINING_LOG, BatchPlan, LoopParams, seed_everything, train_loop, training_losses

log = logging.getLogger("irflow.learn.deepct")


def _check_regressor(path: Path) -> None:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise RuntimeError(f"{path}: no config.json (not a Hugging Face model)")
    if len(json.loads(cfg_file.read_text()).get("id2label") or {"0": "LABEL_0"}) != 1:
        raise RuntimeError(f"{path}: a DeepCT model has exactly one output per token")


class TrainDeepCTParams(LoopParams):
    split: str = Field("train", min_length=1, description="the qrels split whose positives (score > 0) give each "
                                                          "passage its relevant queries")
    epochs: PositiveInt = Field(3, description="passes over the training windows (used only when `steps` is "
                                               "null; 3, as the DeepCT code trains on MS MARCO)")
    batch_size: PositiveInt = Field(16, description="passage windows per step")
    max_length: int = Field(128, ge=8, description="tokens the model reads at once, special tokens included (128: "
                                                  "the paper's); a longer passage is read in consecutive windows "
                                                  "cut at word boundaries")
    warmup: float = Field(0.1, ge=0, lt=1, description="fraction of the steps spent in linear warm-up, then "
                                                       "linear decay to 0 (BERT's warmup_proportion)")


def training_windows(corpus: pa.Table, queries: pa.Table, qrels: pa.Table, split: str,
                     tok, max_length: int) -> tuple[list[dict], int]:
    """(one ``{"words", "targets"}`` example per window of every passage with a relevant query of ``split``,
    in corpus order; how many passages they come from)."""
    by_query = positives(qrels, split)
    if not by_query:
        raise DataError(f"no positive qrels in split '{split}': DeepCT learns term weights from the queries "
                        "judged relevant to passages")
    qtext = query_texts(queries, set(by_query))
    relevant: dict[str, list[str]] = {}
    for q in sorted(by_query):
        if q in qtext:
            for d in by_query[q]:
                relevant.setdefault(d, []).append(qtext[q])
    ids = corpus.column("doc_id").to_pylist()
    keep = [i for i, d in enumerate(ids) if d in relevant]
    if not keep:
        raise DataError(f"none of the passages judged relevant in split '{split}' is in the corpus")
    titles, texts = corpus.column("title").to_pylist(), corpus.column("text").to_pylist()
    passages = [deepct.words(passage_text(titles[i], texts[i])) for i in keep]
    targets = [deepct.word_targets(w, deepct.query_term_recall(relevant[ids[i]])) for i, w in zip(keep, passages)]
    examples = [{"words": w[a:b], "targets": t[a:b]}
                for w, t, spans in zip(passages, targets, deepct.passage_windows(tok, passages, max_length))
                for a, b in spans]
    if not examples:
        raise DataError(f"the passages judged relevant in split '{split}' have no words")
    return examples, len(keep)


def fit_and_save(job: dict, rt: StageRuntime) -> None:
    """What each training process runs (``irflow.engine.distributed.run``): the token regressor trained on the
    job's windows; rank 0 saves the model, its tokenizer and the training log to ``job["out"]``."""
    from transformers import AutoModelForTokenClassification

    p = TrainDeepCTParams(**job["params"])
    seed_everything(p.seed)  # the fresh head's initialisation
    tok = deepct.load_tokenizer(job["model"])
    model = AutoModelForTokenClassification.from_pretrained(job["model"], num_labels=1, ignore_mismatched_sizes=True)
    examples = job["examples"]
    device = rt.device

    def compute_loss(idx: list[int]):
        return deepct.window_loss(model, tok, [examples[i] for i in idx], p.max_length, device)

    plan = BatchPlan(len(examples), p.batch_size, p.seed)
    total = plan.total_steps(p)
    rank, world = distributed.rank_and_world()
    if rank == 0:
        log.info("train_deepct: %d windows of %d passages, %d steps on %d process(es) (%s, %s)", len(examples),
                 job["passages"], total, world, device, rt.precision)
    history = train_loop(model, compute_loss, plan, p, int(round(p.warmup * total)), rt, "train_deepct")
    if rank > 0:
        return
    model.eval()
    out = Path(job["out"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / TRAINING_LOG).write_text(json.dumps(
        {"windows": len(examples), "passages": job["passages"], "processes": world, "steps": len(history),
         "history": history}, indent=1))


@stage("train_deepct", version="1",
       outputs=[Output("deepct_model", kind="model", check=_check_regressor),
                Output("training_losses", "training_losses")],
       work="train", resumable=True)
def train_deepct(p: TrainDeepCTParams, rt: StageRuntime, *, corpus: DatasetRef, queries: DatasetRef,
                 qrels: DatasetRef, model: DatasetRef) -> dict:
    """``model`` (any encoder; a fresh one-output token head where it has none) fine-tuned to predict each
    word's query term recall in the passages judged relevant in ``qrels``'s ``split``; and its loss per
    step (``training_losses``). Runs on ``runtime.train_processes`` processes like the other trainers."""
    tok = deepct.load_tokenizer(model.path)
    examples, passages = training_windows(corpus.table(columns=["doc_id", "title", "text"]), queries.table(),
                                          qrels.table(), p.split, tok, p.max_length)
    distributed.check_split(p.batch_size, rt.train_processes)
    out = Path(rt.workdir) / "deepct_model"
    job = {"examples": examples, "passages": passages, "model": model.path, "out": str(out),
           "params": p.model_dump(mode="json")}
    distributed.run(fit_and_save, job, rt, rt.train_processes)
    return {"deepct_model": out, "training_losses": training_losses(out)}


class DeepCTWeightParams(Params):
    scale: float = Field(100, gt=0, description="tf' = round(max(0, predicted weight) * scale) (100: the paper's)")
    max_length: int = Field(128, ge=8, description="tokens the model reads at once, special tokens included; a "
                                                  "longer passage is weighted in consecutive windows cut at word "
                                                  "boundaries (the length it was trained with)")
    batch_size: PositiveInt = Field(32, description="passages per forward pass (all of their windows)")


def _batch_rows(p: DeepCTWeightParams) -> int:
    return p.batch_size


def _load(path: str, device: str):
    from transformers import AutoModelForTokenClassification

    model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, output_loading_info=True)
    prefix = model.base_model_prefix + "."
    fresh = [k for k in info.get("missing_keys") or () if not k.startswith(prefix)]
    if fresh:
        raise DataError(f"{path}: no token-regression head ({', '.join(sorted(fresh))} missing): weigh with a model "
                        "train_deepct made")
    return deepct.load_tokenizer(path), model.to(device).eval()


@stage("deepct_weight", version="1", outputs=Output("corpus", "corpus"), work="encode", shard="corpus",
       shard_align=_batch_rows)
def deepct_weight(p: DeepCTWeightParams, rt: StageRuntime, *, corpus: DatasetRef, model: DatasetRef) -> pa.Table:
    """The corpus rewritten for BM25 (DeepCT-Index): each passage's words, each repeated round(max(0, w) *
    scale) times, w the weight ``model`` (a ``train_deepct`` model) predicts for it; the title folded into
    the text (the title column is empty). Computed in shards of the corpus (see the module doc)."""
    from irflow.engine.worker import per_worker

    tok, net = per_worker(("deepct", model.path, rt.device), lambda: _load(model.path, rt.device))
    t = corpus.table(columns=["doc_id", "title", "text"])
    titles, texts = t.column("title").to_pylist(), t.column("text").to_pylist()
    out = []
    for start in range(0, t.num_rows, p.batch_size):
        passages = [deepct.words(passage_text(a, b)) for a, b in
                    zip(titles[start:start + p.batch_size], texts[start:start + p.batch_size])]
        with rt.autocast():
            weights = deepct.predict_word_weights(net, tok, passages, p.max_length, rt.device)
        out += [deepct.weighted_text(deepct.term_frequencies(w, x, p.scale)) for w, x in zip(passages, weights)]
    return pa.table({"doc_id": t.column("doc_id"), "title": pa.array([""] * t.num_rows, pa.string()),
                     "text": pa.array(out, pa.string())})
