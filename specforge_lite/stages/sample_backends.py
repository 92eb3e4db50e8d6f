"""The target generating in this process, for the sample stage: each backend turns a batch of
prompts (token ids) into answers `[(token ids, finish)]`. `hf` (transformers, left-padded
batches) and `static` / `compiled` (our static-cache forward); vLLM's sampler lives with its
engine (`serving/vllm/sampler.py`) and the stage picks among them (`stages/sample.py`)."""

from __future__ import annotations

import logging
import torch

from specforge_lite import SpecforgeError
from specforge_lite.decoding.verify import SamplingParams, pick_tokens
from specforge_lite.runtime.hf_runner import cache_kwargs, layer_role
from specforge_lite.targets.loading import eos_token_ids

log = logging.getLogger(__name__)


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch: ids [B, W] and each row's first real column [B]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
    return ids, torch.tensor([width - len(p) for p in prompts])


def keep_batch_rows(cache, index: torch.Tensor) -> None:
    """Keep only the batch rows `index` of a transformers cache, every layer's state included:
    transformers' `batch_select_indices` has none for a linear-attention layer (Qwen3-Next's), and
    on a hybrid one (linear attention beside attention) would leave its recurrent state whole."""
    for layer in cache.layers:
        if layer_role(layer) == "recurrent":  # beam search's reorder: its conv and recurrent states, and a hybrid's keys
            layer.reorder_cache(index)
        else:
            layer.batch_select_indices(index)


class HFBackend:
    """Batched generation on a transformers model: left-padded prefill, then one token
    per step with a KV cache; rows that reach EOS leave the batch (their cache rows
    are dropped), so a long answer does not keep finished ones computing."""

    def __init__(self, model, tokenizer, sample_cfg):
        self.model, self.tokenizer, self.cfg = model, tokenizer, sample_cfg
        self.eos_ids = set(eos_token_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id
        self.sampling = SamplingParams(temperature=max(sample_cfg.temperature, 0.0), top_p=sample_cfg.top_p)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        from transformers import DynamicCache

        device = self.model.device
        input_ids, start = left_padded(prompts, self.pad_id)
        attention = (torch.arange(input_ids.shape[1])[None, :] >= start[:, None]).long()
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, cache)).logits[:, -1]
        next_position = attention.sum(-1, keepdim=True)
        rows = list(range(len(prompts)))  # original index of each live batch row
        generated: list[list[int]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for step in range(self.cfg.max_new_tokens):
            tokens = pick_tokens(logits, self.sampling)
            keep = []
            for j, (row, token) in enumerate(zip(rows, tokens.tolist())):
                generated[row].append(token)
                if token in self.eos_ids:
                    finish[row] = "stop"
                else:
                    keep.append(j)
            if not keep or step == self.cfg.max_new_tokens - 1:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=device)
                keep_batch_rows(cache, index)
                attention, next_position, tokens = attention[index], next_position[index], tokens[index]
                rows = [rows[j] for j in keep]
            attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=attention, position_ids=next_position,
                                use_cache=True, **cache_kwargs(self.model, cache)).logits[:, -1]
            next_position = next_position + 1
        return list(zip(generated, finish))


class StaticBackend:
    """Batched generation on our static-cache forward (`runtime/static_llama.py`), eager or
    compiled (`sample.backend=static|compiled`): the batch is always `sample.batch_size` rows
    (a short last batch repeats its first prompt in the spare rows) over a cache of
    `max_prompt_length + max_new_tokens` positions, so one graph of width 1 serves every
    decoding step, its attention spanning only the cache slots written so far
    (`StaticLlama.window`; on a CPU one package kept between runs, `runtime/graph_cache.py`);
    the prefill runs eagerly, the prompts packed into one sequence
    so no padding is computed (`StaticLlama.prefill_rows`). Finished rows keep their place (a
    fixed shape) and their tokens are dropped; the batch stops when every row has finished.
    Llama-family targets only (`static_llama.unsupported_reason`)."""

    def __init__(self, model, tokenizer, sample_cfg, compiled: bool):
        from torch.export import Dim

        from specforge_lite.runtime.static_llama import WINDOW_STEP, StaticLlama
        from specforge_lite.runtime.graph_cache import compile_kept

        self.model, self.cfg = model, sample_cfg
        self.eos_ids = set(eos_token_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.sampling = SamplingParams(temperature=max(sample_cfg.temperature, 0.0), top_p=sample_cfg.top_p)
        self.batch = sample_cfg.batch_size
        capacity = -(-(sample_cfg.max_prompt_length + sample_cfg.max_new_tokens) // 64) * 64
        try:
            self.module = StaticLlama(model, capacity, (), batch=self.batch).eval()
        except ValueError as error:
            raise SpecforgeError(f"sample.backend={sample_cfg.backend}: {error}; use sample.backend=hf") from None
        self.device = self.module.lm_head.device
        self.step = self.module
        self.compile_s, self.graph_source = None, None  # graph_source: "compiled" or "loaded"
        if compiled:
            with torch.inference_mode():
                example = (torch.zeros(self.batch, 1, dtype=torch.long, device=self.device),
                           torch.zeros(1, dtype=torch.long, device=self.device),
                           torch.zeros(self.batch, dtype=torch.long, device=self.device), False,
                           self.module.window(WINDOW_STEP))
            caches = [name for name, _ in self.module.named_buffers() if name.endswith(("k_cache", "v_cache"))]
            self.step, self.compile_s, self.graph_source = compile_kept(
                "sample-step", self.module, [example], state=caches, dynamic_args=(4,),
                dynamic_shapes=(None, None, None, None, {0: Dim("window", min=2, max=capacity)}))
            log.info("%s the target's batch-%d decoding step in %.0f s", self.graph_source, self.batch,
                     self.compile_s)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        if len(prompts) > self.batch:
            return [out for i in range(0, len(prompts), self.batch) for out in self.generate(prompts[i:i + self.batch])]
        rows = prompts + [prompts[0]] * (self.batch - len(prompts))
        ids, start = left_padded(rows, self.pad_id)
        width = ids.shape[1]
        if width + self.cfg.max_new_tokens > self.module.capacity:
            raise SpecforgeError(f"a prompt of {width} tokens does not fit the static cache of "
                                 f"{self.module.capacity} (sample.max_prompt_length + sample.max_new_tokens)")
        start = start.to(self.device)
        logits = self.module.prefill_rows(rows)
        generated: list[list[int]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        live = set(range(len(prompts)))
        for step in range(self.cfg.max_new_tokens):
            tokens = pick_tokens(logits, self.sampling)
            picked = tokens.tolist()
            for row in sorted(live):
                generated[row].append(picked[row])
                if picked[row] in self.eos_ids:
                    finish[row] = "stop"
                    live.discard(row)
            if not live or step == self.cfg.max_new_tokens - 1:
                break
            position = torch.tensor([width + step], device=self.device)
            logits = self.step(tokens[:, None], position, start, False, self.module.window(width + step + 1))[0][:, -1]
        return list(zip(generated, finish))
