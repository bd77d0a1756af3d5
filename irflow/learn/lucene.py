"""BM25 search of a Lucene index built by Anserini (the ``bm25_search`` stage's searcher); the JVM is set up by
``irflow.engine.java``."""

from __future__ import annotations

from irflow.engine.java import setup_pyserini_env


class LuceneBM25Searcher:
    """BM25 search of a Lucene index through Anserini's ``io.anserini.search.SimpleSearcher``: the Java
    object Pyserini's ``LuceneSearcher`` wraps, called as that wrapper calls it (``batch_search`` /
    ``batch_search_fields``), and so the same hits and scores (tests/test_retrieval_eval.py compares them).

    Why not ``LuceneSearcher`` itself: importing ``pyserini.search.lucene`` imports ``pyserini.encode``
    (torch, transformers, scikit-learn) for its impact and dense searchers: several times what the JVM and the
    index cost every BM25 search's fresh child process."""

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
