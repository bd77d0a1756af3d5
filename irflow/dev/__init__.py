"""For irflow's developers: the reference docs generator and the test helpers (tiny models, slices)."""
