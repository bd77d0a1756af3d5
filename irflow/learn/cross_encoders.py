"""Cross-encoder checkpoints: what counts as one, and loading it (scoring, training and the ONNX export
all read them through here)."""

from __future__ import annotations

from irflow.engine.errors import UserError


class NotACrossEncoder(UserError, ValueError):
    """A model given as a cross-encoder is not one (a bi-encoder, a plain encoder, a 3-class head)."""


def check_cross_encoder(path: str) -> None:
    """Refuse what would silently load as a cross-encoder with a random head: a sentence-transformers
    bi-encoder, a plain encoder checkpoint, or a head with other than 1 or 2 labels."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_dir():
        return  # a hub id: checked when loaded
    if (p / "modules.json").exists():
        raise NotACrossEncoder(f"{path} is a sentence-transformers bi-encoder, not a cross-encoder (it has "
                               "modules.json); give a sequence-classification checkpoint, or train one with "
                               "train_cross_encoder")
    cfg_file = p / "config.json"
    if not cfg_file.exists():
        raise NotACrossEncoder(f"{path}: no config.json (not a Hugging Face model)")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise NotACrossEncoder(f"{path}: architectures {archs} has no *ForSequenceClassification head; a "
                               "plain encoder would be scored through a random head")
    labels = len(cfg.get("id2label") or {"0": "LABEL_0"})
    if labels not in (1, 2):
        raise NotACrossEncoder(f"{path}: a cross-encoder has 1 logit or 2 labels; this head has {labels}")


def load_cross_encoder(path: str, device: str = "cpu"):
    """(tokenizer, model) of a 1-logit or 2-label cross-encoder, on ``device``, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    check_cross_encoder(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
    if model.config.num_labels not in (1, 2):
        raise NotACrossEncoder(f"cross-encoder {path}: expected one output logit or two labels, the model has "
                               f"{model.config.num_labels} labels")
    return tok, model
