"""vLLM in the loop: the engine on this side, its runner on vLLM's side, its report section and sampler."""
