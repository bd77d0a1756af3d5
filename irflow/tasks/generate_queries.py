"""Pseudo-queries for passages of the target corpus: the training signal of unsupervised domain adaptation.

One stage, ``generate_queries``, with four sources (``cfg["source"]``):

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

import logging
import os
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from irflow.stage import Output, stage

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


# ---- shared helpers ---------------------------------------------------------------------------
def queries_per_passage(value, num_passages: int) -> int:
    """``value`` as an int, or GPL's ``"auto"``: round(250_000 / |C|), clipped to [1, 50]."""
    if value == "auto":
        return max(1, min(MAX_AUTO_QPP, round(GPL_TOTAL_QUERIES / max(1, num_passages))))
    n = int(value)
    if n < 1:
        raise ValueError(f"generate_queries: queries_per_passage must be >= 1 or 'auto', got {value!r}")
    return n


def passage_input(title: str, text: str) -> str:
    """What a passage looks like to the generator: BEIR's ``title + " " + text`` (no title: just text)."""
    title = (title or "").strip()
    return f"{title} {text}" if title else text


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
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"generate_queries: crop_ratio must lie in (0, 1], got {ratio!r}")
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


def _model_free(corpus: pa.Table, cfg: dict, source: str) -> dict[str, pa.Table]:
    n = queries_per_passage(cfg.get("queries_per_passage", 1), corpus.num_rows)
    seed = int(cfg.get("seed", 0))
    min_words = int(cfg.get("min_words", 3))
    tag = ID_TAGS[source]
    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    doc_ids, texts = corpus.column("doc_id").to_pylist(), corpus.column("text").to_pylist()
    for doc_id, text in tqdm(zip(doc_ids, texts), total=len(doc_ids), desc=f"{source} queries", unit=" passages",
                             mininterval=2):
        if source == "ict":
            qs = ict_queries(doc_id, text, n, seed, min_words)
        else:
            qs = crop_queries(doc_id, text, n, seed, cfg.get("crop_ratio", (0.1, 0.5)), min_words)
        for i, q in enumerate(qs):
            out["query_id"].append(f"{doc_id}-{tag}{i}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    if not out["query_id"]:
        raise ValueError(f"generate_queries: source '{source}' produced no query from {corpus.num_rows} passages")
    return _outputs(out, with_qrels=True)


# ---- unlabelled -------------------------------------------------------------------------------
def _unlabelled(queries, qrels, cfg: dict) -> dict[str, pa.Table]:
    split = cfg.get("split")
    if not split:
        raise ValueError("generate_queries: source 'unlabelled' needs cfg['split'] (e.g. 'train')")
    if split == "test":
        raise ValueError("generate_queries: test queries must not be used for training "
                         "(source 'unlabelled' refuses split 'test')")
    if queries is None or qrels is None:
        raise ValueError("generate_queries: source 'unlabelled' needs the dataset's 'queries' and 'qrels' inputs")
    import duckdb

    con = duckdb.connect()
    con.register("q", queries.table())
    # The judgements are read only to know which queries belong to the split; none are passed on.
    con.register("r", qrels.table(columns=["query_id", "split"]))
    t = con.sql("SELECT query_id, text FROM q WHERE query_id IN (SELECT query_id FROM r WHERE split = ?) "
                "AND trim(text) <> '' ORDER BY query_id", params=[split]).to_arrow_table()
    if t.num_rows == 0:
        raise ValueError(f"generate_queries: no queries are judged in split '{split}'")
    return _outputs({"query_id": t.column("query_id").to_pylist(), "text": t.column("text").to_pylist(),
                     "doc_id": []}, with_qrels=False)


# ---- t5 ---------------------------------------------------------------------------------------
def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def load_generator(cfg: dict, device: str):
    """Tokenizer and model from ``cfg['_model_path']``; a model that cannot be had raises
    ``ModelNotAvailable`` naming it, before any work is done."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from irflow.models import ModelNotAvailable, ResolvedModel, check_available

    name = cfg.get("model", cfg.get("_model_path"))
    path = cfg.get("_model_path") or name
    if not path:
        raise ValueError("generate_queries: source 't5' needs a model (cfg from irflow.models.model_cfg)")
    check_available(ResolvedModel(name, path, cfg.get("model_key", "")), role="query generator")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSeq2SeqLM.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- say which model, whatever went wrong
        raise ModelNotAvailable(f"query generator: model '{name}' could not be loaded from {path}: "
                                f"{type(e).__name__}: {e}") from e
    return tokenizer, model.to(device).eval()


def _generate_batch(model, tokenizer, texts: list[str], n: int, gen: dict, device: str) -> list[list[str]]:
    """``n`` sampled queries for each text (BEIR QGenModel.generate's settings)."""
    import torch

    enc = tokenizer(texts, padding=True, truncation=True, max_length=gen["max_input_length"], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
                             do_sample=True, top_p=gen["top_p"], top_k=gen["top_k"], max_length=gen["max_length"],
                             num_return_sequences=n)
    decoded = tokenizer.batch_decode(out, skip_special_tokens=True)
    return [decoded[i * n:(i + 1) * n] for i in range(len(texts))]


class BatchGenerator:
    """Runs ``_generate_batch`` over a list of passages in batches, halving the batch size whenever
    the device runs out of memory (long passages x n return sequences can exceed it), and keeping
    the halved size for the rest of the run."""

    def __init__(self, model, tokenizer, gen: dict, device: str, batch_size: int):
        self.model, self.tokenizer, self.gen, self.device = model, tokenizer, gen, device
        self.batch_size = max(1, int(batch_size))

    def __call__(self, texts: list[str], n: int, bar=None) -> list[list[str]]:
        results: list[list[str]] = []
        start = 0
        while start < len(texts):
            batch = texts[start:start + self.batch_size]
            try:
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


def _t5(corpus: pa.Table, cfg: dict, resume_dir: Path) -> dict[str, pa.Table]:
    import torch

    device = cfg.get("_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    n = queries_per_passage(cfg.get("queries_per_passage", 3), corpus.num_rows)
    max_input_length = int(cfg.get("max_input_length", 350))
    gen = {"max_input_length": max_input_length, "max_length": int(cfg.get("max_length", 64)),
           "top_p": float(cfg.get("top_p", 0.95)), "top_k": int(cfg.get("top_k", 25))}
    tokenizer, model = load_generator(cfg, device)
    generator = BatchGenerator(model, tokenizer, gen, device, int(cfg.get("batch_size", 32)))
    threads = torch.get_num_threads()
    if cfg.get("_threads"):
        # On a busy shared CPU, one intra-op thread avoids OpenMP spin-waiting (several times faster).
        torch.set_num_threads(int(cfg["_threads"]))
    try:
        return _t5_shards(corpus, cfg, resume_dir, generator, n)
    finally:
        torch.set_num_threads(threads)


def _t5_shards(corpus: pa.Table, cfg: dict, resume_dir: Path, generator: BatchGenerator, n: int) -> dict[str, pa.Table]:
    import torch

    seed = int(cfg.get("seed", 0))
    shard_size = int(cfg.get("shard_size", 10_000))
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
            texts = [passage_input(t, x) for t, x in zip(titles[lo:hi], bodies[lo:hi])]
            rows = generate_shard(generator, doc_ids[lo:hi], texts, n, int(cfg.get("max_rounds", 3)), bar)
            _write_shard(resume_dir, index, rows)
    table = pa.concat_tables([pq.read_table(_shard_path(resume_dir, i)) for i in range(num_shards)])
    if table.num_rows == 0:
        raise ValueError("generate_queries: the generator produced no (non-empty) query")
    return _outputs({c: table.column(c).to_pylist() for c in ("query_id", "doc_id", "text")}, with_qrels=True)


# ---- the stage --------------------------------------------------------------------------------
@stage("generate_queries", version="1", outputs=[Output("queries", "queries"), Output("qrels", "qrels")])
def generate_queries(corpus, cfg: dict, resume_dir: Path, queries=None, qrels=None) -> dict[str, pa.Table]:
    """Pseudo-queries for the corpus (see the module doc for the sources and papers).

    cfg, by source:
      - all: ``source`` (t5|ict|crop|unlabelled), ``seed`` (0)
      - t5: ``model``/``model_key``/``_model_path`` (irflow.models.model_cfg), ``queries_per_passage``
        (int or "auto", 3), ``max_input_length`` (350 tokens), ``max_length`` (64), ``top_p`` (0.95),
        ``top_k`` (25), ``batch_size`` (32), ``shard_size`` (10000 passages), ``max_rounds`` (3:
        sampling rounds to replace dropped empty/duplicate queries), ``_device``, ``_threads`` (torch
        CPU threads during the stage)
      - ict: ``queries_per_passage`` (1), ``min_words`` (3)
      - crop: ``queries_per_passage`` (1), ``crop_ratio`` ([0.1, 0.5] or a float), ``min_words`` (3)
      - unlabelled: ``split`` (never "test"); needs inputs ``queries`` and ``qrels`` (the dataset's)

    The t5 source is sharded: each finished shard of ``shard_size`` passages is kept in
    ``resume_dir`` and skipped when an interrupted run is started again with the same config.
    Output is deterministic for a seed on a given device and batch size (sampling draws depend on
    both; an out-of-memory halving of the batch changes the draws of the shard it happens in).
    """
    source = cfg.get("source")
    if source not in SOURCES:
        raise ValueError(f"generate_queries: unknown source {source!r} (known: {list(SOURCES)})")
    if source == "unlabelled":
        return _unlabelled(queries, qrels, cfg)
    table = corpus.table()
    if source == "t5":
        return _t5(table, cfg, Path(resume_dir))
    return _model_free(table, cfg, source)
