"""Running at scale: launching ranks, sizing and dry runs, per-rank accounting, rehearsal of the GPU cards.

Modules:
- `dry_run`: `train.dry_run=true`, sizing without weights;
- `launch`: a stage started as one process starts its own ranks;
- `rank_side`: a rank's side of a launched stage: it lives and dies with its command;
- `rehearse`: a GPU recipe's card, command by command, on CPU ranks;
- `rendezvous`: where the ranks meet, chosen or checked at the door;
- `sizing`: per-device memory of every stage at the door.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'training', 'decoding', 'measurement', 'drafters', 'serving')
