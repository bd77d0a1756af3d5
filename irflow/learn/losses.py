"""Training losses for bi-encoders (and one for cross-encoders), in the sentence-transformers style.

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


class InBatchMarginMSELoss(nn.Module):
    """In-batch Margin-MSE: each query's margin between its positive and every *other* passage of the batch,
    regressed on a second teacher's margin for the same pair.

    Hofstätter, Lin, Yang, Lin, Hanbury (SIGIR 2021): "Efficiently Teaching an Effective Dense Retriever
    with Balanced Topic Aware Sampling" (TAS-B), dual-teacher supervision: the pairwise Margin-MSE on a
    cross-encoder's margins plus this loss on a second teacher's (ColBERT there) scores of the in-batch
    pairs, ``L = L_pair + L_inbatch``. For query ``q_i`` with positive ``p_i`` and the candidates ``d_j``
    (every positive and every negative of the batch, but ``q_i``'s own two):

        loss = mean_{i, j} ((s(q_i, p_i) - s(q_i, d_j)) - t_ij)^2,   t_ij = t(q_i, p_i) - t(q_i, d_j)

    ``from_embeddings(q, p, n, teacher_margins)``: ``q, p, n`` (B, d) this process's queries, positives and
    negatives; ``teacher_margins`` (B, 2 W B) the teacher's t_ij over the candidates
    ``[every process's positives; every process's negatives]`` in rank order (W = 1 without torchrun).
    Candidates are gathered like ``CrossBatchInfoNCE``'s (gradients flow back to their process), so W
    processes with equal shares take the step of one process with the whole batch. ``s`` is the student's
    ``similarity``; the teacher's margins come in the student's units (scaled by the caller).
    """

    def __init__(self, similarity: str = "dot"):
        super().__init__()
        self.similarity = _check_similarity(similarity)

    def own_mask(self, b: int, world: int, rank: int, device=None) -> Tensor:
        """(B, 2 W B) True where candidate j counts for query i: all but i's own positive and negative."""
        keep = torch.ones(b, 2 * world * b, dtype=torch.bool, device=device)
        rows = torch.arange(b, device=device)
        keep[rows, rank * b + rows] = False
        keep[rows, world * b + rank * b + rows] = False
        return keep

    def from_embeddings(self, q: Tensor, p: Tensor, n: Tensor, teacher_margins: Tensor) -> Tensor:
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        q, p = q.float(), p.float()
        candidates = torch.cat([gather_across_processes(p), gather_across_processes(n.float())], dim=0)
        student = pairwise_similarity(q, p, self.similarity)[:, None] - similarity_matrix(q, candidates,
                                                                                           self.similarity)
        keep = self.own_mask(q.shape[0], world, rank, device=student.device)
        if not bool(keep.any()):  # one query in the whole batch: no other passage
            return student.sum() * 0.0
        diff = student - teacher_margins.to(student.device, student.dtype)
        return (diff[keep] ** 2).mean()


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


# ---- large effective batches: cross-batch negatives and GradCache --------------------------------
class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward returns to each process the *sum over processes* of the gradient
    w.r.t. its own slice: every process's loss reads every process's passages, so each slice gets
    the gradient of all of them (an all_reduce, which gloo supports, unlike reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.world = dist.get_rank(), dist.get_world_size()
        # all_gather needs equal shapes, and a query's target index assumes equal shares
        rows = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(ctx.world)]
        dist.all_gather(rows, torch.tensor([x.shape[0]], dtype=torch.long, device=x.device))
        if len({int(r) for r in rows}) > 1:
            raise ValueError(f"in-batch negatives across processes need equal shares of every batch, but "
                             f"{ctx.world} processes got {[int(r) for r in rows]} rows (a dataset smaller than "
                             f"one batch, which they do not divide): use a number of processes "
                             f"(runtime.train_processes) that divides it")
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad.chunk(ctx.world, dim=0)[ctx.rank]


def gather_across_processes(x: Tensor) -> Tensor:
    """The rows of ``x`` from every process, in rank order (x itself where no process group runs).
    Gradients flow back to the process that computed each row (RocketQA's cross-batch negatives;
    sentence-transformers' ``gather_across_devices=True``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


def gather_ids(x: Tensor) -> Tensor:
    """Every process's ``x`` (integers, no gradient), concatenated in rank order: what
    ``gather_across_processes`` does for embeddings, for the passage numbers that go with them."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


class CrossBatchInfoNCE(nn.Module):
    """InfoNCE over every passage of every process: RocketQA's cross-batch negatives.

    Qu et al. (NAACL 2021), "RocketQA: An Optimized Training Approach to Dense Passage Retrieval for
    Open-Domain Question Answering", section 4.1. With ``W`` processes of ``B`` queries and ``B * (1 + n)``
    passages each (a positive and ``n`` hard negatives per query), query ``i`` of process ``r`` scores all
    ``W * B * (1 + n)`` gathered passages; its target is its own positive, at ``r * B + i``:

        loss = -1/B sum_i log softmax_j(scale * sim(q_i, p_j))[r * B + i]

    Each process's loss is the mean over its own queries; averaging gradients over processes (as DDP
    does) then gives the gradient of the mean over all ``W * B`` queries: the same update as one process
    with a batch of ``W * B``. With one process it is ``MultipleNegativesRankingLoss``.

    ``mask`` (``B x`` candidates, True = left out) removes candidates from a query's softmax: passages
    its qrels judge relevant that another line brought into the batch (a *false* in-batch negative;
    the sum over ``j`` above then runs over the unmasked candidates only). The target is never masked.
    """

    def __init__(self, similarity: str = "cos", scale: float | None = None):
        super().__init__()
        self.similarity = _check_similarity(similarity)
        self.scale = float(scale) if scale is not None else (20.0 if similarity == "cos" else 1.0)
        self.last_candidates = 0  # passages each query was scored against at the last call

    def from_embeddings(self, q: Tensor, p: Tensor, n: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        all_p = gather_across_processes(p.float())
        candidates = all_p if n is None else torch.cat([all_p, gather_across_processes(n.float())], dim=0)
        self.last_candidates = int(candidates.shape[0])
        scores = similarity_matrix(q.float(), candidates, self.similarity) * self.scale
        target = torch.arange(q.shape[0], device=scores.device) + rank * q.shape[0]
        if mask is not None:
            mask = mask.to(scores.device).clone()
            mask[torch.arange(q.shape[0], device=scores.device), target] = False  # the positive stays
            scores = scores.masked_fill(mask, float("-inf"))
        return F.cross_entropy(scores, target)


class RandContext:
    """Captures the RNG state (CPU and CUDA) now; ``with ctx:`` replays it. GradCache's second forward
    must draw the same dropout masks as its first, or the cached gradients belong to other activations."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if self.cuda else [])
        self._fork.__enter__()
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)

    def __exit__(self, *exc):
        self._fork.__exit__(*exc)


def grad_cache_step(embeds: list, groups: list[list], loss_of_reps, mini_batch: int) -> Tensor:
    """One forward/backward of ``loss_of_reps([embed(g) for embed, g in zip(embeds, groups)])`` in
    memory bounded by ``mini_batch`` texts, with the same gradients as the full computation.

    Gao, Zhang, Han, Callan (2021), "Scaling Deep Contrastive Learning Batch Size under Memory Limited
    Setup" (GradCache; sentence-transformers' ``CachedMultipleNegativesRankingLoss``):
    1. embed every chunk of ``mini_batch`` texts without a graph, remembering the RNG state;
    2. compute the loss on those embeddings (as leaves) and back-propagate to them only;
    3. re-embed each chunk with a graph (same RNG state: same dropout) and back-propagate the cached
       embedding gradients through it: ``(emb * grad).sum().backward()``.
    Parameter gradients accumulate as if the whole batch had been one graph. Returns the loss, detached
    (its backward has been done).
    """
    reps, states = [], []
    with torch.no_grad():
        for embed, g in zip(embeds, groups):
            chunks, rs = [], []
            for i in range(0, len(g), mini_batch):
                rs.append(RandContext())
                chunks.append(embed(g[i:i + mini_batch]))
            reps.append(torch.cat(chunks, 0) if chunks else torch.empty(0))
            states.append(rs)
    leaves = [r.detach().requires_grad_() for r in reps]
    loss = loss_of_reps(leaves)
    loss.backward()
    for embed, g, leaf, rs in zip(embeds, groups, leaves, states):
        for k, i in enumerate(range(0, len(g), mini_batch)):
            with rs[k]:
                out = embed(g[i:i + mini_batch])
            (out * leaf.grad[i:i + mini_batch].to(out.dtype)).sum().backward()
    return loss.detach()


class ListwiseDistillationLoss(nn.Module):
    """KL divergence from a re-ranker's distribution over a query's candidate list to the retriever's.

    Ren et al. (EMNLP 2021), "RocketQAv2: A Joint Training Method for Dense Passage Retrieval and
    Passage Re-ranking", section 3.2 (dynamic listwise distillation). For query ``q`` with candidates
    ``p_1..p_m`` (the positive first):

        s_i = softmax_i(scale * sim(q, p_i))            (retriever)
        t_i = softmax_i(teacher(q, p_i) / temperature)  (re-ranker)
        loss = sum_i t_i * (log t_i - log s_i)          (mean over queries)

    This is the variant with the re-ranker frozen (its scores are precomputed), which
    sentence-transformers calls ``DistillKLDivLoss``; RocketQAv2 also updates the re-ranker with the
    same KL plus its own listwise cross-entropy.
    """

    def __init__(self, similarity: str = "cos", scale: float | None = None, temperature: float = 1.0):
        super().__init__()
        self.similarity = _check_similarity(similarity)
        self.scale = float(scale) if scale is not None else (20.0 if similarity == "cos" else 1.0)
        self.temperature = float(temperature)

    def from_embeddings(self, q: Tensor, candidates: Tensor, teacher_scores: Tensor) -> Tensor:
        """q: (B, d); candidates: (B, m, d); teacher_scores: (B, m)."""
        q, candidates = q.float(), candidates.float()
        if self.similarity == "cos":
            q, candidates = F.normalize(q, dim=-1), F.normalize(candidates, dim=-1)
        student = torch.einsum("bd,bmd->bm", q, candidates) * self.scale
        teacher = F.log_softmax(teacher_scores.float() / self.temperature, dim=-1)
        return F.kl_div(F.log_softmax(student, dim=-1), teacher, log_target=True, reduction="batchmean")


# ---- pairwise ranking losses: STAR and ADORE ----------------------------------------------------------
class StarLoss(nn.Module):
    """STAR: RankNet on static hard negatives, plus a small weight of the batch's other passages as random
    negatives, which keep training on static negatives stable.

    Zhan, Mao, Liu, Guo, Zhang, Ma (SIGIR 2021), "Optimizing Dense Retrieval Model Training with Hard
    Negatives", section 5. With ``s = scale * sim``, query ``q_i``, its positive ``p_i``, its hard negatives
    ``N_i`` and ``R_i`` the batch's other passages (every process's positives and negatives, gathered as
    ``CrossBatchInfoNCE`` gathers them, but ``p_i``, ``N_i`` and masked ones):

        l(q, d+, d-) = log(1 + exp(s(q, d-) - s(q, d+)))        (RankNet)
        L_static = mean_i mean_{n in N_i} l(q_i, p_i, n)
        L_random = mean_i mean_{d in R_i} l(q_i, p_i, d)
        loss = alpha * L_random + L_static                       (0 < alpha << 1)

    ``from_embeddings(q, p, n, mask)``: ``q, p`` (B, d); ``n`` (B * k, d), line i's k negatives at rows
    ``i*k .. i*k+k-1``; ``mask`` as ``CrossBatchInfoNCE``'s (True: left out of ``R_i``).
    """

    def __init__(self, similarity: str = "cos", scale: float | None = None, alpha: float = 0.1):
        super().__init__()
        self.similarity = _check_similarity(similarity)
        self.scale = float(scale) if scale is not None else (20.0 if similarity == "cos" else 1.0)
        self.alpha = float(alpha)
        self.last_candidates = 0

    def from_embeddings(self, q: Tensor, p: Tensor, n: Tensor, mask: Tensor | None = None) -> Tensor:
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
        b = q.shape[0]
        k = n.shape[0] // b
        if k < 1 or n.shape[0] != b * k:
            raise ValueError(f"StarLoss: {n.shape[0]} negatives for {b} queries; it needs k >= 1 per query")
        all_p = gather_across_processes(p.float())
        candidates = torch.cat([all_p, gather_across_processes(n.float())], dim=0)
        self.last_candidates = int(candidates.shape[0])
        scores = similarity_matrix(q.float(), candidates, self.similarity) * self.scale
        rows = torch.arange(b, device=scores.device)
        line = rank * b + rows  # this process's lines among every process's
        own_pos = line
        own_neg = world * b + line[:, None] * k + torch.arange(k, device=scores.device)
        pos = scores[rows, own_pos]
        static = F.softplus(scores.gather(1, own_neg) - pos[:, None]).mean()
        others = torch.ones_like(scores, dtype=torch.bool)
        others[rows, own_pos] = False
        others[rows[:, None], own_neg] = False
        if mask is not None:
            others &= ~mask.to(scores.device)
        pairs = F.softplus(scores - pos[:, None]) * others
        random = (pairs.sum(1) / others.sum(1).clamp(min=1)).mean()
        return self.alpha * random + static


class LambdaLoss(nn.Module):
    """ADORE's LambdaLoss: RankNet over a query's (better, worse) candidate pairs, each weighted by how much
    swapping the two would change nDCG in the current ranking.

    Zhan et al. (SIGIR 2021), "Optimizing Dense Retrieval Model Training with Hard Negatives", section 6
    (ADORE); Burges (2010), "From RankNet to LambdaRank to LambdaMART". For a query's candidates with
    scores ``s`` (``scale * sim``), relevance ``y`` (the qrels grade; 0 for a negative), gain
    ``g = 2^y - 1`` and rank ``r`` in the current ranking of the whole corpus (1 = top):

        |dNDCG_ij| = |g_i - g_j| * |1 / log2(1 + r_i) - 1 / log2(1 + r_j)| / IDCG
        loss = mean_q 1/|P_q| sum_{(i, j) in P_q} |dNDCG_ij| * log(1 + exp(s_j - s_i)),   P_q = {(i, j): y_i > y_j}

    IDCG is the DCG of the query's candidates sorted by gain (every judged positive must be a candidate).
    The weights are constants (no gradient). ``forward(scores, labels, ranks, valid)``: (B, m) each;
    ``valid`` False marks padding. ``from_embeddings(q, candidates, labels, ranks, valid)``: ``q`` (B, d),
    ``candidates`` (B, m, d).
    """

    def __init__(self, similarity: str = "cos", scale: float | None = None):
        super().__init__()
        self.similarity = _check_similarity(similarity)
        self.scale = float(scale) if scale is not None else (20.0 if similarity == "cos" else 1.0)

    @staticmethod
    def weights(labels: Tensor, ranks: Tensor, valid: Tensor | None = None, head: int | None = None) -> Tensor:
        """(B, head, m): |dNDCG_ij| where y_i > y_j (both valid), else 0; ``i`` over the first ``head``
        columns only (default: all m). Only a relevant candidate can be the better one of a pair, so where
        the positives come first, the columns up to the last positive hold every pair."""
        labels, ranks = labels.float(), ranks.float()
        valid = torch.ones_like(labels, dtype=torch.bool) if valid is None else valid.bool()
        head = labels.shape[1] if head is None else head
        gain = torch.where(valid, torch.exp2(labels) - 1, torch.zeros_like(labels))
        discount = 1.0 / torch.log2(1.0 + ranks)
        ideal = gain.sort(dim=1, descending=True).values
        positions = torch.arange(1, labels.shape[1] + 1, device=labels.device, dtype=torch.float32)
        idcg = (ideal / torch.log2(1.0 + positions)).sum(1).clamp(min=1e-12)
        delta = ((gain[:, :head, None] - gain[:, None, :]).abs()
                 * (discount[:, :head, None] - discount[:, None, :]).abs())
        better = (labels[:, :head, None] > labels[:, None, :]) & valid[:, :head, None] & valid[:, None, :]
        return torch.where(better, delta / idcg[:, None, None], torch.zeros_like(delta))

    def forward(self, scores: Tensor, labels: Tensor, ranks: Tensor, valid: Tensor | None = None) -> Tensor:
        scores = scores.float()
        valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
        relevant = (labels > 0) & valid
        if not bool(relevant.any()):
            return scores.sum() * 0.0
        head = int(relevant.nonzero()[:, 1].max()) + 1
        with torch.no_grad():
            w = self.weights(labels, ranks, valid, head)
            n_pairs = ((labels[:, :head, None] > labels[:, None, :]) & valid[:, :head, None]
                       & valid[:, None, :]).sum((1, 2))
        ranknet = F.softplus(scores[:, None, :] - scores[:, :head, None])  # [q, i, j]: log(1 + exp(s_j - s_i))
        per_query = (w * ranknet).sum((1, 2)) / n_pairs.clamp(min=1)
        has = n_pairs > 0
        if not bool(has.any()):
            return scores.sum() * 0.0
        return per_query[has].mean()

    def from_embeddings(self, q: Tensor, candidates: Tensor, labels: Tensor, ranks: Tensor,
                        valid: Tensor | None = None) -> Tensor:
        q, candidates = q.float(), candidates.float()
        if self.similarity == "cos":
            q, candidates = F.normalize(q, dim=-1), F.normalize(candidates, dim=-1)
        return self.forward(torch.einsum("bd,bmd->bm", q, candidates) * self.scale, labels, ranks, valid)


# ---- cross-encoders --------------------------------------------------------------------------------
class LocalizedContrastiveLoss(nn.Module):
    """Softmax cross-entropy over groups of a cross-encoder's logits, each group one positive (first)
    and its hard negatives from the retriever's top list.

    Gao, Dai, Callan (ECIR 2021), "Rethink Training of BERT Rerankers in Multi-Stage Retrieval
    Pipeline" (arXiv:2101.08751): Localized Contrastive Estimation (LCE). For a group with logits
    ``s_0`` (the positive) and ``s_1..s_m`` (its negatives):

        loss = -log( exp(s_0) / sum_j exp(s_j) )        (mean over groups)

    Only differences within a group are learnt, so unlike binary cross-entropy the logits carry no
    label prior to fall back on, and they are not probabilities. Groups may be ragged: a padded slot
    holds ``-inf`` and takes no probability.
    """

    def forward(self, logits: Tensor) -> Tensor:
        """logits: (groups, members), the positive in column 0."""
        logits = logits.float()
        return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
