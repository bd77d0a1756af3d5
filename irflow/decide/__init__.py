"""What to ship: which model a run selects (``selection``) and whether an alias moves (``promotion``), by
paired tests over the evaluation's units (``stats``)."""
