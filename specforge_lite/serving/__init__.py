"""Serving engines in the loop, one folder each: real vLLM (`vllm/`) and llama.cpp (`llamacpp/`).

Each engine sits behind the same small interface (`engines.Engine`): which evaluation methods
it runs, running them on the prompts, its report section and its failures. Nothing here
imports vLLM into the process that runs the stages: `vllm/side/vllm_runner.py` is a
standalone script run by the interpreter that has vLLM, and `vllm/engine.py` talks to it in
JSON lines. In `vllm/`: `interpreter` (which interpreter runs vLLM), `engine` (running it), `methods` (the vllm_* methods at
batch 1), `load` and `load_report` (at load: concurrency, k by batch size, the schedule),
`report` (the report's section), `sampler` (the sample backend), `trees` (what vLLM's trees need).
Modules:
- `engines`: the serving engines the evaluate stage measures, behind one interface;
- `llamacpp/`: llama.cpp in the loop;
- `vllm/`: vLLM in the loop.
"""

# the packages this one may import besides the ground (tests/unit/test_package_structure.py)
MAY_IMPORT = ('config', 'targets', 'runtime', 'data', 'training', 'decoding', 'measurement', 'drafters')
