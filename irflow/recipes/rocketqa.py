"""RocketQA (Qu et al., NAACL 2021) as a declared, cached DAG, with RocketQAv2's listwise distillation
(Ren et al., EMNLP 2021) as a loss option.

    labelled pairs (train split) ──train_dual_encoder──> M_D0        (in-batch / cross-batch / GradCache;
       │                                   │                         extra negatives: none, random, BM25)
       │              M_D0 retrieves the train queries' top 1000 (encode_corpus + dense_search)
       │                                   │
       ├──train_cross_encoder (positives + negatives from M_D0's top k) ──> M_C ──rerank test top-100──> "mc-rerank"
       │                                   │          (optionally fused with M_D0's own scores: "mc-rerank-fused")
       │                                   │
       │  score_candidates (M_C, or the BM25 + M_D0 fusion, reads M_D0's top 50) ──> denoise (p < 0.1 -> negative)
       │                                   │
       ├──train_dual_encoder (labelled + denoised negatives) ──> M_D1   (from M_D0's starting point)
       │                                   │
       │   unlabelled queries ──M_D1 top 50──> score_candidates[augment] (M_C reads them) ──> augment
       │                                   │   (no model: top-1 positive if p > 0.9, negatives p < 0.1)
       └──train_dual_encoder (M_D1's data + augmented data) ──> M_D2
    test queries ──> BM25 | zero-shot | M_D0 | ablations | M_D1 | M_D2 | M_C re-ranking
                     (| BM25 + each dual encoder: hybrid.enabled) ──> evaluate ──> report

Each arrow is a stage cached on its inputs: change the denoise threshold and only denoising (not the
teacher's scoring) and what follows recompute (so for augmentation's thresholds); change M_C's learning rate and M_C, its re-ranking, denoising and the students
after it recompute, while M_D0 and its retrieval are reused. The corpus embeddings of a model are
computed once and shared by its train-query retrieval and its test evaluation.

Keys that follow others (``RocketQAConfig.follows``, shown by ``irflow config --explain``): every
stage that reads positives reads ``train_split``; the evaluated dense systems use the dual encoder's
similarity; M_C re-ranks at the length it was trained on; denoising fills from just below what the
teacher read down to the end of M_D0's list. Cross-stage rules are validators: the labelled split is
neither the evaluated split nor missing; unlabelled queries come from neither; the fill never
reaches into the candidates the teacher judged, nor below M_D0's list.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from irflow.engine.follows import MISSING, Follow
from irflow.engine.params import ModelName, Params
from irflow.engine.runner import Run
from irflow.engine.store import DatasetRef
from irflow.learn.dual_encoder import TrainDualEncoderParams
from irflow.learn.fusion import FusionSettings
from irflow.learn.teachers import Calibration, CrossEncoderTeacher, FusionTeacher
from irflow.recipes.base import Made, recipe
from irflow.recipes.common import (
    HardNegativeTraining,
    SupervisedConfig,
    bm25_train_run,
    check_skip_top,
    evaluate_systems,
    hybrid_rankings,
    labelled_queries,
    retrieve,
    system_name,
    test_systems,
    top_negative_mining,
    train_split_follows,
)
from irflow.recipes.dataset import Dataset, ingest
from irflow.stages.augment import AUGMENTED_SPLIT, AugmentParams, AugmentSettings, augment
from irflow.stages.denoise import DenoiseParams, denoise
from irflow.stages.fuse import FuseParams, fuse
from irflow.stages.generate_queries import CropSource, ICTSource, UnlabelledSource, generate_queries
from irflow.stages.mine_negatives import MineParams, mine_negatives
from irflow.stages.rerank import RerankParams, RerankSettings, rerank
from irflow.stages.sample_queries import SampleQueriesParams, sample_queries
from irflow.stages.score_candidates import ScoreCandidatesParams, ScoreCandidatesSettings, score_candidates
from irflow.stages.train_cross_encoder import TrainCrossEncoderParams, train_cross_encoder
from irflow.stages.train_dual_encoder import train_dual_encoder


# ---- config -------------------------------------------------------------------------------------
class DualEncoderConfig(TrainDualEncoderParams):
    negatives: Literal["none", "random", "bm25"] = Field(
        "none", description="M_D0's extra negatives per query: none (in-batch only), random passages, or BM25's "
                            "top `bm25_depth` (DPR); how many: negatives_per_line")
    bm25_depth: PositiveInt = Field(100, description="negatives bm25: sampled from BM25's top n (positives excluded)")
    bm25_skip_top: NonNegativeInt = Field(0, description="negatives bm25: leave BM25's first n ranks out (where "
                                                         "unjudged relevant passages crowd); 0: none left out")

    @model_validator(mode="after")
    def _bm25_ranks(self):
        check_skip_top(self.bm25_skip_top, self.bm25_depth, "bm25_skip_top", "bm25_depth", "BM25's")
        return self


class RetrieveConfig(Params):
    depth: PositiveInt = Field(1000, description="M_D0's list per train query (RocketQA: 1000): what the "
                                                 "cross-encoder's negatives, denoising and its fill read")


class CrossEncoderConfig(TrainCrossEncoderParams):
    model: ModelName = Field("all-MiniLM-L6-v2", description="M_C's starting point (a plain encoder gets a "
                                                             "fresh 1-logit head), or with train: false the "
                                                             "cross-encoder itself")
    train: bool = Field(True, description="fine-tune M_C on the labelled split (false: use `model` as M_C)")
    depth: PositiveInt = Field(1000, description="M_C's negatives are sampled uniformly from M_D0's top n, "
                                                 "positives excluded (RocketQA: 1000)")
    rerank: RerankSettings = Field(RerankSettings(), description="M_C evaluated as a re-ranker of M_D0's test "
                                                                 "top-n (system mc-rerank)")
    rerank_md0_weight: float | None = Field(
        None, ge=0, le=1, description="also evaluate mc-rerank-fused: M_C's scores and M_D0's own over the same "
                                      "re-ranked top-n, z-scored per query, summed with this weight on M_D0 and 1 - w "
                                      "on M_C (null: not evaluated). A cross-encoder fine-tuned on a few hundred "
                                      "labelled queries from a bi-encoder's body re-ranks below M_D0 alone, yet "
                                      "disagrees with it usefully: interpolating the two is the usual remedy "
                                      "(bench/README.md, choose w on a dev cut with bench/train_dev.py)")

    def scoring(self) -> CrossEncoderTeacher:
        """How M_C scores pairs (denoising, augmentation): at the length it was trained on, quantised as
        it re-ranks (one M_C: ``cross_encoder.rerank.quantization`` applies to all its scoring)."""
        return CrossEncoderTeacher(type="cross_encoder", batch_size=self.rerank.batch_size,
                                   max_length=self.max_length, quantization=self.rerank.quantization)


class FusionConfig(FusionSettings):
    weights: dict[str, float] = Field({"bm25": 0.3, "dense": 0.7}, description="weight of BM25 ('bm25') and of "
                                                                              "the dual encoder ('dense')")


class DenoiseConfig(DenoiseParams, ScoreCandidatesSettings):
    teachers: tuple[Literal["cross_encoder", "fusion"], ...] = Field(
        ("cross_encoder",), min_length=1, description="who denoises; one M_D1 per teacher (md1-ce, md1-fusion); "
                                                      "the first one's data feeds M_D2")
    fusion: FusionConfig = Field(FusionConfig(), description="the fusion teacher: BM25 + M_D0, z-scores per "
                                                             "query; always Platt-calibrated on the labelled "
                                                             "queries (a fused score is not a probability)")


AugmentQueries = Annotated[Union[UnlabelledSource, ICTSource, CropSource], Field(discriminator="source")]


class AugmentConfig(AugmentSettings):
    enabled: bool = Field(False, description="train M_D2 on M_D1's data plus teacher-labelled unlabelled queries")
    queries: AugmentQueries = Field(ICTSource(source="ict"), description="the unlabelled queries: a split's query "
                                                                         "texts (labels unused), or generated ones")
    limit: PositiveInt | None = Field(None, description="use a seeded sample of n unlabelled queries (null: all)")


class StudentConfig(HardNegativeTraining):
    """M_D1 and M_D2 (and the ablations trained like them)."""

    negative_lines: PositiveInt = Field(4, description="lines per (query, positive), each with its own "
                                                       "negatives_per_line denoised negatives (RocketQA: 4 lines "
                                                       "of 1); lines of one query never share a batch")
    init: Literal["base", "md0"] = Field("base", description="start from base_model (RocketQA's scripts: better) "
                                                             "or from M_D0")


class AblationConfig(Params):
    bm25_negatives: bool = Field(False, description="also M_D0 trained with BM25 negatives (md0-bm25neg)")
    undenoised: bool = Field(False, description="also a student on M_D0's top-`denoise.depth` negatives, not "
                                                "denoised (md0-hardneg): RocketQA's 26.03 row")
    listwise: bool = Field(False, description="also a student distilled from M_C's scores of M_D0's top list "
                                              "(RocketQAv2's listwise KL, M_C frozen: md1-listwise)")
    list_size: PositiveInt | None = Field(None, description="listwise: candidates per query, the positive included "
                                                            "(apart from student.list_size, so that changing it "
                                                            "retrains the listwise student only)")


class RocketQAConfig(SupervisedConfig):
    follows: ClassVar = (
        *train_split_follows("dual_encoder.splits", "student.splits", "cross_encoder.split", "denoise.split"),
        Follow("dense.similarity", "dual_encoder.similarity"),
        Follow("cross_encoder.rerank.max_length", "cross_encoder.max_length", unset=(MISSING,)),
        Follow("ablations.list_size", "student.list_size"),
        # null is "no fill"; the fill starts below what the teacher read and ends with M_D0's list
        Follow("denoise.fill_ranks", ("denoise.depth", "retrieve.depth"), lambda depth, listed: [depth + 1, listed],
               unset=(MISSING,), says="[denoise.depth + 1, retrieve.depth]"),
    )

    flow: Literal["rocketqa"] = Field(description="this recipe: rocketqa")
    dual_encoder: DualEncoderConfig = Field(DualEncoderConfig(), description="M_D0: InfoNCE on labelled pairs")
    retrieve: RetrieveConfig = Field(RetrieveConfig(), description="M_D0's retrieval for the train queries")
    cross_encoder: CrossEncoderConfig = Field(CrossEncoderConfig(), description="M_C")
    denoise: DenoiseConfig = Field(DenoiseConfig(), description="denoised hard negatives")
    augment: AugmentConfig = Field(AugmentConfig(), description="M_D2's augmented data")
    student: StudentConfig = Field(StudentConfig(), description="M_D1 / M_D2 training")
    ablations: AblationConfig = Field(AblationConfig(), description="extra systems for the paper's ablation")

    @model_validator(mode="after")
    def _rules(self):
        split, evaluated, splits = self.train_split, self.dataset.split, self.dataset.splits()
        for where, value in (("cross_encoder.split", self.cross_encoder.split), ("denoise.split", self.denoise.split)):
            if value != split:
                raise ValueError(f"{where}: '{value}', but the labelled split is train_split '{split}'")
        for where, value in (("dual_encoder.splits", self.dual_encoder.splits), ("student.splits", self.student.splits)):
            if tuple(value) != (split,):
                raise ValueError(f"{where}: {list(value)}, but the labelled split is train_split '{split}' (M_D2 "
                                 f"adds the augmented split itself)")
        q = self.augment.queries
        if self.augment.enabled and isinstance(q, UnlabelledSource):
            if q.split == evaluated:
                raise ValueError(f"augment.queries.split: '{q.split}' is the evaluated split; its queries must never "
                                 "be trained on, labelled or not")
            if q.split == split:
                raise ValueError(f"augment.queries.split: '{q.split}' is the labelled split; augmentation is for "
                                 "queries without labels (e.g. dev, or generated queries)")
            if splits is not None and q.split not in splits:
                raise ValueError(f"augment.queries.split: '{q.split}' is not a split of {self.dataset.source} "
                                 f"(its qrels: {', '.join(splits)})")
        de = self.dual_encoder
        if de.loss != "infonce":
            raise ValueError("dual_encoder.loss: M_D0 learns from labelled pairs (infonce); listwise_kl needs a "
                             "teacher: see ablations.listwise")
        if (de.negatives == "none") != (de.negatives_per_line == 0):
            raise ValueError(f"dual_encoder.negatives_per_line: {de.negatives_per_line} with negatives "
                             f"'{de.negatives}' (none takes 0; random or bm25 take at least 1)")
        if self.student.loss != "infonce" or self.student.negatives_per_line < 1:
            raise ValueError("student: M_D1 / M_D2 train with infonce on at least one denoised negative per line "
                             "(negatives_per_line >= 1); listwise distillation is ablations.listwise")
        if self.dense.similarity != de.similarity or self.student.similarity != de.similarity:
            raise ValueError(f"dense.similarity / student.similarity: the dual encoders and their evaluation use one "
                             f"similarity (dual_encoder.similarity: {de.similarity})")
        fill = self.denoise.fill_ranks
        if fill is not None and (fill[0] <= self.denoise.depth or fill[1] > self.retrieve.depth):
            raise ValueError(f"denoise.fill_ranks: {list(fill)} must lie below the teacher's top "
                             f"{self.denoise.depth} (denoise.depth: those it judged) and within M_D0's list of "
                             f"{self.retrieve.depth} (retrieve.depth); null: no fill")
        if (self.cross_encoder.loss == "listwise" and "cross_encoder" in self.denoise.teachers
                and self.denoise.calibration.method != "platt"):
            # A listwise M_C learns only differences within a query's group: sigmoid(logit) is no probability.
            raise ValueError("cross_encoder.loss: listwise logits are not probabilities, and M_C denoises "
                             "(denoise.teachers) and, first of them, labels augmentation; set "
                             "denoise.calibration.method: platt, or denoise with fusion only")
        if len(set(self.denoise.teachers)) != len(self.denoise.teachers):
            raise ValueError(f"denoise.teachers: each teacher once, got {list(self.denoise.teachers)}")
        if set(self.denoise.fusion.weights) != {"bm25", "dense"}:
            raise ValueError(f"denoise.fusion.weights: one weight for 'bm25' and one for 'dense', got "
                             f"{sorted(self.denoise.fusion.weights)}")
        return self

    def required_cross_encoders(self) -> list[tuple[str, str]]:
        """Models that must already be cross-encoders (preflight refuses a bi-encoder or plain encoder)."""
        return [] if self.cross_encoder.train else [("cross_encoder.model", self.cross_encoder.model)]


# ---- teachers: who judges M_D0's candidates and labels unlabelled queries -------------------------
@dataclass(frozen=True)
class Judge:
    """A teacher in a run: ``score`` reads a ranking's candidates (for denoising), ``label`` labels
    unlabelled queries from a ranking (augmentation: it scores their candidates, score_candidates[augment],
    then augment decides); ``tag`` names its stages and systems (md1-<tag>)."""

    run: Run
    c: RocketQAConfig
    data: Dataset


@dataclass(frozen=True)
class CrossEncoderJudge(Judge):
    """M_C: reads each (query, passage) pair; its logits are probabilities through ``denoise.calibration``,
    in denoising and in augmentation alike."""

    tag: ClassVar[str] = "ce"
    model: DatasetRef

    def score(self, queries: DatasetRef, ranking: DatasetRef) -> DatasetRef:
        p = self.c.denoise.to(ScoreCandidatesParams, teacher=self.c.cross_encoder.scoring())
        return score_candidates(self.run, p, tag=self.tag, ranking=ranking, queries=queries, corpus=self.data.corpus,
                                qrels=self.data.qrels, teacher=self.model)

    def denoise_params(self) -> DenoiseParams:
        return self.c.denoise.to(DenoiseParams)

    def label(self, queries: DatasetRef, ranking: DatasetRef, calibrated_on: DatasetRef) -> dict[str, DatasetRef]:
        p = self.c.augment.to(ScoreCandidatesParams, split=None, teacher=self.c.cross_encoder.scoring())
        scores = score_candidates(self.run, p, tag="augment", ranking=ranking, queries=queries,
                                  corpus=self.data.corpus, teacher=self.model)
        # The probabilities augmentation thresholds are the ones M_C denoised with: with Platt, fitted on the
        # labelled lists M_C scored for denoising (what a listwise M_C needs; its sigmoid is no probability).
        calibration = self.c.denoise.calibration
        return augment(self.run, self.c.augment.to(AugmentParams, calibration=calibration), scores=scores,
                       calibration=calibrated_on if calibration.method == "platt" else None)


@dataclass(frozen=True)
class FusionJudge(Judge):
    """BM25 + the dual encoder, fused per query: no model of its own, so Platt-calibrated on the labelled lists."""

    tag: ClassVar[str] = "fusion"
    platt: ClassVar[Calibration] = Calibration(method="platt")

    def teacher(self) -> FusionTeacher:
        return self.c.denoise.fusion.to(FusionTeacher, type="fusion")

    def score(self, queries: DatasetRef, ranking: DatasetRef) -> DatasetRef:
        p = self.c.denoise.to(ScoreCandidatesParams, teacher=self.teacher())
        return score_candidates(self.run, p, tag=self.tag, ranking=ranking, queries=queries, corpus=self.data.corpus,
                                qrels=self.data.qrels, teacher_rankings=[bm25_top(self.run, self.c, self.data, queries),
                                                                         ranking])

    def denoise_params(self) -> DenoiseParams:
        return self.c.denoise.to(DenoiseParams, calibration=self.platt)

    def label(self, queries: DatasetRef, ranking: DatasetRef, calibrated_on: DatasetRef) -> dict[str, DatasetRef]:
        bm25 = bm25_train_run(self.run, self.c.bm25, self.data, queries, self.c.augment.depth, tag="bm25-augment")
        p = self.c.augment.to(ScoreCandidatesParams, split=None, teacher=self.teacher())
        scores = score_candidates(self.run, p, tag="augment", ranking=ranking, queries=queries,
                                  corpus=self.data.corpus, teacher_rankings=[bm25, ranking])
        return augment(self.run, self.c.augment.to(AugmentParams, calibration=self.platt), scores=scores,
                       calibration=calibrated_on)


# ---- building blocks ------------------------------------------------------------------------------
def bm25_top(run: Run, c: RocketQAConfig, data: Dataset, queries: DatasetRef) -> DatasetRef:
    """BM25's list for the train queries, deep enough for its negatives and for the fusion teacher."""
    return bm25_train_run(run, c.bm25, data, queries, max(c.dual_encoder.bm25_depth, c.retrieve.depth))


def m_d0(run: Run, c: RocketQAConfig, data: Dataset, queries: DatasetRef, base: DatasetRef, negatives: str,
         tag: str) -> DatasetRef:
    """M_D0: labelled pairs with in-batch (cross-batch with processes > 1) negatives, plus
    ``negatives_per_line`` random passages (no negatives input: DPR's random) or BM25 negatives."""
    de = c.dual_encoder
    mined = None
    if negatives == "bm25":
        mined = [mine_negatives(run, top_negative_mining(de.bm25_depth, de.bm25_skip_top), tag="bm25",
                                rankings=[bm25_top(run, c, data, queries)], qrels=data.qrels)]
    per_line = 0 if negatives == "none" else max(1, de.negatives_per_line)
    return train_dual_encoder(run, de.to(TrainDualEncoderParams, negatives_per_line=per_line), tag=tag,
                              queries=[queries], corpus=data.corpus, base_model=base, qrels=[data.qrels],
                              negatives=mined)["model"]


def m_c(run: Run, c: RocketQAConfig, data: Dataset, queries: DatasetRef, md0_list: DatasetRef) -> DatasetRef:
    """M_C: labelled positives + negatives sampled uniformly from M_D0's top ``cross_encoder.depth``
    (or, with train: false, the cross-encoder named in the config, checked before any stage ran)."""
    model = run.model(c.cross_encoder.model, "cross_encoder.model")
    if not c.cross_encoder.train:
        return model
    depth = min(c.cross_encoder.depth, c.retrieve.depth)
    negatives = mine_negatives(run, MineParams(strategy="topk", depth=depth), tag="md0-ce", rankings=[md0_list],
                               qrels=data.qrels)
    return train_cross_encoder(run, c.cross_encoder.to(TrainCrossEncoderParams), queries=queries, corpus=data.corpus,
                               qrels=data.qrels, base_model=model, negatives=negatives)["cross_encoder"]


def student(run: Run, c: RocketQAConfig, data: Dataset, init: DatasetRef, tag: str, queries: list[DatasetRef],
            qrels: list[DatasetRef], negatives: list[DatasetRef]) -> DatasetRef:
    """A dual encoder trained like M_D1: labelled (+ augmented) pairs, ``negative_lines`` lines each."""
    splits = (c.train_split, AUGMENTED_SPLIT) if len(qrels) > 1 else c.student.splits
    return train_dual_encoder(run, c.student.to(TrainDualEncoderParams, splits=splits), tag=tag, queries=queries,
                              corpus=data.corpus, base_model=init, qrels=qrels, negatives=negatives)["model"]


def listwise_student(run: Run, c: RocketQAConfig, data: Dataset, init: DatasetRef, queries: DatasetRef,
                     scores: DatasetRef) -> DatasetRef:
    """RocketQAv2's listwise distillation with M_C frozen: KL from M_C's scores of each query's list."""
    p = c.student.to(TrainDualEncoderParams, loss="listwise_kl", negatives_per_line=0, negative_lines=1,
                     list_size=c.ablations.list_size)
    return train_dual_encoder(run, p, tag="md1-listwise", queries=[queries], corpus=data.corpus, base_model=init,
                              qrels=[data.qrels], teacher_scores=scores)["model"]


def unlabelled_queries(run: Run, c: RocketQAConfig, data: Dataset) -> DatasetRef:
    """The augmentation's queries: a split's texts (labels unused) or generated from the corpus."""
    q = c.augment.queries
    if isinstance(q, UnlabelledSource):
        gen = generate_queries(run, q, tag="augment", corpus=data.corpus, queries=data.queries, qrels=data.qrels)
    else:
        gen = generate_queries(run, q, tag="augment", corpus=data.corpus)
    if c.augment.limit is None:
        return gen["queries"]
    return sample_queries(run, SampleQueriesParams(n=c.augment.limit, seed=c.augment.seed), tag="augment",
                          queries=gen["queries"])


# ---- the recipe -----------------------------------------------------------------------------------
@recipe("rocketqa", RocketQAConfig)
def rocketqa(c: RocketQAConfig, run: Run) -> Made:
    data = ingest(run, c.dataset)
    base = run.model(c.base_model, "base_model")
    train_q = labelled_queries(run, data, c.train_split)

    # 1. M_D0 on labelled pairs; 2. its top 1000 for the train queries; 3. M_C trained on that list.
    systems = {"md0": (md0 := m_d0(run, c, data, train_q, base, c.dual_encoder.negatives, "md0"))}
    if c.ablations.bm25_negatives and c.dual_encoder.negatives != "bm25":
        systems["md0-bm25neg"] = m_d0(run, c, data, train_q, base, "bm25", "md0-bm25neg")
    md0_list = retrieve(run, c.dense, data, md0, train_q, c.retrieve.depth, tag=f"md0-{c.train_split}")
    cross_encoder = m_c(run, c, data, train_q, md0_list)

    # 4. Each teacher scores M_D0's top 50; denoising keeps the candidates it finds unlikely positives
    #    (thresholds apart from scoring: a threshold change re-decides in seconds); one M_D1 per teacher.
    judges = [CrossEncoderJudge(run, c, data, cross_encoder) if name == "cross_encoder" else FusionJudge(run, c, data)
              for name in c.denoise.teachers]
    init = base if c.student.init == "base" else md0
    denoised = {}
    for judge in judges:
        scores = judge.score(train_q, md0_list)
        denoised[judge.tag] = denoise(run, judge.denoise_params(), tag=judge.tag, scores=scores, ranking=md0_list,
                                      qrels=data.qrels)
        systems[f"md1-{judge.tag}"] = student(run, c, data, init, f"md1-{judge.tag}", [train_q], [data.qrels],
                                              [denoised[judge.tag]["negatives"]])

    # Ablations: M_D0's hard negatives without denoising; RocketQAv2's listwise distillation (M_C frozen).
    if c.ablations.undenoised:
        hard = mine_negatives(run, MineParams(strategy="topk", depth=c.denoise.depth), tag="md0-hard",
                              rankings=[md0_list], qrels=data.qrels)
        systems["md0-hardneg"] = student(run, c, data, init, "md0-hardneg", [train_q], [data.qrels], [hard])
    if c.ablations.listwise and "ce" in denoised:
        systems["md1-listwise"] = listwise_student(run, c, data, init, train_q, denoised["ce"]["scores"])

    # 5-6. Augment: M_D1 retrieves for unlabelled queries, the first teacher labels them; M_D2 = M_D1's data + them.
    if c.augment.enabled:
        first = judges[0]
        unlabelled = unlabelled_queries(run, c, data)
        md1_list = retrieve(run, c.dense, data, systems[f"md1-{first.tag}"], unlabelled, c.augment.depth,
                            tag="md1-augment")
        aug = first.label(unlabelled, md1_list, calibrated_on=denoised[first.tag]["scores"])
        systems["md2"] = student(run, c, data, init, "md2", [train_q, unlabelled], [data.qrels, aug["qrels"]],
                                 [denoised[first.tag]["negatives"], aug["negatives"]])

    # 7. Evaluation on the test split: BM25, zero-shot, every dual encoder, M_C re-ranking M_D0's top 100.
    tested = test_systems(run, c, data, base, systems)
    rankings = tested.rankings
    rankings.update(hybrid_rankings(run, c.hybrid, rankings, c.bm25.first_system, system_name(c.base_model), systems))
    rankings["mc-rerank"] = rerank(run, c.cross_encoder.rerank.to(RerankParams, system="mc-rerank"), tag="mc",
                                   ranking=rankings["md0"], queries=data.test_queries, corpus=data.corpus,
                                   model=cross_encoder)
    if (w := c.cross_encoder.rerank_md0_weight) is not None:
        # Both normalised over the same candidates: M_D0's list cut to the depth M_C re-ranked.
        depth = c.cross_encoder.rerank.depth
        rankings["mc-rerank-fused"] = fuse(run, FuseParams(weights={"md0": w, "mc-rerank": 1 - w}, input_depth=depth,
                                                           depth=depth, system="mc-rerank-fused"),
                                           tag="mc-rerank-fused", rankings=[rankings["md0"], rankings["mc-rerank"]])
    return evaluate_systems(run, c.evaluate, data, tested)

