"""Pseudo-queries for passages of the target corpus: the training signal of unsupervised domain adaptation.

One stage, ``generate_queries``, with four sources (the params' ``source``):

- ``t5`` -- a seq2seq query generator samples queries from each passage: docT5query (Nogueira & Lin,
  2019, "From doc2query to docTTTTTquery"), as BEIR's ``QueryGenerator`` (Thakur et al., 2021) and
  GPL (Wang et al., 2022, "GPL: Generative Pseudo Labeling for Unsupervised Domain Adaptation of
  Dense Retrieval") run it: nucleus sampling, top_p 0.95, top_k 25, at most 64 tokens, input
  ``title + " " + text``.
- ``ict`` -- Inverse Cloze Task (Lee, Chang & Toutanova, 2019, "Latent Retrieval for Weakly Supervised
  Open Domain Question Answering"): a random sentence of the passage is the query.
- ``crop`` -- independent cropping (Izacard et al., 2021, "Unsupervised Dense Information Retrieval
  with Contrastive Learning", Contriever): a random contiguous span of 10-50% of the passage words.
- ``unlabelled`` -- the dataset's own query texts of one split, without their judgements, as a query
  log would give them.

Outputs: ``queries`` and ``qrels``. For the three generating sources each query has one qrels row
(``split="generated"``, ``score=1``) pointing to the passage it came from. ``unlabelled`` queries
have no known positive, so their qrels table is empty (but valid).

Measured on SciFact (shared/notes/offline-adaptation-findings.md): ICT and cropping queries are too
easy -- the source passage is BM25's top-1 for 99.5% (ICT) and 97.4% (cropping) of them -- and a
student trained on them barely moves; real unlabelled in-domain queries did move it (+0.044 nDCG@10).
Model-free sources are offered as cheap baselines and for machines without a query generator.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import tempfile
from pathlib import Path

from typing import Annotated, Literal, Union

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, PositiveInt, field_validator
from tqdm.auto import tqdm

from irflow.errors import DataError
from irflow.params import Params
from irflow.runtime import StageRuntime
from irflow.stage import Output, stage
from irflow.store import DatasetRef
from irflow.text import passage_text

log = logging.getLogger("irflow.generate_queries")

SOURCES = ("t5", "ict", "crop", "unlabelled")
GENERATED_SPLIT = "generated"
# GPL's rule for the number of queries per passage: about 250K generated queries in all (Wang et
# al., 2022, section 4), at least 1 and at most 50 per passage.
GPL_TOTAL_QUERIES = 250_000
MAX_AUTO_QPP = 50
# Query-id tag per source, so queries from several sources can be concatenated without id clashes.
ID_TAGS = {"t5": "q", "ict": "ict", "crop": "crop"}

SHARD_SCHEMA = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("text", pa.string())])

QueriesPerPassage = Union[PositiveInt, Literal["auto"]]


class T5Source(Params):
    source: Literal["t5"] = Field(description="a seq2seq query generator samples queries per passage (docT5query)")
    queries_per_passage: QueriesPerPassage = Field(3, description="queries sampled per passage, or auto: about "
                                                                  "250k in all (GPL), 1 to 50 per passage")
    max_input_length: PositiveInt = Field(350, description="passage tokens the generator reads")
    max_length: PositiveInt = Field(64, description="most tokens per generated query")
    top_p: float = Field(0.95, gt=0, le=1, description="nucleus sampling mass")
    sample_top_k: PositiveInt = Field(25, description="sample among the k most likely tokens")
    batch_size: PositiveInt = Field(32, description="passages per generation batch (halved on out-of-memory)")
    shard_size: PositiveInt = Field(10_000, description="passages per resumable shard")
    max_rounds: PositiveInt = Field(3, description="sampling rounds to replace empty or repeated queries")
    seed: int = Field(42, description="sampling seed (re-seeded per shard)")


class ICTSource(Params):
    source: Literal["ict"] = Field(description="Inverse Cloze Task: a random sentence of the passage is the query")
    queries_per_passage: QueriesPerPassage = Field(1, description="sentences drawn per passage (or auto)")
    min_words: PositiveInt = Field(3, description="shortest sentence used, in words")
    seed: int = Field(42, description="sampling seed")


class CropSource(Params):
    source: Literal["crop"] = Field(description="independent cropping (Contriever): a random span is the query")
    queries_per_passage: QueriesPerPassage = Field(1, description="spans drawn per passage (or auto)")
    crop_ratio: tuple[float, float] = Field((0.1, 0.5), description="span length as a fraction of the passage, "
                                                                    "drawn uniformly from [lo, hi]")
    min_words: PositiveInt = Field(3, description="shortest span, in words")
    seed: int = Field(42, description="sampling seed")

    @field_validator("crop_ratio")
    @classmethod
    def _ratio(cls, v):
        if not 0 < v[0] <= v[1] <= 1:
            raise ValueError(f"crop_ratio must be [lo, hi] with 0 < lo <= hi <= 1, got {list(v)}")
        return v


class UnlabelledSource(Params):
    source: Literal["unlabelled"] = Field(description="the dataset's own query texts of one split, labels unused "
                                                      "(what a query log gives)")
    split: str = Field("train", min_length=1, description="whose queries (never the evaluated split)")

    @field_validator("split")
    @classmethod
    def _not_test(cls, v):
        if v == "test":
            raise ValueError("test queries must not be used for training")
        return v


GenerateParams = Annotated[Union[T5Source, ICTSource, CropSource, UnlabelledSource], Field(discriminator="source")]


# ---- shared helpers ---------------------------------------------------------------------------
def queries_per_passage(value, num_passages: int) -> int:
    """``value`` as an int, or GPL's ``"auto"``: round(250_000 / |C|), clipped to [1, 50]."""
    if value == "auto":
        return max(1, min(MAX_AUTO_QPP, round(GPL_TOTAL_QUERIES / max(1, num_passages))))
    return int(value)


def _outputs(queries: dict[str, list], with_qrels: bool) -> dict[str, pa.Table]:
    q = pa.table({"query_id": queries["query_id"], "text": queries["text"]},
                 schema=pa.schema([("query_id", pa.string()), ("text", pa.string())]))
    doc_ids = queries["doc_id"] if with_qrels else []
    qids = queries["query_id"] if with_qrels else []
    qrels = pa.table({"query_id": pa.array(qids, pa.string()), "doc_id": pa.array(doc_ids, pa.string()),
                      "score": pa.array([1] * len(qids), pa.int32()),
                      "split": pa.array([GENERATED_SPLIT] * len(qids), pa.string())})
    return {"queries": q, "qrels": qrels}


def _passage_rng(seed: int, doc_id: str) -> random.Random:
    # Seeded per passage (not per run): a passage's queries do not depend on corpus order or sharding.
    return random.Random(f"{seed}:{doc_id}")


# ---- ict / crop -------------------------------------------------------------------------------
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    """A light sentence splitter (end punctuation followed by whitespace); enough for picking a span."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def ict_queries(doc_id: str, text: str, n: int, seed: int, min_words: int = 3) -> list[str]:
    """Up to ``n`` distinct sentences of the passage, drawn at random (ICT pseudo-queries).

    Lee et al. remove the sentence from the context it is paired with (90% of the time); here the
    query's positive is the unchanged corpus passage, so the query is contained in its positive --
    one reason such queries are easy. A passage with fewer than two sentences gives none: its only
    sentence would be the whole passage, not a query about it.
    """
    all_sents = split_sentences(text)
    if len(all_sents) < 2:
        return []
    sents = list(dict.fromkeys(s for s in all_sents if len(s.split()) >= min_words))
    return _passage_rng(seed, doc_id).sample(sents, min(n, len(sents)))


def crop_queries(doc_id: str, text: str, n: int, seed: int, ratio=(0.1, 0.5), min_words: int = 3,
                 max_tries: int = 10) -> list[str]:
    """Up to ``n`` distinct random spans of the passage's whitespace tokens; each span's length is
    a fraction drawn uniformly from ``ratio`` (Contriever's 10%-50%) of the passage length."""
    words = text.split()
    if len(words) < min_words:
        return []
    lo, hi = (float(ratio), float(ratio)) if isinstance(ratio, (int, float)) else (float(ratio[0]), float(ratio[1]))
    rng = _passage_rng(seed, doc_id)
    out: list[str] = []
    for _ in range(n * max_tries):
        if len(out) == n:
            break
        length = max(min_words, round(rng.uniform(lo, hi) * len(words)))
        start = rng.randrange(0, len(words) - length + 1)
        span = " ".join(words[start:start + length])
        if span not in out:
            out.append(span)
    return out


def _model_free(corpus: pa.Table, p: ICTSource | CropSource) -> dict[str, pa.Table]:
    source = p.source
    n = queries_per_passage(p.queries_per_passage, corpus.num_rows)
    seed, min_words = p.seed, p.min_words
    tag = ID_TAGS[source]
    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    doc_ids, texts = corpus.column("doc_id").to_pylist(), corpus.column("text").to_pylist()
    for doc_id, text in tqdm(zip(doc_ids, texts), total=len(doc_ids), desc=f"{source} queries", unit=" passages",
                             mininterval=2):
        if source == "ict":
            qs = ict_queries(doc_id, text, n, seed, min_words)
        else:
            qs = crop_queries(doc_id, text, n, seed, p.crop_ratio, min_words)
        for i, q in enumerate(qs):
            out["query_id"].append(f"{doc_id}-{tag}{i}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    if not out["query_id"]:
        raise DataError(f"source '{source}' produced no query from {corpus.num_rows} passages")
    return _outputs(out, with_qrels=True)


# ---- unlabelled -------------------------------------------------------------------------------
def _unlabelled(queries, qrels, p: UnlabelledSource) -> dict[str, pa.Table]:
    if queries is None or qrels is None:
        raise ValueError("generate_queries: source 'unlabelled' needs the dataset's 'queries' and 'qrels' inputs")
    import duckdb

    with duckdb.connect() as con:
        con.register("q", queries.table())
        # The judgements are read only to know which queries belong to the split; none are passed on.
        con.register("r", qrels.table(columns=["query_id", "split"]))
        t = con.sql("SELECT query_id, text FROM q WHERE query_id IN (SELECT query_id FROM r WHERE split = ?) "
                    "AND trim(text) <> '' ORDER BY query_id", params=[p.split]).to_arrow_table()
    if t.num_rows == 0:
        splits = sorted(set(qrels.table(columns=["split"]).column("split").to_pylist()))
        raise DataError(f"no queries are judged in split '{p.split}' (the dataset's splits: {', '.join(splits)})")
    return _outputs({"query_id": t.column("query_id").to_pylist(), "text": t.column("text").to_pylist(),
                     "doc_id": []}, with_qrels=False)


# ---- t5 ---------------------------------------------------------------------------------------
def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def load_generator(model: DatasetRef, device: str):
    """Tokenizer and model of a seq2seq query generator; one that cannot be loaded raises
    ``ModelNotAvailable`` naming it."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from irflow.models import ModelNotAvailable

    try:
        tokenizer = AutoTokenizer.from_pretrained(model.path)
        generator = AutoModelForSeq2SeqLM.from_pretrained(model.path)
    except Exception as e:  # noqa: BLE001 -- say which model, whatever went wrong
        raise ModelNotAvailable(f"query generator: model '{model.name}' could not be loaded from {model.path}: "
                                f"{type(e).__name__}: {e}") from e
    return tokenizer, generator.to(device).eval()


def _generate_batch(model, tokenizer, texts: list[str], n: int, gen: dict, device: str) -> list[list[str]]:
    """``n`` sampled queries for each text (BEIR QGenModel.generate's settings)."""
    import torch

    enc = tokenizer(texts, padding=True, truncation=True, max_length=gen["max_input_length"], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                             do_sample=True, top_p=gen["top_p"], top_k=gen["sample_top_k"], max_length=gen["max_length"],
                             num_return_sequences=n)
    decoded = tokenizer.batch_decode(out, skip_special_tokens=True)
    return [decoded[i * n:(i + 1) * n] for i in range(len(texts))]


class BatchGenerator:
    """Runs ``_generate_batch`` over a list of passages in batches, halving the batch size whenever
    the device runs out of memory (long passages x n return sequences can exceed it), and keeping
    the halved size for the rest of the run."""

    def __init__(self, model, tokenizer, gen: dict, device: str, batch_size: int, autocast=None):
        self.model, self.tokenizer, self.gen, self.device = model, tokenizer, gen, device
        self.batch_size = max(1, int(batch_size))
        self.autocast = autocast

    def __call__(self, texts: list[str], n: int, bar=None) -> list[list[str]]:
        results: list[list[str]] = []
        start = 0
        while start < len(texts):
            batch = texts[start:start + self.batch_size]
            try:
                with self.autocast() if self.autocast else contextlib.nullcontext():
                    results.extend(_generate_batch(self.model, self.tokenizer, batch, n, self.gen, self.device))
            except (RuntimeError, MemoryError) as e:
                if not is_oom(e) or self.batch_size == 1:
                    raise
                self.batch_size = max(1, self.batch_size // 2)
                log.warning("generate_queries: out of memory at batch size %d; retrying with %d",
                            len(batch), self.batch_size)
                _free_device_memory()
                continue
            start += len(batch)
            if bar is not None:
                bar.update(len(batch))
        return results


def _free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _clean(q: str) -> str:
    return " ".join(q.split())


def generate_shard(generator: BatchGenerator, doc_ids: list[str], texts: list[str], n: int, max_rounds: int,
                   bar=None) -> dict[str, list]:
    """``n`` distinct non-empty queries per passage where sampling allows it.

    Sampling can repeat itself or stop at once (an empty query); those are dropped, and passages left
    short get up to ``max_rounds - 1`` more rounds of sampling for the missing ones only.
    """
    kept: list[list[str]] = [[] for _ in doc_ids]
    todo = list(range(len(doc_ids)))
    for round_ in range(max_rounds):
        if not todo:
            break
        gens = generator([texts[i] for i in todo], n, bar if round_ == 0 else None)
        still = []
        for i, qs in zip(todo, gens):
            for q in map(_clean, qs):
                if q and q not in kept[i] and len(kept[i]) < n:
                    kept[i].append(q)
            if len(kept[i]) < n:
                still.append(i)
        todo = still
    if todo:
        log.info("generate_queries: %d passage(s) have fewer than %d distinct queries after %d rounds",
                 len(todo), n, max_rounds)
    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    for doc_id, qs in zip(doc_ids, kept):
        for j, q in enumerate(qs):
            out["query_id"].append(f"{doc_id}-{ID_TAGS['t5']}{j}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    return out


def _shard_path(resume_dir: Path, index: int) -> Path:
    return resume_dir / f"shard-{index:06d}.parquet"


def _write_shard(resume_dir: Path, index: int, rows: dict[str, list]) -> Path:
    """Write a finished shard atomically: a shard file that exists is complete."""
    path = _shard_path(resume_dir, index)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.table(rows, schema=SHARD_SCHEMA), tmp)
    os.replace(tmp, path)
    return path


def _t5(corpus: pa.Table, p: T5Source, model: DatasetRef, rt: StageRuntime) -> dict[str, pa.Table]:
    n = queries_per_passage(p.queries_per_passage, corpus.num_rows)
    gen = {"max_input_length": p.max_input_length, "max_length": p.max_length, "top_p": p.top_p,
           "sample_top_k": p.sample_top_k}
    tokenizer, generator_model = load_generator(model, rt.device)
    generator = BatchGenerator(generator_model, tokenizer, gen, rt.device, p.batch_size, rt.autocast)
    if rt.resume_dir is not None:
        return _t5_shards(corpus, p, Path(rt.resume_dir), generator, n)
    # Called outside a Run (``generate_queries.fn(p, StageRuntime(), ...)``): nothing to resume from.
    with tempfile.TemporaryDirectory(prefix="irflow-generate-") as shards:
        return _t5_shards(corpus, p, Path(shards), generator, n)


def _t5_shards(corpus: pa.Table, p: T5Source, resume_dir: Path, generator: BatchGenerator, n: int
               ) -> dict[str, pa.Table]:
    import torch

    seed, shard_size = p.seed, p.shard_size
    doc_ids = corpus.column("doc_id").to_pylist()
    titles, bodies = corpus.column("title").to_pylist(), corpus.column("text").to_pylist()
    num_shards = (len(doc_ids) + shard_size - 1) // shard_size
    done = {i for i in range(num_shards) if _shard_path(resume_dir, i).exists()}
    if done:
        log.info("generate_queries: resuming, %d of %d shard(s) already done", len(done), num_shards)
    with tqdm(total=len(doc_ids), desc=f"generate queries (n={n})", unit=" passages") as bar:
        bar.update(sum(min(shard_size, len(doc_ids) - i * shard_size) for i in done))
        for index in range(num_shards):
            if index in done:
                continue
            lo, hi = index * shard_size, min(len(doc_ids), (index + 1) * shard_size)
            # Re-seeded per shard: a shard generated after a restart equals the one an
            # uninterrupted run would have produced (same device, same batch size).
            torch.manual_seed(seed * 1_000_003 + index)
            texts = [passage_text(t, x) for t, x in zip(titles[lo:hi], bodies[lo:hi])]
            rows = generate_shard(generator, doc_ids[lo:hi], texts, n, p.max_rounds, bar)
            _write_shard(resume_dir, index, rows)
    table = pa.concat_tables([pq.read_table(_shard_path(resume_dir, i)) for i in range(num_shards)])
    if table.num_rows == 0:
        raise DataError("the generator produced no (non-empty) query")
    return _outputs({c: table.column(c).to_pylist() for c in ("query_id", "doc_id", "text")}, with_qrels=True)


# ---- the stage --------------------------------------------------------------------------------
@stage("generate_queries", version="2", outputs=[Output("queries", "queries"), Output("qrels", "qrels")],
       work="generate", resumable=True)
def generate_queries(p: GenerateParams, rt: StageRuntime, *, corpus: DatasetRef, queries: DatasetRef | None = None,
                     qrels: DatasetRef | None = None, model: DatasetRef | None = None) -> dict[str, pa.Table]:
    """Pseudo-queries for the corpus (see the module doc for the sources and papers).

    Inputs: ``corpus``; ``model`` (t5: the seq2seq generator); ``queries`` and ``qrels`` (unlabelled:
    the dataset's own, to pick the split's query texts).

    The t5 source is sharded: each finished shard of ``shard_size`` passages is kept in the stage's
    resume dir and skipped when an interrupted run is started again with the same key. Output is
    deterministic for a seed on a given device and batch size (sampling draws depend on both; an
    out-of-memory halving of the batch changes the draws of the shard it happens in).
    """
    if isinstance(p, UnlabelledSource):
        return _unlabelled(queries, qrels, p)
    table = corpus.table()
    if isinstance(p, T5Source):
        if model is None:
            raise ValueError("generate_queries: source 't5' needs the model input (the query generator)")
        return _t5(table, p, model, rt)
    return _model_free(table, p)
