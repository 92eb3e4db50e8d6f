"""A GGUF export where llama.cpp (xllamacpp) cannot be imported: the files are written, the
console says they were never loaded in llama.cpp, and export.json marks them unchecked."""

from __future__ import annotations

import json
import sys

from tests.integration.test_bad_inputs import in_process

SMOKE = ["+recipe=smoke", "drafter.aux_layer_ids=null", "train.max_steps=4"]


def test_gguf_export_without_xllamacpp_says_unchecked(tmp_path, monkeypatch, capsys):
    assert in_process("train", *SMOKE, f"run_dir={tmp_path}") == 0
    monkeypatch.setitem(sys.modules, "xllamacpp", None)  # `import xllamacpp` raises ImportError, as when absent
    capsys.readouterr()
    assert in_process("export", *SMOKE, f"run_dir={tmp_path}", "export.gguf=true") == 0
    console = "".join(capsys.readouterr())
    assert "export/gguf is UNCHECKED: never loaded in llama.cpp (xllamacpp is not installed" in console, console
    gguf = json.loads((tmp_path / "export" / "export.json").read_text())["gguf"]
    assert gguf["checked"] is False and gguf["load_check"]["ran"] is False
    assert (tmp_path / "export" / "gguf" / "eagle3.gguf").is_file()
    assert "Not loaded in llama.cpp here" in (tmp_path / "export" / "gguf" / "README.md").read_text()
