"""What the train stage is built from: features and their formats, losses, optimisers, checkpoints, tracking, strategies."""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data')
