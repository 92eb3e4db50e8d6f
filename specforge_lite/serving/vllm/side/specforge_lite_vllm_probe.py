"""Run inside vLLM's workers (standard library and torch only): what each holds of the target.

A module of its own, on the vLLM processes' PYTHONPATH (serving.vllm_engine.runner_env), so
that `LLM.apply_model` sends `held_weights` to the workers by name.
"""


def _is_layer(name: str) -> bool:
    """accounting.is_layer_weight's rule, restated: this file runs where the package is not installed."""
    parts = name.split(".")
    return any(p == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts))


def _packed_bytes(module, param) -> int:
    """The bytes of a weight vLLM's CPU backend moved into a packed GEMM handle (the parameter
    left empty): the handle's K x N where it says, else the module's partition sizes."""
    for cell in getattr(getattr(module, "cpu_linear", None), "__closure__", None) or ():
        handle = cell.cell_contents
        if getattr(handle, "k", -1) > 0 and getattr(handle, "n", -1) > 0:
            return handle.k * handle.n * param.element_size()
    rows, cols = getattr(module, "output_size_per_partition", 0), getattr(module, "input_size_per_partition", 0)
    return rows * cols * param.element_size()


def held_weights(model) -> dict:
    """Run inside a vLLM worker: the bytes of `model`'s parameters it holds, split into
    decoder layers (`...layers.N...`) and the rest, with the worker's tensor-parallel rank;
    `packed_bytes`: the part counted from packed handles rather than parameters."""
    import torch.distributed as dist

    layer = other = packed = 0
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            size = param.numel() * param.element_size()
            if size == 0 and name == "weight":
                size = _packed_bytes(module, param)
                packed += size
            if _is_layer(f"{module_name}.{name}"):
                layer += size
            else:
                other += size
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "layer_bytes": layer, "other_bytes": other,
            "packed_bytes": packed}
