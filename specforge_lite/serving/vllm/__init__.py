"""vLLM in the loop: the engine on this side, its runner on vLLM's side, its report section and sampler.

Modules:
- `engine`: the vLLM process's life: start, requests, stop;
- `interpreter`: which interpreter runs vLLM, its environment and arguments;
- `load`: vLLM's methods with N requests in flight;
- `load_report`: what the report says of the load runs;
- `methods`: the `vllm_*` evaluate methods at batch 1;
- `report`: vLLM as an evaluate engine and its report section;
- `sampler`: `sample.backend=vllm`;
- `trees`: whether an installed vLLM can serve a static draft tree.
"""
