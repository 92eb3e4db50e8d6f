"""Running at scale: launching ranks, sizing and dry runs, per-rank accounting, rehearsal of the GPU cards."""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'training', 'decoding', 'measurement', 'drafters', 'serving')
