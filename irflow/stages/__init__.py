"""The stages: one module each, thin (a params model and a function of params, runtime and input refs)."""
# The ONNX export registers itself with the runner (irflow.engine.stage.ONNX_EXPORT, read by irflow.engine.runner): any stage module's import
# brings it, so a stage declared with onnx= always finds it.
from irflow.stages import export_onnx  # noqa: E402,F401
