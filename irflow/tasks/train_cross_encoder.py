"""Fine-tune a cross-encoder (a BERT-style model with one relevance logit) on labelled pairs.

Training pairs: every positive of the ``split`` qrels (score > 0) with label 1, and for each
positive ``negatives_per_positive`` negatives with label 0 -- sampled (seeded) from the query's mined
negatives when the ``negatives`` input is given, else random corpus passages; a judged positive of
the query is never a negative. Loss: binary cross-entropy on the logit (as sentence-transformers'
CrossEncoder trains with one label). The loop, checkpoints and resume are train_student's.

The base checkpoint may be a plain encoder (e.g. MiniLM's BERT weights): a fresh 1-logit head is
initialised (seeded). The result is saved with ``save_pretrained`` (model + tokenizer), so
``AutoModelForSequenceClassification.from_pretrained(path)`` loads it and the ``pseudo_label``
stage's cross-encoder teacher can use it. (Measured caveat: on SciFact-sized data a fresh head from
MiniLM weights is not a useful teacher; see the offline-adaptation notes.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from irflow.stage import Output, stage
from irflow.tasks.pseudo_label import doc_texts, query_texts, sample_negatives
from irflow.tasks.train_student import BatchPlan, base_model_path, seed_everything, train_loop

log = logging.getLogger("irflow.train")


def _check_cross_encoder(path: Path) -> None:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise RuntimeError(f"{path}: no config.json (not a Hugging Face model)")
    config = json.loads(cfg_file.read_text())
    if len(config.get("id2label") or {"0": "LABEL_0"}) != 1:
        raise RuntimeError(f"{path}: a cross-encoder must have exactly one output logit")


def training_pairs(qrels: pa.Table, corpus_ids: list[str], cfg: dict, negatives: pa.Table | None = None) -> dict:
    """{q, d, label}: positives of the split (score > 0) and their sampled negatives."""
    split = cfg.get("split", "train")
    k = int(cfg.get("negatives_per_positive", 4))
    seed = int(cfg.get("seed", 42))
    good = qrels.filter(pc.greater(qrels.column("score"), 0))
    judged: dict[str, set] = {}
    for q, d in zip(good.column("query_id").to_pylist(), good.column("doc_id").to_pylist()):
        judged.setdefault(q, set()).add(d)
    pos = good.filter(pc.equal(good.column("split"), split))
    if pos.num_rows == 0:
        raise ValueError(f"train_cross_encoder: no positive qrels in split '{split}'")
    pairs = sorted(set(zip(pos.column("query_id").to_pylist(), pos.column("doc_id").to_pylist())))
    pools: dict[str, set] = {}
    if negatives is not None:
        for q, d in zip(negatives.column("query_id").to_pylist(), negatives.column("doc_id").to_pylist()):
            pools.setdefault(q, set()).add(d)
    ex = {"q": [], "d": [], "label": []}
    short = 0
    for q, p in pairs:
        ex["q"].append(q), ex["d"].append(p), ex["label"].append(1.0)
        if negatives is not None:
            pool = [d for d in pools.get(q, ()) if d not in judged[q] and d != q]
        else:
            # Draw a few more than needed from the whole corpus, then drop judged positives.
            pool = [d for d in sample_negatives(corpus_ids, k + len(judged[q]) + 1, seed, "random", q, p)
                    if d not in judged[q] and d != q]
        negs = sample_negatives(pool, k, seed, q, p)
        short += len(negs) < k
        for d in negs:
            ex["q"].append(q), ex["d"].append(d), ex["label"].append(0.0)
    if short:
        log.warning("train_cross_encoder: %d positive(s) got fewer than %d negatives", short, k)
    return ex


@stage("train_cross_encoder", version="1", outputs=Output("cross_encoder", kind="model", check=_check_cross_encoder))
def train_cross_encoder(queries, corpus, qrels, cfg: dict, workdir: Path, resume_dir: Path, negatives=None,
                        base_model=None) -> Path:
    """Inputs: queries, corpus, qrels, negatives (optional), base_model (optional; else cfg model).

    cfg: {model, model_key, _model_path, split (train), negatives_per_positive (4), batch_size (16),
          max_length (256), lr (2e-5), warmup_steps (100), steps | epochs (1), seed (42),
          checkpoint_every (500), bf16_autocast (false), max_grad_norm (1.0), _device (cpu)}
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    seed = int(cfg.get("seed", 42))
    device = cfg.get("_device", "cpu")
    corpus_t = corpus.table()
    ex = training_pairs(qrels.table(), corpus_t.column("doc_id").to_pylist(), cfg,
                        negatives.table() if negatives is not None else None)
    qtext = query_texts(queries.table(), set(ex["q"]))
    dtext = doc_texts(corpus_t, set(ex["d"]))
    keep = [i for i in range(len(ex["q"])) if ex["q"][i] in qtext and ex["d"][i] in dtext]
    ex = {k: [v[i] for i in keep] for k, v in ex.items()}
    if not ex["q"]:
        raise ValueError("train_cross_encoder: no training pairs")

    path = base_model_path(cfg, base_model)
    seed_everything(seed)  # the fresh head's initialisation
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, ignore_mismatched_sizes=True)
    model.to(device)
    max_length = int(cfg.get("max_length", 256))
    bce = torch.nn.BCEWithLogitsLoss()
    labels = torch.tensor(ex["label"], dtype=torch.float32)

    def compute_loss(idx: list[int]):
        enc = tok([qtext[ex["q"][i]] for i in idx], [dtext[ex["d"][i]] for i in idx], padding=True,
                  truncation="longest_first", max_length=max_length, return_tensors="pt").to(device)
        logits = model(**enc).logits.view(-1).float()
        return bce(logits, labels[idx].to(device))

    plan = BatchPlan(len(ex["q"]), int(cfg.get("batch_size", 16)), seed)
    log.info("train_cross_encoder: %d pairs (%d positive), %d steps", len(ex["q"]), int(sum(ex["label"])),
             plan.total_steps(cfg))
    history = train_loop(model, compute_loss, plan, {"warmup_steps": 100, **cfg}, resume_dir, "train_cross_encoder")
    out = Path(workdir) / "cross_encoder"
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "irflow_training.json").write_text(json.dumps(
        {"pairs": len(ex["q"]), "positives": int(sum(ex["label"])), "steps": len(history), "history": history},
        indent=1))
    return out
