"""Choices from what runs (runtime/width_timing.py, dtype_choice.py, target_choice.py, stages/sample_dtype.py):
forwards timed in interleaved rounds, a default left only by a lead the noise cannot make, and the
sample stage's dtype decided once per samples folder and recorded."""

from __future__ import annotations

import json
import platform

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.data.samples import dtype_problem, recorded_dtype, wait_for_recorded_dtype
from specforge_lite.runtime import dtype_choice, target_choice
from specforge_lite.runtime.dtype_choice import choose_cpu_dtype, chosen_dtype, cpu_flags, native_bf16
from specforge_lite.runtime.fast_engine import FastEngine
from specforge_lite.runtime.width_timing import (MIN_MARGIN, clearly_faster, keep_or_replace, margin,
                                                 time_forwards)
from specforge_lite.stages import sample_dtype


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """A runner whose forward of `w` tokens advances `clock` by `cost(w, call index)` seconds and logs the call."""

    def __init__(self, name, clock, calls, cost):
        self.name, self.clock, self.calls, self.cost = name, clock, calls, cost

    def reset(self):
        pass

    def forward(self, ids, last_only=False):
        if not last_only:  # the context's prefill is not a timed forward
            self.clock.now += self.cost(len(ids), len(self.calls))
            self.calls.append((self.name, len(ids)))

    def crop(self, keep):
        pass

    def _sync(self):
        pass


def synthetic(ms: dict, noise: dict) -> dict:
    return {"ms": ms, "noise": noise, "rounds": 5}


def test_the_margin_rule_on_synthetic_timings():
    quiet, noisy = 0.0, 0.08  # relative spreads: the margin is MIN_MARGIN, then 2 x 8%
    assert margin(quiet) == MIN_MARGIN and margin(noisy) == pytest.approx(0.16)
    assert not clearly_faster([4.0, 5.8], [4.0, 6.0], quiet)  # 2% faster: inside MIN_MARGIN
    assert clearly_faster([3.5, 5.0], [4.0, 6.0], quiet)  # 15% faster
    assert not clearly_faster([3.5, 5.0], [4.0, 6.0], noisy)  # 15% is inside twice an 8% noise
    assert clearly_faster([3.0, 4.5], [4.0, 6.0], noisy)  # 25% is not
    ms = {"compiled": {1: 4.0, 4: 6.0}, "static": {1: 3.9, 4: 5.9}, "hf": {1: 3.0, 4: 4.0}}
    assert keep_or_replace(synthetic(ms, {"compiled": 0.01, "static": 0.01, "hf": 0.01}), "compiled") == "hf"
    # the larger noise of the two counts: a noisy candidate cannot win by a lead its own noise makes
    assert keep_or_replace(synthetic(ms, {"compiled": 0.01, "static": 0.01, "hf": 0.2}), "compiled") == "compiled"


def test_time_forwards_interleaves_in_rotated_rounds():
    clock, calls = FakeClock(), []
    costs = {"a": {1: 0.001, 4: 0.002}, "b": {1: 0.003, 4: 0.004}}
    runners = {name: FakeRunner(name, clock, calls, lambda w, i, n=name: costs[n][w]) for name in costs}
    timing = time_forwards(runners, list(range(8)), [4, 1], rounds=3, clock=clock)
    pairs = [("a", 1), ("a", 4), ("b", 1), ("b", 4)]
    rounds = [calls[i:i + 4] for i in range(0, len(calls), 4)]
    assert len(rounds) == 4  # a warm-up round, then 3 timed
    for index, order in enumerate(rounds):  # each round times every pair once, starting one further along
        assert order == pairs[index % 4:] + pairs[:index % 4]
    assert timing["ms"] == {"a": {1: pytest.approx(1.0), 4: pytest.approx(2.0)},
                            "b": {1: pytest.approx(3.0), 4: pytest.approx(4.0)}}
    assert timing["noise"] == {"a": pytest.approx(0.0), "b": pytest.approx(0.0)} and timing["rounds"] == 3


def test_a_drift_while_timing_lands_on_both_alike():
    """Two identical forwards while the machine slows down call by call: interleaved, neither wins
    (timed one after the other, the second would look slower by the drift)."""
    clock, calls = FakeClock(), []
    drifting = lambda w, i: 0.001 * w * (1 + 0.02 * i)  # noqa: E731
    runners = {name: FakeRunner(name, clock, calls, drifting) for name in ("float32", "bfloat16")}
    timing = time_forwards(runners, list(range(8)), [1, 4], rounds=5, clock=clock)
    totals = {name: sum(ms.values()) for name, ms in timing["ms"].items()}
    assert abs(totals["bfloat16"] / totals["float32"] - 1) < MIN_MARGIN
    assert keep_or_replace(timing, "float32") == "float32" and keep_or_replace(timing, "bfloat16") == "bfloat16"


def test_a_cpu_without_native_bf16_stays_float32_untimed(tiny_target):
    model, _ = tiny_target
    chosen, info = choose_cpu_dtype(model, [1, 4], native=False)
    assert chosen is model and chosen.dtype == torch.float32
    assert info["used"] == "float32" and info["measured_ms"] == {} and "no native bf16" in info["reason"]


@pytest.mark.parametrize("bf16_total,noise,used", [(0.97, 0.0, "float32"), (0.7, 0.0, "bfloat16"),
                                                   (0.8, 0.15, "float32"), (0.5, 0.15, "bfloat16")])
def test_bf16_is_kept_only_when_clearly_faster(tiny_target, monkeypatch, bf16_total, noise, used):
    """choose_cpu_dtype leaves float32 only by more than the margin (timings stubbed: the rule is under test)."""
    model, _ = tiny_target

    def timed(runners, context, widths, rounds):
        assert set(runners) == {"float32", "bfloat16"} and widths == [1, 4]
        return synthetic({"float32": {1: 4.0, 4: 6.0}, "bfloat16": {1: 4.0 * bf16_total, 4: 6.0 * bf16_total}},
                         {"float32": noise, "bfloat16": noise})

    monkeypatch.setattr(dtype_choice, "time_forwards", timed)
    chosen, info = choose_cpu_dtype(model, [4], native=True)
    assert info["used"] == used and str(chosen.dtype) == f"torch.{used}"
    assert info["noise"] == {"float32": noise, "bfloat16": noise} and "noise" in info["margin_rule"]
    assert info["timed_forward"] == {"float32": "static (eager)", "bfloat16": "static (eager)"}
    assert model.dtype == torch.float32  # the loaded target is never cast in place


def test_native_bf16_times_both_on_the_forward_given(tiny_target):
    model, _ = tiny_target
    chosen, info = choose_cpu_dtype(model, [1, 4], rounds=2, native=True)
    measured = info["measured_ms"]
    assert set(measured) == {"float32", "bfloat16"} and all(set(ms) == {1, 4} for ms in measured.values())
    assert all(v > 0 for ms in measured.values() for v in ms.values()) and set(info["noise"]) == set(measured)
    if info["used"] == "bfloat16":  # a copy with the same weights, rounded
        for a, b in zip(model.parameters(), chosen.parameters()):
            assert torch.equal(a.to(torch.bfloat16), b)


def test_eval_engine_auto_keeps_its_default_inside_the_noise(tiny_target, monkeypatch):
    """build_target_engine(auto): hf replaces the default (static here: compiling is stubbed to fail)
    only by more than the margin."""
    model, _ = tiny_target
    monkeypatch.setattr(FastEngine, "compile", lambda self: (_ for _ in ()).throw(RuntimeError("no compiler")))
    for hf_total, used in ((0.97, "static"), (0.6, "hf")):
        monkeypatch.setattr(target_choice, "time_forwards", lambda runners, context, widths, rounds, t=hf_total:
                            synthetic({"hf": {1: 4.0 * t, 4: 6.0 * t}, "static": {1: 4.0, 4: 6.0}},
                                      {"hf": 0.01, "static": 0.01}))
        chosen = target_choice.build_target_engine(model, "auto", 64, (), 4)
        assert chosen.info["used"] == used and chosen.info["default"] == "static"
        assert chosen.info["noise"] == {"hf": 0.01, "static": 0.01} and "fallback" in chosen.info


def test_a_named_dtype_is_used_as_loaded(tiny_target):
    model, _ = tiny_target
    chosen, info = chosen_dtype(OmegaConf.create({"dtype": "float32"}), model, [1, 4])
    assert chosen is model and info == {"requested": "float32", "used": "float32", "reason": "target.dtype=float32"}


def test_evaluate_times_the_package_it_compiles(tiny_target, monkeypatch):
    """auto with eval.engine compiled/auto times evaluate's compiled shape; static and hf time the eager forward."""
    model, _ = tiny_target
    shapes = []
    monkeypatch.setattr(dtype_choice, "choose_cpu_dtype", lambda m, widths, compiled: shapes.append(compiled))
    auto = OmegaConf.create({"dtype": "auto"})
    for engine in ("compiled", "auto", "static", "hf"):
        chosen_dtype(auto, model, [1, 4], engine, 128, 4)
    assert shapes == [dtype_choice.CompiledShape(128, (), 4)] * 2 + [None] * 2


def test_native_bf16_reads_the_machine():
    flags = cpu_flags()
    if platform.machine().lower() in ("x86_64", "amd64") and flags:
        assert native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
    assert isinstance(native_bf16(), bool)


def samples_folder(tmp_path, stamp="abc", used="bfloat16", shard=True):
    """A samples folder as the sample stage leaves it: meta.json recording the dtype, one written shard."""
    (tmp_path / "data").mkdir()
    (tmp_path / "meta.json").write_text(json.dumps({"fingerprint": stamp, "target_dtype": {"used": used}}))
    if shard:
        (tmp_path / "data" / "shard-00000.parquet").write_bytes(b"")
        (tmp_path / "data" / "shard-00000.stats.json").write_text(json.dumps({"fingerprint": stamp,
                                                                              "target_dtype": used}))
    return tmp_path


def test_the_samples_record_their_dtype_and_refuse_another(tmp_path):
    out = samples_folder(tmp_path)
    assert recorded_dtype(out, "abc") == "bfloat16" and recorded_dtype(out, "other settings") is None
    (out / "meta.json").write_text('{"damaged')  # the shards' own record decides
    assert recorded_dtype(out, "abc") == "bfloat16"
    assert dtype_problem(out, "bfloat16", "auto") is None and dtype_problem(out, "bfloat16", "bfloat16") is None
    problem = dtype_problem(out, "bfloat16", "float32")
    assert f"{out} holds samples the target drew in bfloat16; target.dtype=float32 would mix" in problem
    assert "set target.dtype=bfloat16" in problem
    cfg = OmegaConf.create({"target": {"dtype": "float32"}})
    with pytest.raises(SpecforgeError, match="would mix float32 and bfloat16 shards"):
        sample_dtype.samples_dtype(cfg, out, "abc")


def test_auto_resumes_in_the_recorded_dtype(tmp_path):
    out = samples_folder(tmp_path)
    record, load_cfg = sample_dtype.samples_dtype(OmegaConf.create({"target": {"dtype": "auto"}}), out, "abc")
    assert record["used"] == "bfloat16" and load_cfg.target.dtype == "bfloat16"
    cfg = OmegaConf.create({"target": {"dtype": "auto"}, "sample": {"batch_size": 2}})
    model, info = sample_dtype.decided_dtype(cfg, torch.nn.Linear(2, 2), out, "abc", 0, record)
    assert model.weight.dtype == torch.bfloat16 and info["used"] == "bfloat16"


def test_other_ranks_follow_rank_0s_timed_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(sample_dtype, "timed_choice", lambda target_cfg, model: True)
    cfg = OmegaConf.create({"target": {"dtype": "auto"}, "sample": {"batch_size": 2}})
    out = samples_folder(tmp_path, shard=False)  # rank 0 chose and recorded bf16 before writing any shard
    model, info = sample_dtype.decided_dtype(cfg, torch.nn.Linear(2, 2), out, "abc", 1, None)
    assert model.weight.dtype == torch.bfloat16 and info["used"] == "bfloat16"
    (out / "meta.json").unlink()
    with pytest.raises(SpecforgeError, match="sample rank 1 waited 0 s for rank 0 to record the dtype"):
        wait_for_recorded_dtype(out, "abc", 1, timeout_s=0.05, poll_s=0.01)
