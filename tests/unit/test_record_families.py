"""The family x stage x engine table (`python -m specforge_lite families`, records/families.py):
read from a JUnit file of the family tests as pytest writes it, rendered cell by cell."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specforge_lite.records import families


def test_the_table_is_the_outcome_of_each_family_test(tmp_path):
    """A real pytest run of a stand-in test file with the family tests' names and ids (one passes,
    one fails, one records the forward evaluate used, one a family the door refuses) gives those outcomes, cell by cell."""
    tests = tmp_path / "test_stand_in.py"
    tests.write_text('''
import pytest

@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_every_stage_runs_each_family_on_its_forward(family, record_property):
    record_property("engine", "static" if family == "qwen3" else "hf")
    record_property("fallback", "" if family == "qwen3" else "the static forward does not support model_type 'gpt_oss'")

@pytest.mark.parametrize("family", ["qwen3_next"])
def test_what_a_family_cannot_run_is_refused_at_the_door(family, record_property):
    record_property("refused", "model_type 'qwen3_next' cannot run them")

@pytest.fixture(params=["qwen3"])
def family_model(request):
    return request.param

@pytest.mark.parametrize("compiled", [False, True], ids=["static", "compiled"])
def test_greedy_speculative_decoding_is_plain_decoding(family_model, compiled):
    assert not compiled, "a planted failure"
''')
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={junit}",
                    "-o", "junit_family=xunit1"], cwd=tmp_path, capture_output=True)
    found = families.outcomes(junit)
    assert found == {"qwen3": {"stages": "passed", "engine": "static", "fallback": "",
                               "static_identity_static": "passed", "static_identity_compiled": "failed"},
                     "gpt_oss": {"stages": "passed", "engine": "hf",
                                 "fallback": "the static forward does not support model_type 'gpt_oss'"},
                     "qwen3_next": {"door": "passed", "refused": "model_type 'qwen3_next' cannot run them"}}
    rows = families.table({"date": "2026-11-27 23:00", "machine": "m", "commit": "abc", "families": found})
    assert "| `qwen3` | yes / - | static | - | - | yes / FAILED | - | - |" in rows
    assert "| `gpt_oss` | yes / - | hf | - | - | - / - | - | model_type 'gpt_oss' |" in rows
    assert "| `qwen3_next` | refused at the door (yes) | - | - | - | - / - | - | model_type 'qwen3_next' cannot " \
           "run them |" in rows


def test_families_leaves_no_test_folders_behind(tmp_path, monkeypatch):
    """`make families` ran pytest with its default base folder, and each run left its tests' temp
    folders (tens of MB) in the system's temp folder (issue 65): now they live and die with the run's own."""
    from specforge_lite.records import results

    seen = tmp_path / "seen.txt"
    tests = tmp_path / "test_stand_in.py"
    tests.write_text(f'''
import pytest

@pytest.mark.parametrize("family", ["qwen3"])
def test_every_stage_runs_each_family_on_its_forward(family, tmp_path, record_property):
    (tmp_path / "weights.bin").write_bytes(b"0" * 1024)
    open({str(seen)!r}, "w").write(str(tmp_path))
    record_property("engine", "static")
''')
    monkeypatch.setattr(families, "TESTS", [str(tests)])
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    assert families.main([]) == 0
    assert json.loads((tmp_path / "results" / "families.json").read_text())["families"]["qwen3"]["stages"] == "passed"
    folder = Path(seen.read_text())
    assert folder.name.startswith("test_every_stage") and not folder.exists(), folder
