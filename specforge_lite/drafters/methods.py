"""The catalogue of evaluation methods: every name `eval.methods` accepts, the family it
belongs to, and the one check of a method list (`method_problems`, run at the door by
`validate`; the evaluate stage then only orders them with `run_order`).

Families: `plain` (our decoding loop without drafts, the baseline of every ratio); our
engine's own drafters (`ENGINE_DRAFTERS`, built by `decoding.drafters.BUILTIN`); the trained
drafters of the registry; Hugging Face's decoders (`HF_METHODS`); the same decoders served by
real vLLM (`VLLM_METHODS`, `vllm_<ours>`); llama.cpp itself on the target's GGUF
(`LLAMACPP_METHODS`: plain, its own n-gram drafter, the GGUFs of our drafters it runs;
`make llamacpp`, checked at the door by `llamacpp.checks`); and `eval.extra_drafters` labels.
"""

from __future__ import annotations

from specforge_lite import SpecforgeError
from specforge_lite.drafters.registry import DRAFTERS, RENAMED, given_on_command_line
from specforge_lite.config.draft_tokens import method_k, widest_k
from specforge_lite.config.schema import MAX_DRAFTS
from specforge_lite.decoding.arctic import ARCTIC_SUFFIX, missing_problem  # Arctic Inference's suffix decoding

PLAIN = "plain"
ENGINE_DRAFTERS = ("ngram", "untrained_draft")
SUFFIX = "suffix"  # suffix decoding over the request and the target's samples (decoding/suffix.py)
HF_METHODS = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


def served_drafters() -> dict[str, tuple]:
    """Trained drafter name -> (vLLM speculative method, its export subfolder[, extra keys]),
    for every registered drafter that declares `VLLM_SERVING`."""
    return {name: module.VLLM_SERVING for name, module in DRAFTERS.items() if module.VLLM_SERVING}


def gguf_drafters() -> dict[str, tuple[str, str]]:
    """Trained drafter name -> (llama.cpp speculative type, its draft GGUF's file name), for
    every registered drafter whose `LLAMACPP_SERVING` says llama.cpp runs it."""
    return {name: module.LLAMACPP_SERVING for name, module in DRAFTERS.items()
            if isinstance(module.LLAMACPP_SERVING, tuple)}


# vllm_<our method>: the same decoder served by real vLLM
VLLM_OF = {"vllm_plain": PLAIN, "vllm_ngram": "ngram", "vllm_untrained_draft": "untrained_draft",
           **{f"vllm_{name}": name for name in served_drafters()}}
VLLM_METHODS = tuple(VLLM_OF)
# llamacpp_<method>: llama.cpp (xllamacpp, in-process) plain, its own ngram-simple drafter (not
# our ngram), and each drafter it runs from its GGUF export
LLAMACPP_METHODS = ("llamacpp_plain", "llamacpp_ngram", *(f"llamacpp_{name}" for name in gguf_drafters()))


# <drafter>_hybrid: each step drafts from suffix lookup or the trained drafter, whichever pays
# (decoding/hybrid.py)
HYBRID = "_hybrid"

# tree methods (`eval.tree`'s shape): <method>_tree for each method that can branch, and
# <drafter>_mixed_tree, the drafter's tree with n-gram lookup's match beside it
TREE, MIXED_TREE = "_tree", "_mixed_tree"


def branching() -> tuple[str, ...]:
    """The chain methods that can draft trees: n-gram lookup, suffix decoding and each drafter
    whose module sets DRAFTS_TREES (its decoder has `propose_tree`)."""
    return ("ngram", SUFFIX, *(name for name, module in DRAFTERS.items() if getattr(module, "DRAFTS_TREES", False)))


def tree_methods() -> list[str]:
    """<method>_tree for each branching method; <drafter>_mixed_tree and <drafter>_hybrid_tree (the
    hybrid's choice per step, its drafter option a tree: decoding/hybrid.py) for the trained ones."""
    trained = [m for m in branching() if m not in ("ngram", SUFFIX)]
    return [f"{m}{TREE}" for m in branching()] + [f"{m}{MIXED_TREE}" for m in trained] + \
        [f"{m}{HYBRID}{TREE}" for m in trained]


def tree_base(method: str) -> tuple[str, bool] | None:
    """(the chain method a tree method grows from, whether n-gram's match joins its tree), or None."""
    for suffix, mixed in ((MIXED_TREE, True), (TREE, False)):
        if method.endswith(suffix):
            return method[:-len(suffix)], mixed
    return None




def hybrid_methods() -> list[str]:
    return [f"{name}{HYBRID}" for name in DRAFTERS]


def hybrid_base(method: str) -> str | None:
    """The trained drafter a hybrid method drafts with beside suffix lookup, or None."""
    return method[:-len(HYBRID)] if method in hybrid_methods() else None


def hybrid_of(method: str) -> str | None:
    """The trained drafter of a hybrid method, chain (`<drafter>_hybrid`) or tree (`_hybrid_tree`)."""
    return hybrid_base((tree_base(method) or (method,))[0])


def chain_methods(methods) -> list[str]:
    """`methods` with each tree or hybrid method replaced by the chain method it grows from (whose
    drafter it drafts with)."""
    chains = ((tree_base(m) or (m,))[0] for m in methods)
    return list(dict.fromkeys(hybrid_base(m) or m for m in chains))


def tree_problems(eval_cfg, target_config=None) -> list[str]:
    """`eval.tree` against the methods that use it (and, once known, the target's context)."""
    problems, tree = [], eval_cfg.get("tree")
    trees = [m for m in eval_cfg.methods if tree_base(m)]
    for method in trees:
        base, mixed = tree_base(method)
        if method in tree_methods() or base not in known():  # an unknown base: method_problems names it
            continue
        if base.startswith(("vllm_", "llamacpp_")):
            why = (f"{base} runs in another engine, which eval.tree does not shape (vLLM's tree is the export's "
                   "speculative_token_tree, docs/ENGINES.md)")
        elif base in branching() or base in hybrid_methods():  # ngram_mixed_tree, suffix_mixed_tree: a mixed tree needs a trained drafter
            why = f"{base}'s trees are {base}{TREE} (a mixed tree joins n-gram's match to a trained drafter's tree)"
        else:
            why = f"{base} drafts chains only (cannot branch)"
        problems.append(f"eval.methods: {method}: {why}; the tree methods are {', '.join(tree_methods())}")
    if trees and tree is None:
        problems.append(f"eval.methods={list(eval_cfg.methods)} has tree methods but eval.tree is null: "
                        "set eval.tree.depth, eval.tree.branch and eval.tree.nodes")
    if tree is not None and tree.nodes < tree.depth:
        problems.append(f"eval.tree.nodes={tree.nodes} is below eval.tree.depth={tree.depth}: a tree of depth "
                        f"{tree.depth} needs at least {tree.depth} nodes")
    problems += [p for p in (branch_problem(tree),) if p]
    context = getattr(target_config, "max_position_embeddings", None)
    if tree is not None and context and tree.nodes + 1 >= context:
        problems.append(f"eval.tree.nodes={tree.nodes}: the target has max_position_embeddings={context}, "
                        f"so a verify of nodes + 1 tokens must stay below {context}")
    return problems


def branch_problem(tree) -> str | None:
    """Work a tree's shape asks for beyond what its node budget can use (the budget itself is
    bounded by MAX_DRAFTS, at its field): every node expands its top `branch` candidates, and no
    node has more children than the tree has nodes."""
    if tree is None or tree.branch <= tree.nodes:
        return None
    return (f"eval.tree.branch={tree.branch} is above eval.tree.nodes={tree.nodes}: no node of a tree of "
            f"{tree.nodes} nodes has more children, so give at most {tree.nodes} (or more nodes, up to {MAX_DRAFTS})")


def length_problems(eval_cfg, target_config) -> list[str]:
    """Once the target's config is known: an answer of eval.max_new_tokens and one verify of the
    widest step (k + 1 or a tree's nodes + 1) must leave the target's context a position for a
    prompt (a longer one would skip every prompt after loading everything)."""
    context = getattr(target_config, "max_position_embeddings", None)
    tree = eval_cfg.get("tree")
    widest = max(widest_k(eval_cfg), tree.nodes if tree is not None and any(map(tree_base, eval_cfg.methods)) else 0)
    limit = (context or 0) - widest - 2
    if not context or eval_cfg.max_new_tokens <= limit:
        return []
    return [length_problem(eval_cfg.max_new_tokens, context, widest + 1, max(limit, 0))]


def length_problem(max_new_tokens: int, context: int, width: int, limit: int) -> str:
    return (f"eval.max_new_tokens={max_new_tokens}: the target has max_position_embeddings={context}, and an "
            f"answer and one verify of {width} tokens must leave a position for the prompt: give at most {limit}")


def no_methods(methods: list[str]) -> str | None:
    """An empty `eval.methods` leaves evaluate nothing to measure, nor an engine to measure it on."""
    if methods:
        return None
    return (f"eval.methods=[] lists no method: give at least one (eval.methods=[plain] times plain decoding "
            f"alone); known: {', '.join(known())}")


def known() -> list[str]:
    """Every method name, in the order `--help` and error messages list them."""
    return [PLAIN, *ENGINE_DRAFTERS, SUFFIX, *DRAFTERS, *tree_methods(), *hybrid_methods(), *HF_METHODS,
            ARCTIC_SUFFIX, *VLLM_METHODS, *LLAMACPP_METHODS]


def trained_kinds(methods) -> list[str]:
    """The registered trained drafter kinds `methods` read: their chains, trees and hybrids' drafters,
    and the drafters behind their vllm_* twins."""
    return sorted({VLLM_OF.get(m, m) for m in chain_methods(methods)} & set(DRAFTERS))


def drafter_folder(cfg, kind: str):
    """Where evaluate reads the trained `kind` drafter: eval.drafter_dirs[kind], else run_dir/train/drafter."""
    from pathlib import Path

    chosen = cfg.eval.drafter_dirs.get(kind)
    return Path(chosen) if chosen else Path(cfg.run_dir) / "train" / "drafter"


def labelled_drafters(eval_cfg) -> dict[str, str]:
    """`eval.extra_drafters` entries LABEL:FOLDER as {label: folder} (checked by `method_problems`)."""
    out = {}
    for item in eval_cfg.get("extra_drafters") or []:
        label, _, folder = str(item).partition(":")
        out[label] = folder
    return out


def method_problems(eval_cfg) -> list[str]:
    """Every problem of `eval.methods`, `eval.extra_drafters` and `eval.best_k_method`."""
    problems, names = [], known()
    methods = list(eval_cfg.methods)
    problems += [p for p in (no_methods(methods),) if p]
    for method in methods:
        if method in RENAMED:
            problems.append(f"eval.methods: {method} was renamed: untrained_draft (a draft model used as it is) or "
                            f"{RENAMED[method]} (one trained here)")
    problems += tree_problems(eval_cfg)
    if ARCTIC_SUFFIX in methods:  # whether `make arctic` built it
        problems += [p for p in (missing_problem(),) if p]
    unknown = [m for m in methods if m not in names and m not in RENAMED
               and not (tree_base(m) and tree_base(m)[0] in names)]  # a chain method's tree: tree_problems
    if unknown:
        problems.append(f"eval.methods={methods}: unknown {unknown}; known: {', '.join(names)}")
    labels = []
    for item in eval_cfg.get("extra_drafters") or []:
        label, sep, folder = str(item).partition(":")
        if not sep or not label or not folder:
            problems.append(f"eval.extra_drafters: {item!r} should be LABEL:FOLDER")
        elif label in labels:
            problems.append(f"eval.extra_drafters: label {label!r} appears twice")
        elif label in names:
            problems.append(f"eval.extra_drafters: label {label!r} is a method name; pick another label")
        labels.append(label)
    problems += draft_tokens_problems(eval_cfg, [*methods, *labels])
    # best k needs our engine's forward costs: an evaluate of vllm_* methods only ignores it; a
    # recipe's best_k_method that the command line's eval.methods leaves out yields to the first chain
    if eval_cfg.best_k_method is not None and eval_cfg.best_k_method not in [*methods, *labels] \
            and given_on_command_line("eval.best_k_method") is False:
        pass
    elif eval_cfg.best_k_method is not None and eval_cfg.best_k_method not in [*methods, *labels] \
            and engine_needed(eval_cfg):
        problems.append(f"eval.best_k_method={eval_cfg.best_k_method!r} is not one of eval.methods {methods}"
                        + (f" or eval.extra_drafters labels {labels}" if labels else ""))
    elif eval_cfg.best_k_method is not None and engine_needed(eval_cfg):
        problems += [p for p in (best_k_problem(eval_cfg.best_k_method, [*methods, *labels], eval_cfg),) if p]
    return problems


def best_k_problem(method: str, methods: list[str], eval_cfg) -> str | None:
    """Best k is estimated from a chain's per-position acceptance in our engine: a tree method,
    plain decoding or another engine's method has none (the report would say best k = None)."""
    chains = [m for m in methods if m in own_k_methods(eval_cfg) and m not in HF_METHODS]
    if method in chains:
        return None
    return (f"eval.best_k_method={method!r} has no best k: it is estimated for a chain method our engine "
            f"drafts with ({', '.join(chains) or 'none in this evaluate'}); name one of those, or null")


# the chain methods whose k `eval.method_draft_tokens` may set: our engine's drafters and the
# Hugging Face decoders that take a k (plain and hf_generate draft nothing; the serving engines
# and the tree methods have one k, eval.num_draft_tokens, and one shape, eval.tree)
def own_k_methods(eval_cfg) -> list[str]:
    return [*ENGINE_DRAFTERS, SUFFIX, ARCTIC_SUFFIX, *DRAFTERS, *hybrid_methods(), "hf_prompt_lookup", "hf_assisted",
            *labelled_drafters(eval_cfg)]


def draft_tokens_problems(eval_cfg, methods: list[str]) -> list[str]:
    """`eval.method_draft_tokens`: METHOD:K items, each method once, one of this evaluate's that
    takes its own k, each k an integer >= 1."""
    problems, seen = [], []
    for item in eval_cfg.get("method_draft_tokens") or []:
        method, k = method_k(item)
        where = f"eval.method_draft_tokens: {item!r}"
        if k is None:
            problems.append(f"{where} should be METHOD:K with K an integer >= 1 (eval.method_draft_tokens=[dflash:1])")
        elif method in seen:
            problems.append(f"{where}: {method!r} appears twice")
        elif method not in methods:  # repr: a stray space ('ngram :2') is seen
            problems.append(f"{where}: {method!r} is not one of eval.methods {methods}")
        elif k > MAX_DRAFTS:
            problems.append(f"{where}: k={k} is above {MAX_DRAFTS}, the most drafts one step verifies (evaluate "
                            "times a target forward at every width up to it)")
        elif tree_base(method):
            problems.append(f"{where}: {method!r} is a tree method: eval.tree (depth, branch, nodes) shapes what it "
                            "drafts, not a k")
        elif method not in own_k_methods(eval_cfg):
            problems.append(f"{where}: {method!r} drafts eval.num_draft_tokens (a k of its own is for our engine's "
                            "chain methods: the trained drafters, their <drafter>_hybrid, ngram, suffix, arctic_suffix, "
                            "untrained_draft, hf_prompt_lookup and hf_assisted)")
        seen.append(method)
    return problems


def run_order(eval_cfg) -> list[str]:
    """The methods an evaluate runs, `plain` first, then `eval.methods` and the extra drafters'
    labels in their order (a validated config: `method_problems` found nothing)."""
    problems = method_problems(eval_cfg)
    if problems:  # a config built in code, past the door
        raise SpecforgeError(problems[0])
    ordered = [*eval_cfg.methods, *labelled_drafters(eval_cfg)]
    return [PLAIN] + [m for m in dict.fromkeys(ordered) if m != PLAIN]


def engine_needed(eval_cfg) -> bool:
    """Whether an evaluate decodes in our engine (which holds the whole target): any method of
    `eval.methods` that is not a vllm_* method, or an `eval.extra_drafters` label. Without one,
    evaluate loads no target weights and measures against vllm_plain (serving/engines.py)."""
    return any(m not in VLLM_METHODS for m in eval_cfg.methods) or bool(labelled_drafters(eval_cfg))


def vllm_only_methods(eval_cfg) -> list[str]:
    """The methods of an evaluate without our engine: vllm_plain, the baseline (added when
    missing), then the other vllm_* methods in their order."""
    return ["vllm_plain"] + [m for m in dict.fromkeys(eval_cfg.methods) if m != "vllm_plain"]


def vllm_override(eval_cfg, tensor_parallel_size: int) -> str:
    """The command-line override that measures these methods in vLLM alone: vllm_plain, then the
    vLLM twin of each method that has one (eagle3 -> vllm_eagle3), and the tensor parallelism."""
    twin = {ours: name for name, ours in VLLM_OF.items()}
    names = ["vllm_plain"] + [m if m in VLLM_METHODS else twin.get(m) for m in eval_cfg.methods]
    return f"eval.methods=[{','.join(n for n in dict.fromkeys(names) if n)}] " \
           f"eval.vllm.tensor_parallel_size={tensor_parallel_size}"
