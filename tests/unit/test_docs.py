"""The recipe cards and README quote measured figures only from benchmarks/results (make docs:
`specforge_lite/records/docs.py`)."""

from __future__ import annotations

import json
import re

import pytest

from specforge_lite.records import docs, results, topics

# eagle_smollm2's card before its figures were generated: a replaced run's numbers typed by hand
OLD_CARD = """Measured on 2 CPU cores, fp32, 2026-11-24 (`docs/BENCHMARKS.md`, section
eval_eagle_smollm2; the sampling and training figures from the 2026-11-22 `make demo` on a
fresh clone: 22 min 43 s for the whole run, sampling 2.5 min, training 14.5 min, after a
53 s `make setup`): `evaluate` took 10 min 43 s, of which about 2.5 min compiling the
target's and drafters' forwards. Plain decoding on our compiled engine ran 61.8 tokens/s,
2.74x Hugging Face `generate`. EAGLE-3: tau 1.43 [1.38, 1.49] and 1.04x [0.99, 1.09]
plain at k = 3; at k = 1, the best k the report models, 1.12x [1.06, 1.17].
"""


def test_cards_and_readme_match_their_results_files():
    assert docs.problems() == []


def test_readme_and_measured_cards_have_generated_blocks():
    assert "<!-- results:glance -->" in docs.README.read_text()
    for card in ("eagle_smollm2", "peagle_smollm2", "distill_smollm2", "medusa_smollm2", "compare_smollm2"):
        assert docs.BLOCK.search((docs.ROOT / "recipes" / card / "README.md").read_text()), card


def test_a_changed_figure_in_a_block_is_caught():
    card = (docs.ROOT / "recipes" / "eagle_smollm2" / "README.md").read_text()
    assert docs.stale_blocks(card) == []
    body = docs.render_block("eval_eagle_smollm2")
    changed = card.replace(body, body.replace("| eagle3 | 1.", "| eagle3 | 2.", 1))
    assert changed != card
    assert docs.stale_blocks(changed) == ["eval_eagle_smollm2"]


def test_figures_typed_outside_the_blocks_are_caught():
    found = docs.outside_figures(OLD_CARD)
    for figure in ("22 min", "61.8 tokens/s", "2.74x", "1.04x", "1.12x"):
        assert figure in found
    # the same figures inside a block, in code or as goals are not hand-typed measurements
    block = "<!-- results:x -->\nplain 61.8 tokens/s, 1.04x\n<!-- /results:x -->\n"
    assert docs.outside_figures(block + "`make demo  # 3 min`\ngoal: tau at least 2.5, speedup >= 1.4x\n") == []


def test_benchmarks_doc_by_topic_keeps_the_sections_scripts_update():
    text = topics.DOC.read_text()
    _, sections = topics.split(text)
    ordered = topics.order_benchmarks(text)
    assert topics.order_benchmarks(ordered) == ordered
    kept = {name for name in sections if not topics.superseded(name)}
    for name in kept:
        assert f"<!-- {name} -->" in ordered and f"<!-- /{name} -->" in ordered
    assert "<!-- docs:toc -->" in ordered


def test_a_superseded_section_is_left_out_and_a_new_one_is_filed_by_topic():
    doc = ("# Benchmarks\n\nintro\n\n<!-- engine -->\n## Old forward\n<!-- /engine -->\nreading\n\n"
           "<!-- engine_avx512 -->\n## New forward\n<!-- /engine_avx512 -->\n\n"
           "<!-- llamacpp_laptop -->\n## llama.cpp on a laptop\n<!-- /llamacpp_laptop -->\n")
    ordered = topics.order_benchmarks(doc)
    assert "Old forward" not in ordered and "reading" not in ordered
    assert ordered.index("# Serving engines") < ordered.index("## llama.cpp on a laptop")
    assert "- [Engine: the target's forward](#engine-the-targets-forward)" in ordered


# --- README as a guide, the reference in docs/ ------------------------------------------------

GUIDE_FILES = [docs.README, *docs.GUIDES]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PLACEHOLDER_PARTS = {"NAME", "linear"}  # docs/ADDING_A_DRAFTER.md's example drafter, a name to fill in


def test_readme_is_a_guide_of_at_most_400_lines():
    assert len(docs.README.read_text().splitlines()) <= 400


def test_readme_links_every_doc_and_every_doc_it_links_exists():
    text = docs.README.read_text()
    named = set(re.findall(r"\bdocs/[\w.\-]+\.md", text))
    assert named, "README links no docs/ file"
    assert sorted(n for n in named if not (docs.ROOT / n).is_file()) == []
    on_disk = {f"docs/{p.name}" for p in (docs.ROOT / "docs").glob("*.md")}
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    assert sorted(on_disk - linked) == [], "a docs/ file README does not link"


def test_links_between_the_guides_reach_a_file_and_a_heading():
    broken = []
    for path in [*GUIDE_FILES, docs.ROOT / "recipes" / "README.md"]:
        for target in LINK.findall(path.read_text()):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.is_file():
                broken.append(f"{path.relative_to(docs.ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                seen: dict[str, int] = {}
                anchors = {topics.slug(head, seen) for _, head in docs.headings(dest.read_text())}
                if anchor not in anchors:
                    broken.append(f"{path.relative_to(docs.ROOT)}: {target} (no such heading)")
    assert broken == []


def test_module_paths_the_guides_name_exist():
    """Paths of the package, tests and benchmarks, and `python -m` modules, that README, the
    docs/ guides and recipes/README.md name (docs/BENCHMARKS.md's commands are records of
    past runs and keep the paths they ran with)."""
    missing = []
    for path in [*GUIDE_FILES, docs.ROOT / "recipes" / "README.md"]:
        text = path.read_text()
        files = re.findall(r"\b(?:specforge_lite|tests|benchmarks)/[\w/.\-]+\.py\b", text)
        modules = [m.replace(".", "/") for m in re.findall(r"python -m ((?:specforge_lite|benchmarks)(?:\.\w+)+)", text)]
        for name in files + [m + ".py" for m in modules]:
            if PLACEHOLDER_PARTS & set(name.split("/")):
                continue
            if not (docs.ROOT / name).is_file() and not (docs.ROOT / name[:-3] / "__main__.py").is_file():
                missing.append(f"{path.relative_to(docs.ROOT)}: {name}")
    assert missing == []


def test_readme_and_each_guide_carry_an_up_to_date_contents_list():
    assert docs.GUIDES, "no docs/ guides"
    for path in GUIDE_FILES:
        text = path.read_text()
        assert docs.CONTENTS.search(text), f"{path.name} has no <!-- docs:contents --> block"
        assert docs.fill_guide(text) == text, f"{path.name}: contents list is stale (make docs)"


def test_a_stale_contents_list_is_caught():
    guide = "# Guide\n\n<!-- docs:contents -->\n<!-- /docs:contents -->\n\n## One\n\n```\n## not a heading\n```\n\n### Sub\n"
    filled = docs.fill_guide(guide)
    block = docs.CONTENTS.search(filled).group(0)
    assert block == "<!-- docs:contents -->\n- [One](#one)\n  - [Sub](#sub)\n<!-- /docs:contents -->"
    assert docs.fill_guide(filled.replace("## One", "## Renamed")) != filled.replace("## One", "## Renamed")


def test_no_doc_repeats_a_heading():
    assert docs.duplicate_headings("# A\n## B\n```\n## B\n```\n### C\n") == []  # code is no heading
    assert docs.duplicate_headings("## C\n### C\n") == ["C"]  # one anchor for both, whatever the level
    assert docs.duplicate_headings("## Target forward (AVX2)\ntext\n## Target forward (AVX2)\n") == [
        "Target forward (AVX2)"]
    for path in [docs.README, *sorted((docs.ROOT / "docs").glob("*.md"))]:
        assert docs.duplicate_headings(path.read_text()) == [], path.name


KEY = re.compile(r"(?<![\w./])((?:train|sample|eval|drafter|trainer|export|data|target)(?:\.[a-z_0-9]+)+)")
NOT_KEYS = {"eval.draft_model"}  # a removed key SETTINGS.md says is refused with its new name


def test_config_keys_the_guides_name_exist(compose_cfg):
    """Every `group.key` README, the docs/ guides and recipes/README.md name is a key of the
    composed config under some drafter (file names such as export.json and Python attribute
    paths such as target.config.* are not keys)."""
    from omegaconf import OmegaConf

    from specforge_lite.drafters.registry import DRAFTERS

    configs = [OmegaConf.to_container(compose_cfg([f"drafter={name}"])) for name in DRAFTERS]

    def known(key: str) -> bool:
        for node in configs:
            for part in key.split("."):
                node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
            if node is not KeyError:
                return True
        return False

    unknown = []
    for path in [*GUIDE_FILES, docs.ROOT / "recipes" / "README.md"]:
        for key in sorted(set(KEY.findall(path.read_text()))):
            if key.rsplit(".", 1)[-1] in ("json", "py", "gguf", "md") or key.startswith("target.config."):
                continue
            if key not in NOT_KEYS and not known(key):
                unknown.append(f"{path.relative_to(docs.ROOT)}: {key}")
    assert unknown == []


# --------------------------------------------------------------------------- troubleshooting entries

# the functions whose one-line errors and warnings (issue 42: locks, dead ranks, manifests, the vLLM
# fallback, unhealthy training, damaged shards and caches, refused drafters) each need an entry
TROUBLESHOOTING = docs.ROOT / "docs" / "TROUBLESHOOTING.md"
ENTRIES = {
    "specforge_lite/run_folders.py": ["take_lock", "place_files"],
    "specforge_lite/scale/launch.py": ["failure_line", "stopped_line", "next_step"],
    "specforge_lite/stages/sample.py": ["backend_name", "open_backend", "stale_samples"],
    "specforge_lite/training/health.py": ["no_loss_position", "diverged_message", "require_loss_positions",
                                         "require_finite_drafter"],
    "specforge_lite/drafters/common.py": ["require_finite"],
    "specforge_lite/targets/digest.py": ["*"],
    "specforge_lite/data/samples.py": ["shard_problem", "answer_corpus", "dtype_problem", "wait_for_recorded_dtype"],
    "specforge_lite/training/features.py": ["prepare", "_intact"],
    "specforge_lite/serving/llamacpp/files.py": ["target_gguf", "load_check"],
    "specforge_lite/serving/llamacpp/methods.py": ["check_drafted"],
    "specforge_lite/drafters/methods.py": ["branch_problem", "length_problem", "no_methods", "best_k_problem"],
    "specforge_lite/__main__.py": ["unresolved"],
    "specforge_lite/runtime/hf_runner.py": ["rollback_problem", "cache_problem", "role_problem"],
    "specforge_lite/training/checkpoints.py": ["check_written_by", "other_inputs"],
    "specforge_lite/targets/model_types.py": ["check_model_type"],
    "specforge_lite/targets/loading.py": ["check_layer_count"],
    "specforge_lite/measurement/metrics.py": ["cost_curve_note"],
    "specforge_lite/records/results.py": ["read_results", "write_results", "shaped"],
    "specforge_lite/records/docs.py": ["render_block"],
    "specforge_lite/data/eval_prompts.py": ["dataset_problem", "tasks_overlap", "heldout_problem"],
    "specforge_lite/stages/export.py": ["evaluated"],
    "specforge_lite/decoding/arctic.py": ["missing_problem"],
    "specforge_lite/data/formats.py": ["format_problem"],
    "specforge_lite/serving/vllm/load.py": ["schedule_problem"],
    "specforge_lite/serving/vllm/methods.py": ["gpu_runner_problem"],
    "specforge_lite/stages/door.py": ["engine_problem", "temperature_problems"],
}
# messages inside functions that raise many others: (module, the phrase its message opens with)
PHRASES = [("specforge_lite/stages/export.py", "export/gguf is UNCHECKED: never loaded in llama.cpp"),
           ("specforge_lite/scale/rank_side.py", "128 + signal.SIGHUP"),
           ("specforge_lite/drafters/methods.py", "the most drafts one step verifies"),
           ("specforge_lite/config/schema.py", "the drafts one step verifies; evaluate times a target forward"),
           ("specforge_lite/stages/train.py", "the earlier run's checkpoints moved to"),
           ("specforge_lite/scale/rendezvous.py", "another process listens on it on this machine"),
           ("specforge_lite/scale/rendezvous.py", "the name does not resolve to an address"),
           ("specforge_lite/stages/door.py", "drafter, and this run trains drafter="),
           ("specforge_lite/stages/sample.py", "read; give a smaller fraction"),
           ("specforge_lite/stages/export.py", "no such folder; name a trained"),
           ("specforge_lite/drafters/methods.py", "is a tree method: eval.tree (depth, branch, nodes) shapes what it"),
           ("specforge_lite/serving/vllm/load.py", "the load is measured through vLLM, and"),
           ("specforge_lite/serving/vllm/load.py", "the schedule vLLM takes starts at batch size 1"),
           ("specforge_lite/serving/vllm/load.py", "vLLM would refuse it"),
           ("specforge_lite/serving/vllm/report.py", "vLLM at load failed")]


def words(text: str) -> str:
    """Lower-case words only, without punctuation."""
    return " ".join(re.sub(r"[^a-z0-9.]+", " ", text.lower()).split())


def message_openings(path, functions: list[str]) -> list[str]:
    """The first three words of the longest literal piece of every message that `functions` of
    `path` raise (SpecforgeError and kin), log at warning level or above, or build as a line."""
    import ast

    tree = ast.parse((docs.ROOT / path).read_text())
    chosen = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Module))
              and (getattr(n, "name", "*") in functions)]
    openings = []
    for function in chosen:
        for node in ast.walk(function):
            call = node.exc if isinstance(node, ast.Raise) else node
            if isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute)):
                name = call.func.id if isinstance(call.func, ast.Name) else call.func.attr
                if not (name.endswith("Error") or name in ("warning", "error")) or not call.args:
                    continue
                message = call.args[0]
            elif isinstance(node, ast.Return) and isinstance(node.value, (ast.JoinedStr, ast.BinOp)):
                message = node.value
            else:
                continue
            pieces = [piece for c in ast.walk(message) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                      for piece in re.split(r"%[-.0-9]*[sdfgr]", c.value)]
            longest = max(pieces, key=lambda p: len(words(p)), default="")
            if len(words(longest).split()) >= 3:
                openings.append(" ".join(words(longest).split()[:3]))
    return list(dict.fromkeys(openings))


def test_every_new_error_has_a_troubleshooting_entry():
    """Each message of ENTRIES' functions opens with words TROUBLESHOOTING.md quotes: a message
    added there without an entry fails this test."""
    text = words(TROUBLESHOOTING.read_text())
    missing = {}
    for path, functions in ENTRIES.items():
        openings = message_openings(path, functions)
        assert openings, f"{path} {functions}: no message found (renamed? update ENTRIES)"
        if absent := [o for o in openings if o not in text]:
            missing[path] = absent
    assert not missing, f"messages without an entry in docs/TROUBLESHOOTING.md: {missing}"
    for path, phrase in PHRASES:
        assert phrase in (docs.ROOT / path).read_text(), f"{path} no longer says {phrase!r}: update PHRASES"
    assert "export/gguf is UNCHECKED" in TROUBLESHOOTING.read_text() and "128+N" in TROUBLESHOOTING.read_text()
    for _, phrase in PHRASES[2:]:
        assert words(phrase) in text, f"docs/TROUBLESHOOTING.md does not quote {phrase!r}"


@pytest.mark.parametrize("name,damage", [("eval_eagle_smollm2", b'{"date": "2026-11-2'),
                                         ("gpu_check_nvidia_h200", b"\xff\xfe not text"),
                                         ("eval_eagle_smollm2", "no tau"),
                                         # whole JSON of the wrong shape, or a record without its commit (issue 65)
                                         ("eval_eagle_smollm2", "methods a list"),
                                         ("gpu_check_nvidia_h200", "steps a list"),
                                         ("eval_eagle_smollm2", "no commit")])
def test_a_damaged_results_file_stops_make_docs_in_one_line_naming_it(tmp_path, monkeypatch, capsys, name, damage):
    """make docs (and --check) on a results file that is not JSON: one `error:` line naming the file,
    exit 2, nothing written (it used to be a JSONDecodeError naming no file)."""
    import shutil

    from specforge_lite.__main__ import run_tool

    copy = tmp_path / "benchmarks" / "results"
    shutil.copytree(results.RESULTS, copy)
    if isinstance(damage, str):  # whole JSON: one figure missing was published as '-' with exit 0
        d = json.loads((copy / f"{name}.json").read_text())
        if damage == "no tau":
            del docs.report_of(d)["methods"]["eagle3"]["tau"]
        elif damage == "methods a list":
            docs.report_of(d)["methods"] = list(docs.report_of(d)["methods"])
        elif damage == "steps a list":
            d["steps"] = list(d["steps"])
        else:  # published as `commit ?`
            del d["commit"]
        (copy / f"{name}.json").write_text(json.dumps(d))
    else:
        (copy / f"{name}.json").write_bytes(damage)
    monkeypatch.setattr(results, "RESULTS", copy)
    monkeypatch.setattr(results, "ROOT", tmp_path)
    readme = tmp_path / "README.md"  # what `make docs` would rewrite: a copy, the only file it reaches
    original = docs.README.read_text()
    readme.write_text(original)
    monkeypatch.setattr(topics, "DOC", tmp_path / "BENCHMARKS.md")
    monkeypatch.setattr(docs, "README", readme)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "GUIDES", [])
    monkeypatch.setattr(docs, "CARDS", [])
    for argv in (["--check"], []):
        assert run_tool("docs", argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: results file benchmarks/results/{name}.json"), err
        assert "run again the benchmark that writes it" in err and "Traceback" not in err, err
        assert damage != "no tau" or "method eagle3 has no tau" in err, err
    assert readme.read_text() == original
    assert not (tmp_path / "BENCHMARKS.md").exists()


def test_the_docs_name_every_registered_drafter_and_each_of_its_options():
    """README's drafter list and SETTINGS.md name every drafter of the registry; SETTINGS.md
    names each of its options (`drafter.KEY` or `KEY`), so a new drafter or option without
    docs fails here."""
    import dataclasses

    from specforge_lite.drafters.registry import DRAFTERS

    readme = (docs.ROOT / "README.md").read_text()
    settings = (docs.ROOT / "docs" / "SETTINGS.md").read_text()
    drafters_section = settings.split("## Drafters", 1)[1].split("\n## ", 1)[0]
    missing = {}
    for name, module in DRAFTERS.items():
        listed = {"README": readme, "SETTINGS.md's Drafters": drafters_section}
        gaps = [f"`{name}` in {where}" for where, text in listed.items() if f"- **`{name}`**" not in text]
        gaps += [f.name for f in dataclasses.fields(module.Options)
                 if f.name != "name" and not re.search(rf"`(drafter\.)?{f.name}(=[^`]*)?`", settings)]
        if gaps:
            missing[name] = gaps
    assert not missing, f"undocumented drafters or options: {missing}"
