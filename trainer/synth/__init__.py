"""Generated targets and data for tests, demos and benchmarks: a tiny trained-from-nothing Qwen3
(``tiny``) and random-weight targets of real shapes (``synthetic``)."""
