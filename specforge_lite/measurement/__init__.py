"""What an evaluate measures of decoding, and how its report says it (the figures of a report):
- `metrics`: tau, per-position acceptance, the confidence calibration, forward costs by width, best k;
- `stats`: bootstrap intervals of the report's ratios;
- `identity`: whether a greedy answer is plain's, and why not;
- `checks`: a compiled drafter against its eager module, plain's own rounding;
- `choices`: a method's best k and best tree;
- `recommend`: which method to deploy;
- `report`: report.md and its plots.
The decoding they measure is `specforge_lite/decoding/`; the stage that runs them, `stages/evaluate.py`.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'decoding')
