"""``irflow new``: a commented config for a user's own documents and this machine.

It reads the corpus once, as a run would (so its errors are the run's), counts each document's words and
measures tokens per word with the model's tokenizer, cuts every document longer than the encoder reads
into passages, sizes the held-out set (a fraction of the documents, by their ids' hashes) to the corpus, picks what can run here -- the query source (a query log, a T5
generator by local folder or hub id, else the best offline choice and its measured caveat), the teacher
(a cross-encoder, else the BM25 + MiniLM fusion) -- sizes training to a time budget with the rates
measured on this kind of hardware (``irflow.tools.estimate``), and writes the estimate into the config.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from irflow.decide.selection import POWER_FILE, expected_detectable_gain
from irflow.engine.errors import ConfigError, UserError
from irflow.engine.runtime import others_busy

RECIPES = ("gpl", "baselines")
T5_HUB = "BeIR/query-gen-msmarco-t5-base-v1"
CE_HUB = "cross-encoder/ms-marco-MiniLM-L-6-v2"
ENCODER_TOKENS = 256  # what the evaluated encoder reads (dense.max_seq_length written below)
PASSAGE_FILL = 0.9  # a passage's words fill this share of what the encoder reads (the rest: its title, a margin)
PROXY_TARGET = 200  # held-out documents aimed at: enough for a paired test per document, few for training to lose
PROXY_FRACTION = (0.05, 0.2)  # the held-out fraction's bounds
MIN_PROXY_DOCUMENTS = 20  # below this many held-out documents the proxy decides nothing (irflow.decide.selection)
RATIO_SAMPLE = 5000  # documents tokenised to measure tokens per word


def _available(name: str) -> bool:
    from irflow.engine.models import ModelNotAvailable, model_ref

    try:
        model_ref(name, None, "check")
        return True
    except ModelNotAvailable:
        return False


@dataclass(frozen=True)
class CorpusProfile:
    """A corpus as ``irflow new`` read it, once: each document's words and tokens."""

    documents: int
    words: list[int]  # per document (title + text), in corpus order
    text_words: list[int]  # per document, its text's (what dataset.passages cuts)
    tokens: list[int]  # per document, counted with the model's tokenizer (beyond RATIO_SAMPLE, or without
    # the tokenizer: words x the measured or prior tokens per word)
    measured_with: str  # the tokenizer, or "prior"
    sentence_quantiles: tuple[float, ...] = ()  # ICT's sentences' words (irflow.tools.estimate.sentence_quantiles)

    @property
    def tokens_per_word(self) -> float:
        return round(sum(self.tokens) / max(1, sum(self.words)), 3)


def _profile(path: Path, fmt: str, fields: dict | None, model: str) -> CorpusProfile:
    import pyarrow.parquet as pq

    from irflow.sources.corpus_sources import read_corpus
    from irflow.tools import estimate as est

    with tempfile.TemporaryDirectory(prefix="irflow-new-") as tmp:
        out = Path(tmp) / "c.parquet"
        stats = read_corpus(path, out, format=fmt, fields=fields)
        t = pq.read_table(out, columns=["title", "text"])
    texts = [f"{a or ''} {b or ''}".strip() for a, b in zip(t.column("title").to_pylist(), t.column("text").to_pylist())]
    words = [len(x.split()) for x in texts]
    text_words = [len((b or "").split()) for b in t.column("text").to_pylist()]
    sentences = est.sentence_quantiles(t.column("text"))
    tokenizer = est.local_tokenizer(model)
    if tokenizer is None:
        return CorpusProfile(stats.documents, words, text_words, [round(w * est.WORDS_TO_TOKENS) for w in words],
                             "prior", sentences)
    counted = [len(ids) for ids in tokenizer(texts[:RATIO_SAMPLE], add_special_tokens=False, truncation=False,
                                             verbose=False)["input_ids"]]
    ratio = sum(counted) / max(1, sum(words[:RATIO_SAMPLE]))
    tokens = counted + [round(w * ratio) for w in words[RATIO_SAMPLE:]]
    return CorpusProfile(stats.documents, words, text_words, tokens, "the model's tokenizer", sentences)


def passage_settings(profile: CorpusProfile, encoder_tokens: int = ENCODER_TOKENS
                     ) -> tuple[dict | None, int, float]:
    """(dataset.passages, how many documents are longer than the encoder reads, the long documents' tokens per
    word): judged per document; passages sized so that a long document's passage fits."""
    limit = encoder_tokens - 2  # [CLS] and [SEP]
    long_docs = [i for i in range(profile.documents) if profile.tokens[i] > limit]
    if not long_docs:
        return None, 0, 0.0
    ratio = sum(profile.tokens[i] for i in long_docs) / max(1, sum(profile.words[i] for i in long_docs))
    words = max(32, int(limit * PASSAGE_FILL / ratio) // 10 * 10)
    return {"max_words": words, "stride": max(1, words * 3 // 4)}, len(long_docs), ratio


def cut_lengths(words: int, max_words: int, stride: int) -> list[int]:
    """The words of each passage ``irflow.sources.corpus_sources.cut_passages`` makes of a document of ``words``
    words (the last one shorter)."""
    from irflow.sources.corpus_sources import passage_spans

    return [b - a for a, b in passage_spans(words, max_words, stride)]


def cut_count(words: list[int], max_words: int, stride: int) -> int:
    """How many passages ``irflow.sources.corpus_sources.cut_passages`` makes of documents of these word counts."""
    return sum(len(cut_lengths(w, max_words, stride)) for w in words)


def proxy_fraction(documents: int) -> float:
    """The held-out fraction aimed at PROXY_TARGET documents, within PROXY_FRACTION, two significant digits."""
    lo, hi = PROXY_FRACTION
    f = min(hi, max(lo, PROXY_TARGET / max(1, documents)))
    return float(f"{f:.2g}")


@dataclass
class Choices:
    """What ``irflow new`` chose, why, and what it warns of: printed on the terminal and written as the
    config's header."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.lines.append(what)

    def warn(self, what: str) -> None:
        self.warnings.append(what)


def new_config(recipe: str, corpus: str, *, queries: str | None = None, qrels: str | None = None,
               query_log: str | None = None, model: str = "all-MiniLM-L6-v2", generator: str | None = None,
               teacher: str | None = None, fields: dict | None = None, budget_minutes: float = 60.0,
               command: str | None = None, calibrated=None) -> tuple[str, str, Choices]:
    """(the config's YAML text with comments, the estimate table, the choices and warnings). ``calibrated``:
    an ``irflow.tools.estimate.Calibration`` (what a store measured here) the estimates and the budget use."""
    from irflow.sources.beir import is_beir_source
    from irflow.sources.corpus_sources import documents_path
    from irflow.tools import estimate as est

    if recipe not in RECIPES:
        raise ConfigError(f"recipe '{recipe}': irflow new writes {' or '.join(RECIPES)} configs for your own "
                          "documents (RocketQA and ANCE train on labelled train queries: start from configs/)")
    if (queries is None) != (qrels is None):
        raise ConfigError("--queries and --qrels go together (a labelled set); a file of queries without labels "
                          "is --query-log")
    src = Path(corpus).expanduser()
    if is_beir_source(corpus):
        raise ConfigError(f"{corpus} is a BEIR dataset: start from configs/baselines_scifact.yaml (dataset.source)")
    profile = _profile(documents_path(src), "auto", fields, model)
    choices = Choices()
    labelled = qrels is not None
    passages, n_passages = _passages(profile, labelled, choices)
    d: dict = {"source": str(src.resolve())}
    if fields:
        d["fields"] = fields
    if passages:
        d["passages"] = passages
    held_out = _evaluation(d, profile.documents, recipe, queries, qrels, choices)
    if query_log:
        d["query_log"] = str(Path(query_log).expanduser().resolve())
    cfg: dict = {"flow": recipe, "dataset": d}
    if recipe == "baselines":
        cfg.update(bm25={"variants": ["flat"]}, dense={"model": model})
    else:
        cfg.update(_training(model, query_log, generator, teacher, held_out is not None, choices))
    # torch or ONNX Runtime, whichever a probe finds faster here (irflow.learn.backend_probe): neither is faster everywhere
    cfg["runtime"] = {"backend": "auto"}
    choices.add("runtime.backend: auto (torch or ONNX Runtime for encoding, whichever a short probe finds faster "
                "on this machine; remembered in the store)")
    words = _passage_words(profile, passages)
    size = est.CorpusSize(n_passages, round(sum(words) / len(words), 1) if words else 0.0, round(held_out or 0),
                          _log_queries(query_log), word_quantiles=est.quantiles(words),
                          tokens_per_word=profile.tokens_per_word, sentence_quantiles=profile.sentence_quantiles)
    hw = est.hardware()
    timed = calibrated.apply if calibrated else (lambda rows: rows)
    c, stages, inputs, params = _plan(yaml.safe_dump(cfg, sort_keys=False))
    if recipe == "gpl":  # size training to the budget, then estimate every stage of the plan
        _fit_budget(cfg, c, stages, inputs, params, size, hw, timed, budget_minutes, choices)
        c, stages, inputs, params = _plan(yaml.safe_dump(cfg, sort_keys=False))  # the steps chosen
    text = yaml.safe_dump(cfg, sort_keys=False)
    estimates = timed(est.estimate(c, stages, size, hw, params, inputs=inputs))
    table = est.format_estimates(estimates, hw, calibrated=calibrated, load=others_busy())
    header = [command or f"irflow new {recipe} --corpus {corpus}", "", *choices.lines,
              f"machine: {hw.describe()}", *(f"warning: {w}" for w in choices.warnings), "", *table.splitlines(), "",
              "irflow run THIS_FILE; then irflow export latest --out DIR (the model the run selected)"]
    return "\n".join("# " + ln if ln else "#" for ln in header) + "\n" + text, table, choices


def _passages(profile, labelled: bool, choices: Choices) -> tuple[dict | None, int]:
    """(dataset.passages, or None: documents are not cut; how many passages the corpus becomes)."""
    docs = profile.documents
    passages, long_docs, ratio = passage_settings(profile)
    if passages and labelled:
        # judgements name whole documents: cut, they would name none of the passages
        choices.warn(f"{long_docs:,} document(s) are longer than the encoder reads ({ENCODER_TOKENS} tokens) and are "
                     "not cut, because your judgements (--qrels) name whole documents: the encoder reads the first "
                     f"{ENCODER_TOKENS} tokens of each. Judge passages (<document id>#<n>) and set dataset.passages "
                     "to cut them")
        passages = None
    n_passages = cut_count(profile.text_words, passages["max_words"], passages["stride"]) if passages else docs
    choices.add(f"corpus: {_n(docs, 'document')} -> {_n(n_passages, 'passage')}"
                + (f": {long_docs:,} longer than the encoder reads ({ENCODER_TOKENS} tokens; counted with "
                   f"{profile.measured_with}) cut into passages of {passages['max_words']} words every "
                   f"{passages['stride']} ({ratio:.2f} tokens a word in them)" if passages else
                   f": {long_docs:,} longer than the encoder reads ({ENCODER_TOKENS} tokens), not cut" if long_docs else
                   f": none longer than the encoder reads ({ENCODER_TOKENS} tokens), none cut"))
    return passages, n_passages


def _evaluation(d: dict, docs: int, recipe: str, queries: str | None, qrels: str | None,
                choices: Choices) -> float | None:
    """The dataset section's evaluation (``d``, in place): labelled, a synthetic held-out set, or none when the
    corpus is too small for one. Returns the proxy queries expected (0 when labelled), None: nothing evaluated."""
    if qrels is not None:
        d.update(queries=str(Path(queries).expanduser().resolve()), qrels=str(Path(qrels).expanduser().resolve()))
        choices.add(f"evaluation: labelled ({queries}, {qrels})")
        return 0
    fraction = proxy_fraction(docs)
    expected = fraction * docs
    if expected < MIN_PROXY_DOCUMENTS:
        d["proxy"] = None
        choices.add("evaluation: none (dataset.proxy: null)")
        choices.warn(f"{_n(docs, 'document')} are too few to evaluate without labels: a synthetic held-out set needs "
                     f"about {MIN_PROXY_DOCUMENTS} held-out documents (at most {PROXY_FRACTION[1]:.0%} of the corpus), "
                     f"so at least {int(MIN_PROXY_DOCUMENTS / PROXY_FRACTION[1])} documents. "
                     + ("The run trains and hands out the trained model unmeasured (GPL without evaluation data); "
                        "give --queries and --qrels to measure it" if recipe == "gpl" else
                        "The run hands out the starting model, unmeasured"))
        return None
    d["proxy"] = {"fraction": fraction}
    choices.add(f"evaluation: a synthetic held-out set (a proxy): documents whose id hashes below {fraction:g} "
                f"(about {expected:.0f} of {docs:,}) and their duplicates are set aside before training, an ICT "
                "query per passage of theirs; a document once held out stays out as the corpus changes")
    low, high = expected_detectable_gain(expected)
    choices.add(f"  with about {expected:.0f} held-out documents it finds a real gain of about {low:.3f}-{high:.3f} "
                f"nDCG@10 or more 4 times in 5 (as on SciFact's and NFCorpus's runs: irflow/measured/"
                f"{POWER_FILE.name}); a smaller gain is likely taken for noise and the starting model kept. A larger "
                "dataset.proxy.fraction finds smaller gains, and trains on fewer documents")
    return expected


def _training(model: str, query_log: str | None, generator: str | None, teacher: str | None, evaluates: bool,
              choices: Choices) -> dict:
    """GPL's sections: where its queries come from, its miners, teacher, labels, student and evaluation."""
    if query_log:
        gen, why = {"source": "unlabelled"}, "your query log (what made GPL's student gain on SciFact and NFCorpus)"
    elif generator or _available(T5_HUB):
        gen = {"source": "t5", "model": generator or T5_HUB, "queries_per_passage": 3}
        why = "a T5 query generator (the paper's)"
    else:
        gen, why = {"source": "ict"}, (f"ict: no query log and no T5 generator here ({T5_HUB} is not downloadable; "
                                       "give --generator DIR)")
        if evaluates:
            choices.warn("model-free queries (ict) lowered GPL's student below zero-shot on SciFact and NFCorpus "
                         "(bench/results/model_free.json), and a proxy of their own kind cannot select the student: "
                         "the run will most likely keep the starting model. A query log (--query-log) is the "
                         "offline source that gained")
    choices.add(f"training queries: {why}")
    if teacher or _available(CE_HUB):
        t = {"type": "cross_encoder", "model": teacher or CE_HUB}
        choices.add("teacher: a cross-encoder (the paper's)")
    else:
        t = {"type": "fusion", "method": "zscore", "weights": {"bm25": 0.3, "minilm": 0.7},
             "score_every_candidate": True}
        choices.add(f"teacher: BM25 + MiniLM fusion (no cross-encoder here: {CE_HUB} is not downloadable; "
                    "give --teacher DIR)")
    return {"generate": gen,
            "mine": {"miners": [{"name": "bm25", "type": "bm25"},
                                {"name": "minilm", "type": "dense", "model": model}], "depth": 50},
            "teacher": t, "label": {"negatives_per_positive": 16, "rank_range": [3, 30], "scale": "auto"},
            "train": {"model": model, "similarity": "cos", "batch_size": 16, "max_seq_length": 200,
                      "lr": 2.0e-5, "warmup_steps": 25, "steps": 100, "checkpoint_every": 50,
                      "qgen": {"enabled": False}},
            "bm25": {"variants": ["flat"]}, "dense": {"batch_size": 64, "max_seq_length": ENCODER_TOKENS},
            "hybrid": {"method": "zscore", "sparse_weight": 0.3, "depth": 100}}


def _fit_budget(cfg: dict, c, stages: list[str], inputs: dict, params: dict, size, hw, timed, budget_minutes: float,
                choices: Choices) -> None:
    """``train.steps`` (in ``cfg``, in place) so that the whole run fits ``budget_minutes`` here, or the fewest
    steps and a warning with the minutes it needs."""
    from irflow.tools import estimate as est

    one = timed(est.estimate(c, ["train_student[gpl]"], size, hw, params))[0].seconds
    per_step = max(1e-3, (one - 3) / c.train.steps)
    others = sum(e.seconds for e in timed(est.estimate(c, stages, size, hw, params, inputs=inputs))
                 if not e.stage.startswith("train_student"))
    left = max(60.0, budget_minutes * 60 - others)
    steps = int(min(140_000, max(50, left / per_step)))
    cfg["train"]["steps"] = steps
    cfg["train"]["checkpoint_every"] = max(50, steps // 10)
    choices.add(f"train.steps: {steps:,}, what fits --budget-minutes {budget_minutes:g} here with the rest of "
                "the run (the paper: 140,000 steps on a GPU)")
    needed = others + 3 + steps * per_step
    if needed > budget_minutes * 60 * 1.05:
        choices.warn(f"--budget-minutes {budget_minutes:g} is less than this run needs: without training it "
                     f"takes about {others / 60:.1f} min here (encoding the corpus, searching, labelling), and "
                     f"with the fewest steps irflow trains ({steps}) about {needed / 60:.0f} min; give it "
                     f"{needed / 60:.0f} minutes or more")


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _passage_words(profile: CorpusProfile, passages: dict | None) -> list[int]:
    """The words of each passage the corpus becomes."""
    if not passages:
        return list(profile.text_words)
    return [x for w in profile.text_words for x in cut_lengths(w, passages["max_words"], passages["stride"])]


def _log_queries(query_log: str | None) -> int:
    if not query_log:
        return 0
    return sum(1 for ln in Path(query_log).expanduser().read_text(errors="replace").splitlines() if ln.strip())


def _plan(text: str):
    """The config model, the stage labels a first run computes, and each one's inputs and params
    (``irflow.tools.estimate.plan_of``)."""
    from irflow.recipes.base import load_config
    from irflow.tools.estimate import plan_of

    c = load_config(yaml.safe_load(text))
    stages, inputs, params = plan_of(c)
    return c, stages, inputs, params


def write(out: str | Path, text: str, force: bool = False) -> Path:
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"--out {out} exists (--force to replace it)")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: no directory {out.parent}")
    out.write_text(text)
    return out
