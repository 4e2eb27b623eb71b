"""Static-shape decoder runtime: checkpoints, model math, KV cache, buckets, sampling, graphs."""
