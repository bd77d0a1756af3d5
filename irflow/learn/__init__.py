"""The learning code: pure functions with no refs and no stage or recipe config -- losses, training loops,
encoders and teachers, query generators, fusion and scoring, ANN indexes and the
Lucene BM25 searcher, text rules. A module may declare
the ``Params`` models of its own functions' settings (``training.LoopParams``, ``fusion.FusionSettings``, the
teachers, ``teachers.Calibration``); stages' params and recipe configs extend or hold them."""
