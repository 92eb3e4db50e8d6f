"""What the frozen target contributes to a training batch, online or from a disk cache.

For a batch of right-padded sequences the target gives, per position: the hidden
states of the drafter's aux layers (concatenated, [B, T, 3H]) and the final hidden
state after the model's norm ([B, T, H]), from which the logits over any subset of
the vocabulary are one small matmul. Offline mode stores exactly these (bf16, int8 or int4
on disk, `train.feature_format`; see feature_formats.py) so training never needs the
full-vocab logits or the target itself; `int4_topk` stores the teacher's top draft-vocab
logits instead of the final hidden state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specforge_lite import SpecforgeError
from specforge_lite.training.feature_formats import (GROUP_SIZE, SparseTeacher, bytes_per_token, dequantize, hidden_format,
                                            quantize, stores_last, topk_teacher)
from specforge_lite.run_folders import umask
from specforge_lite.checked_io import DAMAGED, ArtifactError, read_json_object, safetensors_header, write_failure
from specforge_lite.targets.digest import target_files

log = logging.getLogger(__name__)


@torch.no_grad()
def target_hidden(target, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layer_ids,
                  compute: torch.dtype | None = None) -> tuple:
    """`(aux_hidden [B, T, len(aux_layer_ids) * H] or None when no aux layers are asked for,
    last_hidden [B, T, H])` from one frozen target forward, in the target's dtype.

    compute: a lower dtype for the forward's matmuls than the target's weights (bf16 autocast of
    an fp32 target on a CPU that computes bf16 natively: train.mixed_precision); None: as loaded."""
    weights = next(target.parameters()).dtype
    lower = compute is not None and compute != weights
    cast = torch.autocast(input_ids.device.type, dtype=compute) if lower else contextlib.nullcontext()
    with cast:
        out = target.model(input_ids=input_ids, attention_mask=attention_mask,
                           output_hidden_states=bool(aux_layer_ids), use_cache=False)
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
    last = out.last_hidden_state
    if lower:
        aux, last = (aux.to(weights) if aux is not None else None), last.to(weights)
    return aux, last


@torch.no_grad()
def draft_vocab_targets(head: torch.Tensor, draft_head: torch.Tensor, last_hidden: torch.Tensor,
                        t2d: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits on the draft vocab [B, T, V_d] and whether the full-vocab argmax is in it [B, T].

    head: the target's lm_head weight [V, H]; draft_head: its draft-vocab rows [V_d, H]
    (gathered once by the caller). The full-vocab argmax is only computed where a loss
    can land (positions i whose next token i+1 is masked in), which saves most of the
    large lm_head.
    """
    logits = last_hidden @ draft_head.T
    needed = torch.zeros_like(loss_mask, dtype=torch.bool)
    needed[:, :-1] = loss_mask[:, 1:].bool()
    in_draft = torch.zeros_like(needed)
    if needed.any():
        argmax = (last_hidden[needed] @ head.T).argmax(-1)
        in_draft[needed] = t2d[argmax]
    return logits, in_draft


def rows_digest(rows: list[dict]) -> dict:
    """How many rows and a hash of their ids (where they have one) and token ids, in order."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(str(row.get("id", "")).encode() + b"\0")
        digest.update(torch.as_tensor(row["input_ids"], dtype=torch.int64).numpy().tobytes() + b"\1")
    return {"count": len(rows), "sha256": digest.hexdigest()}


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b of the tensors' names, dtypes, shapes and bytes, in name order: what a feature shard
    records in its metadata when written and is checked against when reused."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        data = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def computed_dtype(target, compute: torch.dtype | None) -> str:
    """The dtype the target's forward computes in (`target_hidden`): its weights', or `compute` under autocast."""
    weights = next(target.parameters()).dtype
    return str(weights) if compute is None or compute == weights else f"{weights} autocast {compute}"


def cache_key(rows: list[dict], target_path: str, target_dtype, aux_layer_ids, feature_format: str = "bf16",
              draft_vocab: torch.Tensor | None = None) -> dict:
    """What the offline features are made of: the rows, the target, the layers, the dtype and
    the stored format (with int4_topk, the draft vocab its stored teacher ids index)."""
    stored = "bfloat16" if feature_format == "bf16" else f"{feature_format}/g{GROUP_SIZE}"
    key = {"rows": rows_digest(rows), "target": target_files(target_path),
           "aux_layer_ids": list(aux_layer_ids), "target_dtype": str(target_dtype), "stored_dtype": stored}
    if draft_vocab is not None:
        ids = torch.as_tensor(draft_vocab, dtype=torch.int64).cpu().numpy().tobytes()
        key["draft_vocab"] = hashlib.sha256(ids).hexdigest()
    return key


def changed_keys(cached: dict | None, key: dict) -> list[str]:
    """The names of `key`'s fields that differ from `cached` (all of them for a cache without a key)."""
    if not isinstance(cached, dict):
        return ["settings (no key recorded)"]
    return [name for name in key if cached.get(name) != key[name]] or ["settings"]


def collate(rows: list[dict], pad_id: int, device) -> dict:
    """Right-pad a list of samples rows to `input_ids`, `attention_mask`, `loss_mask` [B, T]."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        attention[i, :n] = 1
        mask[i, :n] = torch.as_tensor(r["loss_mask"])
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "loss_mask": mask.to(device)}


class FeatureCache:
    """Offline mode: aux and last hidden states per sequence in safetensors shards.

    `features/shard-NNNNN.safetensors` holds sequences [N*S, (N+1)*S) as tensors
    `aux.<i>` [T_i, 3H] (only for drafters that read aux layers) and `last.<i>` [T_i, H]
    in bf16, or quantized (`aux.<i>` / `last.<i>` the int8 or packed int4 values plus
    `aux_scale.<i>` / `last_scale.<i>` the group scales); int4_topk keeps `topk.values.<i>`,
    `topk.ids.<i>`, `in_draft.<i>` instead of `last.<i>`. The shard's metadata names the format
    and the widths, and a checksum of its tensors (`tensors_checksum`), checked when the shard is
    reused: a damaged one is rebuilt, never read. A shard is written to a
    temporary name and renamed, so a killed caching run resumes at the first missing shard.
    """

    def __init__(self, directory: Path, shard_size: int, feature_format: str = "bf16"):
        self.dir = Path(directory)
        self.shard_size = shard_size
        self.format = feature_format
        self._open: dict[int, object] = {}

    def shard_file(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.safetensors"

    def own_files(self) -> list[Path]:
        """The files this cache writes in its folder: meta.json, its shards and their temporary names."""
        meta = self.dir / "meta.json"
        return ([meta] if meta.exists() else []) + sorted(self.dir.glob("shard-*.safetensors")) + \
            sorted(self.dir.glob(".shard-*.tmp"))

    @staticmethod
    def estimate_bytes(num_tokens: int, hidden_size: int, num_aux_layers: int = 3, feature_format: str = "bf16") -> int:
        """aux (num_aux_layers * H) + last (H) per token in the format's bytes (feature_formats.bytes_per_token)."""
        return int(num_tokens * bytes_per_token(feature_format, hidden_size, num_aux_layers))

    def prepare(self, samples, hidden_size: int, aux_layer_ids, key: dict) -> None:
        """Once, before any rank builds: a folder cached with another `key` (from `cache_key`:
        what the features are made of) is emptied, never read; meta.json records the key."""
        self.dir.mkdir(parents=True, exist_ok=True)
        num_tokens = sum(len(r["input_ids"]) for r in samples)
        size = self.estimate_bytes(num_tokens, hidden_size, len(aux_layer_ids), self.format)
        meta = self.dir / "meta.json"
        key = {**key, "shard_size": self.shard_size}
        cached = read_json_object(meta).get("key") if meta.exists() else None
        if cached != key:
            if own := self.own_files():  # only what this cache wrote: a user's file in the folder stays
                log.warning("offline features in %s were cached for other %s: rebuilding them", self.dir,
                            ", ".join(changed_keys(cached, key)))
            for path in own:
                path.unlink()
        log.info("offline features (%s): %d sequences, %d tokens -> about %.2f GB on disk in %s",
                 self.format, len(samples), num_tokens, size / 1e9, self.dir)
        meta.write_text(json.dumps({"num_sequences": len(samples), "num_tokens": num_tokens,
                                    "feature_format": self.format,
                                    "aux_layer_ids": list(aux_layer_ids), "estimated_bytes": size,
                                    "shard_size": self.shard_size, "key": key}))

    def build(self, target, samples, aux_layer_ids, pad_id: int, batch_size: int, rank: int = 0, world: int = 1,
              barrier=None, lockstep: bool = False, teacher=None, compute: torch.dtype | None = None) -> None:
        """Write the missing shards (after `prepare`): rank r of `world` writes the r-th, r+world-th, ...
        of them, straight into the shared folder, so training reads them as one rank's cache.
        `barrier`: called once every rank has listed the missing shards (before any is written).
        lockstep: the target is sharded over the ranks (every rank must take part in every
        target forward), so a rank with fewer batches runs empty-handed forwards until all are done.
        teacher: for int4_topk, `teacher(last [B, T, H], loss_mask [B, T]) -> (draft-vocab logits
        [B, T, V_d], in_draft [B, T])` (features.draft_vocab_targets with the drafter's vocab).
        compute: the target forward's dtype where it is lower than the weights' (`target_hidden`)."""
        if not stores_last(self.format) and teacher is None:
            raise SpecforgeError(f"train.feature_format={self.format} stores the teacher: the cache needs "
                                 "the draft vocab")
        num_shards = (len(samples) + self.shard_size - 1) // self.shard_size
        todo = [j for j in range(num_shards) if not self._intact(self.shard_file(j))]
        if barrier is not None:
            barrier()
        mine = todo[rank::world]

        def batches(shards):
            for j in shards:
                lo, hi = j * self.shard_size, min((j + 1) * self.shard_size, len(samples))
                yield from ((j, start, min(start + batch_size, hi), start + batch_size >= hi)
                            for start in range(lo, hi, batch_size))

        forwards = max(sum(1 for _ in batches(todo[r::world])) for r in range(world)) if lockstep else None
        log.info("offline features: rank %d of %d writes %d of the %d missing shards (of %d)", rank, world, len(mine),
                 len(todo), num_shards)
        bar = tqdm(total=sum(hi - lo for _, lo, hi, _ in batches(mine)), desc="cache features", unit="seq",
                   dynamic_ncols=True, disable=rank != 0)
        tensors, done = {}, 0
        for j, lo, hi, last_batch in batches(mine):
            rows = samples[lo:hi]
            batch = collate(rows, pad_id, target.device)
            aux, last = target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_layer_ids, compute)
            done += 1
            soft = None if stores_last(self.format) else teacher(last_hidden=last, loss_mask=batch["loss_mask"])
            for k, row in enumerate(rows):
                n = len(row["input_ids"])
                if aux is not None:
                    tensors.update(self._stored("aux", lo + k, aux[k, :n]))
                if soft is None:
                    tensors.update(self._stored("last", lo + k, last[k, :n]))
                else:  # ranked where the logits are (a GPU), stored from the CPU
                    parts = topk_teacher(soft[0][k, :n], soft[1][k, :n])
                    tensors.update({f"{name}.{lo + k}": t.cpu() for name, t in parts.items()})
            bar.update(len(rows))
            if last_batch:
                widths = {"aux_width": str(aux.shape[-1] if aux is not None else 0), "last_width": str(last.shape[-1])}
                self._write(j, tensors, {"feature_format": self.format, "group_size": str(GROUP_SIZE), **widths})
                tensors = {}
        bar.close()
        while lockstep and done < forwards:  # the other ranks' forwards need this rank's shards of the layers
            batch = collate(samples[:1], pad_id, target.device)
            target_hidden(target, batch["input_ids"], batch["attention_mask"], aux_layer_ids, compute)
            done += 1

    def _stored(self, name: str, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """One sequence's [T, W] hidden states as the tensors the format stores (quantized where
        the states are, a GPU, then moved to the CPU)."""
        parts = {key: t.cpu() for key, t in quantize(x, hidden_format(self.format)).items()}
        return {f"{name}.{index}": parts["q"], **({f"{name}_scale.{index}": parts["scale"]} if "scale" in parts else {})}

    def _write(self, j: int, tensors: dict, metadata: dict | None = None) -> None:
        """Shard j written under a temporary name and renamed: a killed run resumes at it."""
        tmp = self.dir / f".shard-{j:05d}.tmp"
        try:
            save_file(tensors, str(tmp), metadata={**(metadata or {}), "checksum": tensors_checksum(tensors)})
            tmp.chmod(0o666 & ~umask())  # safetensors writes 600: the umask's mode, as for every artifact
            tmp.replace(self.shard_file(j))
        except Exception as err:
            tmp.unlink(missing_ok=True)
            if write_failure(err):
                raise SpecforgeError(f"cannot write {self.shard_file(j)} ({err}); the cache resumes at this "
                                     "shard once there is room") from err
            raise

    def _intact(self, shard: Path) -> bool:
        """A cached shard that exists, holds every byte its header lists, is in this cache's
        format (a shard without a format is bf16, as before formats were recorded) and whose
        tensors match the checksum recorded when it was written; any other is rebuilt."""
        if not shard.exists():
            return False
        try:
            safetensors_header(shard)
        except ArtifactError as err:
            log.warning("%s; rebuilding that shard", err)
            return False
        with safe_open(str(shard), framework="pt") as handle:
            metadata = handle.metadata() or {}
            stored = metadata.get("feature_format", "bf16")
            if stored != self.format:
                log.warning("%s holds %s features, not %s; rebuilding that shard", shard, stored, self.format)
                return False
            recorded = metadata.get("checksum")
            if recorded is None or recorded != tensors_checksum({k: handle.get_tensor(k) for k in handle.keys()}):
                log.warning("%s: %s; rebuilding that shard", shard, "no checksum recorded (written by an older "
                            "version)" if recorded is None else "its tensors differ from the checksum recorded "
                            f"when it was written; {DAMAGED}")
                return False
        return True

    def _handle(self, index: int) -> tuple:
        """(the open shard of sequence `index`, its metadata, its tensor names), opened once."""
        shard = index // self.shard_size
        if shard not in self._open:
            handle = safe_open(str(self.shard_file(shard)), framework="pt")
            metadata = handle.metadata() or {}
            stored = metadata.get("feature_format", "bf16")
            if stored != self.format:  # never misread: `prepare` and `build` rebuild such a shard first
                raise SpecforgeError(f"{self.shard_file(shard)} holds {stored} features, not {self.format}")
            self._open[shard] = (handle, metadata, set(handle.keys()))
        return self._open[shard]

    def _read(self, handle, metadata: dict, name: str, index: int) -> torch.Tensor:
        fmt = hidden_format(self.format)
        parts = {"q": handle.get_tensor(f"{name}.{index}")}
        if fmt == "bf16":
            return parts["q"].float()
        parts["scale"] = handle.get_tensor(f"{name}_scale.{index}")
        return dequantize(parts, fmt, int(metadata[f"{name}_width"]))

    def get(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | dict]:
        """One sequence's features, read through a memory map (random access is cheap) and
        dequantized: `(aux [T, 3H] or None, last [T, H])`, or for int4_topk `(aux, {"values",
        "ids", "in_draft"})`."""
        handle, metadata, names = self._handle(index)
        aux = self._read(handle, metadata, "aux", index) if f"aux.{index}" in names else None
        if stores_last(self.format):
            return aux, self._read(handle, metadata, "last", index)
        return aux, {"values": handle.get_tensor(f"topk.values.{index}"), "ids": handle.get_tensor(f"topk.ids.{index}"),
                     "in_draft": handle.get_tensor(f"in_draft.{index}")}

    def batch(self, indices: list[int], device) -> tuple[torch.Tensor | None, torch.Tensor | SparseTeacher]:
        """Right-padded `(aux [B, T, 3H] or None, last [B, T, H])` for the given sequence indices;
        for int4_topk the second is a `SparseTeacher` (the drafters' preparer reads it)."""
        pairs = [self.get(i) for i in indices]
        lengths = [(a if a is not None else (l_ if torch.is_tensor(l_) else l_["ids"])).shape[0] for a, l_ in pairs]
        width = max(lengths)
        aux = None if pairs[0][0] is None else torch.zeros(len(pairs), width, pairs[0][0].shape[-1])
        for k, (a, _) in enumerate(pairs):
            if aux is not None:
                aux[k, : a.shape[0]] = a
        aux = aux.to(device) if aux is not None else None
        if torch.is_tensor(pairs[0][1]):
            last = torch.zeros(len(pairs), width, pairs[0][1].shape[-1])
            for k, (_, l_) in enumerate(pairs):
                last[k, : l_.shape[0]] = l_
            return aux, last.to(device)
        top_k = pairs[0][1]["ids"].shape[-1]
        values, ids = torch.zeros(len(pairs), width, top_k), torch.zeros(len(pairs), width, top_k, dtype=torch.long)
        in_draft = torch.zeros(len(pairs), width, dtype=torch.bool)
        for k, (_, t) in enumerate(pairs):
            n = t["ids"].shape[0]
            values[k, :n], ids[k, :n], in_draft[k, :n] = t["values"].float(), t["ids"].long(), t["in_draft"].bool()
        return aux, SparseTeacher(values.to(device), ids.to(device), in_draft.to(device))
