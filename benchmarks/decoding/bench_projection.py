"""Projected EAGLE-3 speedups for real target shapes: measured forward and drafter costs, stated acceptance.

    python -m benchmarks.decoding.bench_projection [--small] [--device cuda] [--dtype bfloat16]
                                                   [--context 512] [--repeats 3] [--engine static]

Randomly initialised targets of real shapes (Llama-3.1-8B; one tensor-parallel rank of
Llama-3.1-70B) and their EAGLE-3 drafter: the target forward over 1..8 new tokens and the
drafter's step measured on the device, fed to the report's cost model with the demo's measured
acceptance and a stated one (`specforge_lite/records/projection.py` says how; `make gpu-check`
runs the same measurement as its `projection` step). Real shapes need a GPU; `--small` runs a
tiny shape anywhere. Writes benchmarks/results/projection_<device>.json and its section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

from benchmarks.common import fail, run, update_doc_section, write_results
from specforge_lite.records.projection import SHAPES, SMALL, markdown, project


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny shape instead of the real ones")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="static", choices=("hf", "static", "compiled", "auto"))
    args = parser.parse_args(argv)
    if not args.small and not args.device.startswith("cuda"):
        fail("real shapes (8B, a 70B rank) need a GPU; use --small on this machine")
    payload = project(SMALL if args.small else SHAPES, args.device, args.dtype, args.context, args.repeats,
                      args.engine)
    command = "python -m benchmarks.decoding.bench_projection" + (" --small" if args.small else "")
    name = f"projection_{args.device.split(':')[0]}" + ("_small" if args.small else "")
    write_results(name, {"command": command, **payload})
    update_doc_section(name, markdown(payload, command))


if __name__ == "__main__":
    run(main)
