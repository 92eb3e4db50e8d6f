"""docs/BENCHMARKS.md by topic: the sections the benchmark scripts write (`update_doc_section`),
ordered, with a table of contents, superseded runs left out (git keeps them).

A section is its `<!-- name -->` ... `<!-- /name -->` block (what `update_doc_section`
replaces) plus the hand-written reading that follows it up to the next section.
"""

from __future__ import annotations

import re

from specforge_lite.records import results
from specforge_lite.records.results import ROOT, read_results

DOC = ROOT / "docs" / "BENCHMARKS.md"
HEADER = """# Benchmarks

Every number here is written by a script in `benchmarks/` from a run on the machine
named in its section; re-run the command to reproduce it. Ratios are measured inside
one run (the machines are shared and noisy); absolute tokens/s vary between runs.
"""

OPEN = re.compile(r"^<!-- ([\w.\-]+) -->$", re.M)
TOC = re.compile(r"<!-- docs:toc -->.*?<!-- /docs:toc -->\n*", re.S)

# (topic, sections in reading order); a section not listed goes to the first topic whose
# prefixes it starts with, else to the last topic.
TOPICS = [
    ("Engine: the target's forward", ["engine_avx512", "engine_avx2", "engine_autotune", "dtype_choice_xeon_amx",
                                      "dtype_choice_xeon_amx_16t"], ("engine", "dtype")),
    ("Sampling", ["sampling_budget", "sample_backends", "sampling", "batched_sampling"], ("sampl", "batched")),
    ("Training", ["demo_training", "learning_curve", "training", "training_target", "eagle3_options",
                  "eagle3_study", "sampled_vs_source",
                  "learning_curves_learning_curves_smollm2", "drafter_contract_equivalence",
                  "feature_formats", "dflash_weighting"],
     ("train", "learning_curves")),
    ("Drafters side by side", ["eval_eagle_smollm2", "eval_eagle_smollm2_k1", "eval_eagle_smollm2_avx2",
                               "eval_eagle_smollm2_avx2_k1", "peagle", "peagle_drafting",
                               "learning_curves_learning_curves_peagle_smollm2", "eval_compare_smollm2",
                               "eval_distill_smollm2", "peer_compare"], ("eval_", "peagle", "peer", "medusa")),
    ("Serving engines: vLLM and llama.cpp", ["vllm", "vllm_load", "vllm_layout", "llamacpp_smollm2"],
     ("vllm", "llamacpp", "gguf", "sglang")),
    ("Scale-out and sizing", ["scaling"], ("scal", "dry_run", "rehears", "gpu", "distributed")),
    ("Other records", [], ()),
]

# what a reader needs before a topic's sections (no figures: those live in the sections)
INTROS = {
    "Drafters side by side": "Each section's date is in the contents. Sections recorded before the packaged "
                             "compiled target forward (the `engine_avx2` and `engine_avx512` sections) measured "
                             "their speeds on the earlier engine: their tau and acceptance stand, their tokens/s "
                             "and speedups do not compare with later sections. `draft_model` in those sections is "
                             "today's `untrained_draft`.",
}

# section -> the later record of the same experiment. The section is left out while its own
# results file is older than the successor's (a re-run brings it back).
SUPERSEDED_BY = {
    "engine": "engine_avx512",                       # same CPU kind, before the packaged forward
    "decoding": "eval_eagle_smollm2",                # our engine against HF's, on the old engine
    "eval_distill_smollm2_lr1e-3": "eval_distill_smollm2",  # the lr check, before the 2-epoch recipe
    "trees": "eval_families_smollm2",               # n-gram trees on the eager forward, before trained drafters' trees
}

# section -> results file, where the names differ
RESULT_OF = {"peagle": "peagle_smollm2"}


def result_date(section: str) -> str:
    path = results.RESULTS / f"{RESULT_OF.get(section, section)}.json"
    if not path.exists():
        return ""
    return str(read_results(path).get("date", ""))


def superseded(section: str) -> bool:
    successor = SUPERSEDED_BY.get(section)
    return bool(successor) and result_date(successor) > result_date(section)


def split(text: str) -> tuple[str, dict[str, str]]:
    """(header, {name: section text}) with the generated contents and topic headings taken out."""
    text = TOC.sub("", text)
    marks = list(OPEN.finditer(text))
    if not marks:
        return text, {}
    header = "\n".join(line for line in text[:marks[0].start()].split("\n")
                       if not (line.startswith("# ") and line != "# Benchmarks"))
    sections = {}
    for i, mark in enumerate(marks):
        name = mark.group(1)
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = text[mark.start():end]
        close = body.find(f"<!-- /{name} -->") + len(f"<!-- /{name} -->")
        reading = "\n".join(line for line in body[close:].split("\n")
                            if not line.startswith("# ") and line not in INTROS.values())
        sections[name] = (body[:close] + reading).strip() + "\n"
    return header.strip() + "\n", sections


def topic_of(name: str) -> int:
    for i, (_, names, _) in enumerate(TOPICS):
        if name in names:
            return i
    for i, (_, _, prefixes) in enumerate(TOPICS):
        if name.startswith(prefixes) and prefixes:
            return i
    return len(TOPICS) - 1


def slug(heading: str, seen: dict[str, int]) -> str:
    """GitHub's anchor for a heading (a repeated one gets -1, -2, ...)."""
    base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(base, 0)
    seen[base] = count + 1
    return base if count == 0 else f"{base}-{count}"


def heading(section: str, name: str) -> str:
    found = re.search(r"^## (.+)$", section, re.M)
    return found.group(1).strip() if found else name


def order_benchmarks(text: str) -> str:
    header, sections = split(text)
    grouped: list[list[str]] = [[] for _ in TOPICS]
    listed = [n for _, names, _ in TOPICS for n in names]
    for name in sorted(sections, key=lambda n: listed.index(n) if n in listed else len(listed)):
        if not superseded(name):
            grouped[topic_of(name)].append(name)
    seen: dict[str, int] = {}
    toc, body = ["<!-- docs:toc -->", "Contents (written by `make docs`; each section's date is its results "
                 "file's):", ""], []
    for (title, _, _), names in zip(TOPICS, grouped):
        if not names:
            continue
        toc.append(f"- [{title}](#{slug(title, seen)})")
        body.append(f"# {title}\n" + (f"\n{INTROS[title]}\n" if title in INTROS else ""))
        for name in names:
            head = heading(sections[name], name)
            date = result_date(name)
            toc.append(f"  - [{head}](#{slug(head, seen)})" + (f", {date[:10]}" if date else ""))
            body.append(sections[name])
    toc.append("<!-- /docs:toc -->")
    return header + "\n" + "\n".join(toc) + "\n\n" + "\n".join(body)


def update_doc_section(name: str, markdown: str) -> None:
    """Replace (or append) the section between `<!-- name -->` markers in docs/BENCHMARKS.md,
    the sections kept in topic order."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- {name} -->\n{markdown.strip()}\n<!-- /{name} -->"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(order_benchmarks(text))  # a new section goes under its topic, in the contents
