"""How long a run will take here, and how much memory, before it starts: per stage, from the corpus's size
and the rates measured on this kind of hardware (``irflow/measured/rates.json``).

The model: a stage's time is its fixed cost (a Prefect task, a JVM for BM25) plus its work in text-tokens
(texts x their length, capped at the stage's max length) times the hardware's seconds per 1,000
text-tokens for that kind of work (encode, score, train), scaled by the model's size (layers x hidden^2,
against MiniLM's 6 x 384) and by cores (rates are for 2). A trainer's steps are its params' ``steps``, else
``epochs`` over its examples (the train split's positives, counted here). ``irflow new`` writes the estimate into the
config it makes; ``irflow run`` prints it before the first stage and the measured seconds after.
These are estimates: within a factor of two on the machines the rates come from.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from irflow.engine.labels import stage_name
from irflow.learn.collapse import COSINE_PROBE

RATES = Path(__file__).resolve().parents[1] / "measured" / "rates.json"
WORDS_TO_TOKENS = 1.3  # WordPiece tokens per whitespace word in English prose (a corpus's own are counted when read)
QUERY_TOKENS = 20  # a query's tokens
PROXY_QUERIES = "generate_queries[proxy]"  # the synthetic evaluation's generator (irflow.recipes.dataset), not training's


@lru_cache(maxsize=1)
def rates() -> dict:
    return json.loads(RATES.read_text())


@dataclass(frozen=True)
class Hardware:
    kind: str  # a key of rates.json's hardware: cpu-avx2, cpu-avx512, cpu-amx, cuda
    cores: int
    gpu: str | None
    memory_mb: int

    def describe(self) -> str:
        return self.gpu or f"{self.cores} CPU cores, {self.kind.removeprefix('cpu-').upper()}"


def hardware() -> Hardware:
    from irflow.engine.runtime import cpu_flags

    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError):
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 -- no torch, no GPU: a CPU estimate
        pass
    flags = cpu_flags()
    kind = ("cuda" if gpu else "cpu-amx" if "amx_bf16" in flags else
            "cpu-avx512" if "avx512f" in flags else "cpu-avx2")
    return Hardware(kind, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    gpu, mem)


@dataclass(frozen=True)
class CorpusSize:
    passages: int
    mean_words: float
    queries: int = 0  # evaluation queries (labelled or proxy)
    log_queries: int = 0  # a query log's queries (generate.source: unlabelled)
    train_positives: tuple[int, ...] = ()  # per query of the train split, its positives (supervised recipes)
    train_passages: int = 0  # passages with a train positive (DeepCT's training windows)
    word_quantiles: tuple[float, ...] = ()  # the passages' words at even quantiles (``quantiles``; none: the mean)
    # tokens per whitespace word, counted with the model's tokenizer on a sample (``tokens_per_word``); biomedical
    # text reads 1.5 (NFCorpus), English prose 1.3
    tokens_per_word: float = WORDS_TO_TOKENS
    # the words of the sentences ICT draws its queries from, at 200 even quantiles (``sentence_quantiles``: a
    # sample); none: a query's QUERY_TOKENS
    sentence_quantiles: tuple[float, ...] = ()

    def train_pairs(self, per_query: int | None = None) -> int:
        """The train split's (query, positive) pairs, at most ``per_query`` a query."""
        return sum(min(n, per_query or n) for n in self.train_positives)

    @property
    def mean_tokens(self) -> float:
        return self.mean_words * self.tokens_per_word

    def tokens(self, max_len: int) -> float:
        """A passage's mean tokens read at ``max_len``: a short passage is not padded to it, so the mean of the
        capped lengths (where the quantiles are known), not the cap of the mean."""
        if not self.word_quantiles:
            return min(self.mean_tokens, max_len)
        return sum(min(w * self.tokens_per_word, max_len) for w in self.word_quantiles) / len(self.word_quantiles)

    def padded_tokens(self, max_len: int, batch: int) -> float:
        """The tokens each passage of a training batch is padded to: the longest of ``batch`` passages (its
        expected rank, read off the quantiles), capped at ``max_len``; without the quantiles, the mean."""
        q = self.word_quantiles
        if not q:
            return min(self.mean_tokens, max_len)
        at = min(len(q) - 1.0, max(0.0, (1 - 1 / (batch + 1)) * len(q) - 0.5))  # midpoint i sits at (i + 0.5)/n
        lo = int(at)
        words = q[lo] + (q[min(lo + 1, len(q) - 1)] - q[lo]) * (at - lo)
        return min(words * self.tokens_per_word, max_len)

    def padded_sentence_tokens(self, max_len: int, batch: int) -> float | None:
        """The tokens a batch of ICT queries is padded to: the expected longest of ``batch`` sentences drawn from
        the quantiles (each capped at ``max_len``): sum_i x_(i) ((i / m)^batch - ((i - 1) / m)^batch) over the
        m sorted values. A few long sentences (code, legal text) pad most batches; None when not counted."""
        if not self.sentence_quantiles:
            return None
        x = sorted(min(w * self.tokens_per_word, max_len) for w in self.sentence_quantiles)
        m = len(x)
        return sum(v * ((i / m) ** batch - ((i - 1) / m) ** batch) for i, v in enumerate(x, start=1))


TOKENISED_SAMPLE = 500  # passages the estimate tokenises to count tokens per word (evenly spread: within 1-2%)


def local_tokenizer(model: str | None):
    """The tokenizer of ``model`` when it is here (a folder, or a name irflow resolves to one); None otherwise
    (a hub model not downloaded): the estimate then reads ``WORDS_TO_TOKENS``."""
    if not model:
        return None
    try:
        from transformers import AutoTokenizer

        from irflow.engine.models import resolve

        path = resolve(model).path
        return AutoTokenizer.from_pretrained(path) if Path(path).is_dir() else None
    except Exception:  # noqa: BLE001 -- no tokenizer here: the English prior stands in
        return None


def tokens_per_word(texts, tokenizer, sample: int = TOKENISED_SAMPLE) -> float | None:
    """Tokens per whitespace word over up to ``sample`` of ``texts`` (a pyarrow string column; evenly spread, only
    those read into Python), counted with ``tokenizer``; None without one."""
    if tokenizer is None or not len(texts):
        return None
    picked = [t for t in spread_sample(texts, sample) if t]
    words = sum(len(t.split()) for t in picked)
    if not words:
        return None
    ids = tokenizer(picked, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
    return round(sum(len(x) for x in ids) / words, 3)


def spread_sample(texts, sample: int) -> list:
    """Up to ``sample`` of ``texts`` (a list or a pyarrow column; only those read into Python), evenly spread."""
    picked = list(range(0, len(texts), max(1, len(texts) // sample)))[:sample]
    return texts.take(picked).to_pylist() if hasattr(texts, "take") else [texts[i] for i in picked]


def student_model(c) -> str | None:
    """The model a config trains or encodes with (what the estimate scales its rates and counts tokens by)."""
    dense = getattr(c, "dense", None)
    return getattr(getattr(c, "train", None), "model", None) or getattr(dense, "model", None) or getattr(
        c, "base_model", None)


def quantiles(words, slices: int = 20) -> tuple[float, ...]:
    """Words per passage at the midpoints of ``slices`` even slices (what ``CorpusSize.tokens`` averages)."""
    import numpy as np

    w = np.asarray(words, dtype=float)
    mid = (np.arange(slices) + 0.5) / slices
    return tuple(round(float(x), 1) for x in np.quantile(w, mid)) if w.size else ()


def sentence_quantiles(texts, sample: int = 2000, min_words: int = 3) -> tuple[float, ...]:
    """Words of the queries ICT draws (``irflow.learn.generation.ict_queries``: a sentence of ``min_words`` or
    more, one a passage of two sentences or more, each of them as likely), drawn here from up to ``sample`` of
    ``texts`` (a list or a pyarrow string column, evenly spread), at 200 quantiles: enough of the tail for a
    batch's longest."""
    import random

    from irflow.learn.generation import split_sentences

    rng, words = random.Random(0), []
    for text in spread_sample(texts, sample):
        sentences = split_sentences(text or "")
        eligible = [n for n in (len(x.split()) for x in sentences) if n >= min_words] if len(sentences) >= 2 else []
        if eligible:
            words.append(rng.choice(eligible))
    return quantiles(words, 200)


@dataclass
class StageEstimate:
    stage: str
    seconds: float
    peak_mb: int
    work: str  # what the time is made of, in words
    kind: str = "fixed"  # which rate the time grows with: encode, score, train, generate, bm25, or fixed


def model_scale(name: str | None) -> float:
    """A model's cost against MiniLM-L6 (6 layers x 384): layers x hidden^2, from its config.json when it is
    a local folder, else from its name (base: 12 x 768, large: 24 x 1024)."""
    if not name:
        return 1.0
    cfg = Path(name) / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        layers = c.get("num_hidden_layers") or c.get("num_layers") or 6
        hidden = c.get("hidden_size") or c.get("d_model") or 384
        return max(0.01, layers * hidden**2 / (6 * 384**2))
    low = name.lower()
    return 24 * 1024**2 / (6 * 384**2) if "large" in low else 12 * 768**2 / (6 * 384**2) if "base" in low else 1.0


def _rate(hw: Hardware, work: str) -> float:
    per_1k = rates()["hardware"][hw.kind][work]["value"]
    return per_1k * (2 / max(1, hw.cores) if hw.kind != "cuda" else 1.0)


def estimate(c, stages: list[str], size: CorpusSize, hw: Hardware | None = None,
             params: dict[str, dict] | None = None, queries: dict[str, int] | None = None,
             inputs: dict[str, dict] | None = None) -> list[StageEstimate]:
    """Seconds and peak memory of each of ``stages`` (plan labels: ``encode_corpus[zero-shot]``) under config
    ``c`` on a corpus of ``size``. ``params``: label -> the stage's params (``api.status``'s; None: ``plan_of(c)``),
    which each stage's estimate reads its work from (the config only for what is not a param: the models'
    sizes, the queries a recipe trains on); ``queries``: label -> the queries a
    search stage reads (``searched_queries``; otherwise the evaluation's and the generated ones); ``inputs``:
    label -> {role: dataset ids} (the plan's), by which an encoding of a corpus whose passages an earlier
    stage of the plan encoded with the same model and settings is estimated at the passages left to encode
    (``irflow.engine.row_reuse``: the zero-shot model's corpus after the miner's training corpus). A stage is
    its fixed cost (``fixed_seconds``) plus what its estimator in ``WORK`` adds; one without: the fixed cost."""
    if params is None:  # the stages' params (and inputs) as a first run in an empty store would call them
        _, planned_inputs, params = plan_of(c)
        inputs = planned_inputs if inputs is None else inputs
    run = _Estimating(c, size, hw or hardware(), params, queries or {}, inputs or {})
    out = []
    computed: set[str] = set()
    for label in stages:
        base = stage_name(label)
        own = run.params.get(label) or {}  # the stage's params as the plan gives them
        if (same := _computation(run, label)) is not None:
            if same in computed:  # a label computing what an earlier one computes (one cache key): a cache hit
                out.append(StageEstimate(label, 0.0, int(run.mem["base"]), "computed above (same params and inputs)"))
                continue
            computed.add(same)
        work = WORK.get(base)
        sec, peak, what, kind = (work(run, label, own) if work else None) or (0.0, 0.0, "fixed cost", "fixed")
        out.append(StageEstimate(label, round(run.fixed.get(base, 1) + sec, 1), int(run.mem["base"] + peak), what,
                                 kind))
    return out


def _computation(run: "_Estimating", label: str) -> str | None:
    """What a planned stage computes, as its cache key would see it (its name, params and input ids); None when
    the plan does not give its params and inputs."""
    if label not in run.params or label not in run.inputs:
        return None
    return json.dumps([stage_name(label), run.params[label], run.inputs[label]], sort_keys=True, default=str)


class _Estimating:
    """What every stage's estimate reads: the config, the corpus, the hardware, the plan's params, queries and
    inputs, the shipped rates, and the encodings planned so far (``encoded``)."""

    def __init__(self, c, size: CorpusSize, hw: Hardware, params: dict, queries: dict, inputs: dict):
        self.c, self.size, self.hw, self.params, self.queries, self.inputs = c, size, hw, params, queries, inputs
        self.fixed = rates()["fixed_seconds"]["value"]
        self.mem = rates()["memory_mb"]["value"]
        dense = getattr(c, "dense", None)
        self.enc_len = getattr(dense, "max_seq_length", None) or 256
        self.scale = model_scale(student_model(c))
        self.emb_mb = size.passages * 384 * 4 * 2 / 2**20 * max(1.0, self.scale ** 0.5)
        self.n_gen = _generated_queries(c, size)
        self.encoded: dict[tuple, tuple] = {}  # (model ids, encoding params) -> the corpus ids its first encoding read
        self.proxy = getattr(getattr(c, "dataset", None), "proxy", None)
        judged = self.proxy is None or getattr(self.proxy, "judged", False)
        self.held_out = 0.1 if judged else getattr(self.proxy, "fraction", 0.1)
        # the teacher's model is an input, not a param: its size is read from the config's name for it
        self.teacher_scale = model_scale(getattr(getattr(c, "teacher", None), "model", None))
        # a query's candidates for the teacher: the miners' top mine.depth each, overlapping by about half
        self.candidates = getattr(getattr(c, "mine", None), "depth", 50) * 1.5

    def stage(self, name: str) -> dict:
        """The params of the first planned stage called ``name`` (another stage's: the triples ``label_scores``
        scores, the training queries ``generate_queries`` makes, not the synthetic evaluation's, planned first);
        {} when the plan has none."""
        return next((p for label, p in self.params.items() if stage_name(label) == name and label != PROXY_QUERIES),
                    {})

    def rate(self, work: str) -> float:
        return _rate(self.hw, work)

    def searched(self, label: str) -> int:
        """The queries a stage reads: counted by the plan (``searched_queries``), else the generated ones for
        a stage reading generated training queries, the evaluation's for one reading those (the proxy's
        queries are generated too, from the held-out passages), both when the plan does not say."""
        if label in self.queries:
            return self.queries[label]
        ids = (self.inputs.get(label) or {}).get("queries") or []
        if len(ids) != 1:
            return self.size.queries + self.n_gen
        training = ids[0].startswith("<generate_queries[") and not ids[0].startswith(f"<{PROXY_QUERIES}")
        return self.n_gen if training else self.size.queries


Work = tuple[float, float, str, str]  # seconds and MB beyond the fixed cost, the work in words, its kind


def _encode_corpus(run: _Estimating, label: str, own: dict) -> Work:
    roles = run.inputs.get(label) or {}
    length = own.get("max_seq_length") or _own_length(roles.get("model"), run.params) or run.enc_len
    passages = run.size.passages
    model_ids, corpus_ids = tuple(roles.get("model") or ()), tuple(roles.get("corpus") or ())
    if model_ids and run.encoded.setdefault((model_ids, json.dumps(own, sort_keys=True)), corpus_ids) != corpus_ids:
        passages = round(run.size.passages * run.held_out)  # the rest reused from the first encoding
    tokens = run.size.tokens(length)
    sec = passages * tokens / 1000 * run.rate("encode") * run.scale + run.fixed["model_load"]
    return sec, run.mem["model"] + run.emb_mb, f"{passages:,} passages x {tokens:.0f} tokens", "encode"


def _dense_search(run: _Estimating, label: str, own: dict) -> Work:
    sec = run.searched(label) * QUERY_TOKENS / 1000 * run.rate("encode") * run.scale
    return sec, run.mem["model"] + run.emb_mb, "query encoding + search", "encode"


def _pairs_scored(run: _Estimating, label: str, own: dict) -> Work:
    """BM25 or a dense miner scoring every candidate of a query (``teacher.score_every_candidate``), a score
    per pair."""
    bm25 = stage_name(label) == "bm25_score"
    pairs = int(run.searched(label) * run.candidates)
    sec = pairs / rates()["pairs_scored_per_s"]["value"]["bm25" if bm25 else "dense"]
    if not bm25:  # the queries are encoded first
        sec += _dense_search(run, label, own)[0]
    return (sec, run.mem["jvm"] if bm25 else run.mem["model"] + run.emb_mb, f"{pairs:,} (query, passage) pairs scored",
            "bm25" if bm25 else "encode")


def _bm25_index(run: _Estimating, label: str, own: dict) -> Work:
    return (run.size.passages / rates()["bm25_passages_per_s"]["value"], run.mem["jvm"],
            f"{run.size.passages:,} passages indexed", "bm25")


def _bm25_search(run: _Estimating, label: str, own: dict) -> Work:
    n, depth = run.searched(label), own.get("depth") or 1000
    ms = rates()["bm25_search_ms"]["value"]
    return n * (ms["query"] + ms["hit"] * depth) / 1000, run.mem["jvm"], f"{n:,} queries searched to {depth}", "bm25"


def _generate(run: _Estimating, label: str, own: dict) -> Work | None:
    if stage_name(label) == "generate_queries" and "[t5" not in label:  # the model-free sources: a fixed cost
        return None
    qpp = own.get("queries_per_passage", 1)
    qpp = qpp if isinstance(qpp, int) else 3
    per_query = rates()["hardware"][run.hw.kind]["generate_query_s"]["value"] * (
        2 / max(1, run.hw.cores) if run.hw.kind != "cuda" else 1.0)
    n = run.size.passages * qpp
    return n * per_query, 2 * run.mem["model"], f"{n:,} queries sampled", "generate"


def _cross_encoder(run: _Estimating, label: str, own: dict) -> Work | None:
    teacher = own.get("teacher") or {}
    if teacher.get("type") != "cross_encoder":
        return None
    if stage_name(label) == "label_scores":
        pairs = run.n_gen * (own["negatives_per_positive"] + 1)
    else:  # the held-out log queries' candidates
        held = run.queries.get(label) or int((run.size.log_queries or 0) * getattr(run.proxy.queries, "fraction", 0.2))
        pairs = int(held * run.candidates)
    sec = pairs * run.size.tokens(teacher["max_length"]) / 1000 * run.rate("score") * run.teacher_scale
    verb = "scored" if stage_name(label) == "label_scores" else "judged"
    return sec, run.mem["model"], f"{pairs:,} (query, passage) pairs {verb}", "score"


def _reranked(run: _Estimating, label: str, own: dict) -> Work | None:
    """A cross-encoder reading each query's top ``depth`` of a ranking: ``rerank`` (the model input) and
    ``score_candidates`` (its teacher, when a cross-encoder; a labelled split's queries are those with
    positives there)."""
    if stage_name(label) == "rerank":  # the model input: RocketQA's cross-encoder, else the config's teacher
        ce = getattr(run.c, "cross_encoder", None)
        max_length = own.get("max_length") or 256
        scale = model_scale(getattr(ce, "model", None)) if ce is not None else run.teacher_scale
    else:
        teacher = own.get("teacher") or {}
        if teacher.get("type") != "cross_encoder":
            return None
        max_length, scale = teacher.get("max_length") or 350, run.teacher_scale
    queries = (len(run.size.train_positives) if own.get("split") == "train" and run.size.train_positives
               else run.searched(label))
    pairs = queries * (own.get("depth") or 50)
    sec = pairs * min(run.size.tokens(max_length) + QUERY_TOKENS, max_length) / 1000 * run.rate("score") * scale
    return sec + run.fixed["model_load"], run.mem["model"], f"{pairs:,} (query, passage) pairs scored", "score"


def _pseudo_label(run: _Estimating, label: str, own: dict) -> Work | None:
    if not isinstance(own.get("scale"), dict):  # a fixed margin scale: nothing encoded
        return None
    # scale: auto encodes a sample of the triples (query, positive, negative) label_scores scored with the student
    triples = run.n_gen * max(1, run.stage("label_scores").get("negatives_per_positive") or 1)
    sample = min(triples, own.get("scale_sample") or 1000)
    length = own["scale"].get("max_seq_length") or run.enc_len
    # each distinct text once (``student_margins``): the sample's positives and negatives, drawn from the
    # corpus, repeat as the sample nears its size
    passages = run.size.passages * (1 - math.exp(-2 * sample / max(1, run.size.passages)))
    queries = min(sample, run.n_gen or sample)
    sec = ((queries * QUERY_TOKENS + passages * run.size.tokens(length)) / 1000 * run.rate("encode") * run.scale
           + run.fixed["model_load"])
    return sec, run.mem["model"], f"{sample:,} triples ({passages:,.0f} passages) encoded for the margin scale", "encode"


def _train_student(run: _Estimating, label: str, own: dict) -> Work | None:
    if not own:
        return None
    steps, batch, length = own["steps"], own["batch_size"], own["max_seq_length"]
    # texts an example encodes: the query and its positive, and one negative (margin_mse) or, listwise, every
    # negative labelled for the query
    negatives = {"mnrl": 0, "margin_mse": 1}.get(
        own.get("loss", "margin_mse"), run.stage("label_scores").get("negatives_per_positive") or 1)
    texts = (2 + negatives) * batch
    # a batch's column of passages is padded to its longest (not bucketed by length, as an encoding is), and a
    # token of a longer passage costs more (its attention reads every other token of it)
    padded = run.size.padded_tokens(length, batch)
    tokens = (batch * _query_tokens(run.stage("generate_queries"), run.size, length, batch)
              + (texts - batch) * padded * _length_cost(padded))
    sec = steps * tokens / 1000 * run.rate("train") * run.scale + run.fixed["model_load"]
    return sec, run.mem["train"] * max(1.0, run.scale ** 0.5) * batch / 16, f"{steps} steps of {batch}", "train"


def _length_cost(tokens: float) -> float:
    """A training token's cost in a passage of ``tokens`` against one of the length the train rate was measured
    at: (c + tokens) / (c + reference), ``length_cost`` of rates.json."""
    c = rates()["length_cost"]["value"]
    return (c["tokens"] + tokens) / (c["tokens"] + c["train_reference_tokens"])


def _deepct_weight(run: _Estimating, label: str, own: dict) -> Work | None:
    if not run.params.get(label):
        return None
    n = _windows(run.size.mean_tokens, run.params[label]["max_length"])
    sec = run.size.passages * run.size.mean_tokens / 1000 * run.rate("encode") * run.scale + run.fixed["model_load"]
    return sec, run.mem["model"], f"{run.size.passages:,} passages x {n} windows weighted", "encode"


def _own_length(model_ids: list[str] | None, params: dict[str, dict] | None) -> int | None:
    """The tokens a planned student reads when its encoding sets none: the length it trained at (a student is
    saved with its training's ``max_seq_length``)."""
    ref = model_ids[0] if model_ids and len(model_ids) == 1 else ""
    if not ref.startswith("<train_student["):  # a planned output: <train_student[gpl]:student>
        return None
    return ((params or {}).get(ref[1:].split(":")[0]) or {}).get("max_seq_length")


def _query_tokens(generate: dict, size: CorpusSize, max_len: int, batch: int) -> float:
    """A training query's tokens: a span of a passage (Contriever's crops: the mean of ``crop_ratio`` of it, the
    ``generate`` stage's params); a sentence of one (ICT: the batch's query column is padded to its longest
    sentence, which in text with long sentences, such as docstrings, is most of a passage); else a query's
    ``QUERY_TOKENS``."""
    ratio = generate.get("crop_ratio")
    if ratio:
        return max(QUERY_TOKENS, min(size.mean_tokens * sum(ratio) / 2, max_len))
    sentence = size.padded_sentence_tokens(max_len, batch) if generate.get("source") == "ict" else None
    return max(QUERY_TOKENS, sentence) if sentence else QUERY_TOKENS


def plan_of(c) -> tuple[list[str], dict[str, dict], dict[str, dict]]:
    """The stage labels a first run of config ``c`` computes (in an empty store, made and removed here), and each
    one's inputs (label -> {role: ids}) and params (label -> its params, as the run would call it)."""
    import shutil
    import tempfile

    from irflow.engine import orchestration
    from irflow.recipes.base import get_recipe, plan

    store = tempfile.mkdtemp(prefix="irflow-plan-")
    old = os.environ.get("PREFECT_HOME")
    try:
        orchestration.configure(store)
        steps = plan(get_recipe(c.flow), c, store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
        if old is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = old
    # a stage called twice with the same inputs (BM25's index for mining and for evaluation) computes once
    return (list(dict.fromkeys(p["name"] for p in steps)), {p["name"]: p["inputs"] for p in steps},
            {p["name"]: p["params"] for p in steps})


def searched_queries(plan, size: CorpusSize, catalog=None) -> dict[str, int]:
    """label -> how many queries each planned stage with a ``queries`` input reads: a stored input's rows
    (from ``catalog``), the train split's queries for one the run's ``select_queries[train]`` will make;
    other stages are left to the default."""
    out = {}
    for p in plan:  # api.status's StageStatus rows
        ids = p.inputs.get("queries") or []
        if len(ids) != 1:
            continue
        if ids[0].startswith("<select_queries[train]") and size.train_positives:
            out[p.name] = len(size.train_positives)
        elif not ids[0].startswith("<") and catalog is not None:
            row = catalog.dataset(ids[0])
            if row and row.get("num_rows") is not None:
                out[p.name] = int(row["num_rows"])
    return out


def _trainer(run: _Estimating, label: str, own: dict) -> Work | None:
    """A supervised trainer from its params (a dump of its params model: every field but the KEYED_WHEN_SET
    ones at their default, read with ``get``): its steps (``steps``, else ``epochs`` over the train split's
    examples) x the text-tokens one step embeds. None without the plan's params."""
    if not run.params.get(label):
        return None
    base, p, size, scale = stage_name(label), run.params[label], run.size, run.scale
    batch = p["batch_size"]
    doc = size.mean_tokens
    if base == "train_dual_encoder":
        per_query = p["list_size"] if p["loss"] == "listwise_kl" else 1 + p["negatives_per_line"]
        examples = size.train_pairs(p.get("positives_per_query")) * (
            p["negative_lines"] if p["negatives_per_line"] else 1)
        passage = min(doc, p["passage_max_length"])
        toks = batch * (min(QUERY_TOKENS, p["query_max_length"]) + per_query * passage)
        extra = 2 * COSINE_PROBE * passage  # the collapse check embeds its probe passages twice
    elif base == "train_query_encoder":  # the documents are frozen: only queries are embedded
        examples, extra = len(size.train_positives), 0.0
        toks = batch * min(QUERY_TOKENS, p["query_max_length"])
    elif base == "train_cross_encoder":
        examples, extra = size.train_pairs(p.get("positives_per_query")) * (1 + p["negatives_per_positive"]), 0.0
        toks = batch * min(doc + QUERY_TOKENS, p["max_length"])
    else:  # train_deepct: every window of each passage with a train positive
        examples, extra = size.train_passages * _windows(doc, p["max_length"]), 0.0
        toks = batch * min(doc, p["max_length"])
    steps = p["steps"] or p["epochs"] * -(-examples // batch)
    if not steps:
        return 0.0, 0.0, "steps unknown (no train split counted)", "train"
    sec = (steps * toks / 1000 * run.rate("train") * scale + extra / 1000 * run.rate("encode") * scale
           + run.fixed["model_load"])
    return sec, run.mem["train"] * max(1.0, scale ** 0.5) * batch / 16, f"{steps} steps of {batch}", "train"


# stage name -> what its time grows with (the others: their fixed cost)
WORK = {"encode_corpus": _encode_corpus, "dense_search": _dense_search, "dense_score": _pairs_scored,
        "bm25_index": _bm25_index, "bm25_search": _bm25_search, "bm25_score": _pairs_scored,
        "generate_queries": _generate, "doc2query_expand": _generate,
        "label_scores": _cross_encoder, "judge_queries": _cross_encoder, "pseudo_label": _pseudo_label,
        "score_candidates": _reranked, "rerank": _reranked,
        "train_student": _train_student, "train_dual_encoder": _trainer, "train_query_encoder": _trainer,
        "train_cross_encoder": _trainer, "train_deepct": _trainer, "deepct_weight": _deepct_weight}


def _windows(tokens: float, max_length: int) -> int:
    """The windows of ``max_length`` tokens (two of them special) a passage of ``tokens`` is read in."""
    return max(1, -(-int(tokens) // max(1, max_length - 2)))


def _generated_queries(c, size: CorpusSize) -> int:
    gen = getattr(c, "generate", None)
    if gen is None:
        return 0
    if gen.source == "unlabelled":  # a query log, else the texts of a labelled split's queries (train: counted)
        train = len(size.train_positives) if getattr(gen, "split", None) == "train" else 0
        return size.log_queries or train or size.queries
    qpp = getattr(gen, "queries_per_passage", 1)
    return size.passages * (qpp if isinstance(qpp, int) else 3)


def corpus_size(d, proxy_queries: int | None = None, model: str | None = None) -> CorpusSize:
    """Count the passages and words of a config's dataset (``dataset:`` section), reading it as a run would
    (your own documents: cut into passages) into a temporary file; ``model``: the tokens a word makes are
    counted with its tokenizer on a sample, when it is here."""
    import tempfile

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from irflow.sources.beir import is_beir_source
    from irflow.sources.corpus_sources import read_corpus, read_documents, source_bytes

    src = Path(d.source).expanduser()
    beir = is_beir_source(d.source)
    size = source_bytes(src)
    if size > MAX_SIZED_BYTES:
        raise ValueError(f"{d.source} is {size / 2**20:,.0f} MB: too large to read twice (irflow new estimates it once)")
    with tempfile.TemporaryDirectory(prefix="irflow-size-") as tmp, no_progress_bars():
        out = Path(tmp) / "corpus.parquet"
        if beir:
            read_corpus(src, out, format="beir")
        else:
            read_documents(src, out, d)
        t = pq.read_table(out, columns=["text"])
    words = pc.list_value_length(pc.utf8_split_whitespace(t.column("text")))
    ratio = tokens_per_word(t.column("text"), local_tokenizer(model)) or WORDS_TO_TOKENS
    mean = pc.mean(words).as_py() or 0.0
    log_q = 0
    if getattr(d, "query_log", None):
        log_q = sum(1 for ln in Path(d.query_log).read_text(errors="replace").splitlines() if ln.strip())
    if proxy_queries is not None:
        queries = proxy_queries
    elif beir and src.exists() and (judged := len({q for q, _ in _split_positives(src, d.split)})):
        queries = min(judged, getattr(d, "limit_queries", None) or judged)
    elif beir or d.qrels is not None:
        queries = 300
    elif d.proxy is None:  # nothing evaluated
        queries = 0
    else:  # one query per held-out document: about the fraction of the documents (passages: an upper bound)
        queries = round(d.proxy.fraction * t.num_rows)
        if d.proxy.documents is not None:
            queries = min(queries, d.proxy.documents)
    pairs = _split_positives(src, "train") if beir and src.exists() else []
    per_query = Counter(q for q, _ in pairs)
    return CorpusSize(t.num_rows, round(mean, 1), queries, log_q, tuple(per_query[q] for q in sorted(per_query)),
                      len({d for _, d in pairs}), quantiles(words.to_numpy(zero_copy_only=False)), ratio,
                      sentence_quantiles(t.column("text")))


def _split_positives(src: Path, split: str) -> list[tuple[str, str]]:
    """The (query, passage) positives of a BEIR source's ``split`` (none: no qrels file for it)."""
    from irflow.learn.qrels import positive_pairs
    from irflow.sources.beir import BeirSource, _read_qrels

    b = BeirSource(src)
    member = b.qrels_files().get(split)
    return positive_pairs(_read_qrels(b, member, split), split) if member else []


MAX_SIZED_BYTES = 200 * 2**20  # a source read before the run to size it; larger ones are left to irflow new


@contextmanager
def no_progress_bars():
    old = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = old


# ---- calibrated by this store -------------------------------------------------------------------
CALIBRATE_FROM = 5.0  # stages estimated shorter than this (seconds) say more about fixed costs than rates
BUSY = 0.5  # other work above this many runnable processes per core: the cores were not free


def hardware_key(hw: Hardware) -> str:
    """What a store's measured rates are kept under: the CPU model and cores (or the GPU)."""
    from irflow.engine.runtime import cpu_model

    return hw.gpu or f"{cpu_model()} / {hw.cores} cores"


@dataclass(frozen=True)
class Calibration:
    """Measured / estimated of the stages this store ran on this hardware with free cores, at three grains: the
    stage itself (``train_student[gpl]``), its kind of stage (``train_student``), its kind of work (``train``).
    A stage's estimate takes the finest that has been measured: MoCo's training says little of Margin-MSE's."""

    factors: dict[str, tuple[float, int]]  # stage label, stage name or kind of work -> (median ratio, stage runs)

    def factor(self, e: StageEstimate) -> tuple[str, float] | None:
        """The key and factor that calibrate ``e``; None: nothing of its kind measured."""
        for key in (e.stage, stage_name(e.stage), e.kind):
            if key in self.factors:
                return key, self.factors[key][0]
        return None

    def apply(self, est: list[StageEstimate]) -> list[StageEstimate]:
        return [replace(e, seconds=round(e.seconds * f[1], 1)) if (f := self.factor(e)) else e for e in est]

    def describe(self, est: list[StageEstimate] | None = None) -> str:
        """The factors used for ``est`` (every factor without it)."""
        keys = {f[0] for e in est if (f := self.factor(e))} if est is not None else set(self.factors)
        return "calibrated by this store's runs here: " + ", ".join(
            f"{k} x{f:.2f} ({n} stage run{'s' if n > 1 else ''})" for k, (f, n) in sorted(self.factors.items())
            if k in keys)


def calibration(catalog, hw: Hardware) -> Calibration | None:
    """What this store measured on this hardware (``Catalog.estimated_stages``); None: nothing to calibrate by
    (the shipped rates stand). See ``calibration_from``."""
    if catalog is None:
        return None
    return calibration_from(catalog.estimated_stages(hardware_key(hw)), hw.cores)


def calibration_from(rows: list[dict], cores: int) -> Calibration | None:
    """Per stage, kind of stage and kind of work, the median of measured / prior over ``rows`` (``{stage, kind,
    prior, measured, load, runtime}``) estimated at ``CALIBRATE_FROM`` seconds or more that ran with free cores
    (the cores other processes kept busy when the run was estimated, and the load average when the stage
    started less its own threads, at most ``BUSY`` a core), each factor kept within 0.2-5."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if not r["prior"] or r["prior"] < CALIBRATE_FROM or r["measured"] is None:
            continue
        started = (r["runtime"].get("load") or [None])[0]
        others = [r["load"], None if started is None else started - (r["runtime"].get("threads") or cores)]
        if any(x is not None and x > BUSY * cores for x in others):
            continue
        for key in dict.fromkeys((r["stage"], stage_name(r["stage"]), r["kind"])):
            ratios.setdefault(key, []).append(r["measured"] / r["prior"])
    if not ratios:
        return None
    return Calibration({k: (min(5.0, max(0.2, float(statistics.median(v)))), len(v)) for k, v in ratios.items()})


def cores_busy(hw: Hardware, load: float | None) -> bool:
    """Whether ``load`` (the cores other processes keep busy) leaves the CPU cores an estimate assumes free
    not free (more than ``BUSY`` a core); a GPU's estimate is not moved by it."""
    return load is not None and load > BUSY * hw.cores and hw.kind != "cuda"


def load_note(hw: Hardware, load: float | None, threads: int | None = None, total: float | None = None,
              now: float | None = None) -> str | None:
    """What a busy machine does to the figures: they assume free cores. ``threads``: the run's
    ``runtime.threads`` (None: every core); ``total``: the estimate's seconds, for the finishing time at the
    slower pace (from ``now``, the epoch seconds; default: now)."""
    if not cores_busy(hw, load):
        return None
    import time
    from datetime import datetime

    c = rates()["contention"]["value"]
    free = max(1, hw.cores - round(load))
    slower = 1 + load / hw.cores
    head = (f"warning: other processes keep {load:.1f} of the {hw.cores} cores busy: other work shares them, and "
            f"these figures assume they are free; expect about {slower:.1f}x as long")
    start = time.time() if now is None else now

    def ends(factor: float) -> str:  # the finishing time at ``factor`` times the estimate
        return f"{datetime.fromtimestamp(start + total * factor):%H:%M}" if total else ""

    if total:
        head += f" (it then ends about {ends(slower)}, not {ends(1.0)})"
    if threads is not None and threads <= free:
        return (f"{head}; at runtime.threads={threads} beside another run computing with torch, a run measured "
                f"{c['one_thread']:g}x there (irflow/measured/rates.json)")
    shared = c["threads_shared"]
    return (f"{head}, and up to {shared:g}x beside another run computing with torch on every core "
            f"(their threads wait for each other{f'; about {ends(shared)}' if total else ''}); with --set "
            f"runtime.threads={free} this run measured {c['one_thread']:g}x there (irflow/measured/rates.json)")


def format_estimates(est: list[StageEstimate], hw: Hardware, measured: dict[str, float] | None = None,
                     calibrated: Calibration | None = None, load: float | None = None,
                     threads: int | None = None) -> str:
    total = sum(e.seconds for e in est)
    peak = max((e.peak_mb for e in est), default=0)
    head = f"{'stage':<34} {'estimate':>9} {'peak MB':>8}" + (f" {'measured':>9}" if measured is not None else "")
    source = calibrated.describe(est) if calibrated else "irflow/measured/rates.json"
    lines = [f"estimate for {hw.describe()}, cores free ({source}):", head]
    for e in est:
        # not measured: its output came from another label's identical computation (one cache key)
        m = "" if measured is None else (f" {measured[e.stage]:>8.1f}s" if e.stage in measured else f" {'-':>9}")
        lines.append(f"{e.stage:<34} {e.seconds:>8.1f}s {e.peak_mb:>8,}{m}  {e.work}")
    tail = f"{'total':<34} {total:>8.1f}s {peak:>8,}"
    if measured is not None:
        tail += f" {sum(measured.get(e.stage, 0) for e in est):>8.1f}s"
    lines.append(tail)
    note = load_note(hw, load, threads, total) if measured is None else None
    return "\n".join(lines + ([note] if note else []))
