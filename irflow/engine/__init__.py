"""The engine: how a stage is declared (``stage``, ``params``, ``data_contracts``) and run (``runner``: key,
lookup, compute, validate, publish, record), where results live (``store``, ``catalog``), where work runs
(``executors``, ``shards``, ``branches``, ``worker``, ``ray_cluster``, ``distributed``) and the run's settings
(``runtime``, ``config``, ``follows``, ``models``). It knows nothing of retrieval."""
