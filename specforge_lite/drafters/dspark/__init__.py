"""DSpark: DFlash's block drafter with a Markov head, which biases each block row's logits by
the token drafted before it, and a confidence head, which predicts each drafted token's
acceptance (speculators `models/dspark`, vLLM `qwen3_dspark.py`, `method: "dspark"`).

The drafter contract (`specforge_lite.contract.DrafterModule`), DFlash's where DSpark adds
nothing: `options` (typed config: DFlash's and the heads'), `model` (the heads and the
training forward), `train` (build, save / load, memory; the loss is DFlash's, which adds the
confidence loss), `decode` (the engine drafter: rows read out in order through the Markov
head), `export` (speculators' dspark format), `interop` (our train folder, speculators', SpecForge's).
"""

from __future__ import annotations

from specforge_lite.contract import DrySize
from specforge_lite.drafters.dflash import sized
from specforge_lite.drafters.dflash.train import batch_preparer, loss_and_metrics, target_layers, trained_weights
from specforge_lite.drafters.dspark.decode import DSparkDecodeDrafter
from specforge_lite.drafters.dspark.export import export
from specforge_lite.drafters.dspark.interop import layout
from specforge_lite.drafters.dspark.interop import load_any as load
from specforge_lite.drafters.dspark.model import DSparkConfig, DSparkDrafter
from specforge_lite.drafters.dspark.options import DSparkOptions as Options
from specforge_lite.drafters.dspark.train import activation_bytes, build, describe, save

NAME = "dspark"
UNTRACKED_OPTIONS: tuple[str, ...] = ()
SERVING_NOTE = ("vLLM 0.32 serves DSpark (method dspark, Markov head vanilla) on its GPU model runner only; "
                "its CPU runner has no DSpark proposer (export README)")
VLLM_SERVING = ("dspark", "speculators")  # vLLM speculative method, export subfolder
# where vLLM runs it (serving/vllm/methods.gpu_runner_problem): v1/worker/gpu_model_runner.py, which the CPU
# runner extends, builds no DSpark proposer; the GPU model runner (v1/worker/gpu/) does
VLLM_NEEDS_GPU = "vLLM 0.32 runs DSpark on its GPU model runner only (its CPU runner has no DSpark proposer)"
LLAMACPP_SERVING = ("llama.cpp has no DSpark drafter (its speculative types: draft-simple, draft-eagle3, "
                    "draft-dflash, n-gram ones); its DFlash graph would drop the Markov and confidence heads")
READS_LAST_HIDDEN = False  # trains on aux layers and the teacher's logits, as DFlash
DRAFTS_TREES = True  # its decoder has propose_tree (children from the law after their parent): dspark_tree, ...


def decoder(drafter: DSparkDrafter) -> DSparkDecodeDrafter:
    return DSparkDecodeDrafter(drafter)


def dry_size(cfg, target_config, batch: int, seq: int) -> DrySize:
    """DFlash's dry size of the DSpark module, its heads in the count and in the activations."""
    def heads(c: DSparkConfig) -> tuple[dict, str]:
        facts = {"sample_from_anchor": c.sample_from_anchor, "markov_rank": c.markov_rank,
                 "markov_head_type": c.markov_head_type, "confidence_head": c.confidence_head}
        return facts, f", {c.markov_head_type} Markov head rank {c.markov_rank}, " \
                      f"{'a' if c.confidence_head else 'no'} confidence head"

    return sized(cfg, target_config, batch, seq, (DSparkConfig, DSparkDrafter), activation_bytes, "DSpark", heads)


__all__ = ["NAME", "Options", "UNTRACKED_OPTIONS", "SERVING_NOTE", "VLLM_SERVING", "LLAMACPP_SERVING",
           "READS_LAST_HIDDEN", "build", "target_layers", "batch_preparer", "loss_and_metrics", "trained_weights",
           "describe", "save", "load", "layout", "decoder", "export", "dry_size"]
