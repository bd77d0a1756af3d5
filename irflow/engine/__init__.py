"""The engine: how a stage is declared (``stage``, ``params``; its outputs' table contracts are in
``irflow.data_contracts``) and run (``runner``: key, lookup, compute, validate, publish, record; ``cache``,
``row_reuse``, ``labels``, ``errors``), where results live (``store``, ``catalog``, ``catalog_decisions``,
``memdb``), where work runs (``executors``: ``local``, ``ray`` and its ``ray_cluster``;
``shards``, ``branches``, ``worker``, ``distributed``, ``processes``, ``backends``, ``java``,
``orchestration``), the run's settings (``runtime``, ``config``, ``follows``, ``models``), what registers
itself on import (``registry``) and whether a run keeps to its estimate (``pace``). It knows nothing of
retrieval."""
