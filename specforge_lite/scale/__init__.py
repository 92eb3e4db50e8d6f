"""Running at scale: launching ranks, sizing and dry runs, per-rank accounting, rehearsal of the GPU cards."""
