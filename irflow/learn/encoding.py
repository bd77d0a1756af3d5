"""Bi-encoder encoding in batch-invariant buckets: a progress bar, float32 output in input order.

A text's embedding must not depend on which other texts share its batch, or a corpus encoded in
shards (irflow.engine.shards) would differ from the same corpus encoded whole in the last bits, and so get
another content id. Padding is what varies with the batch: a batch is padded to its longest text, and
a matrix product over another length sums in another order (measured with MiniLM on this CPU: up to
1.1e-7 apart). So texts are grouped by token length rounded up to a multiple of ``BUCKET`` tokens, and
every batch of a group is padded to exactly that length; with ``full_batches`` every batch also has the
same number of rows: the same text always meets the same shapes (bitwise equal embeddings for any
batching and any other texts, checked on CPU; tests/test_shards.py, tests/test_row_reuse.py). Sorting by length
also keeps padding low: at most BUCKET - 1 tokens per text.

The model is a SentenceTransformer (torch), or an ``irflow.learn.onnx_inference.OnnxBiEncoder`` (ONNX
Runtime: ``runtime.backend: onnx`` or ``quantization: int8``; ``load_sentence_transformer``
gives whichever the stage's runtime says): the same batches, tokenised the same way.
"""

from __future__ import annotations

import contextlib

import numpy as np
from tqdm.auto import tqdm

from irflow.engine import pace
from irflow.engine.processes import check_interrupted

BUCKET = 16  # tokens


def embedding_dim(st_model) -> int:
    # sentence-transformers >= 6 renamed the method; keep working with both.
    get = getattr(st_model, "get_embedding_dimension", None) or st_model.get_sentence_embedding_dimension
    return int(get())


def length_batches(lengths: list[int], batch_size: int, max_length: int) -> list[tuple[int, list[int]]]:
    """(padded length, indices) batches: indices grouped by length rounded up to a multiple of BUCKET
    (capped at ``max_length``), in input order within a group, longest groups first."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(min(max_length, -(-max(n, 1) // BUCKET) * BUCKET), []).append(i)
    return [(padded, idx[s:s + batch_size]) for padded in sorted(groups, reverse=True)
            for idx in [groups[padded]] for s in range(0, len(idx), batch_size)]


LENGTH_CHUNK = 2048  # texts tokenised at a time to measure their lengths


def token_lengths(tokenizer, texts: list[str], text_pairs: list[str] | None = None, *, max_length: int,
                  truncation: bool | str = True) -> list[int]:
    """Each text's (or pair's) token count after truncation, tokenised ``LENGTH_CHUNK`` at a time.

    All at once, a fast tokenizer holds every encoding (tokens, offsets, the truncated overflow) until
    the call returns: ~68 KB a pair for NFCorpus's passages at 128 tokens, 8.7 GB above the process's base
    for 129,500 pairs (RocketQA's denoising list; bench/token_lengths_memory.py), kept by the process as
    heap after it is freed. In chunks the peak is one chunk's. The lengths are the same either way."""
    lengths: list[int] = []
    for s in range(0, len(texts), LENGTH_CHUNK):
        enc = tokenizer(texts[s:s + LENGTH_CHUNK], text_pairs[s:s + LENGTH_CHUNK] if text_pairs is not None else None,
                        truncation=truncation, max_length=max_length)
        lengths += [len(ids) for ids in enc["input_ids"]]
    return lengths


def asymmetric(st_model) -> bool:
    """Whether ``st_model`` encodes queries and documents apart: a SentenceTransformer whose first module is
    a ``Router`` (a query route beside a document route, e.g. ADORE's query encoder beside STAR's frozen
    document encoder)."""
    first = next(iter(st_model), None) if hasattr(st_model, "__iter__") else None
    return type(first).__name__ == "Router"


def encode_texts(st_model, texts: list[str], batch_size: int, normalize: bool, desc: str = "encode",
                 autocast=None, full_batches: bool = False, task: str | None = None) -> np.ndarray:
    """Embeddings of ``texts`` (see the module doc for the batching). ``st_model``: a SentenceTransformer
    or an OnnxBiEncoder (the backend); ``autocast``: a context manager factory for reduced precision
    (None: fp32; torch only). ``full_batches``: every batch has exactly ``batch_size`` rows (a short one
    is filled with copies of its first text, whose embeddings are dropped), so that a text's embedding
    depends on nothing but the text: the number of rows also changes the sums (MiniLM on this CPU: rows
    of batches of 2-4 texts at 48 tokens differ in fp32 from the same texts in a batch of 64; of 1-10 in
    bf16). Costs at most ``batch_size - 1`` rows per length group; the corpus encoding uses it (its rows
    are reused one by one, irflow.engine.row_reuse), queries do not. ``task``: "query" or "document", the side the
    texts are on: an asymmetric model (``asymmetric``) encodes them with that route (``encode_query`` /
    ``encode_document``); any other model encodes both sides alike."""
    from irflow.learn.onnx_inference import OnnxBiEncoder

    onnx = isinstance(st_model, OnnxBiEncoder)
    encode = None if onnx else st_model.encode
    if not onnx and asymmetric(st_model):
        if task not in ("query", "document"):
            raise ValueError(f"{desc}: an asymmetric model (query and document routes) needs task query or "
                             f"document, not {task!r}")
        encode = st_model.encode_query if task == "query" else st_model.encode_document
    max_length = int(st_model.max_seq_length)
    lengths = token_lengths(st_model.tokenizer, texts, max_length=max_length)
    out = np.zeros((len(texts), embedding_dim(st_model)), dtype=np.float32)
    batches = length_batches(lengths, batch_size, max_length)
    work, done = sum(padded * len(idx) for padded, idx in batches) or 1, 0  # tokens: a batch's time grows with them
    with tqdm(total=len(texts), desc=desc, unit=" texts", mininterval=2) as bar, \
            (autocast() if autocast and not onnx else contextlib.nullcontext()):
        for padded, idx in batches:
            check_interrupted()
            pace.progress(done / work)  # a slow encoding is said while it runs (irflow.engine.pace)
            done += padded * len(idx)
            batch = [texts[i] for i in idx]
            if full_batches and not (onnx and st_model.row_wise):  # (row-wise: each text alone already)
                batch += batch[:1] * (batch_size - len(batch))
            if onnx:
                out[idx] = st_model.embed(batch, padded, normalize)[:len(idx)]
                bar.update(len(idx))
                continue
            emb = encode(batch, batch_size=len(batch), convert_to_tensor=True, normalize_embeddings=normalize,
                         show_progress_bar=False, processing_kwargs={"text": {"padding": "max_length",
                                                                             "max_length": padded,
                                                                             "truncation": True}})
            out[idx] = emb[:len(idx)].float().cpu().numpy()
            bar.update(len(idx))
    return out


def load_sentence_transformer(path: str, device: str = "cpu", max_seq_length: int | None = None, *,
                              onnx: str | None = None, threads: int = 1):
    """The model at ``path`` (once per shard worker process: ``irflow.engine.worker.per_worker``); with ``onnx``
    (its exported directory, ``StageRuntime.onnx_model``) an ``OnnxBiEncoder`` on ``threads`` threads,
    which ``irflow.learn.encoding.encode_texts`` runs in its place."""
    from irflow.engine.worker import per_worker

    if onnx:
        from irflow.learn import onnx_inference

        return per_worker(("onnx", onnx, threads, max_seq_length),
                          lambda: onnx_inference.load(onnx, threads, max_seq_length))

    def load():
        from sentence_transformers import SentenceTransformer

        m = SentenceTransformer(path, device=device)
        if max_seq_length:
            m.max_seq_length = int(max_seq_length)
        return m

    return per_worker(("sentence_transformer", path, device, max_seq_length), load)
