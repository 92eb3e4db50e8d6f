"""`arctic_suffix`: Arctic Inference's own suffix decoding (`arctic_inference.suffix_decoding`, the
implementation vLLM's `method: suffix` runs), measured as a peer beside our `suffix` on the same
corpus, settings and verify loop.

Its cache keeps a suffix tree per request (the prompt and the answer so far) and a global one over
cached responses. The global tree gets the target's sampled answers (the corpus our `suffix`
indexes); each evaluated answer is evicted from it when its request ends, so no prompt's timed
run drafts from its own warm-up answer. Deterministic drafts (no q).

`make arctic` builds the module from Arctic Inference's sdist (no wheel exists for CPU machines;
its full build wants CUDA and vLLM) and installs it with `python -m specforge_lite.decoding.arctic
install BUILD_DIR`.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import sys
import sysconfig
from pathlib import Path

from specforge_lite.contract import DraftContext, DraftProposal

ARCTIC_SUFFIX = "arctic_suffix"
MODULE = "arctic_inference.suffix_decoding"


def missing_problem() -> str | None:
    """Why `arctic_suffix` cannot run here (its module is not installed, or is installed and does
    not import: a build against another Python or torch, a file missing), or None."""
    try:
        found = importlib.util.find_spec(MODULE) is not None
    except ImportError:
        found = False
    if not found:
        return (f"eval.methods: {ARCTIC_SUFFIX} needs Arctic Inference's suffix decoding ({MODULE}), "
                "not installed here: build it with `make arctic`, or leave the method out")
    try:  # found is not usable: import what the drafter uses, as it will
        importlib.import_module(MODULE).SuffixDecodingCache
    except Exception as err:  # a broken build raises anything: ImportError, OSError, AttributeError...
        first = (str(err).strip().splitlines() or [""])[0]
        return (f"eval.methods: {ARCTIC_SUFFIX}: Arctic Inference's {MODULE} is installed but does not import "
                f"({type(err).__name__}: {first}); build it again with `make arctic`, or leave the method out")
    return None


class ArcticSuffixDrafter:
    name = ARCTIC_SUFFIX
    hidden_state_layers: tuple[int, ...] = ()
    sequential = False

    def __init__(self, answers: list[list[int]] | None, max_depth: int = 16, draft_per_match: float = 1.0,
                 min_prob: float = 0.1):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=-1)
        for i, answer in enumerate(answers or []):  # the global tree: the target's own answers
            self.cache.start_request(("sample", i), [])
            self.cache.add_active_response(("sample", i), [int(t) for t in answer])
            self.cache.stop_request(("sample", i))
        self.max_depth, self.draft_per_match, self.min_prob = max_depth, draft_per_match, min_prob
        self.ids = itertools.count()
        self.request, self.fed = None, 0

    def reset(self) -> None:
        """End the answer's request and evict its response from the global tree."""
        if self.request is not None:
            self.cache.stop_request(self.request)
            if self.request in self.cache.cached_requests:
                self.cache.evict_cached_response(self.request)
            self.request = None

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        ids = ctx.token_ids
        if self.request is None:  # the first step of an answer: the prompt starts its request
            self.request = ("eval", next(self.ids))
            self.cache.start_request(self.request, ids[:ctx.num_prompt_tokens])
            self.fed = ctx.num_prompt_tokens
        if len(ids) > self.fed:  # the answer's tokens committed since
            self.cache.add_active_response(self.request, ids[self.fed:])
            self.fed = len(ids)
        if k == 0:
            return DraftProposal([])
        draft = self.cache.speculate(self.request, ids[-self.max_depth:], max_spec_tokens=k,
                                     max_spec_factor=self.draft_per_match, min_token_prob=self.min_prob)
        return DraftProposal([int(t) for t in draft.token_ids[:k]])

    def accept(self, num_accepted: int) -> None:
        pass  # the request's tree follows the committed tokens


def install(build_dir: Path) -> Path:
    """Put the suffix-decoding module built by `make arctic` (its Python files from the sdist and
    the compiled `_C`) into this interpreter's site-packages; returns the package folder."""
    sources = sorted(build_dir.glob("arctic_inference-*/arctic_inference"))
    built = sorted((build_dir / "cmake").glob("_C*.so"))
    if not sources or not built:
        raise SystemExit(f"{build_dir}: no unpacked sdist or no built _C module (run `make arctic`)")
    target = Path(sysconfig.get_paths()["purelib"]) / "arctic_inference"
    shutil.rmtree(target, ignore_errors=True)
    (target / "suffix_decoding").mkdir(parents=True)
    shutil.copy2(sources[-1] / "__init__.py", target / "__init__.py")
    for name in ("__init__.py", "cache.py"):
        shutil.copy2(sources[-1] / "suffix_decoding" / name, target / "suffix_decoding" / name)
    shutil.copy2(built[-1], target / "suffix_decoding" / built[-1].name)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "install":
        raise SystemExit("usage: python -m specforge_lite.decoding.arctic install BUILD_DIR")
    print(f"{MODULE} installed in {install(Path(sys.argv[2]))}")
