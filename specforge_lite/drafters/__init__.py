"""Trainable drafters, one folder each with the same files:

- `options.py`: the typed options of `conf/drafter/NAME.yaml`;
- `model.py`: the `nn.Module` (and its config);
- `train.py`: build for a target, batch preparation, loss and metrics, save and load;
- `decode.py`: the engine's `Drafter` for it;
- `export.py`: the serving format(s) and their strict reload;
- `__init__.py`: the contract (`specforge_lite.contract.DrafterModule`) plus its dry-run size.

`specforge_lite.drafters.registry.DRAFTERS` lists them; `common.py` and `vocab.py` hold what several share.
Modules:
- `common`: what several drafters share (soft labels, the chained loss, saved-weights selection);
- `dflash/`, `dspark/`, `distilled/`, `eagle3/`, `medusa/`, `peagle/`: one drafter each;
- `eagle_family`: what EAGLE-3 and P-EAGLE share (layers, rules, config blocks);
- `methods`: the catalogue of evaluation methods and the one check of a method list;
- `registry`: the one list of trainable drafters;
- `vocab`: EAGLE-3's reduced draft vocabulary and its maps.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'training', 'decoding', 'measurement')
