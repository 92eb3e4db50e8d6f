"""Results and the docs made from them, and the GPU check that records one machine's run.

`results` writes and reads benchmarks/results/NAME.json (with the machine and the commit that
measured it); `topics` keeps docs/BENCHMARKS.md's sections in topic order; `docs` writes the
recipe cards' results blocks, README's results at a glance and every guide's contents from the
results files (`python -m specforge_lite docs`); `gpu_check` runs the GPU checks on a CUDA
machine and records them (`python -m specforge_lite gpu-check`), `gpu_section` renders them.
`goals` checks a run against the issues' goals of benchmarks/goals.yaml, `runs` reads what a
record needs from run folders, `timing` times what is compared; `projection` and `draft_loop`
are measurements the GPU check and the benchmark scripts share.

The top of the package order: it may import any module of specforge_lite, and only the command
line (`__main__`) imports it; the scripts under benchmarks/ use it to measure, write and read.
Modules:
- `docs`: the docs made from results files (cards' blocks, README, BENCHMARKS.md, contents);
- `draft_loop`: the decode loop outside the target forward, per method;
- `families`: the family x stage x engine table;
- `goals`: the issues' goals a record checks;
- `gpu_check`: `make gpu-check`: the GPU tests and measurements in one command;
- `gpu_section`: docs/BENCHMARKS.md's section of each GPU check;
- `projection`: projected EAGLE-3 speedups for real target shapes;
- `results`: results files written and read, and the one formatter of a value with its interval;
- `runs`: what a record reads from run folders;
- `timing`: wall-clock timing for benchmarks, modes interleaved round by round;
- `topics`: docs/BENCHMARKS.md's sections in topic order.
"""
