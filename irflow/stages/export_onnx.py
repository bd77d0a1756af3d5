"""Export a model to ONNX (optionally int8-quantised): a stored model dataset, made once per source model.

Not called by recipes: the stage runner calls it for a stage that runs a model on ONNX Runtime
(``runtime.backend: onnx``, or its ``quantization: int8``; ``irflow.engine.runner._onnx_models``), just
before that stage computes. Its key is (source model id, task, opset, quantization), so the export is
made once and reused by every stage and run after; its lineage goes back to the source model
(``irflow lineage onnx_model-...``). What the export holds and how it runs: ``irflow.learn.onnx_inference``.
"""

from __future__ import annotations

from pydantic import Field

from irflow.engine.params import Params
from irflow.engine.runtime import StageRuntime
from irflow.engine.stage import ONNX_EXPORT, Output, stage
from irflow.engine.store import DatasetRef
from irflow.learn import onnx_inference
from irflow.learn.backend_probe import time_backends


class ExportParams(Params):
    task: onnx_inference.Task = Field(description="embed: a sentence-transformers bi-encoder (the transformer's "
                                                  "token embeddings; pooling and normalisation applied after); "
                                                  "score: a sequence-classification cross-encoder (its logits)")
    quantization: onnx_inference.Quantization = Field("none", description="none: fp32, exact; int8: dynamic "
                                                                          "quantisation (per-channel int8 weights)")
    opset: int = Field(onnx_inference.OPSET, description="ONNX opset of the exported graph")


@stage("export_onnx", version="2", outputs=Output("onnx_model", kind="model", check=onnx_inference.check_export))
def export_onnx(p: ExportParams, rt: StageRuntime, *, model: DatasetRef):
    """``model`` exported with torch.onnx (and quantised), checked against torch on a sample batch."""
    return onnx_inference.export(model.path, rt.workdir / "onnx", p.task, p.quantization, p.opset)


# what the runner calls before an onnx= stage, and times the backends with under runtime.backend auto
ONNX_EXPORT.update(stage=export_onnx, params=ExportParams, probe=time_backends)
