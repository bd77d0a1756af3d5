"""The user's tools around runs: export with a model card, ``irflow new``'s scaffold and the estimate,
reports and run graphs, store maintenance."""
