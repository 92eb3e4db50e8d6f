"""`make gpu-check`: every GPU measurement in one command (benchmarks/results/gpu_check_<gpu>.json)."""
