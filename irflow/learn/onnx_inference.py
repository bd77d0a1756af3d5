"""Inference with ONNX Runtime on the CPU: export, int8 quantisation, and running exported models.

On a CPU, encoding a corpus and scoring (query, passage) pairs with a cross-encoder are most of a
run's time. ONNX Runtime runs the same fp32 transformer faster than eager torch, and its dynamic int8
quantisation (``onnxruntime.quantization.quantize_dynamic``: int8 weights, activations quantised per
call) uses the CPU's integer dot products (AVX-512 VNNI here) for the matmuls.

Why not sentence-transformers' ``backend="onnx"``: it exports through optimum-onnx, which pins
transformers < 4.58 and does not install beside our transformers 5.x. So the export is done here with
``torch.onnx.export`` (the dynamo exporter, torch's maintained one; packages onnx and onnxscript) and
covers the Hugging Face transformer only:

- a bi-encoder (sentence-transformers format): the transformer's token embeddings
  (``last_hidden_state``); the model's own Pooling (cls / mean / max / mean_sqrt_len_tokens) and, if the
  model has one, its Normalize module are then applied here, in numpy, as its sentence-transformers
  modules declare (read from the loaded model at export time and written to ``irflow_onnx.json``).
  A model with other modules (a Dense projection, a custom module) is refused: its ONNX embeddings
  would not be the model's;
- a cross-encoder (a sequence-classification checkpoint): the logits; ``irflow.learn.scoring.relevance``
  turns them into a score as for torch.

Inputs are those of the tokenizer that the model's forward takes (input_ids, attention_mask, and
token_type_ids for BERT), with dynamic batch and sequence axes. The export checks itself: the ONNX
model's output on a sample batch must be allclose to torch's (``EXPORT_ATOL``), or nothing is stored.

An exported model is a stored model dataset (the ``export_onnx`` stage, ``irflow/stages/export_onnx.py``):
keyed on the source model's id, the opset and the quantisation, so it is exported once and reused by
every later stage and run, with its lineage (``irflow lineage``) going back to the source model. A
stage that runs with ``runtime.backend: onnx`` (exact, fp32) or with ``quantization: int8`` gets the
exported model's directory through its runtime (``StageRuntime.onnx_model``), and ``encode_texts`` /
``cross_encoder_scores`` take the ONNX path.

Batch invariance (why int8 runs one text per call): irflow needs a text's embedding or a pair's score
not to depend on the other texts of its batch (shards must assemble to the same bytes as a whole
run; ``irflow.learn.encoding``). fp32 ONNX keeps this as torch does, with every batch of a length bucket
padded to one shape. Dynamic quantisation does not: the activations' int8 scale is computed over the
whole input tensor of each matmul, i.e. over the batch (and its padding) -- one text's hidden states
move when it is encoded alone rather than in a batch (docs/how-to/onnx.md says by how much). So an int8
model is run one text (one pair) per call, unpadded: its scale is then that text's own. Such calls are
small (one text's tokens), too small to split over threads inside ONNX Runtime: an int8 model's session
computes on one thread, and the stage's ``threads`` callers share it, each running its own texts (ONNX
Runtime's ``run`` is thread-safe and releases the GIL). On 2 cores with MiniLM, callers of a 1-thread session
encode about twice as fast as one text per call on a 2-thread session, and both beat torch fp32 in
batches (docs/bench/onnx.md gives the seconds).

Attention is exported in its eager form (``attn_implementation="eager"``: matmul, softmax, matmul)
rather than torch's fused scaled-dot-product op, whose exported decomposition ONNX Runtime ran slower
(docs/bench/onnx.md).

Quantisation is per channel (one weight scale per output column): per tensor, a MiniLM embedding's
cosine to its fp32 embedding was clearly lower than per channel (docs/bench/onnx.md gives both).
"""

from __future__ import annotations

import inspect
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from irflow.engine.errors import UserError

log = logging.getLogger("irflow.onnx")

#: The ONNX opset of exports: torch 2.13's dynamo exporter emits it natively (a lower one goes
#: through onnx's version converter). Part of the export's cache key.
OPSET = 20
#: What an export must reproduce of torch's output on a sample batch (fp32; the int8 model is lossy
#: by design and checked only for shape).
EXPORT_ATOL = 1e-4
META_FILE = "irflow_onnx.json"
MODEL_FILE = "model.onnx"
FP32_FILE = "model.fp32.onnx"  # int8: the fp32 graph it is quantised from (removed after)

Task = Literal["embed", "score"]
Quantization = Literal["none", "int8"]
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens")


class _Drop(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes`` (noise that says nothing here)."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


# torch's exporter notes every torchvision op it cannot register (no torchvision here, none needed);
# the quantiser suggests its optional pre-processing (shape inference, graph optimisation before
# quantising), skipped here: the MatMuls, most of the time, are quantised without it (int8's encoding rate:
# bench/results/inference.json).
logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(_Drop("torchvision is not installed"))
logging.getLogger().addFilter(_Drop("Please consider to run pre-processing before quantization"))
# The exporter's graph passes log each step at INFO ("Removed 21 unused nodes", constant folding skipped
# for graph inputs): a run's log is not the place.
for _name in ("onnx_ir", "onnxscript"):
    logging.getLogger(_name).setLevel(logging.WARNING)


class OnnxUnsupported(UserError, ValueError):
    """A model this backend cannot run as the model itself would (a module it does not implement)."""


# ---- export ------------------------------------------------------------------------------------
def _st_layout(st) -> dict:
    """What the sentence-transformers modules after the transformer do: pooling mode and normalisation.
    Anything else is refused (its embeddings would not be the model's)."""
    mods = list(st)
    names = [type(m).__name__ for m in mods]
    if not names or names[0] != "Transformer":
        raise OnnxUnsupported(f"runtime.backend onnx: the model's first module is {names[:1]}, not a Transformer")
    pooling, normalize = None, False
    for m, name in zip(mods[1:], names[1:]):
        if name == "Pooling" and pooling is None:
            pooling = _pooling_mode(m)
        elif name == "Normalize" and not normalize:
            normalize = True
        else:
            raise OnnxUnsupported(f"runtime.backend onnx: module {name} of this sentence-transformers model is not "
                                  f"supported (only Transformer, Pooling, Normalize); use runtime.backend torch")
    if pooling is None:
        raise OnnxUnsupported("runtime.backend onnx: the sentence-transformers model has no Pooling module")
    return {"pooling": pooling, "normalize": normalize}


def _pooling_mode(m) -> str:
    mode = getattr(m, "pooling_mode", None)  # sentence-transformers >= 6: one string
    if mode is None:  # older: one flag per mode
        on = [k for k in POOLING_MODES if getattr(m, f"pooling_mode_{k}_token", False)
              or getattr(m, f"pooling_mode_{k}_tokens", False)]
        mode = on[0] if len(on) == 1 else on
    if mode == "mean_tokens":
        mode = "mean"
    if mode not in POOLING_MODES:
        raise OnnxUnsupported(f"runtime.backend onnx: pooling mode {mode!r} is not supported "
                              f"({', '.join(POOLING_MODES)})")
    return mode


def _input_names(tokenizer, model) -> list[str]:
    """The tokenizer's outputs that the model's forward takes, in a fixed order."""
    takes = set(inspect.signature(model.forward).parameters)
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in takes and
             n in (getattr(tokenizer, "model_input_names", None) or ["input_ids", "attention_mask"])]
    if names[:2] != ["input_ids", "attention_mask"]:
        raise OnnxUnsupported(f"runtime.backend onnx: the model takes {names}, not input_ids and attention_mask")
    return names


def _sample(tokenizer, names: list[str], pairs: bool):
    # Batch 2 and 24 tokens: torch.export specialises dimensions of size 0 or 1, so the example must
    # not have them; the axes are then exported as dynamic.
    q = ["what is the capital of france", "protein folding in cells"]
    d = ["Paris is the capital and largest city of France.", "Chaperones help proteins fold."]
    enc = tokenizer(q, d, padding="max_length", max_length=24, truncation=True, return_tensors="pt") if pairs \
        else tokenizer(d, padding="max_length", max_length=24, truncation=True, return_tensors="pt")
    return tuple(enc[n] for n in names)


def export(source: str, out_dir: str | Path, task: Task, quantization: Quantization = "none", opset: int = OPSET,
           max_seq_length: int | None = None) -> Path:
    """Export the model at ``source`` into ``out_dir``: ``model.onnx``, the tokenizer, and
    ``irflow_onnx.json`` (what running it needs: task, inputs, pooling, normalisation, max length).
    ``task`` embed: a sentence-transformers bi-encoder; score: a sequence-classification cross-encoder."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict = {"task": task, "opset": opset, "quantization": quantization, "exporter": "torch.onnx dynamo",
                  "torch": torch.__version__}
    if task == "embed":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(source, device="cpu")
        meta.update(_st_layout(st))
        model, tok = st[0].auto_model, st[0].tokenizer
        meta["max_seq_length"] = int(max_seq_length or st.max_seq_length)
        meta["do_lower_case"] = bool(getattr(st[0], "do_lower_case", False))
        output = "token_embeddings"
    else:
        from irflow.learn.cross_encoders import load_cross_encoder

        tok, model = load_cross_encoder(source, "cpu")
        meta["num_labels"] = int(model.config.num_labels)
        output = "logits"
    model = model.float().eval()
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation("eager")  # see the module doc: ONNX Runtime runs it faster (same numbers)
    meta["attention"] = getattr(model.config, "_attn_implementation", None)
    names = _input_names(tok, model)
    meta["inputs"] = names

    class Wrapped(torch.nn.Module):  # the inputs by name (as torch.export wants them); one output tensor
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
            o = self.inner(**{n: given[n] for n in names})
            return o.last_hidden_state if task == "embed" else o.logits

    wrapped = Wrapped(model).eval()
    sample = _sample(tok, names, pairs=task == "score")
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
    fp32 = out / (MODEL_FILE if quantization == "none" else FP32_FILE)
    with torch.inference_mode():
        expected = wrapped(*sample).float().numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracing notes
        torch.onnx.export(wrapped, sample, str(fp32), input_names=names, output_names=[output], opset_version=opset,
                          dynamo=True, dynamic_shapes={n: {0: batch, 1: seq} for n in names}, verbose=False)
    feeds = {n: t.numpy().astype(np.int64) for n, t in zip(names, sample)}
    got = _session(str(fp32), 1).run(None, feeds)[0]
    if got.shape != expected.shape or not np.allclose(got, expected, atol=EXPORT_ATOL, rtol=1e-4):
        raise RuntimeError(f"ONNX export of {source}: output differs from torch's by up to "
                           f"{float(np.abs(got - expected).max()):.2e} (> {EXPORT_ATOL}); not stored")
    meta["export_max_abs_diff"] = float(np.abs(got - expected).max())
    if task == "embed":
        meta["embedding_dim"] = int(expected.shape[-1])  # pooling keeps the hidden size
    if quantization == "int8":
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # The quantiser re-runs onnx shape inference, which refused the dynamo exporter's own shape
        # annotations of a 1-logit head ("Inferred shape and existing shape differ in dimension 0: (32)
        # vs (1)"); they are hints only, so they are dropped and inferred again.
        graph = onnx.load(str(fp32))
        del graph.graph.value_info[:]
        onnx.save(graph, str(fp32), save_as_external_data=True, location=fp32.name + ".data")
        # Per-channel int8 weights (see the module doc); reduce_range stays off: it only avoids int16
        # saturation on CPUs without VNNI, at a cost in accuracy.
        quantize_dynamic(str(fp32), str(out / MODEL_FILE), weight_type=QuantType.QInt8, per_channel=True)
        for f in out.glob(FP32_FILE + "*"):  # the fp32 graph and its external weights: not needed
            f.unlink()
    tok.save_pretrained(str(out))
    (out / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return out


def check_export(path: Path) -> None:
    """An exported model directory holds the graph and its metadata (a stage output check)."""
    for f in (MODEL_FILE, META_FILE):
        if not (Path(path) / f).is_file():
            raise ValueError(f"ONNX export {path}: {f} is missing")


# ---- running -----------------------------------------------------------------------------------
def _session(path: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads)  # the stage runtime's threads, as torch gets
    so.inter_op_num_threads = 1
    # Idle threads sleep instead of spinning: on a machine shared with other work (2 cores, load ~7
    # here) spinning threads burn the cores the other thread needs (MiniLM, 64 x 256 tokens: 8.0 CPU-s
    # with spinning, 7.0 without; wall 9.8 s vs 6.9 s).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def pool(token_embeddings: np.ndarray, attention_mask: np.ndarray, mode: str) -> np.ndarray:
    """Sentence embeddings from token embeddings, as sentence-transformers' Pooling computes them."""
    if mode == "cls":
        return token_embeddings[:, 0]
    mask = attention_mask[..., None].astype(token_embeddings.dtype)
    if mode == "max":
        return np.where(mask > 0, token_embeddings, np.float32(-1e9)).max(axis=1)
    summed = (token_embeddings * mask).sum(axis=1)
    count = np.maximum(mask.sum(axis=1), 1e-9)
    return summed / (np.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    # torch.nn.functional.normalize: x / max(||x||, 1e-12)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _row_wise(meta: dict) -> bool:
    """int8: one text per call, unpadded (see the module doc: batch invariance)."""
    return meta.get("quantization") == "int8"


@dataclass
class OnnxModel:
    """An exported model loaded into an ONNX Runtime session (``load``)."""

    path: str
    meta: dict
    session: object
    tokenizer: object

    callers: int = 1  # row-wise models: threads calling the (one-thread) session at once

    @property
    def row_wise(self) -> bool:
        return _row_wise(self.meta)

    def run(self, enc) -> np.ndarray:
        feeds = {n: np.asarray(enc[n], dtype=np.int64) for n in self.meta["inputs"]}
        return self.session.run(None, feeds)[0]

    def run_rows(self, items: list, one) -> np.ndarray:
        """``one(item)`` (a model call on that item alone) for each item, on ``callers`` threads; in order."""
        if self.callers <= 1 or len(items) <= 1:
            return np.concatenate([one(x) for x in items])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.callers, thread_name_prefix="irflow-onnx") as pool:
            return np.concatenate(list(pool.map(one, items)))


class OnnxBiEncoder(OnnxModel):
    """Stands in for a SentenceTransformer in ``irflow.learn.encoding.encode_texts``."""

    max_seq_length: int

    def get_sentence_embedding_dimension(self) -> int:
        return int(self.meta["embedding_dim"])

    def embed(self, texts: list[str], padded: int, normalize: bool) -> np.ndarray:
        """Embeddings of ``texts``, each batch padded to ``padded`` tokens (int8: each text alone)."""
        if self.meta.get("do_lower_case"):
            texts = [t.lower() for t in texts]
        if self.row_wise:
            return self._finish(self.run_rows(texts, lambda t: self._pooled(
                self.tokenizer([t], truncation=True, max_length=self.max_seq_length, return_tensors="np"))), normalize)
        enc = self.tokenizer(texts, padding="max_length", max_length=padded, truncation=True, return_tensors="np")
        return self._finish(self._pooled(enc), normalize)

    def _pooled(self, enc) -> np.ndarray:
        return pool(self.run(enc), np.asarray(enc["attention_mask"]), self.meta["pooling"])

    def _finish(self, emb: np.ndarray, normalize: bool) -> np.ndarray:
        # The model's Normalize module, or the stage's cos similarity (normalising twice is a no-op).
        return l2_normalize(emb) if (normalize or self.meta["normalize"]) else emb


class OnnxCrossEncoder(OnnxModel):
    """Stands in for a sequence-classification model in ``irflow.learn.scoring.cross_encoder_scores``."""

    def logits(self, pairs: list[tuple[str, str]], padded: int) -> np.ndarray:
        if self.row_wise:  # unpadded; `padded` is at least the pair's length (it only truncates at max_length)
            return self.run_rows(pairs, lambda qd: self.run(self.tokenizer(
                [qd[0]], [qd[1]], truncation="longest_first", max_length=padded, return_tensors="np")))
        enc = self.tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding="max_length",
                             truncation="longest_first", max_length=padded, return_tensors="np")
        return self.run(enc)


def cpu_has_int8_dot() -> bool:
    """VNNI (AVX-512 or AVX) or AMX int8: where int8 matmuls run on integer dot-product instructions."""
    from irflow.engine.runtime import cpu_flags

    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


def load(path: str, threads: int, max_seq_length: int | None = None) -> OnnxBiEncoder | OnnxCrossEncoder:
    """The exported model at ``path`` (an ``export`` directory) in a session with ``threads`` threads."""
    from transformers import AutoTokenizer

    meta = json.loads((Path(path) / META_FILE).read_text())
    if meta.get("quantization") == "int8" and not cpu_has_int8_dot():
        # The model is the same everywhere (it is keyed and stored); how exact it runs follows the CPU.
        # Without VNNI int8 still encodes faster than torch fp32 (docs/how-to/onnx.md), but the saturation
        # is real: embeddings and a tiny test cross-encoder's scores are measurably further from fp32 than
        # with VNNI (docs/how-to/onnx.md gives the figures; tests/test_onnx.py asserts > 0.9 with VNNI).
        log.warning("quantization int8 on a CPU without VNNI or AMX int8 (no avx512_vnni / avx_vnni / amx_int8 "
                    "flag): ONNX Runtime's u8s8 int8 products saturate there, so int8 embeddings and scores are "
                    "less exact than on a CPU with them (still faster than fp32: docs/how-to/onnx.md); quantization none is exact")
    cls = OnnxBiEncoder if meta["task"] == "embed" else OnnxCrossEncoder
    row_wise = _row_wise(meta)  # one text per call: `threads` callers of a 1-thread session
    model = cls(path, meta, _session(str(Path(path) / MODEL_FILE), 1 if row_wise else threads),
                AutoTokenizer.from_pretrained(path))
    model.callers = max(1, int(threads)) if row_wise else 1
    if isinstance(model, OnnxBiEncoder):
        model.max_seq_length = int(max_seq_length or meta["max_seq_length"])
    return model
