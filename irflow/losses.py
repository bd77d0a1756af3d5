"""Training losses for bi-encoders, in the sentence-transformers style.

Each loss is an ``nn.Module`` that can either embed tokenized inputs with a model
(``loss(features, labels)``, as sentence-transformers losses do) or take embeddings that were
computed elsewhere (``loss.from_embeddings(...)``), which is what irflow's training loop and the
tests use. The similarity is a real parameter: ``"dot"`` or ``"cos"`` changes the scores the loss
sees.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SIMILARITIES = ("dot", "cos")


def _check_similarity(similarity: str) -> str:
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
    return similarity


def pairwise_similarity(a: Tensor, b: Tensor, similarity: str) -> Tensor:
    """Row-wise sim(a[i], b[i]) -> shape (n,)."""
    if _check_similarity(similarity) == "cos":
        return F.cosine_similarity(a, b, dim=-1)
    return (a * b).sum(dim=-1)


def similarity_matrix(a: Tensor, b: Tensor, similarity: str) -> Tensor:
    """All sim(a[i], b[j]) -> shape (len(a), len(b))."""
    if _check_similarity(similarity) == "cos":
        a, b = F.normalize(a, p=2, dim=-1), F.normalize(b, p=2, dim=-1)
    return a @ b.transpose(0, 1)


def embed(model, features: dict) -> Tensor:
    return model(features)["sentence_embedding"]


class MarginMSELoss(nn.Module):
    """Margin-MSE: MSE between the student's margin sim(q, p) - sim(q, n) and a teacher's margin.

    Hofstätter, Althammer, Schröder, Sertkan, Hanbury (2020): "Improving Efficient Neural Ranking
    Models with Cross-Architecture Knowledge Distillation" (arXiv:2010.02666). GPL (Wang, Thakur,
    Reimers, Gurevych, NAACL 2022: "GPL: Generative Pseudo Labeling for Unsupervised Domain
    Adaptation of Dense Retrieval") trains its students with it on cross-encoder margins.

    ``similarity`` is honoured: "cos" scores the student with cosine similarity, "dot" with the
    dot product. (GPL's training script accepts ``cos_sim`` but its MarginMSE always uses the dot
    product; here the two give different losses, as they should.)
    """

    def __init__(self, model: nn.Module | None = None, similarity: str = "dot"):
        super().__init__()
        self.model = model
        self.similarity = _check_similarity(similarity)

    def student_margin(self, q: Tensor, p: Tensor, n: Tensor) -> Tensor:
        return pairwise_similarity(q, p, self.similarity) - pairwise_similarity(q, n, self.similarity)

    def from_embeddings(self, q: Tensor, p: Tensor, n: Tensor, labels: Tensor) -> Tensor:
        margin = self.student_margin(q.float(), p.float(), n.float())
        return F.mse_loss(margin, labels.to(margin.dtype).view(-1))

    def forward(self, sentence_features: Iterable[dict], labels: Tensor) -> Tensor:
        if self.model is None:
            raise ValueError("MarginMSELoss(model=None): use from_embeddings(q, p, n, labels)")
        q, p, n = (embed(self.model, f) for f in sentence_features)
        return self.from_embeddings(q, p, n, labels)


class MultipleNegativesRankingLoss(nn.Module):
    """In-batch negatives softmax loss (InfoNCE) for (query, positive[, hard negative]) examples.

    Henderson et al. (2017): "Efficient Natural Language Response Suggestion for Smart Reply"
    (arXiv:1705.00652); van den Oord, Li, Vinyals (2018): "Representation Learning with Contrastive
    Predictive Coding" (arXiv:1807.03748). For query i the candidates are every positive in the batch
    (and every hard negative, when given); the target is its own positive. Scores are multiplied by
    ``scale`` before the softmax: 20 for cosine (sentence-transformers' default), 1 for dot products.
    """

    def __init__(self, model: nn.Module | None = None, similarity: str = "cos", scale: float | None = None):
        super().__init__()
        self.model = model
        self.similarity = _check_similarity(similarity)
        self.scale = float(scale) if scale is not None else (20.0 if similarity == "cos" else 1.0)

    def from_embeddings(self, q: Tensor, p: Tensor, n: Tensor | None = None) -> Tensor:
        candidates = p if n is None else torch.cat([p, n], dim=0)
        scores = similarity_matrix(q.float(), candidates.float(), self.similarity) * self.scale
        target = torch.arange(q.shape[0], device=scores.device)
        return F.cross_entropy(scores, target)

    def forward(self, sentence_features: Iterable[dict], labels: Tensor | None = None) -> Tensor:
        if self.model is None:
            raise ValueError("MultipleNegativesRankingLoss(model=None): use from_embeddings(q, p, n)")
        embs = [embed(self.model, f) for f in sentence_features]
        return self.from_embeddings(embs[0], embs[1], embs[2] if len(embs) > 2 else None)
