"""Where documents come from: BEIR datasets (``beir``) and a user's own files (``corpus_sources``)."""
