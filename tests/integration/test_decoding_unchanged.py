"""Every method's answers on the smoke recipe, token for token, as a recorded evaluate gave them
(issue 68: the decoder moved into rooms with its behaviour unchanged).

`tests/golden/decoding/smoke_answers.json` holds the answers' digests (`identity.tokens_digest`)
of two evaluates of one smoke run, greedy and sampled, recorded at the commit it names by
`python -m tests.integration.test_decoding_unchanged --record`. The target and the drafter are in
float32, where another summation order moves a logit by ulps, which flips an argmax or a draw only
at a near-tie. Hybrids are compared greedy only: which source a sampled step drafts from follows
this machine's timings, and with it the random draws that follow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_cli

GOLDEN = REPO / "tests" / "golden" / "decoding" / "smoke_answers.json"
RUN = ["+recipe=smoke", "target.dtype=float32", "eval.dataset=builtin:mt_bench", "eval.max_prompts=4",
       "eval.max_new_tokens=32", "eval.warmup=0", "eval.cost_repeats=1"]
CHAINS = ["plain", "eagle3", "ngram", "suffix", "untrained_draft"]
TREES = ["eagle3_tree", "eagle3_mixed_tree", "ngram_tree", "suffix_tree"]
PEERS = ["hf_generate", "hf_prompt_lookup", "hf_assisted"]
HYBRIDS = ["eagle3_hybrid", "eagle3_hybrid_tree"]
EVALUATES = {"greedy": ("0.0", CHAINS + TREES + HYBRIDS + PEERS), "sampled": ("0.7", CHAINS + TREES + PEERS)}


def answers(run_dir: Path) -> dict[str, dict[str, str]]:
    """{evaluate: {"prompt/turn/method": digest}} of the EVALUATES of one smoke run in `run_dir`."""
    run_cli("sample", *RUN, f"run_dir={run_dir}", check=True)
    run_cli("train", *RUN, f"run_dir={run_dir}", check=True)
    found = {}
    for name, (temperature, methods) in EVALUATES.items():
        run_cli("evaluate", *RUN, f"run_dir={run_dir}", f"eval.temperature={temperature}",
                f"eval.methods=[{','.join(methods)}]", check=True)
        rows = json.loads((run_dir / "eval" / "report.json").read_text())["answers"]
        (run_dir / "eval").rename(run_dir / f"eval_{name}")
        found[name] = {f"{r['prompt_id']}/{r['turn']}/{r['method']}": r["tokens_digest"] for r in rows}
    return found


def test_every_methods_answers_are_the_recorded_ones(tmp_path):
    recorded = json.loads(GOLDEN.read_text())
    found = answers(tmp_path)
    for name, digests in recorded["answers"].items():
        assert set(found[name]) == set(digests), name
        changed = sorted(key for key, digest in digests.items() if found[name][key] != digest)
        assert not changed, f"{name}: answers that differ from the recording at {recorded['commit']}: {changed}"


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = answers(Path(folder))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({"commit": commit, "command": "python -m tests.integration.test_decoding_unchanged "
                                  "--record", "run": RUN, "answers": result}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: {sum(len(v) for v in result.values())} answers")
