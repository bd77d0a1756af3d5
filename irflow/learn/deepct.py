"""DeepCT's arithmetic: words, query term recall targets, term frequencies from predicted weights, and the
token-regression model run over words (no refs, no config).

Dai & Callan (2019), "Context-Aware Sentence/Passage Term Importance Estimation for First Stage
Retrieval" (DeepCT; extended to documents as HDCT, 2020): a BERT with a linear layer over each token's
last hidden state predicts how important each passage term is; trained to regress query term recall,
its predictions replace the term frequencies of a BM25 index.

- Words: the maximal runs of word characters (Python's ``\\w+``: letters, digits, underscore) of the
  lower-cased text (``words``). Passages are read as every model of irflow reads them, ``title + " " +
  text`` (``irflow.learn.text.passage_text``); queries by the same rule.
- Targets: query term recall, QTR(t, d) = |Q_{d,t}| / |Q_d|, where Q_d are the queries judged relevant to
  passage d and Q_{d,t} those whose words include t (``query_term_recall``). Every word occurrence of d gets
  its word's target (0 for a word no relevant query has); the target sits on the word's first wordpiece and
  the other wordpieces are masked out of the loss, as DeepCT's ``gen_target_token_weights`` does.
- Loss: the squared error over a passage window's scored tokens (first wordpieces), averaged over them,
  then over the batch (``window_loss``).
- Windows: a passage longer than ``max_length`` wordpieces is read in consecutive windows cut at word
  boundaries (``word_windows``), each with the tokenizer's special tokens; so every word gets a weight,
  in training and in weighting alike. (The DeepCT code truncates: words past the limit were dropped.)
- Term frequencies: tf'(t, d) = round(max(0, w) * scale) (``tf_from_weight``; round half to even, as numpy's
  round in the DeepCT code), per word the largest over its occurrences (``term_frequencies``, as DeepCT's
  ``bert_term_sample_to_json.py``), words with tf' 0 left out; the passage's new text writes each word tf'
  times (``weighted_text``) in the order the words first get a weight, so a BM25 indexer counts tf'.

Not done as the DeepCT scripts optionally do: no stemming or stopword removal when matching query words to
passage words (the BM25 index stems and drops stopwords when it indexes the weighted text).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

WORD = re.compile(r"\w+")


def words(text: str | None) -> list[str]:
    """The lower-cased words of ``text``, in order (``\\w+`` runs)."""
    return WORD.findall((text or "").lower())


def query_term_recall(queries: Iterable[str]) -> dict[str, float]:
    """QTR(t, d) for every word t of the relevant queries ``queries`` of one passage d: the fraction of them
    whose words include t. Every query counts in |Q_d|, a query without words too."""
    sets = [set(words(q)) for q in queries]
    if not sets:
        return {}
    counts = Counter(t for s in sets for t in s)
    return {t: c / len(sets) for t, c in counts.items()}


def word_targets(passage_words: Sequence[str], recall: dict[str, float]) -> list[float]:
    """The target of each word occurrence of a passage: its QTR, 0 for a word no relevant query has."""
    return [float(recall.get(w, 0.0)) for w in passage_words]


def tf_from_weight(weight: float, scale: float = 100) -> int:
    """tf' = round(max(0, weight) * scale), half to even (a NaN weight: 0)."""
    w = float(weight)
    return int(round(max(0.0, w) * scale)) if w == w else 0


def term_frequencies(passage_words: Sequence[str], weights: Sequence[float | None],
                     scale: float = 100) -> dict[str, int]:
    """word -> tf' of a passage: the largest tf' over the word's occurrences, words with tf' 0 left out, in
    the order words first get a tf' above 0. An occurrence without a weight (None: a word the tokenizer
    made no wordpiece of) counts as 0."""
    tfs: dict[str, int] = {}
    for w, x in zip(passage_words, weights, strict=True):
        tf = 0 if x is None else tf_from_weight(x, scale)
        if tf > 0 and tf > tfs.get(w, 0):
            tfs[w] = tf
    return tfs


def weighted_text(tfs: dict[str, int]) -> str:
    """The passage text a BM25 indexer reads tf' from: each word written tf' times, space separated."""
    return " ".join(" ".join([w] * n) for w, n in tfs.items() if n > 0)


def word_windows(pieces: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """[start, stop) word ranges, in order, each holding at most ``budget`` wordpieces (``pieces``: each
    word's count), cut at word boundaries; a word of more than ``budget`` pieces gets a window of its own
    (it is truncated there: its first piece, the one that carries its weight, is kept)."""
    if budget < 1:
        raise ValueError(f"a window must hold at least one wordpiece, got a budget of {budget}")
    out, start, used = [], 0, 0
    for i, n in enumerate(pieces):
        if i > start and used + n > budget:
            out.append((start, i))
            start, used = i, 0
        used += n
    if start < len(pieces):
        out.append((start, len(pieces)))
    return out


# ---- the model over words (torch) ------------------------------------------------------------------
def load_tokenizer(path: str):
    """The model's fast tokenizer (word alignment needs one). Byte-level BPE tokenizers (RoBERTa's) read
    pre-split words only with ``add_prefix_space``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path}: DeepCT aligns wordpieces to words, which needs a fast tokenizer "
                         f"(tokenizer.json); {type(tok).__name__} is not one")
    try:
        tok([["a"]], is_split_into_words=True)
    except ValueError:
        tok = AutoTokenizer.from_pretrained(path, add_prefix_space=True)
    return tok


def window_budget(tok, max_length: int) -> int:
    """Wordpieces of a window: ``max_length`` less the tokenizer's special tokens."""
    budget = int(max_length) - tok.num_special_tokens_to_add(pair=False)
    if budget < 1:
        raise ValueError(f"max_length: {max_length} tokens leave no room for a word beside the special tokens")
    return budget


def piece_counts(tok, passages: Sequence[Sequence[str]]) -> list[list[int]]:
    """Each passage's wordpieces per word (0: the tokenizer made none of it)."""
    if not passages:
        return []
    nonempty = [i for i, p in enumerate(passages) if p]
    out = [[0] * len(p) for p in passages]
    if nonempty:
        # whole passages, longer than the model reads: counted here, read in windows (verbose: no warning)
        enc = tok([list(passages[i]) for i in nonempty], is_split_into_words=True, add_special_tokens=False,
                  verbose=False)
        for row, i in enumerate(nonempty):
            for wid in enc.word_ids(row):
                if wid is not None:
                    out[i][wid] += 1
    return out


def passage_windows(tok, passages: Sequence[Sequence[str]], max_length: int) -> list[list[tuple[int, int]]]:
    """Each passage's word windows (``word_windows``) for a model reading ``max_length`` tokens."""
    budget = window_budget(tok, max_length)
    return [word_windows(c, budget) for c in piece_counts(tok, passages)]


def encode_windows(tok, windows: Sequence[Sequence[str]], max_length: int):
    """(the tokenizer's tensors for the windows, padded; per window the (token position, word index) of
    each word's first wordpiece)."""
    enc = tok([list(w) for w in windows], is_split_into_words=True, truncation=True, max_length=max_length,
              padding=True, return_tensors="pt")
    firsts = []
    for b in range(len(windows)):
        seen, pos = set(), []
        for i, wid in enumerate(enc.word_ids(b)):
            if wid is not None and wid not in seen:
                seen.add(wid)
                pos.append((i, wid))
        firsts.append(pos)
    return enc, firsts


def token_weights(model, enc, device: str):
    """The model's one regression output per token, (windows, tokens), fp32."""
    out = model(**{k: v.to(device) for k, v in enc.items()})
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[..., 0].float()


def window_loss(model, tok, examples: Sequence[dict], max_length: int, device: str):
    """DeepCT's loss over a batch of windows ``{"words": [...], "targets": [...]}``: per window the mean
    squared error over its words' first wordpieces, averaged over the windows."""
    import torch

    enc, firsts = encode_windows(tok, [ex["words"] for ex in examples], max_length)
    shape = enc["input_ids"].shape
    target = torch.zeros(shape, dtype=torch.float32)
    mask = torch.zeros(shape, dtype=torch.float32)
    for b, (ex, pos) in enumerate(zip(examples, firsts)):
        for i, wid in pos:
            target[b, i] = float(ex["targets"][wid])
            mask[b, i] = 1.0
    pred = token_weights(model, enc, device)
    target, mask = target.to(pred.device), mask.to(pred.device)
    per_window = ((pred - target) ** 2 * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return per_window.mean()


def predict_word_weights(model, tok, passages: Sequence[Sequence[str]], max_length: int,
                         device: str) -> list[list[float | None]]:
    """The predicted weight of every word occurrence of each passage (None: a word the tokenizer made no
    wordpiece of), all of their windows in one forward pass."""
    import torch

    spans = passage_windows(tok, passages, max_length)
    flat = [(p, a, b) for p, ws in enumerate(spans) for a, b in ws]
    out: list[list[float | None]] = [[None] * len(p) for p in passages]
    if not flat:
        return out
    enc, firsts = encode_windows(tok, [passages[p][a:b] for p, a, b in flat], max_length)
    with torch.inference_mode():
        pred = token_weights(model, enc, device).cpu().tolist()
    for (p, a, _), pos, row in zip(flat, firsts, pred):
        for i, wid in pos:
            out[p][a + wid] = row[i]
    return out
