"""RocketQA (Qu et al., NAACL 2021) as a declared, cached DAG, with RocketQAv2's listwise distillation
(Ren et al., EMNLP 2021) as a loss option.

    labelled pairs (train split) ──train_dual_encoder──> M_D0        (in-batch / cross-batch / GradCache;
       │                                   │                         extra negatives: none, random, BM25)
       │              M_D0 retrieves the train queries' top 1000 (encode_corpus + dense_search)
       │                                   │
       ├──train_cross_encoder (positives + negatives from M_D0's top k) ──> M_C ──rerank test top-100──> "mc-rerank"
       │                                   │
       │  score_candidates (M_C, or the BM25 + M_D0 fusion, reads M_D0's top 50) ──> denoise (p < 0.1 -> negative)
       │                                   │
       ├──train_dual_encoder (labelled + denoised negatives) ──> M_D1   (from M_D0's starting point)
       │                                   │
       │   unlabelled queries ──M_D1 top 50──> augment (M_C: top-1 positive if p > 0.9, negatives p < 0.1)
       │                                   │
       └──train_dual_encoder (M_D1's data + augmented data) ──> M_D2
    test queries ──> BM25 | zero-shot | M_D0 | ablations | M_D1 | M_D2 | M_C re-ranking ──> evaluate ──> report

Each arrow is a stage cached on its inputs: change the denoise threshold and only denoising (not the
teacher's scoring) and what follows recompute; change M_C's learning rate and M_C, its re-ranking, denoising and the students
after it recompute, while M_D0 and its retrieval are reused. The corpus embeddings of a model are
computed once and shared by its train-query retrieval and its test evaluation.

Cross-stage rules are validators of ``RocketQAConfig``: the labelled split is neither the evaluated
split nor missing; unlabelled queries come from neither; every stage that reads positives reads the
labelled split; the evaluated dense systems use the dual encoder's similarity.
"""

# No `from __future__ import annotations`: Prefect loads a deployment entrypoint file as a module that
# is not in sys.modules, where pydantic could not resolve string annotations of the config models.
from typing import Annotated, Literal, Union

from pydantic import Field, PositiveInt, model_validator

from irflow.dual_encoder import TrainDualEncoderParams
from irflow.flows.common import (Dataset, SupervisedConfig, bm25_train_run, evaluate_runs, ingest, labelled_queries,
                                 raw_section, retrieve, test_runs)
from irflow.params import ModelName, Params
from irflow.recipe import recipe
from irflow.stage import Run
from irflow.store import DatasetRef
from irflow.tasks.augment import AUGMENTED_SPLIT, AugmentParams, AugmentSettings, augment
from irflow.tasks.denoise import DenoiseParams, denoise
from irflow.tasks.generate_queries import CropSource, ICTSource, UnlabelledSource, generate_queries
from irflow.tasks.mine_negatives import MineParams, mine_negatives
from irflow.tasks.sample_queries import SampleQueriesParams, sample_queries
from irflow.tasks.score_candidates import ScoreCandidatesParams, score_candidates
from irflow.tasks.rerank import RerankParams, RerankSettings, rerank
from irflow.tasks.train_cross_encoder import TrainCrossEncoderParams, train_cross_encoder
from irflow.tasks.train_dual_encoder import train_dual_encoder
from irflow.teachers import CrossEncoderTeacher, FusionTeacher
from irflow.fusion import FusionSettings


# ---- config -------------------------------------------------------------------------------------
class DualEncoderConfig(TrainDualEncoderParams):
    negatives: Literal["none", "random", "bm25"] = Field(
        "none", description="M_D0's extra negatives per query: none (in-batch only), random passages, or BM25's "
                            "top `bm25_depth` (DPR); how many: negatives_per_query")
    bm25_depth: PositiveInt = Field(100, description="negatives bm25: sampled from BM25's top n (positives excluded)")

    def params(self, **fields) -> TrainDualEncoderParams:
        return self.to(TrainDualEncoderParams, **fields)


class RetrieveConfig(Params):
    depth: PositiveInt = Field(1000, description="M_D0's list per train query (RocketQA: 1000): what the "
                                                 "cross-encoder's negatives, denoising and its fill read")


class CrossEncoderConfig(TrainCrossEncoderParams):
    model: ModelName = Field("all-MiniLM-L6-v2", description="M_C's starting point (a plain encoder gets a "
                                                             "fresh 1-logit head), or with train: false the "
                                                             "cross-encoder itself")
    train: bool = Field(True, description="fine-tune M_C on the labelled split (false: use `model` as M_C)")
    negatives_depth: PositiveInt = Field(1000, description="M_C's negatives are sampled uniformly from M_D0's "
                                                           "top n, positives excluded (RocketQA: 1000)")
    rerank: RerankSettings = Field(RerankSettings(), description="M_C evaluated as a re-ranker of M_D0's test "
                                                                 "top-n (system mc-rerank); it reads `max_length` "
                                                                 "tokens, as M_C was trained, unless "
                                                                 "rerank.max_length is set")

    @model_validator(mode="before")
    @classmethod
    def _rerank_reads_as_trained(cls, data):
        # A cross-encoder trained on 128 tokens and evaluated on 256 is evaluated on inputs it never
        # saw (and twice as slowly): the re-ranker inherits the training length unless told otherwise.
        if isinstance(data, dict):
            rerank = data.get("rerank")
            rerank = rerank.model_dump(exclude_unset=True) if isinstance(rerank, RerankSettings) else dict(rerank or {})
            rerank.setdefault("max_length", data.get("max_length", cls.model_fields["max_length"].default))
            data = {**data, "rerank": rerank}
        return data

    def teacher(self) -> CrossEncoderTeacher:
        return CrossEncoderTeacher(type="cross_encoder", batch_size=self.rerank.batch_size,
                                   max_length=self.max_length)


class FusionConfig(FusionSettings):
    weights: dict[str, float] = Field({"bm25": 0.3, "dense": 0.7}, description="weight of BM25 ('bm25') and of "
                                                                              "the dual encoder ('dense')")


class DenoiseConfig(DenoiseParams):
    depth: PositiveInt = Field(50, description="the teacher reads M_D0's top n per train query (RocketQA: 50)")
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


class StudentConfig(TrainDualEncoderParams):
    """M_D1 and M_D2 (and the ablations trained like them)."""

    init: Literal["base", "md0"] = Field("base", description="start from base_model (RocketQA's scripts: better) "
                                                             "or from M_D0")


class AblationConfig(Params):
    bm25_negatives: bool = Field(False, description="also M_D0 trained with BM25 negatives (md0-bm25neg)")
    undenoised: bool = Field(False, description="also a student on M_D0's top-`denoise.depth` negatives, not "
                                                "denoised (md0-hardneg): RocketQA's 26.03 row")
    listwise: bool = Field(False, description="also a student distilled from M_C's scores of M_D0's top list "
                                              "(RocketQAv2's listwise KL, M_C frozen: md1-listwise)")
    list_size: PositiveInt = Field(8, description="listwise: candidates per query, the positive included")


class RocketQAConfig(SupervisedConfig):
    flow: Literal["rocketqa"] = Field(description="this recipe: rocketqa")
    dual_encoder: DualEncoderConfig = Field(DualEncoderConfig(), description="M_D0: InfoNCE on labelled pairs")
    retrieve: RetrieveConfig = Field(RetrieveConfig(), description="M_D0's retrieval for the train queries")
    cross_encoder: CrossEncoderConfig = Field(CrossEncoderConfig(), description="M_C")
    denoise: DenoiseConfig = Field(DenoiseConfig(), description="denoised hard negatives")
    augment: AugmentConfig = Field(AugmentConfig(), description="M_D2's augmented data")
    student: StudentConfig = Field(StudentConfig(negatives_per_query=1, negative_lines=4),
                                   description="M_D1 / M_D2 training (RocketQA: 4 lines of 1 denoised negative per "
                                               "positive)")
    ablations: AblationConfig = Field(AblationConfig(), description="extra systems for the paper's ablation")

    @model_validator(mode="before")
    @classmethod
    def _follow(cls, data):
        """Fill what follows another section, before validation (so `irflow config` shows it)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        split = data.get("train_split", "train")
        for key, field in (("cross_encoder", "split"), ("denoise", "split")):
            section = raw_section(data, key)
            if section is not None:
                section.setdefault(field, split)
        for key in ("dual_encoder", "student"):
            section = raw_section(data, key)
            if section is not None:
                section.setdefault("splits", [split])
        student = raw_section(data, "student")
        if student is not None:
            student.setdefault("negatives_per_query", 1)
            student.setdefault("negative_lines", 4)
        de = raw_section(data, "dual_encoder")
        dense = raw_section(data, "dense")
        if dense is not None and de is not None:
            dense.setdefault("similarity", de.get("similarity", TrainDualEncoderParams.model_fields["similarity"].default))
        return data

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
        if (de.negatives == "none") != (de.negatives_per_query == 0):
            raise ValueError(f"dual_encoder.negatives_per_query: {de.negatives_per_query} with negatives "
                             f"'{de.negatives}' (none takes 0; random or bm25 take at least 1)")
        if self.student.loss != "infonce" or self.student.negatives_per_query < 1:
            raise ValueError("student: M_D1 / M_D2 train with infonce on at least one denoised negative per line "
                             "(negatives_per_query >= 1); listwise distillation is ablations.listwise")
        if self.dense.similarity != de.similarity or self.student.similarity != de.similarity:
            raise ValueError(f"dense.similarity / student.similarity: the dual encoders and their evaluation use one "
                             f"similarity (dual_encoder.similarity: {de.similarity})")
        if len(set(self.denoise.teachers)) != len(self.denoise.teachers):
            raise ValueError(f"denoise.teachers: each teacher once, got {list(self.denoise.teachers)}")
        if set(self.denoise.fusion.weights) != {"bm25", "dense"}:
            raise ValueError(f"denoise.fusion.weights: one weight for 'bm25' and one for 'dense', got "
                             f"{sorted(self.denoise.fusion.weights)}")
        return self

    def required_cross_encoders(self) -> list[tuple[str, str]]:
        """Models that must already be cross-encoders (preflight refuses a bi-encoder or plain encoder)."""
        return [] if self.cross_encoder.train else [("cross_encoder.model", self.cross_encoder.model)]


# ---- building blocks ------------------------------------------------------------------------------
def student(run: Run, c: RocketQAConfig, data: Dataset, queries: list[DatasetRef], init: DatasetRef,
            label: str, qrels: list[DatasetRef], negatives: list[DatasetRef]) -> DatasetRef:
    """A dual encoder trained like M_D1: labelled (+ augmented) pairs, `negative_lines` lines each."""
    s = c.student
    p = s.to(TrainDualEncoderParams, splits=(c.train_split, AUGMENTED_SPLIT) if len(qrels) > 1 else s.splits)
    return train_dual_encoder(run, p, label=label, queries=queries, corpus=data.corpus, base_model=init,
                              qrels=qrels, negatives=negatives)


# ---- the recipe -----------------------------------------------------------------------------------
@recipe("rocketqa", RocketQAConfig)
def rocketqa(c: RocketQAConfig, run: Run) -> list[dict]:
    data = ingest(run, c.dataset)
    base = run.model(c.base_model, "base_model")
    train_q = labelled_queries(run, data, c.train_split)
    de = c.dual_encoder
    systems: dict[str, DatasetRef] = {}  # system name -> model, evaluated on the test split below

    # 1. M_D0: labelled pairs, in-batch (cross-batch with processes > 1) negatives, + random / BM25 ones.
    bm25_train = None

    def m_d0(kind: str, label: str) -> DatasetRef:
        nonlocal bm25_train
        n = 0 if kind == "none" else de.negatives_per_query if kind == de.negatives else max(1, de.negatives_per_query)
        negatives = None  # with negatives_per_query > 0 and no negatives input: random passages (DPR)
        if kind == "bm25":
            bm25_train = bm25_train or bm25_train_run(run, c.bm25, data, train_q, max(de.bm25_depth, c.retrieve.depth))
            negatives = [mine_negatives(run, MineParams(strategy="topk", depth=de.bm25_depth), label="bm25",
                                        runs=[bm25_train], qrels=data.qrels)]
        return train_dual_encoder(run, de.params(negatives_per_query=n), label=label, queries=[train_q],
                                  corpus=data.corpus, base_model=base, qrels=[data.qrels], negatives=negatives)

    md0 = m_d0(de.negatives, "md0")
    systems["md0"] = md0
    if c.ablations.bm25_negatives and de.negatives != "bm25":
        systems["md0-bm25neg"] = m_d0("bm25", "md0-bm25neg")

    # 2. M_D0 retrieves the train queries' top 1000.
    md0_train = retrieve(run, c.dense, data, md0, train_q, c.retrieve.depth, label=f"md0-{c.train_split}")

    # 3. M_C: labelled positives + negatives sampled uniformly from M_D0's top k (positives excluded).
    if c.cross_encoder.train:
        ce_negatives = mine_negatives(run, MineParams(strategy="topk", depth=min(c.cross_encoder.negatives_depth,
                                                                                  c.retrieve.depth)),
                                      label="md0-ce", runs=[md0_train], qrels=data.qrels)
        m_c = train_cross_encoder(run, c.cross_encoder.to(TrainCrossEncoderParams), queries=train_q,
                                  corpus=data.corpus, qrels=data.qrels,
                                  base_model=run.model(c.cross_encoder.model, "cross_encoder.model"),
                                  negatives=ce_negatives)
    else:  # preflight checked that it is a cross-encoder (RocketQAConfig.required_cross_encoders)
        m_c = run.model(c.cross_encoder.model, "cross_encoder.model")

    # 4. Denoise M_D0's top 50 with each teacher; one M_D1 per teacher.
    init = base if c.student.init == "base" else md0
    denoised: dict[str, dict] = {}
    for teacher in c.denoise.teachers:
        label = "ce" if teacher == "cross_encoder" else teacher
        settings = c.denoise.to(DenoiseParams)
        if teacher == "cross_encoder":
            scored = score_candidates(run, c.denoise.to(ScoreCandidatesParams, teacher=c.cross_encoder.teacher()),
                                      label=label, run=md0_train, queries=train_q, corpus=data.corpus,
                                      qrels=data.qrels, teacher=m_c)
        else:
            fusion = FusionTeacher(type="fusion", **c.denoise.fusion.model_dump())
            bm25_train = bm25_train or bm25_train_run(run, c.bm25, data, train_q, max(de.bm25_depth, c.retrieve.depth))
            scored = score_candidates(run, c.denoise.to(ScoreCandidatesParams, teacher=fusion), label=label,
                                      run=md0_train, queries=train_q, corpus=data.corpus, qrels=data.qrels,
                                      teacher_runs=[bm25_train, md0_train])
            settings = DenoiseParams(**{**settings.model_dump(), "calibration": {"method": "platt"}})
        # thresholds apart from scoring: a threshold change re-decides in seconds, never re-scores
        out = denoise(run, settings, label=label, scores=scored, run=md0_train, qrels=data.qrels)
        denoised[teacher] = out
        histogram_artifact(run, out["histogram"], key=f"denoise-{label}")
        name = "md1-ce" if teacher == "cross_encoder" else "md1-fusion"
        systems[name] = student(run, c, data, [train_q], init, name, [data.qrels], [out["negatives"]])

    # Ablations: M_D0's hard negatives without denoising; RocketQAv2's listwise distillation (M_C frozen).
    if c.ablations.undenoised:
        hard = mine_negatives(run, MineParams(strategy="topk", depth=c.denoise.depth), label="md0-hard",
                              runs=[md0_train], qrels=data.qrels)
        systems["md0-hardneg"] = student(run, c, data, [train_q], init, "md0-hardneg", [data.qrels], [hard])
    if c.ablations.listwise and "cross_encoder" in denoised:
        p = c.student.to(TrainDualEncoderParams, loss="listwise_kl", negatives_per_query=0, negative_lines=1,
                         list_size=c.ablations.list_size)
        systems["md1-listwise"] = train_dual_encoder(run, p, label="md1-listwise", queries=[train_q],
                                                     corpus=data.corpus, base_model=init, qrels=[data.qrels],
                                                     teacher_scores=denoised["cross_encoder"]["scores"])

    # 5-6. Augment: M_D1 retrieves for unlabelled queries, M_C labels them; M_D2 = M_D1's data + them.
    if c.augment.enabled:
        primary = c.denoise.teachers[0]
        md1 = systems["md1-ce" if primary == "cross_encoder" else "md1-fusion"]
        unlabelled = unlabelled_queries(run, c, data)
        md1_aug = retrieve(run, c.dense, data, md1, unlabelled, c.augment.depth, label="md1-augment")
        if primary == "cross_encoder":
            aug = augment(run, c.augment.to(AugmentParams, teacher=c.cross_encoder.teacher()), queries=unlabelled,
                          run=md1_aug, corpus=data.corpus, teacher=m_c)
        else:
            bm25_aug = bm25_train_run(run, c.bm25, data, unlabelled, c.augment.depth, label="bm25-augment")
            p = AugmentParams(**{**c.augment.to(AugmentSettings).model_dump(), "calibration": {"method": "platt"}},
                              teacher=FusionTeacher(type="fusion", **c.denoise.fusion.model_dump()))
            aug = augment(run, p, queries=unlabelled, run=md1_aug, corpus=data.corpus, teacher_runs=[bm25_aug, md1_aug],
                          calibration=denoised[primary]["scores"])
        systems["md2"] = student(run, c, data, [train_q, unlabelled], init, "md2", [data.qrels, aug["qrels"]],
                                 [denoised[primary]["negatives"], aug["negatives"]])

    # 7. Evaluation on the test split: BM25, zero-shot, every dual encoder, M_C re-ranking M_D0's top 100.
    runs = test_runs(run, c, data, base, systems)
    runs["mc-rerank"] = rerank(run, c.cross_encoder.rerank.to(RerankParams, system="mc-rerank"), label="mc",
                               run=runs["md0"], queries=data.test_queries, corpus=data.corpus, model=m_c)
    return evaluate_runs(run, c.evaluate, data, runs)


def unlabelled_queries(run: Run, c: RocketQAConfig, data: Dataset) -> DatasetRef:
    """The augmentation's queries: a split's texts (labels unused) or generated from the corpus."""
    q = c.augment.queries
    if isinstance(q, UnlabelledSource):
        gen = generate_queries(run, q, label="augment", corpus=data.corpus, queries=data.queries, qrels=data.qrels)
    else:
        gen = generate_queries(run, q, label="augment", corpus=data.corpus)
    if c.augment.limit is None:
        return gen["queries"]
    return sample_queries(run, SampleQueriesParams(n=c.augment.limit, seed=c.augment.seed), label="augment",
                          queries=gen["queries"])


def __getattr__(name: str):
    # `rocketqa_flow`: the Prefect flow (prefect.yaml's entrypoint), built on first use.
    if name == "rocketqa_flow":
        return rocketqa.flow
    raise AttributeError(name)


def histogram_artifact(run: Run, histogram: DatasetRef, key: str) -> None:
    """The denoise histogram as a Prefect markdown artifact (bins x counts, and where the PNG is)."""
    import json
    from pathlib import Path

    if run.dry_run:
        return
    data = json.loads((Path(histogram.path) / "histogram.json").read_text())
    groups = list(data["counts"])
    lines = [f"**{data['title']}** (thresholds: {data['thresholds']})", "",
             "| probability | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for i, lo in enumerate(data["edges"][:-1]):
        lines.append(f"| {lo:.2f}-{data['edges'][i + 1]:.2f} | " + " | ".join(str(data["counts"][g][i]) for g in groups)
                     + " |")
    lines += ["", f"PNG: `{Path(histogram.path) / 'histogram.png'}` (dataset {histogram.id})"]
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(key=key, markdown="\n".join(lines), description=f"irflow run {run.run_id}")
    except Exception:  # noqa: BLE001 -- outside a Prefect run there is no artifact store
        pass
