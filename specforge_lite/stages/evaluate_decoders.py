"""Which decoder each evaluate method runs: the trained drafters read from their folders
(`trained_drafters`, `trained_dir`), the engine's own and model-free proposers, the hybrids and
trees over them, the Hugging Face peers, and the target forward they all verify on
(`build_decoders`). The measurement protocol that runs them is `evaluate.py`; the report built
from their answers, `evaluate_entries.py`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from specforge_lite import SpecforgeError
from specforge_lite.run_folders import samples_dir
from specforge_lite.data.samples import answer_corpus
from specforge_lite.decoding.drafters import BUILTIN, DraftModelDrafter
from specforge_lite.targets.surgery import load_untrained_draft
from specforge_lite.decoding.engine import generate_plain, generate_speculative, tree_decoding
from specforge_lite.decoding.hybrid import HybridDrafter
from specforge_lite.decoding.suffix import lookup_factory
from specforge_lite.runtime.compiled_run import prepare_compiled
from specforge_lite.runtime.target_choice import TargetForward, build_target_engine
from specforge_lite.measurement.choices import drafted_k
from specforge_lite.decoding.peers import generate_hf, prepare_assistant
from specforge_lite.decoding.verify import SamplingParams
from specforge_lite.config.draft_tokens import draft_tokens, widest_k
from specforge_lite.drafters.methods import (ARCTIC_SUFFIX, HF_METHODS, PLAIN, SUFFIX, chain_methods, drafter_folder,
                                           hybrid_of, labelled_drafters, tree_base)
from specforge_lite.drafters.registry import DRAFTERS, detect_drafter, say_what_the_trained_folder_decides

log = logging.getLogger(__name__)


def trained_drafters(cfg: DictConfig, methods: list[str], model) -> dict[str, tuple[str, torch.nn.Module]]:
    """name -> (drafter kind, module loaded as saved) of each trained drafter the methods draft with:
    a registered drafter's `trained_dir`, or a folder under the user's label (its kind detected)."""
    labelled, found = labelled_drafters(cfg.eval), {}
    for name in chain_methods(methods):
        if name in DRAFTERS:
            found[name] = (name, trained_dir(cfg, name))
        elif name in labelled and name not in BUILTIN:
            kind, layout = detect_drafter(labelled[name])
            log.info("%s: %s drafter in %s (%s layout)", name, kind, labelled[name], layout)
            found[name] = (kind, Path(labelled[name]))
    return {name: (kind, DRAFTERS[kind].load(folder, model)) for name, (kind, folder) in found.items()}


def build_decoders(cfg: DictConfig, methods: list[str], model, tokenizer, eos_ids: list[int],
                   sampling: SamplingParams, capacity: int = 0, trained: dict | None = None
                   ) -> tuple[dict, dict, TargetForward]:
    """name -> decode(prompt_ids, max_new_tokens, seed) -> Generation, our drafters, and the
    target forward they decode with (`eval.engine`; `capacity`: positions its cache holds;
    `trained`: `trained_drafters`, loaded here when not given; each drafts in the target's dtype)."""
    ecfg = cfg.eval
    trained = trained_drafters(cfg, methods, model) if trained is None else trained
    device = model.device
    drafters, assistant = {}, None

    def gen_for(seed):
        return torch.Generator(device=device).manual_seed(seed)

    def shared_assistant():
        nonlocal assistant
        if assistant is None:
            assistant = load_untrained_draft(ecfg, model)
            prepare_assistant(assistant, draft_tokens(ecfg, "hf_assisted"))
        return assistant

    scfg, lookup = ecfg.suffix, None
    if {SUFFIX, ARCTIC_SUFFIX} & set(chain_methods(methods)) or any(map(hybrid_of, methods)):  # answers, once
        lookup = lookup_factory(scfg, scfg.samples and answer_corpus(samples_dir(cfg), cfg.target.path,
                                                                     scfg.max_corpus_tokens))
    for name in chain_methods(methods):  # every drafter first (a tree method's too): the engine serves their layers
        if name in (SUFFIX, ARCTIC_SUFFIX):
            drafters[name] = lookup(name)
        elif name in BUILTIN or name in trained:
            if name == "untrained_draft":  # the same LM as hf_assisted's assistant
                drafter = DraftModelDrafter(shared_assistant())
            elif name in BUILTIN:
                drafter = BUILTIN[name](cfg, model)
            else:  # in the dtype the target decodes in (docs/ENGINES.md, "Checks that keep a report honest")
                kind, module = trained[name]
                drafter = DRAFTERS[kind].decoder(module.to(model.dtype))
            drafters[name] = drafter
    for drafter in drafters.values():  # a confidence head's drafter: which confidence its drafts carry
        if hasattr(drafter, "confidence_source"):
            drafter.confidence_source = ecfg.get("draft_confidence", "head")
    layers = sorted({layer for d in drafters.values() for layer in d.hidden_state_layers})
    trees = ecfg.get("tree") and any(tree_base(name) for name in methods)
    target = build_target_engine(model, ecfg.engine, capacity or model.config.max_position_embeddings,
                                 layers, widest_k(ecfg) + 1, tree_width=ecfg.tree.nodes + 1 if trees else 0)
    # the drafters' forwards through the same mechanism; each verify width on the faster target forward
    prepare_compiled(target, drafters, lambda name, drafter: drafted_k(ecfg, name, drafter),
                     range(1, max(widest_k(ecfg) + 1, ecfg.cost_widths, ecfg.tree.nodes + 1 if trees else 0) + 1),
                     (ecfg.tree.depth, ecfg.tree.branch) if trees else None)
    plain_runner = target.runner()
    decoders = {PLAIN: lambda ids, n, seed: generate_plain(model, ids, n, sampling, eos_ids, gen_for(seed),
                                                             plain_runner)}
    for name in methods:
        if hybrid := hybrid_of(name):  # its drafter shared with the chain method; its own lookup and times
            drafters[name] = HybridDrafter(drafters[hybrid], lookup())
        if tree_base(name):  # eval.tree's trees from its chain method's drafter (mixed: n-gram's match beside)
            drafter = drafters[name] if hybrid else drafters[tree_base(name)[0]]
            decoders[name] = tree_decoding(model, drafter, tree_base(name)[1], cfg, sampling, eos_ids, gen_for, target)
        elif name in drafters:
            def decode(ids, n, seed, drafter=drafters[name], runner=target.runner(drafters[name].hidden_state_layers),
                       k=drafted_k(ecfg, name, drafters[name])):
                return generate_speculative(model, drafter, ids, n, k, sampling, eos_ids, gen_for(seed), runner)
            decoders[name] = decode
        elif name in HF_METHODS:
            extra = {}
            if name == "hf_prompt_lookup":
                extra = {"prompt_lookup_num_tokens": draft_tokens(ecfg, name), "max_matching_ngram_size": ecfg.ngram_max}
            elif name == "hf_assisted":
                extra = {"assistant_model": shared_assistant()}

            def decode(ids, n, seed, extra=extra):
                torch.manual_seed(seed)  # HF samples from the global generator
                return generate_hf(model, ids, n, sampling, eos_ids, tokenizer.pad_token_id, **extra)
            decoders[name] = decode
    return decoders, drafters, target


def trained_dir(cfg: DictConfig, name: str) -> Path:
    """Where trained drafter `name` is read: eval.drafter_dirs[name] (our train folder or any
    layout the drafter reads: speculators, SGLang, vLLM Medusa, an HF model), else
    run_dir/train/drafter; the folder must hold a drafter of that kind."""
    path = drafter_folder(cfg, name)
    if not path.exists():
        raise SpecforgeError(f"eval method {name} needs a trained {name} drafter in {path}; run the train stage "
                             f"of a {name} recipe first, or set eval.drafter_dirs.{name}")
    found, layout = detect_drafter(path)
    log.info("%s: %s (%s layout)", name, path, layout)
    say_what_the_trained_folder_decides(path, layout, cfg)
    if found != name:
        raise SpecforgeError(f"eval method {name}: {path} holds a {found} drafter, not {name}; "
                             f"set eval.drafter_dirs.{name} to a {name} drafter")
    return path
