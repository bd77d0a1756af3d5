"""The learning code: pure functions with no refs and no config -- losses, training loops, encoders and
teachers, query generators, fusion and scoring, ANN indexes, text rules."""
