"""Where and how stages run: device, precision, threads, JVM heap. Never part of a cache key.

The same params on the same inputs are the same result, whether computed on a laptop CPU or a GPU:
runtime settings decide speed, not what is computed (floating-point noise aside), so they are kept
out of cache keys and recorded per stage run instead (``irflow lineage`` shows them).

Kinds of work, each with its own device and precision (a scalar applies to all):

- ``encode``: corpus and query encoding with bi-encoders
- ``score``: pseudo-labelling: cross-encoder scoring (and the student's own margins for ``scale: auto``)
- ``generate``: query generation (T5)
- ``train``: bi-encoder and cross-encoder training

Precision ``auto`` follows the hardware: training uses bf16 autocast where the device computes bf16
natively (a CUDA GPU that supports it; a CPU with AVX-512 BF16 or AMX), fp32 elsewhere; inference
uses fp32 (its outputs -- embeddings, scores -- are what other stages and the metrics read).
``bf16-native`` is bf16 where the device computes it natively and fp32 elsewhere, for any kind of work
(the offline RocketQA configs score with it: a cross-encoder scores faster in bf16 where it is native). A forced ``bf16`` that is slow on this machine is honoured with a warning: on an AVX2-only CPU
bf16 is emulated, and a MiniLM training step or a cross-encoder's scoring runs many times slower than in
fp32 (docs/concepts/runtime.md gives the measurements).

``backend`` (torch | onnx) is how inference runs: ``onnx`` runs the stages that encode or score with
a model (encoding, dense search, the cross-encoder teachers, rerank) on ONNX Runtime, on the CPU, with
the model exported once into the store (``irflow.learn.onnx_inference``). It is exact (fp32, allclose to
torch), so it is runtime, never keyed; int8 is not exact and is a keyed param (``quantization``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveInt, create_model, field_validator, model_validator

from irflow.engine.params import Params

log = logging.getLogger("irflow.engine.runtime")

WORK_KINDS = ("encode", "score", "generate", "train")
Work = Literal["encode", "score", "generate", "train"]
Precision = Literal["auto", "bf16-native", "fp32", "bf16", "fp16"]
Backend = Literal["torch", "onnx", "auto"]
INFERENCE_WORK = ("encode", "score")  # the kinds of work runtime.backend applies to
_DEVICE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu)(:\d+)?)$")


def _check_device(v: str | None) -> str | None:
    if v is not None and not _DEVICE.match(v):
        raise ValueError(f"'{v}' is not a device (auto, cpu, cuda, cuda:N, mps)")
    return v


class DeviceMap(Params):
    default: str = Field("auto", description="device for every kind of work not named below: auto (a CUDA GPU "
                                             "if there is one, else cpu), cpu, cuda, cuda:N, mps")
    encode: str | None = Field(None, description="device for bi-encoder encoding (null: default)")
    score: str | None = Field(None, description="device for cross-encoder scoring (null: default)")
    generate: str | None = Field(None, description="device for query generation (null: default)")
    train: str | None = Field(None, description="device for training (null: default)")

    @field_validator("*")
    @classmethod
    def _device(cls, v):
        return _check_device(v)

    def for_work(self, work: str) -> str:
        return getattr(self, work, None) or self.default


class PrecisionMap(Params):
    default: Precision = Field("auto", description="precision for every kind of work not named below: auto "
                                                   "(training: bf16 where the hardware has it natively, else "
                                                   "fp32; inference: fp32), bf16-native (bf16 where the hardware "
                                                   "has it natively, else fp32; any work), fp32, bf16, fp16")
    encode: Precision | None = Field(None, description="precision of bi-encoder encoding (null: default)")
    score: Precision | None = Field(None, description="precision of cross-encoder scoring (null: default)")
    generate: Precision | None = Field(None, description="precision of query generation (null: default)")
    train: Precision | None = Field(None, description="autocast precision of training (null: default)")

    def for_work(self, work: str) -> str:
        return getattr(self, work, None) or self.default


class RuntimeFields(Params):
    """The ``runtime:`` section of a config; on the command line ``--set runtime.device=cuda`` (or
    ``runtime.precision=...``, ``runtime.threads=...``): the CLI has no flags of its own for them. An executor's
    own settings are a section of it too (``runtime.ray``): ``RuntimeConfig`` is these fields and those."""

    device: DeviceMap = Field(DeviceMap(), description="device per kind of work; a string sets all of them")
    precision: PrecisionMap = Field(PrecisionMap(), description="precision per kind of work; a string sets all")
    threads: int | None = Field(None, ge=1, description="CPU threads for torch, faiss and Lucene (null: every "
                                                        "CPU this process may use)")
    backend: Backend = Field("torch", description="how encoding and cross-encoder scoring run (corpus and query "
                                                  "encoding, dense search, the cross-encoder teachers, rerank): "
                                                  "torch; onnx: ONNX Runtime on the CPU, fp32, the model "
                                                  "exported once into the store (export_onnx); or auto: whichever "
                                                  "a short probe finds faster for each model on this hardware, "
                                                  "remembered in the store (irflow.learn.backend_probe; neither is "
                                                  "faster on every CPU: docs/how-to/onnx.md has the measured ratio "
                                                  "per kind of CPU). Exact either way (allclose), so never "
                                                  "keyed; int8 is each stage's keyed `quantization`")
    train_processes: int = Field(1, ge=1, description="processes (torchrun; one per GPU on CUDA) that share "
                                                      "each training step: every batch is split between them "
                                                      "and their gradients averaged, so the result is that of "
                                                      "one process; batch sizes must be divisible by it")
    jvm_heap: str = Field("2g", pattern=r"^\d+[kmgKMG]?$",
                          description="maximum heap of the JVM that runs Lucene (BM25), e.g. 2g; the JVM "
                                      "shares the process with torch, and its own default is a quarter of RAM")
    recompute_activations: bool | Literal["auto"] = Field(
        "auto", description="training keeps only each transformer layer's input and recomputes the layer in the "
                            "backward pass (activation checkpointing): the same weights, bit for bit, with the "
                            "activation memory of one layer instead of all of them, for more compute (docs/bench/memory.md "
                            "measures what a MiniLM step costs on 2 CPU cores). auto: on only when a step's activations "
                            "(estimated from the batch, the sequence length and the model's size) would take "
                            "more than half the memory available to the device, said in the log; true / false: "
                            "always / never")

    executor: str = Field("local", description="local: stages and their shards run in this process, one after "
                                               "another; ray: shards run as Prefect tasks on Ray workers, and "
                                               "independent stages at once (runtime.ray); or an executor "
                                               "registered with irflow.engine.executors.register (its "
                                               "settings: runtime.<its name>)")
    shard_rows: PositiveInt = Field(100_000, description="rows of a sharded stage's input per shard (corpus "
                                                         "passages, queries or pairs): the unit of parallel work, "
                                                         "of memory, and of resuming a killed run")
    reuse_rows: bool = Field(True, description="map stages (corpus encoding, query generation) reuse the rows an "
                                               "earlier run computed for unchanged passages and compute only new "
                                               "or edited ones (irflow.engine.row_reuse; the result is the same either "
                                               "way); false: compute every row")

    @model_validator(mode="after")
    def _onnx_on_cpu(self):
        if self.backend == "onnx":
            gpu = sorted({d for w in INFERENCE_WORK for d in [self.device.for_work(w)] if d not in ("auto", "cpu")})
            if gpu:
                # Not silently moved: the user asked for that device. onnxruntime here is the CPU build.
                raise ValueError(f"backend onnx runs on the CPU (onnxruntime's CPU provider), but runtime.device "
                                 f"puts encoding or scoring on {', '.join(gpu)}; use runtime.backend torch there, "
                                 f"or runtime.device.encode/score cpu (or auto)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _scalars(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            for k in ("device", "precision"):
                if isinstance(data.get(k), str):
                    data[k] = {"default": data[k]}
        return data

    def cpu_threads(self) -> int:
        return self.threads or available_cpus()


def _runtime_config() -> type[RuntimeFields]:
    """``RuntimeFields`` and a section per executor that has settings (``Executor.settings``), named after it:
    an executor's settings live in its own module, and a config is checked against every executor's."""
    from irflow.engine.executors import settings_models

    sections = {name: (model, Field(model(), description=(model.__doc__ or "").strip()))
                for name, model in settings_models(set(RuntimeFields.model_fields)).items()}
    return create_model("RuntimeConfig", __base__=RuntimeFields, __module__=__name__, __doc__=RuntimeFields.__doc__,
                        **sections)


RuntimeConfig = _runtime_config()


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---- hardware -------------------------------------------------------------------------------
def _cpuinfo(field: str) -> str | None:
    """The first value of a field of /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo("flags") or "").split())


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX: where bf16 matmuls run in hardware (else they are emulated, and slow)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_device(spec: str) -> str:
    if spec != "auto":
        return spec
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def native_bf16(device: str) -> bool:
    kind = device.split(":")[0]
    if kind == "cuda":
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve_precision(spec: str, work: str, device: str) -> str:
    if spec == "auto":
        return "bf16" if work == "train" and native_bf16(device) else "fp32"
    if spec == "bf16-native":
        return "bf16" if native_bf16(device) else "fp32"
    return spec


def precision_warning(precision: str, work: str, device: str) -> str | None:
    """Why a forced precision is a bad idea here, or None."""
    kind = device.split(":")[0]
    if precision == "bf16" and kind == "cpu" and not cpu_has_native_bf16():
        return (f"runtime.precision: bf16 for {work} on a CPU without native bf16 (no avx512_bf16/amx_bf16 "
                f"flag): it is emulated there, and a MiniLM training step runs many times slower than in fp32 "
                f"(docs/concepts/runtime.md gives the measurement); precision 'auto' or 'bf16-native' picks fp32 here")
    if precision == "fp16" and kind == "cpu":
        return f"runtime.precision: fp16 for {work} on the CPU: CPUs have no fast fp16 path; use fp32 or auto"
    if precision == "bf16" and kind == "cuda" and not native_bf16(device):
        return f"runtime.precision: bf16 for {work}, but this GPU has no native bf16; use fp16, fp32 or auto"
    return None


def check_devices(rt: RuntimeConfig) -> None:
    """Raise ValueError if a device the config names cannot be used here (before any work)."""
    wanted = {rt.device.for_work(w) for w in WORK_KINDS} - {"auto", "cpu", "meta"}
    if not wanted:
        return
    import torch

    for d in sorted(wanted):
        kind = d.split(":")[0]
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"runtime.device: '{d}', but torch sees no CUDA device here "
                                 f"(torch {torch.__version__}); use auto or cpu")
            index = int(d.split(":")[1]) if ":" in d else 0
            if index >= torch.cuda.device_count():
                raise ValueError(f"runtime.device: '{d}', but there are {torch.cuda.device_count()} CUDA device(s)")
        elif kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"runtime.device: '{d}', but MPS is not available here")


# ---- what a stage gets ----------------------------------------------------------------------
@dataclass(frozen=True)
class StageRuntime:
    """Runtime of one stage computation: resolved device and precision for the stage's kind of work,
    threads, JVM heap, and its working directories. Tests build one directly: ``StageRuntime()``."""

    device: str = "cpu"
    precision: str = "fp32"
    threads: int = 2
    jvm_heap: str = "2g"
    recompute_activations: bool | str = "auto"  # RuntimeConfig.recompute_activations (auto: by need)
    workdir: Path | None = None  # scratch, removed after the stage
    resume_dir: Path | None = None  # survives a crash; checkpoints and shards of this cache key
    work: str | None = None
    train_processes: int = 1  # RuntimeConfig.train_processes
    backend: str = "torch"  # RuntimeConfig.backend (encode and score work; else torch)
    # source model path -> its exported ONNX model's directory, for the models this stage runs on ONNX
    # Runtime (backend onnx, or quantization int8): exported by the stage runner before it computes
    # (irflow.engine.runner, the export_onnx stage), so that stage code only asks ``onnx_model(model)``.
    onnx_models: dict = field(default_factory=dict)

    def onnx_model(self, model) -> str | None:
        """The exported ONNX model to run instead of ``model`` (a DatasetRef or a path), or None: torch."""
        return self.onnx_models.get(getattr(model, "path", model))

    def autocast(self):
        """torch autocast for this stage's precision (a no-op context for fp32)."""
        import torch

        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=torch.device(self.device).type, dtype=dtype)

    def provenance(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("workdir", "resume_dir", "onnx_models")}
        if self.onnx_models:  # which exported models ran: their store ids (the directory's name)
            d["onnx_models"] = {src: Path(dst).name for src, dst in self.onnx_models.items()}
        d.update(host_info(self.device))
        return d


def stage_runtime(rt: RuntimeConfig, work: str | None, workdir: Path | None = None,
                  resume_dir: Path | None = None, *, onnx_capable: bool = False,
                  onnx_models: dict[str, str] | None = None) -> StageRuntime:
    """``onnx_capable``: the stage can run its models on ONNX Runtime (``stage(onnx=...)``); the others
    run torch whatever ``backend`` says (the trainers; the student's margins in pseudo_label).
    ``onnx_models``: the exported models it runs instead of the sources (``StageRuntime.onnx_model``)."""
    backend = rt.backend if onnx_capable and work in INFERENCE_WORK else "torch"
    if backend == "auto":  # the runner's probe decided (irflow.learn.backend_probe): the models it exported say which
        backend = "onnx" if onnx_models else "torch"
    if work is None:
        device, precision = "cpu", "fp32"
    elif backend == "onnx":
        device, precision = "cpu", "fp32"  # ONNX Runtime's CPU provider, exact (the config refuses a GPU)
    else:
        device = resolve_device(rt.device.for_work(work))
        precision = resolve_precision(rt.precision.for_work(work), work, device)
    return StageRuntime(device=device, precision=precision, threads=rt.cpu_threads(), jvm_heap=rt.jvm_heap,
                        recompute_activations=rt.recompute_activations, workdir=workdir, resume_dir=resume_dir,
                        work=work, train_processes=rt.train_processes, backend=backend,
                        onnx_models=dict(onnx_models or {}))


def resolved_plan(rt: RuntimeConfig) -> dict[str, dict]:
    """{work kind: {device, precision, warning}}: what `auto` picks on this machine (for the run's log)."""
    out = {}
    for w in WORK_KINDS:
        device = resolve_device(rt.device.for_work(w))
        precision = resolve_precision(rt.precision.for_work(w), w, device)
        out[w] = {"device": device, "precision": precision, "warning": precision_warning(precision, w, device)}
    return out


_VERSIONED = ("torch", "transformers", "sentence-transformers", "onnxruntime", "pyserini", "faiss-cpu", "duckdb",
              "pyarrow", "prefect", "irflow")


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes, this one's threads among them); None where
    the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the whole machine since boot (``/proc/stat``'s first line; busy: all but idle and
    iowait); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_between(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    """Cores kept busy between two ``cpu_ticks`` samples: the busy share of the ticks, times the cores."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return round(cores * busy / total, 2) if total > 0 else 0.0


def others_busy(window: float = 0.5) -> float | None:
    """Cores other processes keep busy now, sampled over ``window`` seconds while this one waits: what the
    cores a run is about to use are doing. Unlike the load average (a one-minute mean), a run that has just
    ended does not count. Falls back to the load average where there is no /proc/stat."""
    import time

    before = cpu_ticks()
    if before is None:
        return load_average()
    time.sleep(window)
    return busy_between(before, cpu_ticks(), os.cpu_count() or 1)


@functools.lru_cache(maxsize=8)
def host_info(device: str) -> dict:
    info = {"cpu": cpu_model(), "cpu_native_bf16": cpu_has_native_bf16(), "versions": library_versions()}
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(torch.device(device))
            info["cuda"] = torch.version.cuda
    return info
