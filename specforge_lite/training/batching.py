"""How a training run cuts its rows into micro-batches: one list of rows per rank per micro-batch.

Two ways, chosen by `train.tokens_per_step` (`choose`):

- null: `train.batch_size` sequences per micro-batch over all ranks, dealt out rank, rank+world,
  ... A batch smaller than the world size would leave a rank without a real sequence: it is
  raised to the world size (and the line that reports the choice says so), and a short batch
  at the end of an epoch is filled with rows from the start of it, so no rank ever idles.
- a token count or `auto`: each rank's micro-batch is a budget of padded tokens (`per_rank`
  sequences of data.max_length). Within a window of batches the rows are sorted by length and
  packed greedily into the budget (a batch of short rows holds more of them), `world`
  neighbouring packs form one micro-batch (similar lengths on every rank), and the micro-batches
  are shuffled. `auto` takes the largest micro-batch the device holds (scale/sizing.py).

Every function here is pure (row lengths in, row indices out) and seeded: a resumed run replays
the same plan.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from specforge_lite import SpecforgeError

WINDOW = 16  # batches sorted by length together: less padding, still shuffled across windows
CPU_MICRO_BATCH = 2  # `auto` where no device memory is known (a CPU): sequences of max_length per rank


# --------------------------------------------------------------------------- the choice

@dataclass(frozen=True)
class BatchChoice:
    """What one optimizer step holds. `per_rank`: sequences of `max_length` per rank per
    micro-batch (the memory the sizing counts); `token_budget`: padded tokens per rank per
    micro-batch when batches are packed by tokens (None: `batch_size` sequences, dealt out)."""

    mode: str  # "batch_size" | "tokens" | "auto"
    per_rank: int
    world: int
    grad_accum: int
    max_length: int
    batch_size: int | None = None  # the global micro-batch in sequences ("batch_size" mode)
    token_budget: int | None = None
    raised_from: int | None = None  # train.batch_size as given, when below the world size
    asked: int | None = None  # train.tokens_per_step as given ("tokens" mode)
    fits: int | None = None  # the largest micro-batch per rank the device holds, when known
    memory: str = ""  # what the device memory was read from

    @property
    def tokens_per_step(self) -> int:
        """Global padded tokens per optimizer step at most (sequences at data.max_length)."""
        per_rank = self.token_budget or self.per_rank * self.max_length
        return per_rank * self.world * self.grad_accum

    def line(self) -> str:
        if self.mode == "batch_size":
            head = f"batch: train.batch_size={self.batch_size}"
            if self.raised_from is not None:
                head = (f"batch: train.batch_size={self.raised_from} raised to {self.batch_size}, the world size "
                        "(every rank trains on a real sequence)")
            what = f"{self.per_rank} sequence(s) per rank"
        else:
            why = (f"the most {self.memory} holds" if self.mode == "auto" and self.fits is not None
                   else "auto on a device of unknown memory" if self.mode == "auto" else "train.tokens_per_step")
            head = f"batch: train.tokens_per_step={'auto' if self.mode == 'auto' else self.tokens_per_step}"
            if self.mode == "tokens" and self.asked not in (None, self.tokens_per_step):  # whole sequences per rank
                how = "raised" if self.asked < self.tokens_per_step else "rounded"
                head = (f"batch: train.tokens_per_step={self.asked} {how} to {self.tokens_per_step} (whole "
                        f"{self.max_length}-token sequences on every rank)")
            what = (f"micro-batch of {self.token_budget} padded tokens per rank ({self.per_rank} x {self.max_length}"
                    f"-token sequence(s), {why}), rows packed by length")
        return (f"{head}: {what} x {self.world} rank(s) x grad_accum {self.grad_accum} = "
                f"{self.tokens_per_step} tokens per step at most")

    def record(self) -> dict:
        return {"mode": self.mode, "micro_batch_per_rank": self.per_rank, "ranks": self.world,
                "grad_accum": self.grad_accum, "tokens_per_step": self.tokens_per_step,
                "token_budget_per_rank": self.token_budget, "batch_size": self.batch_size,
                "raised_from": self.raised_from, "tokens_per_step_asked": self.asked, "fits_per_rank": self.fits}


def parse_tokens(value) -> int | str | None:
    """`train.tokens_per_step` as given: None, "auto" or a positive token count."""
    if value is None:
        return None
    text = str(getattr(value, "value", value)).strip().lower()
    if text == "auto":
        return "auto"
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise SpecforgeError(f"train.tokens_per_step={value!r}: give a token count or auto") from None


def choose(tokens_per_step, batch_size: int, grad_accum: int, max_length: int, world: int,
           fits: int | None = None, memory: str = "") -> BatchChoice:
    """The batch of one step. tokens_per_step: None, "auto" or a count (`parse_tokens`); fits:
    the largest micro-batch per rank (sequences of max_length) the device holds, None when its
    memory is unknown (a CPU: `auto` takes CPU_MICRO_BATCH). A count below one sequence, or one
    that needs a bigger micro-batch than the device holds, is refused naming the fix."""
    common = {"world": world, "grad_accum": grad_accum, "max_length": max_length, "fits": fits, "memory": memory}
    if tokens_per_step is None:
        size = max(batch_size, world)
        return BatchChoice("batch_size", math.ceil(size / world), batch_size=size,
                           raised_from=batch_size if batch_size < world else None, **common)
    if tokens_per_step == "auto":
        per_rank = CPU_MICRO_BATCH if fits is None else max(1, fits)
        return BatchChoice("auto", per_rank, token_budget=per_rank * max_length, **common)
    if tokens_per_step < max_length:
        raise SpecforgeError(f"train.tokens_per_step={tokens_per_step} is below one sequence of data.max_length="
                             f"{max_length}: give at least {max_length} (or auto)")
    budget = max(max_length, tokens_per_step // (world * grad_accum))
    per_rank = math.ceil(budget / max_length)
    if fits and per_rank > fits:  # fits == 0: not even one sequence, which the stage's sizing refuses
        accum = math.ceil(tokens_per_step / (max(1, fits) * max_length * world))
        raise SpecforgeError(f"train.tokens_per_step={tokens_per_step} needs {per_rank} sequences of {max_length} "
                             f"tokens per rank per micro-batch on {world} rank(s) with train.grad_accum={grad_accum}; "
                             f"{memory or 'the device'} holds {fits}: set train.grad_accum={accum} "
                             "or train.tokens_per_step=auto")
    return BatchChoice("tokens", per_rank, token_budget=budget, asked=tokens_per_step, **common)


# --------------------------------------------------------------------------- the plans

def plan_batches(lengths: list[int], batch_size: int, seed: int, epochs: float) -> list[list[int]]:
    """Deterministic micro-batches of sequence indices for the whole run.

    Each epoch: a seeded permutation, cut into windows of 16 batches; within a window
    sequences are sorted by length (less padding), then the batches are shuffled.
    """
    rng = random.Random(seed)
    per_epoch = math.ceil(len(lengths) / batch_size)
    total = max(1, math.ceil(per_epoch * epochs))
    batches: list[list[int]] = []
    while len(batches) < total:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        window = batch_size * WINDOW
        epoch_batches = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
            epoch_batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
        rng.shuffle(epoch_batches)
        batches += epoch_batches
    return batches[:total]


def borrowed(taken: list[int], count: int, rows: int) -> list[int]:
    """`count` rows to fill a short batch: the lowest indices not in `taken` (repeats only when
    there are fewer rows than that)."""
    if count <= 0:  # a full batch, every batch but an epoch's last: nothing to scan
        return []
    skip = set(taken)  # the first `count` free rows are all it can use: no scan of the rest
    candidates = list(itertools.islice((i for i in range(rows) if i not in skip), count)) or list(range(rows))
    return [candidates[k % len(candidates)] for k in range(count)]


def deal(batch: list[int], world: int, rows: int, size: int = 0) -> list[list[int]]:
    """`batch` dealt out over `world` ranks (rank r: sequences r, r+world, ...); a batch shorter
    than `size` (the epoch's last) or than `world` is first filled (`borrowed`), so every rank
    gets a real sequence and every step holds the same number of rows on any world size."""
    batch = list(batch) + borrowed(batch, max(world, size) - len(batch), rows)
    return [batch[r::world] for r in range(world)]


def pack(ordered: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Rows in `ordered` (sorted by length) packed greedily: a pack takes the next row while its
    rows times the longest of them stay within `budget` padded tokens (a row longer than the
    budget goes alone)."""
    packs, current, longest = [], [], 0
    for i in ordered:
        wider = max(longest, lengths[i])
        if current and (len(current) + 1) * wider > budget:
            packs.append(current)
            current, wider = [], lengths[i]
        current.append(i)
        longest = wider
    if current:
        packs.append(current)
    return packs


def split_to(group: list[list[int]], world: int, rows: int) -> list[list[int]]:
    """`group` of packs made `world` packs: the biggest pack halved while it has two rows, then
    single rows borrowed (`borrowed`) for what is still missing."""
    group = [list(p) for p in group]
    while len(group) < world:
        big = max(range(len(group)), key=lambda j: len(group[j]))
        if len(group[big]) < 2:
            break
        half = len(group[big]) // 2
        group[big:big + 1] = [group[big][:half], group[big][half:]]
    taken = [i for p in group for i in p]
    return group + [[i] for i in borrowed(taken, world - len(group), rows)]


def plan_packed(lengths: list[int], budget: int, world: int, seed: int, epochs: float) -> list[list[list[int]]]:
    """Micro-batches of `world` packs (one per rank, each within `budget` padded tokens), seeded.

    Each epoch: a seeded permutation cut into windows of about WINDOW micro-batches, sorted by
    length within a window and packed (`pack`); neighbouring packs make a micro-batch; the
    micro-batches are shuffled. The run takes ceil(micro-batches of the first epoch x epochs).
    """
    rng = random.Random(seed)
    rows = len(lengths)
    mean = max(1.0, sum(lengths) / max(1, rows))
    window = max(world, round(WINDOW * world * budget / mean))
    micro: list[list[list[int]]] = []
    total = None
    while total is None or len(micro) < total:
        order = list(range(rows))
        rng.shuffle(order)
        packs: list[list[int]] = []
        for w in range(0, rows, window):
            packs += pack(sorted(order[w:w + window], key=lambda i: lengths[i]), lengths, budget)
        epoch = [split_to(packs[g:g + world], world, rows) for g in range(0, len(packs), world)]
        rng.shuffle(epoch)
        if total is None:
            total = max(1, math.ceil(len(epoch) * epochs))
        micro += epoch
    return micro[:total]


def plan(lengths: list[int], choice: BatchChoice, seed: int, epochs: float) -> list[list[list[int]]]:
    """The run's micro-batches, each one list of row indices per rank (none empty)."""
    if choice.token_budget is None:
        rows = len(lengths)
        return [deal(b, choice.world, rows, choice.batch_size)
                for b in plan_batches(lengths, choice.batch_size, seed, epochs)]
    return plan_packed(lengths, choice.token_budget, choice.world, seed, epochs)


def padding_share(lengths: list[int], micro_batches: list[list[list[int]]]) -> float:
    """Share of the padded tokens the ranks compute that are padding (each rank pads its rows to
    its longest one)."""
    real = padded = 0
    for ranks in micro_batches:
        for rows in ranks:
            real += sum(lengths[i] for i in rows)
            padded += len(rows) * max((lengths[i] for i in rows), default=0)
    return 0.0 if padded == 0 else 1 - real / padded
