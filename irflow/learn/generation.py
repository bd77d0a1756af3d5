"""Pseudo-query generators on plain arguments (passage ids and texts, a model path, row positions):
no refs, config or stage runtime. The ``generate_queries`` stage calls them; its module doc says what
each source is and where it comes from.

- A seq2seq query generator (docT5query): ``load_generator``; ``BatchGenerator`` samples in batches
  and halves the batch on out-of-memory; ``generate_each`` runs it passage by passage, each seeded from
  the seed and its passage id (a passage's queries depend on it alone); ``generate_batches`` runs it over
  a run of corpus rows in batches that start at multiples of the batch size in the whole corpus, each
  seeded from the seed and its batch number, so that a passage's queries do not depend on how the
  corpus was sharded.
- Model-free: ``ict_queries`` (a random sentence) and ``crop_queries`` (a random span), seeded per passage;
  ``spider_queries`` (a window around a span that recurs in another passage of the same document, that
  passage the positive), seeded per passage, its draws depending on its own document's passages only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import re
import string

from tqdm.auto import tqdm

from irflow.learn.text import passage_text

log = logging.getLogger("irflow.generate_queries")  # named after the stage whose lines these are


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

    Lee et al. remove the sentence from the context it is paired with (90% of the time); as training
    queries here the positive is the unchanged corpus passage, so the query is contained in its positive
    -- one reason such queries are easy. A proxy cuts it out (``cut_out``). A passage with fewer than two sentences gives none: its only
    sentence would be the whole passage, not a query about it.
    """
    all_sents = split_sentences(text)
    if len(all_sents) < 2:
        return []
    sents = list(dict.fromkeys(s for s in all_sents if len(s.split()) >= min_words))
    return _passage_rng(seed, doc_id).sample(sents, min(n, len(sents)))


def cut_out(text: str, queries: list[str]) -> str:
    """``text`` with the first occurrence of each query removed (spaces closed up): the passage a
    query cut out of it (ICT's sentence, crop's span) is then searched for without its own words, as Lee
    et al.'s ICT pairs a sentence with its context *without* the sentence. Left whole, the passage
    contains its query, and string matching finds it: on such a proxy of SciFact BM25 scores near the
    ceiling (``proxy_ndcg@10`` of ``bm25-flat`` in bench/results/own_corpus_scifact.json)."""
    for q in queries:
        text = text.replace(q, " ", 1)
    return " ".join(text.split())


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


# ---- spider -----------------------------------------------------------------------------------
# Function words that make no span worth recurring on their own ("of the", "in a"): a span begins and
# ends with a word outside this list (so it is never stopwords only, and "in white matter in" counts as
# "white matter", not as a longer span). Small on purpose: English function words only.
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing down during each either few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just may me might more
most must my myself neither no nor not of off on once only or other our ours ourselves out over own same
shall she should so some such than that the their theirs them themselves then there these they this those
through to too under until up upon very via was we were what when where whether which while who whom whose
why will with within without would yet you your yours yourself yourselves
""".split())
_EDGE = string.punctuation + "\u201c\u201d\u2018\u2019\u00ab\u00bb\u2026\u2013\u2014"


def _word_key(word: str) -> str:
    """What a word is matched on: lower case, without the punctuation around it ("Cancer," -> "cancer");
    a word of punctuation only has an empty key and never belongs to a span."""
    return word.strip(_EDGE).lower()


def _shared_grams(keys: dict[int, list[str]], lo: int, hi: int
                  ) -> tuple[dict[int, dict[tuple, list[int]]], dict[tuple, set[int]]]:
    """Per passage, its n-grams of ``lo``..``hi`` words (as keys, none empty) that another passage of the
    document also has, with their start positions; and per such n-gram, the passages that have it. An
    n-gram two passages share starts with a ``lo``-gram they share, so longer ones are built only from
    positions whose ``lo``-gram recurs."""
    first: dict[tuple, set[int]] = {}
    for i, k in keys.items():
        for s in range(len(k) - lo + 1):
            g = tuple(k[s:s + lo])
            if all(g):
                first.setdefault(g, set()).add(i)
    grams: dict[int, dict[tuple, list[int]]] = {}
    where: dict[tuple, set[int]] = {}
    for i, k in keys.items():
        mine: dict[tuple, list[int]] = {}
        for s in range(len(k) - lo + 1):
            if len(first.get(tuple(k[s:s + lo]), ())) < 2:
                continue
            for n in range(lo, min(hi, len(k) - s) + 1):
                if not k[s + n - 1]:
                    break
                mine.setdefault(tuple(k[s:s + n]), []).append(s)
        grams[i] = mine
        for g in mine:
            where.setdefault(g, set()).add(i)
    return {i: {g: starts for g, starts in mine.items() if len(where[g]) > 1} for i, mine in grams.items()}, where


def _without(words: list[str], keys: list[str], span: tuple) -> list[str]:
    """``words`` with every occurrence of ``span`` (by keys) taken out, also one that taking out another
    made."""
    n = len(span)
    while True:
        at = next((s for s in range(len(keys) - n + 1) if tuple(keys[s:s + n]) == span), None)
        if at is None:
            return words
        words, keys = words[:at] + words[at + n:], keys[:at] + keys[at + n:]


def multi_passage_documents(document_ids: list[str]) -> int:
    """How many documents have two passages or more (Spider pairs passages of one document only)."""
    seen: dict[str, int] = {}
    for d in document_ids:
        seen[d] = seen.get(d, 0) + 1
    return sum(1 for c in seen.values() if c > 1)


def spider_queries(passage_ids: list[str], document_ids: list[str], texts: list[str], n: int, seed: int, *,
                   min_span_words: int = 2, max_span_words: int = 10, window_words=(10, 30),
                   keep_span_probability: float = 0.5, id_tag: str = "spider") -> dict[str, list]:
    """Recurring-span queries (Spider, Ram et al., NAACL 2022): rows ``query_id``
    (``<passage id>-<id_tag><j>``), ``doc_id`` (the positive: ANOTHER passage of the same document),
    ``text``, ``source`` (the passage the query was cut from) and ``span`` (the recurring span, as it
    reads in the source passage).

    A recurring span is an n-gram of ``min_span_words``..``max_span_words`` words (matched on lower-cased
    words without surrounding punctuation) that two passages of one document share, beginning and ending
    with a word that is not a stopword (``STOPWORDS``; so never stopwords only). For each passage, each
    other passage of its document sharing a span with it is a candidate positive, with their longest
    shared span (ties: one drawn at random); up to ``n`` candidates are taken, those with the longest
    spans first (ties in random order), one query each.
    The query is a window of the source passage around one occurrence of the span: ``window_words`` words
    of context (drawn uniformly from [lo, hi], fewer where the passage has fewer; split at random between
    the two sides), with the span kept (probability ``keep_span_probability``) or taken out -- then every
    occurrence of it is taken out, so the query does not contain it.

    Each passage draws from ``random.Random`` seeded with (seed, passage id): its queries depend on the
    passages of its own document only, not on the corpus order or the rest of the corpus. A passage whose
    document has no other passage, or none sharing a span with it, gives none. The paper also takes a
    passage of the document without the span as the query's negative; here only queries and positives are
    made (the recipe mines negatives).
    """
    lo_w, hi_w = (window_words, window_words) if isinstance(window_words, int) else window_words
    members: dict[str, list[int]] = {}
    for i, d in enumerate(document_ids):
        members.setdefault(d, []).append(i)
    made: dict[int, list[tuple[str, int, str]]] = {}  # passage row -> [(query, positive row, span)]
    for rows in members.values():
        if len(rows) < 2:
            continue
        rows = sorted(rows, key=lambda i: passage_ids[i])  # independent of the corpus order
        words = {i: texts[i].split() for i in rows}
        keys = {i: [_word_key(w) for w in words[i]] for i in rows}
        grams, where = _shared_grams(keys, min_span_words, max_span_words)
        for i in rows:
            longest: dict[int, list[tuple]] = {}  # other passage -> its longest shared spans, in order
            for g in grams[i]:
                if g[0] in STOPWORDS or g[-1] in STOPWORDS:
                    continue
                for j in where[g]:
                    if j == i:
                        continue
                    have = longest.get(j)
                    if have is None or len(g) > len(have[0]):
                        longest[j] = [g]
                    elif len(g) == len(have[0]):
                        have.append(g)
            if not longest:
                continue
            rng = _passage_rng(seed, passage_ids[i])
            others = sorted(longest, key=lambda j: passage_ids[j])
            rng.shuffle(others)
            others.sort(key=lambda j: -len(longest[j][0]))  # the longest spans first; ties stay shuffled
            out: list[tuple[str, int, str]] = []
            for j in others:
                if len(out) == n:
                    break
                span = rng.choice(longest[j])
                start = rng.choice(grams[i][span])
                end = start + len(span)
                w, k = words[i], keys[i]
                context = min(rng.randint(lo_w, hi_w), start + len(w) - end)
                left = rng.randint(max(0, context - (len(w) - end)), min(context, start))
                right = context - left
                if rng.random() < keep_span_probability:
                    q = w[start - left:end + right]
                else:
                    q = _without(w[start - left:start] + w[end:end + right], k[start - left:start] + k[end:end + right],
                                 span)
                text = " ".join(q)
                if text and all(text != t for t, _, _ in out):
                    out.append((text, j, " ".join(w[start:end])))
            made[i] = out
    rows_out: dict[str, list] = {"query_id": [], "doc_id": [], "text": [], "source": [], "span": []}
    for i, pid in enumerate(passage_ids):  # in corpus order
        for q_n, (text, j, span) in enumerate(made.get(i, ())):
            rows_out["query_id"].append(f"{pid}-{id_tag}{q_n}")
            rows_out["doc_id"].append(passage_ids[j])
            rows_out["text"].append(text)
            rows_out["source"].append(pid)
            rows_out["span"].append(span)
    return rows_out


# ---- t5 ---------------------------------------------------------------------------------------
def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "out of memory" in str(e))


def load_generator(path: str, device: str, name: str | None = None):
    """Tokenizer and model of the seq2seq query generator in ``path``; one that cannot be loaded raises
    ``ModelNotAvailable`` naming it (``name``, else the path)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from irflow.engine.models import ModelNotAvailable

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


def generate_passages(generator: BatchGenerator, doc_ids: list[str], texts: list[str], n: int, max_rounds: int,
                      bar=None, id_tag: str = "q") -> tuple[dict[str, list], int]:
    """``n`` distinct non-empty queries per passage where sampling allows it, with ids
    ``<doc_id>-<id_tag><j>``; and how many passages were left with fewer.

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
    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    for doc_id, qs in zip(doc_ids, kept):
        for j, q in enumerate(qs):
            out["query_id"].append(f"{doc_id}-{id_tag}{j}")
            out["doc_id"].append(doc_id)
            out["text"].append(q)
    return out, len(todo)


def passage_seed(seed: int, doc_id: str) -> int:
    """torch's seed for one passage's sampling: a function of the seed and the passage id only."""
    return int.from_bytes(hashlib.sha256(f"{seed}:passage:{doc_id}".encode()).digest()[:8], "little") >> 1


def generate_each(generator: BatchGenerator, doc_ids: list[str], titles: list[str], bodies: list[str], n: int,
                  *, seed: int, max_rounds: int, id_tag: str = "q") -> dict[str, list]:
    """``generate_passages`` passage by passage (``title + " " + text``), torch seeded with
    ``passage_seed(seed, doc_id)`` before each: a passage's queries depend on the seed and the passage
    alone (on a given device), never on which passages come with it. Returns (query_id, doc_id, text)
    lists, in corpus order."""
    import torch

    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    short = 0
    with tqdm(total=len(doc_ids), desc=f"generate queries (n={n})", unit=" passages") as bar:
        for doc_id, title, body in zip(doc_ids, titles, bodies):
            torch.manual_seed(passage_seed(seed, doc_id))
            rows, left = generate_passages(generator, [doc_id], [passage_text(title, body)], n, max_rounds, bar,
                                           id_tag)
            for c in out:
                out[c].extend(rows[c])
            short += left
    if short:
        log.info("generate_queries: %d passage(s) have fewer than %d distinct queries after %d rounds",
                 short, n, max_rounds)
    return out


def batch_seed(seed: int, batch: int) -> int:
    """torch's seed for batch number ``batch`` of the whole corpus (its rows [batch * size, (batch + 1) *
    size)): a function of the seed and the batch only, never of the shard the batch is computed in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{batch}".encode()).digest()[:8], "little") >> 1


def generate_batches(generator: BatchGenerator, doc_ids: list[str], titles: list[str], bodies: list[str], n: int,
                     *, first_row: int, batch_size: int, seed: int, max_rounds: int, id_tag: str = "q"
                     ) -> dict[str, list]:
    """``generate_passages`` over passages (``title + " " + text``) that are the corpus's rows
    [first_row, first_row + len(doc_ids)), batch by batch: batch k is the corpus's rows [k * batch_size,
    (k + 1) * batch_size) (cut to the rows given), torch is seeded with ``batch_seed(seed, k)`` before
    it, and its passages left short are sampled again within the batch. Sampling draws depend on the
    seed and on which passages share a batch (on a given device): so a passage's queries are the same
    whether the corpus is generated whole or in shards, provided each shard starts at a multiple of
    ``batch_size`` (the stage asks the runner for that). An out-of-memory halving (``BatchGenerator``)
    changes the draws from the batch it happens in on. Returns (query_id, doc_id, text) lists, in
    corpus order."""
    import torch

    out: dict[str, list] = {"query_id": [], "doc_id": [], "text": []}
    short = 0
    lo = 0
    with tqdm(total=len(doc_ids), desc=f"generate queries (n={n})", unit=" passages") as bar:
        while lo < len(doc_ids):
            k = (first_row + lo) // batch_size
            hi = min(len(doc_ids), (k + 1) * batch_size - first_row)
            torch.manual_seed(batch_seed(seed, k))
            texts = [passage_text(t, x) for t, x in zip(titles[lo:hi], bodies[lo:hi])]
            rows, left = generate_passages(generator, doc_ids[lo:hi], texts, n, max_rounds, bar, id_tag)
            for c in out:
                out[c].extend(rows[c])
            short += left
            lo = hi
    if short:
        log.info("generate_queries: %d passage(s) have fewer than %d distinct queries after %d rounds",
                 short, n, max_rounds)
    return out
