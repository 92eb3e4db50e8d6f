"""The issues' goals a record checks: benchmarks/goals.yaml, keyed by the results file a record
writes, checked against what the run measured; the verdicts go into that file's `goals` field.

A goal of an evaluate report names a method and one of its measures (`tau`, `speedup`,
`tokens_per_s`, `draft_ms_per_token`, a dotted path such as `best_k.expected_speedup`) and says
what the measure must do:

    at_least / at_most: N        the measure against a bound; with `over: OTHER` the ratio to
                                 OTHER's measure, `gain_over: OTHER` that ratio less one,
                                 `excess_over: OTHER` (measure - 1) / (OTHER's - 1): tau beyond
                                 the one token every decoding step makes
    ahead_of: OTHER              its point estimate above OTHER's
    apart_from: OTHER            its 95% interval (`<measure>_ci`) wholly above OTHER's
    ahead_of_all: [EXCEPT, ...]  above every other method of the report but those
    deploy: METHOD               the report's recommendation deploys METHOD (no measure)
    deploy_one_of: [M, ...]      it deploys one of these (those the report has)

A goal of one figure (`value: what it is` and a bound) is checked with `check_value`. `{name}` in
a key or a method is filled in by the record (the run's k, a DFlash method's name); `for_each:
[a, b]` repeats a goal with `{each}` filled in. A goal whose methods the report lacks is left
out: a verdict says what was compared and whether it held, {"value", "met", "goal", "note"}.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specforge_lite import SpecforgeError
from specforge_lite.records.results import ROOT

GOALS = ROOT / "benchmarks" / "goals.yaml"
KINDS = ("at_least", "at_most", "ahead_of", "apart_from", "ahead_of_all", "deploy", "deploy_one_of")


def goals_of(name: str, fallback: str | None = None, path: Path | None = None) -> dict:
    """The goals of results file `name` in benchmarks/goals.yaml, else those of `fallback`
    (the record's own results file); {} when neither has an entry."""
    path = path or GOALS
    try:
        table = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise SpecforgeError(f"{path}: cannot read the goals ({str(err).splitlines()[0]})") from None
    if not isinstance(table, dict):
        raise SpecforgeError(f"{path}: the goals are a mapping of results file name -> goals")
    entry = table.get(name, table.get(fallback, {}) if fallback else {})
    return entry or {}


def _measure(entry: dict, path: str):
    value = entry
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fill(value, names: dict):
    if isinstance(value, str):
        return value.format(**names)
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    return value


def _verdict(value, met: bool, goal: str, note: str = "") -> dict:
    return {"value": value, "met": bool(met), "goal": goal, **({"note": note} if note else {})}


def _bounded(value, spec: dict, what: str) -> dict:
    """`value` against the spec's at_least / at_most."""
    if "at_least" in spec:
        bound, met, sign = spec["at_least"], value is not None and value >= spec["at_least"], ">="
    else:
        bound, met, sign = spec["at_most"], value is not None and value <= spec["at_most"], "<="
    return _verdict(value, met, f"{what} {sign} {bound:g}", spec.get("note", ""))


def check_one(spec: dict, report: dict) -> dict | None:
    """The verdict of one goal (its placeholders filled) on an evaluate report; None when the
    report lacks a method it compares (or a ratio has no base)."""
    methods, kind = report["methods"], next((k for k in KINDS if k in spec), None)
    if kind is None:
        raise SpecforgeError(f"goal {spec}: say what it checks ({', '.join(KINDS)})")
    method = spec.get("method")
    if kind == "deploy":
        if spec["deploy"] not in methods:
            return None
        deploy = (report.get("recommendation") or {}).get("deploy")
        return _verdict(deploy, deploy == spec["deploy"], f"the report deploys {spec['deploy']}", spec.get("note", ""))
    if kind == "deploy_one_of":
        choices = [m for m in spec["deploy_one_of"] if m in methods]
        if not choices:
            return None
        deploy = (report.get("recommendation") or {}).get("deploy")
        return _verdict(deploy, deploy in choices, f"the report deploys one of {', '.join(choices)}",
                        spec.get("note", ""))
    measure = spec["measure"]
    other = next((spec[k] for k in ("over", "gain_over", "excess_over", "ahead_of", "apart_from") if k in spec), None)
    if method not in methods or (other is not None and other not in methods):
        return None
    mine = _measure(methods[method], measure)
    if kind == "ahead_of_all":
        rest = [v for name, m in methods.items() if name not in (method, *spec["ahead_of_all"])
                and (v := _measure(m, measure)) is not None]
        met = mine is not None and all(mine > v for v in rest)
        return _verdict([mine, max(rest, default=None)], met, f"{method} {measure} above every other method's",
                        spec.get("note", ""))
    if kind == "ahead_of":
        theirs = _measure(methods[other], measure)
        met = mine is not None and theirs is not None and mine > theirs
        return _verdict([mine, theirs], met, f"{method} {measure} above {other}'s", spec.get("note", ""))
    if kind == "apart_from":
        a, b = _measure(methods[method], f"{measure}_ci"), _measure(methods[other], f"{measure}_ci")
        return _verdict([a, b], bool(a and b) and a[0] > b[1], f"{method} {measure} interval above {other}'s",
                        spec.get("note", ""))
    theirs = _measure(methods[other], measure) if other is not None else None
    if other is None:
        value, what = mine, f"{method} {measure}"
    elif None in (mine, theirs) or ("excess_over" in spec and theirs <= 1):
        return None
    elif "excess_over" in spec:
        value, what = (mine - 1) / (theirs - 1), f"{method} ({measure} - 1) / {other}'s"
    else:
        value = mine / theirs - (1 if "gain_over" in spec else 0)
        what = f"{method} {measure} / {other}'s" + (" - 1" if "gain_over" in spec else "")
    verdict = _bounded(value, spec, what)
    if other is not None and methods[method].get("k") and methods[other].get("k") and "note" in verdict:
        verdict["note"] += f" (k {methods[method]['k']} / {methods[other]['k']})"
    return verdict


def check(goals: dict, report: dict, **names) -> dict:
    """{key: verdict} of every goal of `goals` (key -> spec) that the report can answer, keys and
    methods filled in with `names` (and `{each}` for a goal with `for_each`)."""
    verdicts = {}
    for key, spec in goals.items():
        for each in spec.get("for_each", [None]):
            filled = {**names, **({"each": each} if each is not None else {})}
            try:
                one, name = {k: _fill(v, filled) for k, v in spec.items() if k != "for_each"}, _fill(key, filled)
            except KeyError as err:
                raise SpecforgeError(f"goal {key}: this record fills in no {{{err.args[0]}}}") from None
            if (verdict := check_one(one, report)) is not None:
                verdicts[name] = verdict
    return verdicts


def check_value(goals: dict, key: str, value: float) -> dict:
    """{key: verdict} of a goal of one figure (`value: what it is` and a bound) for `value`; {}
    when `goals` has no such goal."""
    spec = goals.get(key)
    return {key: _bounded(value, spec, spec.get("value", key))} if spec else {}


def lines(verdicts: dict) -> list[str]:
    """One line per verdict, for a record's section: '- key: value -> met (goal; note)'."""
    def shown(value):
        if isinstance(value, float):
            return f"{value:.2f}"
        if isinstance(value, list):
            return "[" + ", ".join(shown(v) for v in value) + "]"
        return str(value)

    return [f"- {key}: {shown(v['value'])} -> {'met' if v['met'] else 'NOT met'} ({v['goal']}"
            + (f"; {v['note']})" if v.get("note") else ")") for key, v in verdicts.items()]
