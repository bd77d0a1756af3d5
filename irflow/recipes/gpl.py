"""GPL: Generative Pseudo Labeling (Wang et al., NAACL 2022), as a declared, cached DAG.

    corpus ──generate_queries──> queries', qrels'        (T5 / ICT / cropping / Spider / unlabelled queries)
       │            │
       │     ┌──────┴───────────── miners (BM25, dense models) retrieve for queries'
       │     └─> mine_negatives ──> negatives              (positives excluded; miner + rank kept)
       │                 │
       │         label_scores ──> (q, pos, neg, raw scores) (cross-encoder logits, or a BM25+dense fusion;
       │                 │                                   sharded by queries; with
       │                 │                                   teacher.score_every_candidate each miner first
       │                 │                                   scores every candidate: bm25_score, dense_score)
       │         pseudo_label ──> (q, pos, neg, margin)    (the margin scale: a change re-labels, never re-scores)
       │                 │
       │         train_student (Margin-MSE) ──> student     (and a QGen baseline: MNRL on (q, pos))
       │                 │
    test queries ──> BM25 | zero-shot | hybrid | doc2query | QGen | GPL | BM25 + each student ──> evaluate ──> report

With ``rounds: R > 1`` mining, labelling and training repeat on the same queries: in round r the dense
miner on train.model is round r-1's student (so a fusion teacher fuses BM25 with that student), and the
round's student trains on from it (``round_init: previous``) or from train.model (``base``). Each round is
keyed on the previous round's student: raising ``rounds`` computes only the new rounds.

With ``train.tas.enabled`` the GPL student trains on TAS-B's batches (Hofstätter et al., SIGIR 2021:
topic clusters of the generated queries, balanced margin sampling; ``irflow.learn.tas``) and, with
``train.tas.teacher``, also on that bi-encoder's in-batch margins; the QGen baseline never does.

With ``train.init: <alias>`` (``promote.alias``, ``irflow.decide.promotion``) the students start from the model
that alias holds instead of train.model: training continues from the model in use, which is evaluated as
system ``<alias>`` and is what the students are selected against.

Each arrow is a stage cached on its inputs: change `train.*` and only training and evaluation
recompute; change the teacher and labels, training, evaluation recompute while generation and
mining are reused; change the generator and everything after ingest recomputes.

Cross-stage rules are validators of ``GPLConfig`` (checked before any work, with no model or data):
the positive follows the query source (``teacher_top1`` for unlabelled queries, which have no
source passage); ``label.scale: auto`` fits margins to the student that ``train`` trains (its
similarity and length); the evaluated dense systems use the student's similarity; doc2query needs
a generator; an unlabelled query source's split must exist and must not be the evaluated split;
teacher weights and label miners name miners.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, PositiveInt, field_validator, model_validator

from irflow.decide.promotion import check_alias_name
from irflow.engine.follows import Follow
from irflow.engine.params import CrossEncoderName, ModelName, NoParams, Params
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.recipes.base import Made, RecipeConfig, recipe
from irflow.recipes.common import (
    BM25Config,
    DenseConfig,
    HybridConfig,
    bm25_rankings,
    checkpoint_candidates,
    dense_ranking,
    evaluate_systems,
    hybrid_rankings,
    start_model,
    system_name,
    test_systems,
)
from irflow.recipes.dataset import Dataset, DatasetConfig, ingest, same_kind
from irflow.stages.bm25 import (
    BM25IndexParams,
    BM25ScoreParams,
    BM25SearchParams,
    BM25Weights,
    Variant,
    bm25_index,
    bm25_score,
    bm25_search,
)
from irflow.stages.dense import DenseRetrieval, DenseScoreParams, EncodeParams, dense_score, encode_corpus
from irflow.stages.doc2query import Doc2QueryParams, doc2query_expand
from irflow.stages.evaluate import EvaluationParams
from irflow.stages.generate_queries import (
    CropSource,
    ICTSource,
    SpiderSource,
    T5Source,
    UnlabelledSource,
    generate_queries,
)
from irflow.stages.mine_negatives import MineParams, mine_negatives
from irflow.stages.pseudo_label import (
    AutoScale,
    CrossEncoderTeacher,
    FusionTeacher,
    JudgeParams,
    LabelScoresParams,
    LabelSettings,
    PseudoLabelParams,
    judge_queries,
    label_positives,
    label_scores,
    pseudo_label,
)
from irflow.stages.train_student import TASParams, TrainStudentParams, train_student


# ---- config -------------------------------------------------------------------------------------
class T5Generate(T5Source):
    model: ModelName = Field("BeIR/query-gen-msmarco-t5-base-v1", description="the seq2seq query generator")


GenerateConfig = Annotated[Union[T5Generate, ICTSource, CropSource, SpiderSource, UnlabelledSource],
                          Field(discriminator="source")]


class BM25Miner(BM25Weights):
    type: Literal["bm25"] = Field(description="BM25 retrieves the candidates")
    name: str = Field("bm25", min_length=1, description="the miner's name (its run's system)")
    variant: Variant = Field("flat", description="BM25 index variant")


class DenseMiner(Params):
    type: Literal["dense"] = Field(description="a bi-encoder retrieves the candidates")
    model: ModelName = Field(description="the bi-encoder (hub id, local directory, stored model id)")
    name: str | None = Field(None, description="the miner's name (null: dense-<model directory name>)")
    similarity: Literal["cos", "dot"] | None = Field(None, description="its similarity (null: dense.similarity)")


Miner = Annotated[Union[BM25Miner, DenseMiner], Field(discriminator="type")]


def miner_name(m: BM25Miner | DenseMiner) -> str:
    return m.name or system_name(m.model)


class MineConfig(MineParams):
    miners: tuple[Miner, ...] = Field((BM25Miner(type="bm25"),), min_length=1,
                                      description="retrievers whose top `depth` per query are mined")


class CrossEncoderTeacherConfig(CrossEncoderTeacher):
    model: CrossEncoderName = Field("cross-encoder/ms-marco-MiniLM-L-6-v2", description="the cross-encoder")


class FusionTeacherConfig(FusionTeacher):
    score_every_candidate: bool = Field(
        False, description="true: every miner scores every candidate of a query (BM25 from its index, a dense "
                           "miner from its corpus embeddings) and the fusion standardises each miner over the "
                           "candidates; false: each miner's own top `mine.depth`, a candidate it did not "
                           "return getting its lowest score")


TeacherConfig = Annotated[Union[CrossEncoderTeacherConfig, FusionTeacherConfig], Field(discriminator="type")]


class LabelConfig(LabelSettings):
    positive: Literal["qrels", "teacher_top1"] | None = Field(
        None, description="qrels: the generated query's source passage; teacher_top1: the teacher's best "
                          "candidate (null: follows generate.source -- teacher_top1 for unlabelled queries)")
    scale: AutoScale | float | None = Field(
        None, description="margin scale: auto (fitted to the student that train trains: its similarity and "
                          "length follow train), a factor, or null (teacher units, as GPL)")


class QGenConfig(Params):
    enabled: bool = Field(True, description="train the QGen baseline: MNRL on (query, positive) pairs")
    steps: PositiveInt | None = Field(None, description="its steps (null: train.steps)")
    epochs: PositiveInt | None = Field(None, description="its epochs (null: train.epochs)")
    lr: float | None = Field(None, gt=0, description="its learning rate (null: train.lr)")
    batch_size: PositiveInt | None = Field(None, description="its batch size (null: train.batch_size)")
    warmup_steps: int | None = Field(None, ge=0, description="its warm-up (null: train.warmup_steps)")


class TASConfig(TASParams):
    teacher: ModelName | None = Field(
        None, description="TAS-B's second teacher: a bi-encoder (hub id, local directory, stored model id) whose "
                          "scores of every in-batch (query, other passage) pair the GPL student also learns, "
                          "an in-batch Margin-MSE added to the pairwise one (TAS-B: ColBERT; offline e.g. "
                          "all-MiniLM-L6-v2); null: no in-batch loss (topic-aware and balanced sampling only)")

    @property
    def uses_teacher(self) -> bool:
        """Whether the student learns a second teacher's in-batch scores."""
        return self.enabled and self.teacher is not None


class TrainConfig(TrainStudentParams):
    model: ModelName = Field("GPL/msmarco-distilbert-margin-mse", description="the student's starting point")
    init: str = Field(
        "base", description="where the students start: base (train.model) or an alias name (e.g. production: "
                            "the model that alias holds, so training continues from the model in use; its id enters "
                            "the trainers' keys). The alias's model is then evaluated as system <alias> and is what "
                            "the trained models are selected against (train.model stays the zero-shot baseline); an "
                            "alias with no model yet falls back to base with a warning")
    qgen: QGenConfig = Field(QGenConfig(), description="the QGen baseline (same settings unless given)")
    tas: TASConfig = Field(TASConfig(), description="TAS-B for the GPL student: topic-aware batches, balanced "
                                                    "margin sampling, an in-batch teacher (the QGen baseline "
                                                    "trains without it; keyed only when enabled)")

    @field_validator("init")
    @classmethod
    def _init(cls, v):
        return v if v == "base" else check_alias_name(v)

    def gpl_params(self) -> TrainStudentParams:
        return self.to(TrainStudentParams, tas=self.tas.to(TASParams))

    def qgen_params(self) -> TrainStudentParams:
        given = {k: v for k, v in self.qgen.model_dump().items() if k != "enabled" and v is not None}
        return self.to(TrainStudentParams, loss="mnrl", tas=TASParams(), candidates_every=0, **given)


class Doc2QueryConfig(Doc2QueryParams):
    enabled: bool | None = Field(None, description="evaluate BM25 over doc2query-expanded passages (null: when "
                                                   "generate.source is t5; needs a generator)")


_TEACHER = {"own": "", "every": ", teacher scoring every candidate"}
MODEL_FREE_FILE = Path(__file__).resolve().parents[1] / "measured" / "model_free.json"
SAME_KIND_FILE = Path(__file__).resolve().parents[1] / "measured" / "proxy_same_kind.json"
JUDGED_LOG_FILE = Path(__file__).resolve().parents[1] / "measured" / "proxy_judged_log.json"


def same_kind_measured() -> str:
    """The measured rows of ``SAME_KIND_FILE`` in words: each student on the proxy and on the real qrels."""
    rows = json.loads(SAME_KIND_FILE.read_text())["rows"]
    return "; ".join(f"{r['dataset']} {r['student']} student: proxy {r['proxy']:.4f} vs zero-shot {r['proxy_zero_shot']:.4f}, "
                     f"real qrels {r['real']:.4f} vs {r['real_zero_shot']:.4f}" for r in rows) + \
        " (bench/results/own_corpus_*_caveat.json)"


def judged_log_measured() -> str:
    """The measured rows of ``JUDGED_LOG_FILE`` in words: where the start ranked on a judged log and on the qrels."""
    rows = json.loads(JUDGED_LOG_FILE.read_text())["rows"]
    return "; ".join(f"{r['dataset']} as unlabelled documents, the zero-shot model ranked {r['start_rank_on_proxy']} "
                     f"of {r['models']} models on it and {r['start_rank_on_real_qrels']} on the real qrels "
                     f"({r['source']})" for r in rows)


def model_free_measured() -> dict:
    """What GPL on model-free queries was measured to give (irflow/measured/model_free.json): per source, rows
    of dataset, teacher, zero-shot and student nDCG@10 and the paired p; the figures the warning quotes."""
    return json.loads(MODEL_FREE_FILE.read_text())


def model_free_advice(source: str) -> list[str]:
    """The warning for a model-free query source that was measured to lower the student (empty if none)."""
    m = model_free_measured()
    rows = m["rows"].get(source, ())
    if not any(r["student"] < r["zero_shot"] for r in rows):
        return []
    seen = "; ".join(f"{r['dataset']} {r['zero_shot']:.4f} -> {r['student']:.4f} ({r['student'] - r['zero_shot']:+.4f}, "
                     f"paired t-test p {r['t_pvalue']:.2f}{_TEACHER[r['teacher']]})" for r in rows)
    best = m["best_without_labels"]
    return [f"generate.source: {source} -- GPL trained on {source.upper()} pseudo-queries did not beat the "
            f"zero-shot model it starts from; it scored below it (nDCG@10 on the test split, zero-shot -> GPL "
            f"student: {seen}; bench/results/model_free.json). Such queries are near-copies of their passage (BM25 "
            f"finds it first for {m['bm25_finds_source_first']} of them on SciFact and NFCorpus): too easy to teach a "
            f"ranking. Better: real in-domain queries without labels (generate: {{source: unlabelled}}: a BEIR "
            f"split's queries, or your dataset.query_log), a T5 query generator (generate.source: t5, the paper's), "
            f"or no training at all: the BM25 + dense fusion (the `{best['system']}` system) was the best system "
            f"without labels (SciFact {best['scifact']:.4f}, NFCorpus {best['nfcorpus']:.4f})"]


def _positive(source: str) -> str:
    return "teacher_top1" if source == "unlabelled" else "qrels"


def _fit_to_student(similarity: str, max_seq_length: int) -> dict:
    return {"similarity": similarity, "max_seq_length": max_seq_length}


class GPLConfig(RecipeConfig):
    judges_queries: ClassVar[bool] = True  # its teacher judges a held-out query log (dataset.proxy.queries: log)
    follows: ClassVar = (
        Follow("label.positive", "generate.source", _positive,
               says="teacher_top1 if generate.source is unlabelled, else qrels"),
        Follow("label.scale", ("train.similarity", "train.max_seq_length"), _fit_to_student, unset=("auto",),
               says="null; auto: fitted to train.similarity and train.max_seq_length"),
        Follow("dense.similarity", "train.similarity"),
        Follow("doc2query.enabled", "generate.source", lambda source: source == "t5", says="generate.source is t5"),
    )

    flow: Literal["gpl"] = Field(description="this recipe: gpl")
    dataset: DatasetConfig = Field(description="the BEIR dataset and the split to evaluate")
    generate: GenerateConfig = Field(T5Generate(source="t5"), description="where training queries come from")
    mine: MineConfig = Field(MineConfig(), description="hard-negative mining")
    teacher: TeacherConfig = Field(CrossEncoderTeacherConfig(type="cross_encoder"), description="who labels")
    label: LabelConfig = Field(LabelConfig(), description="how triples are drawn and labelled")
    train: TrainConfig = Field(TrainConfig(), description="the students")
    bm25: BM25Config = Field(BM25Config(), description="BM25 systems (and the BM25 of doc2query)")
    dense: DenseConfig = Field(DenseConfig(), description="how dense systems encode and search (similarity "
                                                          "follows train.similarity)")
    hybrid: HybridConfig = Field(HybridConfig(), description="BM25 + zero-shot fusion")
    rounds: PositiveInt = Field(
        1, description="pseudo-labelling rounds (1: GPL). Round r > 1 mines, scores and labels the same queries "
                       "again with the dense miner whose model is train.model replaced by round r-1's student "
                       "(in the miners and so in a fusion teacher), and trains the next student from "
                       "`round_init`")
    round_init: Literal["previous", "base"] = Field(
        "previous", description="where round r > 1's student starts: previous (round r-1's student, trained on) or "
                                "base (the first round's starting point again, train.model or train.init's alias "
                                "model, on the new labels)")
    doc2query: Doc2QueryConfig = Field(Doc2QueryConfig(), description="the docT5query baseline")
    evaluate: EvaluationParams = Field(EvaluationParams(), description="metrics")

    def refreshed_miner(self) -> "DenseMiner | None":
        """The dense miner that follows the student from round 2 on: the one on train.model."""
        return next((m for m in self.mine.miners if isinstance(m, DenseMiner) and m.model == self.train.model), None)

    def advice(self) -> list[str]:
        out = model_free_advice(self.generate.source)
        if same_generator(self):
            proxy = self.dataset.proxy.queries.source
            out.append(
                f"generate.source ({self.generate.source}) and dataset.proxy.queries ({proxy}) both cut their queries "
                f"from the passage they point to: the proxy then asks the kind of query the student trained on, and "
                f"favours it (measured, the datasets run as unlabelled with an ICT proxy: {same_kind_measured()}). "
                f"So this run will keep the starting model whatever the proxy says; a query log (generate.source: "
                f"unlabelled) or a proxy generator of another kind (t5) lets it select a trained one")
        proxy = self.dataset.evaluation_proxy
        if proxy is not None and proxy.judged and isinstance(self.teacher, FusionTeacherConfig) \
                and any(isinstance(m, DenseMiner) and m.model == self.train.model for m in self.mine.miners):
            out.append(
                f"dataset.proxy.queries: log has the held-out queries judged by the fusion teacher, which scores with "
                f"train.model ({self.train.model}), the model training starts from: the judge is partly the start, "
                f"so the proxy favours it (measured: {judged_log_measured()}) and the run will mostly keep the "
                f"start. A cross-encoder teacher (teacher.type: cross_encoder) is a judge of its own")
        return out

    @model_validator(mode="after")
    def _rules(self):
        source = self.generate.source
        if self.train.loss == "mnrl":
            raise ValueError("train.loss: the GPL student learns the teacher's labels (margin_mse or "
                             "listwise_kl); the MNRL baseline is train.qgen")
        if self.train.tas.teacher is not None and not self.train.tas.enabled:
            raise ValueError("train.tas.teacher: the in-batch teacher is part of TAS-B; set train.tas.enabled: true "
                             "(or leave the teacher out)")
        if self.train.loss == "listwise_kl" and self.label.scale is None:
            raise ValueError("train.loss: listwise_kl puts the teacher's scores and the student's similarities "
                             "under one softmax scale, so label.scale must bring the scores to the student's "
                             "units: set label.scale (auto, or a factor)")
        if source == "unlabelled" and self.label.positive == "qrels":
            raise ValueError("label.positive: qrels needs the source passage of each query; unlabelled queries "
                             "have none: use teacher_top1 (or leave it out)")
        if isinstance(self.label.scale, AutoScale) and (
                self.label.scale.similarity != self.train.similarity
                or self.label.scale.max_seq_length != self.train.max_seq_length):
            raise ValueError(f"label.scale: auto fits margins to the student train trains (similarity "
                             f"{self.train.similarity}, max_seq_length {self.train.max_seq_length}); got "
                             f"{self.label.scale.model_dump()}")
        if self.dense.similarity != self.train.similarity:
            raise ValueError(f"dense.similarity: the evaluated students use train.similarity "
                             f"({self.train.similarity}); got {self.dense.similarity}")
        if self.doc2query.enabled and source != "t5":
            raise ValueError(f"doc2query.enabled: doc2query expands passages with generated queries; "
                             f"generate.source is {source}, not t5")
        if source == "unlabelled" and self.dataset.own:
            if self.dataset.query_log is None:
                raise ValueError("generate.source: unlabelled reads a query log: set dataset.query_log (a file of "
                                 "query texts) for your own documents")
        elif source == "unlabelled":
            if self.generate.split == self.dataset.split:
                raise ValueError(f"generate.split: '{self.generate.split}' is the evaluated split "
                                 f"(dataset.split); training on its queries would leak the test set")
            splits = self.dataset.splits()
            if splits is not None and self.generate.split not in splits:
                raise ValueError(f"generate.split: '{self.generate.split}' is not a split of {self.dataset.source} "
                                 f"(its qrels: {', '.join(splits)})")
        names = [miner_name(m) for m in self.mine.miners]
        if len(set(names)) != len(names):
            raise ValueError(f"mine.miners: miner names must be distinct, got {names}")
        if isinstance(self.teacher, FusionTeacher) and self.teacher.weights is not None:
            wrong = sorted(set(self.teacher.weights) ^ set(names))
            if wrong:
                raise ValueError(f"teacher.weights: one weight per miner, by name: miners are {names}, weights "
                                 f"name {sorted(self.teacher.weights)}")
        if isinstance(self.teacher, FusionTeacherConfig) and self.teacher.score_every_candidate:
            if self.teacher.input_depth is not None:
                raise ValueError("teacher.input_depth: with score_every_candidate the candidates are the miners' "
                                 "top mine.depth, each scored by every miner; leave input_depth out")
            multifield = [miner_name(m) for m in self.mine.miners
                          if isinstance(m, BM25Miner) and m.variant != "flat"]
            if multifield:
                raise ValueError(f"teacher.score_every_candidate: BM25 scores a single passage from a flat index; "
                                 f"miner(s) {multifield} use variant multifield")
        if self.rounds > 1 and self.refreshed_miner() is None:
            raise ValueError(f"rounds: {self.rounds} replaces, from round 2 on, the dense miner whose model is "
                             f"train.model ({self.train.model}) with the last round's student; no miner has it "
                             f"(miners: {names})")
        if self.label.miners and not set(self.label.miners) <= set(names):
            raise ValueError(f"label.miners: {sorted(set(self.label.miners) - set(names))} are not miners "
                             f"(miners: {names})")
        return self


# ---- building blocks ------------------------------------------------------------------------------
def query_generation(run: Run, g, data: Dataset) -> dict[str, DatasetRef]:
    """Generated (or unlabelled real) queries and their qrels (the source passage; spider: the other
    passage of its document; none if unlabelled), from the training corpus (without the passages a
    synthetic evaluation holds out)."""
    corpus = data.training_corpus
    if isinstance(g, T5Generate):
        return generate_queries(run, g.to(T5Source), tag="t5", corpus=corpus,
                                model=run.model(g.model, "generate.model"))
    if isinstance(g, UnlabelledSource) and data.query_log is not None:  # your own documents' query log, whole
        return generate_queries(run, g, tag=g.source, corpus=corpus, queries=data.query_log)
    if isinstance(g, UnlabelledSource):
        return generate_queries(run, g, tag=g.source, corpus=corpus, queries=data.queries, qrels=data.qrels)
    return generate_queries(run, g, tag=g.source, corpus=corpus)


def miner_model(run: Run, m: DenseMiner, c: GPLConfig, student: DatasetRef | None) -> DatasetRef:
    """A dense miner's model: its own, or (``student``, rounds after the first) the last round's student if
    the miner is the one on train.model."""
    if student is not None and m is c.refreshed_miner():
        return student
    return run.model(m.model, f"mine.miners.{c.mine.miners.index(m)}.model")


def miner_run(run: Run, m: BM25Miner | DenseMiner, c: GPLConfig, corpus: DatasetRef, queries: DatasetRef,
              student: DatasetRef | None = None, suffix: str = "", prefix: str = "miner") -> DatasetRef:
    """A miner's top `mine.depth` for the generated queries (stages tagged ``<prefix>-<miner>``); the run's
    system is the miner's name."""
    name = miner_name(m)
    if isinstance(m, BM25Miner):
        index = bm25_index(run, BM25IndexParams(variant=m.variant), tag=m.variant, corpus=corpus)
        return bm25_search(run, m.to(BM25SearchParams, depth=c.mine.depth, remove_query=False, system=name),
                           tag=f"{prefix}-{name}", bm25_index=index, queries=queries)
    # Same model and encoding as an evaluated system: its corpus embeddings are reused (cached).
    settings = c.dense.to(DenseRetrieval, depth=c.mine.depth, remove_query=False,
                          similarity=m.similarity or c.dense.similarity)
    return dense_ranking(run, settings, corpus, queries, model=miner_model(run, m, c, student), system=name,
                     tag=f"{prefix}-{name}{suffix}")


def labelling(run: Run, c: GPLConfig, gen: dict, negatives: DatasetRef, rankings: list[DatasetRef],
              student: DatasetRef, corpus: DatasetRef, round_tag: str | None = None) -> DatasetRef:
    """The teacher's (q, pos, neg, margin) triples: the teacher scores each query's triples (sharded by
    queries), then the margins are scaled (a scale change re-labels without re-scoring). ``round_tag``
    (``r2``, ...) tags the stages of rounds after the first."""
    teacher = c.teacher
    cross_encoder = isinstance(teacher, CrossEncoderTeacherConfig)
    p = c.label.to(LabelScoresParams, teacher=teacher.to(CrossEncoderTeacher if cross_encoder else FusionTeacher))
    scores = label_scores(run, p, tag=round_tag, queries=gen["queries"], corpus=corpus, negatives=negatives,
                          qrels=gen["qrels"] if p.positive == "qrels" else None,
                          teacher_rankings=rankings if isinstance(teacher, FusionTeacher) else None,
                          teacher=run.model(teacher.model, "teacher.model") if cross_encoder else None)
    return pseudo_label(run, c.label.to(PseudoLabelParams), tag=round_tag, scores=scores, queries=gen["queries"],
                        corpus=corpus, student=student if isinstance(c.label.scale, AutoScale) else None)


def miner_scores(run: Run, m: BM25Miner | DenseMiner, c: GPLConfig, corpus: DatasetRef, queries: DatasetRef,
                 candidates: list[DatasetRef], student: DatasetRef | None = None, suffix: str = "",
                 prefix: str = "teacher") -> DatasetRef:
    """The miner's score of every candidate pair (``teacher.score_every_candidate``), from the index or
    the corpus embeddings its mining built (cached); the run's system is the miner's name."""
    name = miner_name(m)
    if isinstance(m, BM25Miner):
        index = bm25_index(run, BM25IndexParams(variant=m.variant), tag=m.variant, corpus=corpus)
        return bm25_score(run, m.to(BM25ScoreParams, system=name), tag=f"{prefix}-{name}", bm25_index=index,
                          queries=queries, candidates=candidates)
    settings = c.dense.to(EncodeParams, similarity=m.similarity or c.dense.similarity)
    model = miner_model(run, m, c, student)
    embeddings = encode_corpus(run, settings, tag=f"miner-{name}{suffix}", corpus=corpus, model=model)
    return dense_score(run, settings.to(DenseScoreParams, system=name), tag=f"{prefix}-{name}{suffix}",
                       embeddings=embeddings, queries=queries, model=model, candidates=candidates)


def teacher_runs(run: Run, c: GPLConfig, gen: dict, negatives: DatasetRef, mined: list[DatasetRef],
                 corpus: DatasetRef, student: DatasetRef | None = None, suffix: str = "") -> list[DatasetRef]:
    """What a fusion teacher fuses: the miners' own lists, or (``score_every_candidate``) every miner's
    score of every candidate -- the mined negatives, and the positives of positive=qrels."""
    if not (isinstance(c.teacher, FusionTeacherConfig) and c.teacher.score_every_candidate):
        return mined
    candidates = [negatives] + ([gen["qrels"]] if c.label.positive == "qrels" else [])
    return [miner_scores(run, m, c, corpus, gen["queries"], candidates, student, suffix) for m in c.mine.miners]


def judged_heldout_log(run: Run, c: GPLConfig, data: Dataset) -> Dataset:
    """The held-out log queries (``dataset.proxy.queries.source: log``) with their judgements: every miner's
    top ``mine.depth`` over the whole corpus, scored by the run's teacher as labelling scores the training
    queries' candidates, the teacher's best ``relevant`` judged relevant."""
    queries, corpus, teacher = data.test_queries, data.corpus, c.teacher
    mined = [miner_run(run, m, c, corpus, queries, prefix="judge") for m in c.mine.miners]
    cross_encoder = isinstance(teacher, CrossEncoderTeacherConfig)
    rankings = None if cross_encoder else mined
    if isinstance(teacher, FusionTeacherConfig) and teacher.score_every_candidate:
        rankings = [miner_scores(run, m, c, corpus, queries, mined, prefix="judge-teacher") for m in c.mine.miners]
    p = JudgeParams(relevant=c.dataset.proxy.queries.relevant,
                    teacher=teacher.to(CrossEncoderTeacher if cross_encoder else FusionTeacher))
    qrels = judge_queries(run, p, queries=queries, corpus=corpus, candidates=mined, teacher_rankings=rankings,
                          teacher=run.model(teacher.model, "teacher.model") if cross_encoder else None)
    return replace(data, qrels=qrels)


# ---- the recipe -----------------------------------------------------------------------------------
def same_generator(c: GPLConfig) -> bool:
    """Whether the training queries and the proxy's (own documents, no labels) come from one generator, or
    from two that cut their queries out of the passage alike (ict, crop)."""
    proxy = c.dataset.evaluation_proxy
    return proxy is not None and same_kind(proxy.queries.source, c.generate.source)


def same_kind_caveat(c: GPLConfig) -> str | None:
    """Why the proxy cannot tell a trained student from the start, when its queries are of the students'
    training kind (measured: such students lead zero-shot on the proxy and trail it on real qrels,
    irflow/measured/proxy_same_kind.json); None otherwise."""
    if not same_generator(c):
        return None
    return (f"the proxy's queries ({c.dataset.proxy.queries.source}) are of the kind the students trained on "
            f"({c.generate.source}): it favours them whether or not they retrieve better "
            f"(bench/results/own_corpus_*.json); give a query log, or another dataset.proxy.queries source, to "
            f"select a trained model")


def doc2query_rankings(run: Run, c: GPLConfig, data: Dataset, gen: dict) -> dict[str, DatasetRef]:
    """BM25 over the corpus expanded with the generated queries (``doc2query.enabled``), else none."""
    if not c.doc2query.enabled:
        return {}
    expanded = doc2query_expand(run, c.doc2query.to(Doc2QueryParams), corpus=data.corpus,
                                queries=gen["queries"], qrels=gen["qrels"])
    return bm25_rankings(run, c.bm25.model_copy(update={"variants": ("flat",)}), expanded, data.test_queries,
                         prefix="bm25-doc2query", tag_suffix="-doc2query")


@recipe("gpl", GPLConfig)
def gpl(c: GPLConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    base = run.model(c.train.model, "train.model")
    # the students' starting point: train.model, or (train.init: an alias) the model in use, trained on
    init, start = start_model(run, c.train.init, base, c.train.model, "train.init")

    # 1. Query generation (once: every round labels the same queries).
    gen = query_generation(run, c.generate, data)
    if data.judged:  # a synthetic evaluation of held-out log queries: the teacher judges them
        data = judged_heldout_log(run, c, data)

    # Each round: 2. negative mining with every miner; 3. pseudo labels from the teacher; 4. the GPL student
    # (Margin-MSE on the teacher's margins). Round 1 is GPL; from round 2 on, the dense miner on train.model is
    # the last round's student, so the mining and a fusion teacher see it (self-training).
    corpus = data.training_corpus  # the corpus itself, unless a synthetic evaluation holds passages out
    students, candidates, student, labels = {}, {}, None, []
    # TAS-B's second teacher (train.tas.teacher): the bi-encoder that scores the student's in-batch pairs
    tas_teacher = run.model(c.train.tas.teacher, "train.tas.teacher") if c.train.tas.uses_teacher else None
    student_params = c.train.gpl_params()
    for r in range(1, c.rounds + 1):
        round_tag = None if r == 1 else f"r{r}"  # stage tags of round r > 1: mine_negatives[r2], miner-bi-r2
        suffix = f"-{round_tag}" if round_tag else ""
        mined = [miner_run(run, m, c, corpus, gen["queries"], student, suffix) for m in c.mine.miners]
        negatives = mine_negatives(run, c.mine.to(MineParams), tag=round_tag, rankings=mined,
                                   qrels=gen["qrels"], corpus=corpus)
        start_from = init if student is None or c.round_init == "base" else student
        labels.append(labelling(run, c, gen, negatives,
                                teacher_runs(run, c, gen, negatives, mined, corpus, student, suffix),
                                start_from, corpus, round_tag))
        # (A trainer also outputs its loss per step, training_losses: in the catalog, for reports.)
        student = train_student(run, student_params, tag=f"gpl{suffix}", queries=gen["queries"],
                                corpus=corpus, base_model=start_from, pseudo_labels=labels[-1],
                                inbatch_teacher=tas_teacher)["student"]
        students[f"gpl-student{suffix}"] = student
        candidates.update(checkpoint_candidates(run, student_params, data, student, f"gpl-student{suffix}",
                                                f"gpl{suffix}"))

    # The QGen baseline: MNRL on (q, pos), the first round's positives.
    if c.train.qgen.enabled:
        positives = label_positives(run, NoParams(), pseudo_labels=labels[0])
        students["qgen-student"] = train_student(run, c.train.qgen_params(), tag="qgen", queries=gen["queries"],
                                                 corpus=corpus, base_model=init, qrels=positives)["student"]

    # 5. Evaluation on the test split: baselines and the adapted students side by side.
    # (the students kept every train.candidates_every steps are evaluated too, not fused with BM25)
    tested = test_systems(run, c, data, base, {**students, **candidates}, base_model=c.train.model, start=start)
    rankings = tested.rankings
    rankings.update(hybrid_rankings(run, c.hybrid, rankings, c.bm25.first_system, system_name(c.train.model), students))
    rankings.update(doc2query_rankings(run, c, data, gen))
    return evaluate_systems(run, c.evaluate, data, tested, same_kind_caveat(c))

