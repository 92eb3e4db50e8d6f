"""Training: step and stage throughput, options, learning curves, feature formats, scale-out and sizing."""
