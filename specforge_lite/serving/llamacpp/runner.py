"""llama.cpp as an evaluation backend, in-process through `xllamacpp` (`make llamacpp`).

One `LlamaCppRunner` holds one llama.cpp server (target GGUF, optional draft) and decodes
prompts given as token ids through its native `/completion` endpoint: greedy, a fixed number
of new tokens (end-of-sequence ignored), batch 1, no prompt cache. It returns the tokens, the
wall time and llama.cpp's own counters (`timings.draft_n`, `timings.draft_n_accepted`).

tau follows the evaluate report's definition (tokens emitted by decoding forwards / decoding
forwards, bonus included, plain = 1.00). The first token comes from the prompt forward and every
later forward emits its accepted drafts + 1, so the decoding forwards are
`predicted_n - 1 - draft_n_accepted` and tau = (predicted_n - 1) / that.

Methods: `llamacpp_plain`; `llamacpp_ngram` (llama.cpp's `ngram-simple` drafter: the last
n-gram's previous continuation in the context); `llamacpp_NAME` for each trained drafter whose
contract says llama.cpp runs its GGUF (`LLAMACPP_SERVING`: EAGLE-3 with `draft-eagle3`, DFlash
with `draft-dflash`, the distilled draft model with `draft-simple`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specforge_lite import SpecforgeError
from specforge_lite.drafters.methods import gguf_drafters

log = logging.getLogger(__name__)
LOOP_TIMEOUT_S = 60  # for the task loop to answer before the server is freed
INSTALL_HINT = "make llamacpp (or pip install '.[llamacpp]')"

# method -> llama.cpp speculative type (None: plain decoding); a trained drafter's method and type
# come from its contract (`LLAMACPP_SERVING`, through `drafters.methods.gguf_drafters`)
METHODS = {
    "llamacpp_plain": None,
    "llamacpp_ngram": "NGRAM_SIMPLE",
    **{f"llamacpp_{name}": spec_type for name, (spec_type, _) in gguf_drafters().items()},
}
NEEDS_DRAFT = {method for method in METHODS if method not in ("llamacpp_plain", "llamacpp_ngram")}
# the command-line spelling of each type, for the recipe card and the results file
SPEC_TYPE_FLAGS = {"NGRAM_SIMPLE": "ngram-simple", "DRAFT_EAGLE3": "draft-eagle3", "DRAFT_SIMPLE": "draft-simple",
                   "DRAFT_DFLASH": "draft-dflash"}


def import_xllamacpp():
    try:
        import xllamacpp
    except ImportError:
        raise SpecforgeError(f"llama.cpp methods need xllamacpp: {INSTALL_HINT}") from None
    return xllamacpp


def available() -> bool:
    try:
        import_xllamacpp()
    except SpecforgeError:
        return False
    return True


def version() -> str:
    return str(import_xllamacpp().__version__)


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # llama.cpp's own decoding time (prompt processing excluded)
    wall_seconds: float  # the whole request, as the caller saw it
    drafted: int
    accepted: int

    @property
    def tau(self) -> float:
        n = len(self.tokens) - 1
        return n / max(1, n - self.accepted)


@dataclass
class LlamaCppRunner:
    target_gguf: Path
    method: str = "llamacpp_plain"
    draft_gguf: Path | None = None
    threads: int = 2
    speculative_tokens: int = 4
    n_ctx: int = 2048
    server: object = field(default=None, init=False, repr=False)
    refusal: str | None = field(default=None, init=False)  # llama.cpp's line refusing the draft, if it logged one

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpecforgeError(f"unknown llama.cpp method {self.method!r}; one of {sorted(METHODS)}")
        if (self.method in NEEDS_DRAFT) != (self.draft_gguf is not None):
            raise SpecforgeError(f"{self.method} {'needs' if self.method in NEEDS_DRAFT else 'takes no'} draft GGUF")
        for path in (self.target_gguf, self.draft_gguf):
            if path is not None and not Path(path).is_file():
                raise SpecforgeError(f"{path}: no such GGUF file")

    def start(self) -> "LlamaCppRunner":
        xl = import_xllamacpp()
        params = xl.CommonParams()
        params.model.path = str(self.target_gguf)
        params.n_ctx = self.n_ctx
        params.n_parallel = 1
        params.cpuparams.n_threads = self.threads
        params.cpuparams_batch.n_threads = self.threads
        params.sampling.temp = 0.0
        params.sampling.top_k = 1
        params.warmup = True
        params.endpoint_slots = True  # `close` waits for the task loop through it
        spec_type = METHODS[self.method]
        if spec_type is not None:
            params.speculative.types = [getattr(xl.common_speculative_type, f"COMMON_SPECULATIVE_TYPE_{spec_type}")]
            params.speculative.draft.n_max = self.speculative_tokens
            params.speculative.draft.n_min = 0
            params.speculative.draft.p_min = 0.0  # greedy chains: draft every step, let the target judge
            if self.draft_gguf is not None:
                params.speculative.draft.mparams.path = str(self.draft_gguf)
                params.speculative.draft.cpuparams.n_threads = self.threads
                params.speculative.draft.cpuparams_batch.n_threads = self.threads
        try:
            with captured_stderr() as log_lines:
                self.server = xl.Server(params)
        except Exception as err:
            raise SpecforgeError(f"llama.cpp (xllamacpp {version()}) cannot load {Path(self.target_gguf).name}"
                                 f"{' with draft ' + Path(self.draft_gguf).name if self.draft_gguf else ''}: "
                                 f"{err}") from None
        if spec_type is not None:
            self.refusal = refusal_line(log_lines)
        return self

    def __enter__(self) -> "LlamaCppRunner":
        return self.start() if self.server is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server: it stops when the object is freed. xllamacpp's destructor tells the
        task loop to stop and joins it while holding the GIL; a stop sent before that loop runs is
        lost and the join never returns (a refused draft closes the runner right after loading).
        So the server is freed only once its task loop has answered a request."""
        server, self.server = self.server, None
        if server is None:
            return
        if not wait_task_loop(server.listening_address):
            log.warning("llama.cpp's server did not answer within %d s; freeing it may hang", LOOP_TIMEOUT_S)
        del server

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> Completion:
        """Greedy decoding of exactly `max_new_tokens` tokens after `prompt_ids`."""
        if self.server is None:
            self.start()
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": int(max_new_tokens), "temperature": 0.0,
                "top_k": 1, "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "speculative.n_max": self.speculative_tokens, "speculative.n_min": 0, "speculative.p_min": 0.0}
        request = urllib.request.Request(f"{self.server.listening_address}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise SpecforgeError(f"llama.cpp refused the request: {err.read().decode(errors='replace')[:300]}") from None
        wall = time.perf_counter() - start
        timings = reply.get("timings", {})
        return Completion(tokens=[int(t) for t in reply["tokens"]], seconds=float(timings["predicted_ms"]) / 1000,
                          wall_seconds=wall, drafted=int(timings.get("draft_n", 0)),
                          accepted=int(timings.get("draft_n_accepted", 0)))


def wait_task_loop(address: str, timeout: float = LOOP_TIMEOUT_S) -> bool:
    """Whether the llama.cpp server at `address` answered `/slots` within `timeout` seconds:
    that endpoint is served by the task loop, so an answer means the loop runs (`/health` is
    answered by the HTTP thread alone, before the loop may have started)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{address}/slots", timeout=5):
                return True
        except urllib.error.HTTPError as err:
            if err.code != 503:  # 503: still loading; any other status came back through the loop
                return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class captured_stderr:
    """Copies what llama.cpp writes to file descriptor 2 while loading (its log goes there, not
    through Python) into a list of lines, and still shows it on stderr."""

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self.lines

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        os.write(2, text)
        self.lines.extend(text.decode(errors="replace").splitlines())


def refusal_line(log_lines: list[str]) -> str | None:
    """llama.cpp's error line saying it will not draft (it then decodes plain), without its
    timestamp and level prefix; None when it logged none."""
    for line in log_lines:
        if " E " in line and ("speculative" in line or "draft" in line):
            return " ".join(line.split(" E ", 1)[1].split())
    return None
