"""Content keys: the sampled weight digest against a full hash of the same file (time, bytes read).

    python -m benchmarks.training.bench_digest [--rounds 5]

Reads the embedded SmolLM2-135M-Instruct safetensors file, warm in the page cache, with
`targets.digest`'s sampled scheme (the safetensors header, three chunks per tensor, fixed chunks
over the file) and with a blake2b over every byte, alternating, and records the median of each.
The sampled reads grow with the number of tensors, not with the file's size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path

from benchmarks.common import machine, run, timed, update_doc_section, write_results
from specforge_lite.targets import digest
from specforge_lite.targets.loading import resolve_target_path

COMMAND = "python -m benchmarks.training.bench_digest"


def full_hash(path: Path) -> str:
    whole = hashlib.blake2b(digest_size=16)
    with path.open("rb") as fh:
        while block := fh.read(8 << 20):
            whole.update(block)
    return whole.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    folder = Path(resolve_target_path("builtin:smollm2-135m-instruct"))
    path = max(digest.weight_files(folder), key=lambda p: p.stat().st_size)
    size = path.stat().st_size
    with path.open("rb") as fh:
        header, spans = digest._spans(path, size, fh)
    sampled_bytes = 8 + len(header) + sum(end - begin for begin, end in spans)
    full_hash(path)  # warm the page cache once for both
    sampled_s, full_s = [], []
    for _ in range(args.rounds):
        sampled_s.append(timed(lambda: digest._compute(path, size, digest.WHOLE_BYTES))[1])
        full_s.append(timed(lambda: full_hash(path))[1])
    result = {"command": f"{COMMAND} --rounds {args.rounds}", "machine": machine(), "file_bytes": size,
              "tensors": len([name for name in json.loads(header) if name != "__metadata__"]), "sampled_bytes_read": sampled_bytes,
              "sampled_s": statistics.median(sampled_s), "full_hash_s": statistics.median(full_s),
              "rounds": args.rounds, "page_cache": "warm"}
    write_results("digest", result)
    update_doc_section("digest", f"""## Content keys: sampled weight digest against a full hash

Command: `{result['command']}` ({result['machine']}; the file warm in the page cache).

| file | size | read by the sampled digest | sampled digest | full blake2b | ratio |
|---|---:|---:|---:|---:|---:|
| SmolLM2-135M-Instruct `{path.name}` | {size / 2**20:.0f} MiB | {sampled_bytes / 2**20:.1f} MiB | {result['sampled_s']:.3f} s | {result['full_hash_s']:.2f} s | {result['full_hash_s'] / result['sampled_s']:.1f}x |

The sampled digest reads the header, up to three {digest.CHUNK // 1024} KiB chunks per tensor and
{digest.FILE_CHUNKS} chunks spread over the file, so its reads grow with the tensor count, not the
file's size; each file version's digest is kept and read back on later runs (`targets/digest.py`).
""")
    print(f"sampled {result['sampled_s']:.3f} s ({sampled_bytes / 2**20:.1f} MiB read), "
          f"full {result['full_hash_s']:.2f} s ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    run(main)
