"""Config keys that moved or were renamed when configs became typed: a config that still uses one is told where
it went (``RecipeConfig.renamed_keys``, read by ``irflow.engine.config.format_errors``). A key maps to its hint, or
to {section: hint} with "" for any other section (None: no hint there)."""

DEPTH = "renamed: depth (how many passages per query a ranking holds)"
PER_LINE = "renamed: negatives_per_line (hard negatives on each training line)"
RENAMED_KEYS = {
    "bf16_autocast": "precision is a runtime setting now: runtime.precision: auto | bf16-native | fp32 | bf16 | fp16 "
                     "(auto uses bf16 only where the hardware has it)",
    "top_k": {"bm25": DEPTH, "dense": DEPTH, "hybrid": DEPTH, "mine": "renamed: depth (how deep each miner's list is mined)",
              "generate": "renamed: sample_top_k (T5 sampling)",
              "": "renamed: depth (retrieval, fusion, mining), sample_top_k (T5 sampling)"},
    "hits": DEPTH,
    "neg_rank_range": "renamed: rank_range",
    "negatives_per_query": {"dual_encoder": PER_LINE, "student": PER_LINE, "warmup": PER_LINE,
                            "": "renamed: negatives_per_positive"},
    "num_negatives": "renamed: negatives_per_miner (per query and miner)",
    "num_random": "renamed: negatives_per_query",
    "mined_per_query": "renamed: negatives_per_query (sampled per query from the model's top depth)",
    "negatives_depth": "renamed: depth (M_C's negatives come from M_D0's top depth)",
    "depth": {"teacher": "renamed: input_depth (read only each input ranking's top n)",
              "denoise": "renamed: input_depth (read only each input ranking's top n)", "": None},
    "device": "device is a runtime setting: runtime.device (per kind of work: encode, score, generate, train)",
}
