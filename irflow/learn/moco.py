"""MoCo for dense retrieval: a momentum key encoder and a queue of keys from earlier batches.

Izacard, Caron, Hosseini, Riedel, Bojanowski, Joulin, Grave (TMLR 2022), "Unsupervised Dense Information
Retrieval with Contrastive Learning" (Contriever, arXiv:2112.09118), after He, Fan, Wu, Xie, Girshick
(CVPR 2020), "Momentum Contrast for Unsupervised Visual Representation Learning" (arXiv:1911.05722).

The query encoder is trained. The key encoder embeds the passages (the keys) without a gradient and
follows the query encoder as an exponential moving average after every optimizer step:

    theta_k <- m * theta_k + (1 - m) * theta_q                     (m = 0.999 in the paper)

The keys of earlier batches wait in a FIFO queue (65,536 in the paper) and serve as extra negatives, so a
query is scored against many more passages than the batch holds. For query q with positive key k+:

    L = -log exp(s(q, k+)/tau) / (exp(s(q, k+)/tau) + sum_{k- in the batch's keys and the queue} exp(s(q, k-)/tau))

(tau = 0.05 in the paper; s is cos or dot). Contriever embeds queries and passages with one encoder, so the
model kept after training is the query encoder; the key encoder and the queue serve training only.

A queued key of a query's own positive passage (the same passage, reached by another query of it in an
earlier batch) is left out of that query's softmax: it is no negative. Under torchrun every process
queues the keys of the whole batch (gathered, in rank order), so the queues stay identical.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from irflow.learn.losses import _check_similarity, gather_ids, similarity_matrix


@torch.no_grad()
def momentum_update(key_encoder: nn.Module, query_encoder: nn.Module, momentum: float) -> None:
    """theta_k <- m * theta_k + (1 - m) * theta_q, parameter by parameter, in place."""
    for k, q in zip(key_encoder.parameters(), query_encoder.parameters(), strict=True):
        k.mul_(momentum).add_(q.detach().to(k.dtype), alpha=1.0 - momentum)


class KeyQueue(nn.Module):
    """A FIFO of ``size`` keys (and the passage number of each), in buffers: on the model's device and
    in its checkpoints. ``enqueue`` overwrites the oldest entries; an empty slot holds id -1."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("keys", torch.zeros(size, dim))
        self.register_buffer("ids", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))  # the next slot to write: the oldest

    @property
    def size(self) -> int:
        return self.keys.shape[0]

    @torch.no_grad()
    def enqueue(self, keys: Tensor, ids: Tensor) -> None:
        keys, ids = keys[-self.size:], ids[-self.size:]  # more keys than slots: the newest stay
        slots = (self.ptr + torch.arange(len(keys), device=self.ptr.device)) % self.size
        self.keys[slots] = keys.detach().to(self.keys.dtype)
        self.ids[slots] = ids.to(self.ids.device)
        self.ptr.copy_((self.ptr + len(keys)) % self.size)

    def contents(self) -> tuple[Tensor, Tensor]:
        """(keys, ids) of the filled slots, oldest first."""
        order = (self.ptr + torch.arange(self.size, device=self.ptr.device)) % self.size
        filled = order[self.ids[order] >= 0]
        return self.keys[filled], self.ids[filled]


class MoCoLoss(nn.Module):
    """InfoNCE of each query against the batch's keys, the hard negatives' keys and the queue.

    ``q`` (B x d) are the queries' embeddings (with a gradient); ``k`` (N x d) the keys of the batch's
    positives, query i's at ``first + i`` (N = B in one process; every process's keys, gathered, in
    several); ``n`` the keys of hard negatives, if any; ``queue`` (K x d) keys of earlier batches;
    ``queue_mask`` (B x K, True = left out) removes queued keys from a query's softmax. Scores are
    ``sim(q, key) / temperature``; keys get no gradient.
    """

    def __init__(self, similarity: str = "cos", temperature: float = 0.05):
        super().__init__()
        self.similarity = _check_similarity(similarity)
        self.temperature = float(temperature)
        self.last_candidates = 0  # keys each query was scored against at the last call (masked ones too)

    def from_embeddings(self, q: Tensor, k: Tensor, queue: Tensor | None = None, *, n: Tensor | None = None,
                        first: int = 0, queue_mask: Tensor | None = None) -> Tensor:
        keys = [k] + ([n] if n is not None else []) + ([queue] if queue is not None else [])
        candidates = torch.cat([x.detach().float() for x in keys])
        self.last_candidates = int(candidates.shape[0])
        scores = similarity_matrix(q.float(), candidates, self.similarity) / self.temperature
        if queue is not None and queue_mask is not None:
            left_out = torch.zeros_like(scores, dtype=torch.bool)
            left_out[:, candidates.shape[0] - len(queue):] = queue_mask.to(scores.device)
            scores = scores.masked_fill(left_out, float("-inf"))
        target = torch.arange(q.shape[0], device=scores.device) + first
        return F.cross_entropy(scores, target)


def _dimension(encoder: nn.Module) -> int:
    # sentence-transformers >= 5 names it get_embedding_dimension
    get = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
    return int(get())


class MoCo(nn.Module):
    """What the training loop trains: the query encoder, its momentum key encoder (a copy that takes no
    gradient) and the queue; one module, so a checkpoint holds all three and the optimizer sees the
    query encoder's parameters only. The encoder is a sentence-transformers model (or any module with
    the same call: features in, ``{"sentence_embedding": ...}`` out)."""

    def __init__(self, encoder: nn.Module, queue_size: int, momentum: float, similarity: str = "cos",
                 temperature: float = 0.05, dim: int | None = None):
        super().__init__()
        self.query_encoder = encoder
        self.key_encoder = copy.deepcopy(encoder).requires_grad_(False)
        self.queue = KeyQueue(queue_size, dim if dim is not None else _dimension(encoder))
        self.momentum = float(momentum)
        self.loss_fn = MoCoLoss(similarity, temperature)

    def momentum_update(self) -> None:
        momentum_update(self.key_encoder, self.query_encoder, self.momentum)

    def loss(self, q: Tensor, k: Tensor, ids: Tensor, n: Tensor | None = None) -> Tensor:
        """The loss of queries ``q`` with positive keys ``k`` (of passages numbered ``ids``) and hard
        negatives' keys ``n``; then the batch's positive keys join the queue (hard negatives do not)."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        ids = ids.to(q.device)
        # every process's keys and passage numbers, in rank order (an all_gather without gradient)
        all_k, all_ids = gather_ids(k.detach().float()), gather_ids(ids)
        all_n = gather_ids(n.detach().float()) if n is not None else None
        queue, queue_ids = self.queue.contents()
        own_passage = ids[:, None] == queue_ids[None, :]
        loss = self.loss_fn.from_embeddings(q, all_k, queue, n=all_n, first=rank * q.shape[0], queue_mask=own_passage)
        self.queue.enqueue(all_k, all_ids)
        return loss
