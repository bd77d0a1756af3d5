"""Pseudo-query generators on plain arguments (passage ids and texts, a model path, a folder for
shards): no refs, config or stage runtime. The ``generate_queries`` stage calls them; its module doc
says what each source is and where it comes from.

- A seq2seq query generator (docT5query): ``load_generator``; ``BatchGenerator`` samples in batches
  and halves the batch on out-of-memory; ``generate_sharded`` runs it over a corpus in shards kept
  in a folder, so an interrupted run resumes at the first unfinished shard.
- Model-free: ``ict_queries`` (a random sentence) and ``crop_queries`` (a random span).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from irflow.text import passage_text

log = logging.getLogger("irflow.generate_queries")  # the stage's logger: its lines read as they did

SHARD_SCHEMA = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("text", pa.string())])


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


# ---- t5 ---------------------------------------------------------------------------------------
def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def load_generator(path: str, device: str, name: str | None = None):
    """Tokenizer and model of the seq2seq query generator in ``path``; one that cannot be loaded raises
    ``ModelNotAvailable`` naming it (``name``, else the path)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from irflow.models import ModelNotAvailable

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        generator = AutoModelForSeq2SeqLM.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- say which model, whatever went wrong
        raise ModelNotAvailable(f"query generator: model '{name or path}' could not be loaded from {path}: "
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
                   bar=None, id_tag: str = "q") -> dict[str, list]:
    """``n`` distinct non-empty queries per passage where sampling allows it, with ids
    ``<doc_id>-<id_tag><j>``.

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
            out["query_id"].append(f"{doc_id}-{id_tag}{j}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    return out


def _shard_path(shard_dir: Path, index: int) -> Path:
    return shard_dir / f"shard-{index:06d}.parquet"


def _write_shard(shard_dir: Path, index: int, rows: dict[str, list]) -> Path:
    """Write a finished shard atomically: a shard file that exists is complete."""
    path = _shard_path(shard_dir, index)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(pa.table(rows, schema=SHARD_SCHEMA), tmp)
    os.replace(tmp, path)
    return path


def generate_sharded(generator: BatchGenerator, doc_ids: list[str], titles: list[str], bodies: list[str], n: int,
                     *, shard_dir: Path | None, shard_size: int, seed: int, max_rounds: int, id_tag: str = "q"
                     ) -> pa.Table:
    """``generate_shard`` over the passages (``title + " " + text``) in shards of ``shard_size``, each
    written to ``shard_dir`` when finished; shards found there are not generated again. Without a
    ``shard_dir`` (nothing to resume from) a temporary folder holds them. Returns every shard's rows
    (query_id, doc_id, text), in corpus order."""
    if shard_dir is None:
        with tempfile.TemporaryDirectory(prefix="irflow-generate-") as tmp:
            return generate_sharded(generator, doc_ids, titles, bodies, n, shard_dir=Path(tmp), shard_size=shard_size,
                                    seed=seed, max_rounds=max_rounds, id_tag=id_tag)
    import torch

    shard_dir = Path(shard_dir)
    num_shards = (len(doc_ids) + shard_size - 1) // shard_size
    done = {i for i in range(num_shards) if _shard_path(shard_dir, i).exists()}
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
            rows = generate_shard(generator, doc_ids[lo:hi], texts, n, max_rounds, bar, id_tag)
            _write_shard(shard_dir, index, rows)
    return pa.concat_tables([pq.read_table(_shard_path(shard_dir, i)) for i in range(num_shards)])
