"""Trees in the evaluate report (issue 41): the trees table beside the chains, the best tree
estimated from a tree method's own steps, the recommendation weighing tree methods like any
other, best k held to what a drafter can propose, and the static tree the export carries."""

from __future__ import annotations

import ast
import json

import pytest

from specforge_lite.config.schema import TreeConfig
from specforge_lite.decoding.drafters import NgramDrafter
from specforge_lite.decoding.engine import Generation
from specforge_lite.measurement.metrics import (best_tree, expected_tokens_per_step, full_tree_nodes,
                                             per_position_acceptance, tree_steps)
from specforge_lite.measurement.report import best_tree_lines, render_markdown, trees_table
from specforge_lite.measurement.recommend import recommend
from specforge_lite.measurement import choices
from specforge_lite.stages import evaluate, export
from tests.conftest import compose

MS = 1e-3


def tree_generation(paths: list[int], nodes: list[int], depth: int, target_s: float = 0.0,
                    draft_s: float = 0.0) -> Generation:
    """One answer of a tree method: per step the accepted path's length and the nodes verified,
    every step allowed `depth`; the tokens the steps emitted (one prefill token first)."""
    gen = Generation(tokens=[1] * (1 + sum(p + 1 for p in paths)), finish="length", num_prompt_tokens=8)
    for path, width in zip(paths, nodes):
        gen.add_step(depth, width, path, 0.0, 0.0)
    gen.target_s, gen.draft_s = target_s, draft_s
    gen.prefill_s, gen.total_s = 0.01, 0.01 + target_s + draft_s
    return gen


# --------------------------------------------------------------------------- the estimate


def test_steps_and_per_depth_acceptance_of_the_accepted_path():
    gens = [tree_generation([0, 1, 3], [8, 8, 8], 3), tree_generation([2, 1], [6, 8], 3)]
    steps = tree_steps(gens)
    assert steps["steps"] == 5 and steps["nodes"] == [8, 8, 8, 6, 8]
    assert steps["nodes_per_step"] == pytest.approx(38 / 5) and steps["path_per_step"] == pytest.approx(7 / 5)
    # depth 1 reached by 5 steps, kept by 4; depth 2 by 4, kept by 2; depth 3 by 2, kept by 1
    assert per_position_acceptance(gens, 3) == pytest.approx([4 / 5, 2 / 4, 1 / 2])
    assert full_tree_nodes(3, 4) == 4 + 16 + 64 and full_tree_nodes(2, 1) == 2


def test_best_tree_picks_a_shallower_tree_when_deep_levels_rarely_pay():
    # depth 1 is accepted often, deeper levels almost never; a verify costs more the wider it is
    alphas = [0.7, 0.1, 0.05, 0.0, 0.0]
    costs = {w: (10 + 3 * (w - 1)) * MS for w in range(1, 10)}  # 10 ms at width 1 .. 34 ms at width 9
    out = best_tree(alphas, [8] * 50, 5, 2, 8, costs, lambda d: 1.0 * MS * d)
    table = {row["depth"]: row for row in out["table"]}
    assert list(table) == [1, 2, 3, 4, 5] and table[5]["measured"] and not table[1]["measured"]
    # depth 1 of branch 2 holds 2 nodes, depth 2 six, depth 3 and more the whole budget of 8
    assert [table[d]["nodes"] for d in (1, 2, 3)] == [2, 6, 8] and table[1]["mean_nodes"] == 2
    assert table[1]["step_ms"] == pytest.approx(1 + 16) and table[5]["step_ms"] == pytest.approx(5 + 34)
    assert table[2]["expected_tokens_per_step"] == pytest.approx(expected_tokens_per_step(alphas, 2))
    best = out["best"]
    assert (best["depth"], best["branch"], best["nodes"]) == (1, 2, 2)  # smaller than the 5 / 2 / 8 it ran
    assert best["expected_speedup"] == pytest.approx((1.7 / 17) / (1 / 10))


def test_best_tree_keeps_the_measured_shape_when_verify_is_flat_and_acceptance_high():
    alphas = [0.9, 0.8, 0.8]
    costs = {w: 10 * MS for w in range(1, 10)}
    out = best_tree(alphas, [7, 8, 8], 3, 4, 8, costs, lambda d: 0.0, answer_tokens=64, prefill_s=0.02)
    assert out["best"]["depth"] == 3 and out["best"]["measured"]
    # a step never verifies more nodes than the measured step did
    assert out["table"][-1]["mean_nodes"] == pytest.approx(23 / 3)
    # the tree verify's own price: a scale on the verify forwards, not on plain decoding
    scaled = best_tree(alphas, [7, 8, 8], 3, 4, 8, costs, lambda d: 0.0, verify_scale=2.0)
    assert scaled["plain_tokens_per_s"] == pytest.approx(100) and scaled["table"][0]["step_ms"] == pytest.approx(20)


def test_best_tree_stops_at_widths_whose_cost_was_not_measured():
    costs = {1: 10 * MS, 2: 11 * MS, 3: 12 * MS}  # widths up to 3: trees of 2 nodes at most
    out = best_tree([0.5, 0.5, 0.5], [6] * 4, 3, 2, 6, costs, lambda d: 0.0)
    assert [row["depth"] for row in out["table"]] == [1]
    assert best_tree([0.5], [4], 1, 4, 4, {1: 10 * MS}, lambda d: 0.0)["best"] is None


def test_tree_fields_price_the_verify_at_what_the_tree_paid():
    """evaluate's tree fields from real Generations and a real (non-sequential) drafter: the
    measured depth's estimated step costs what its verify forwards paid."""
    gens = [tree_generation([2, 0, 3, 1], [5, 5, 5, 5], 3, target_s=4 * 0.030, draft_s=4 * 0.002)] * 3
    entry = {"draft_ms_per_step": 2.0, "overhead_ms_per_step": 0.0}
    costs = {w: 0.010 + 0.001 * w for w in range(1, 7)}  # chain forward 16 ms at width 6; the tree paid 30
    fields = choices.tree_fields(TreeConfig(depth=3, branch=2, nodes=5), "ngram", False, gens, entry,
                                   NgramDrafter(), costs, (0.01, 13.0), {"overhead_ms_per_step": 0.0})
    assert fields["chain"] == "ngram" and fields["shape"] == {"depth": 3, "branch": 2, "nodes": 5}
    assert fields["nodes_per_step"] == 5 and fields["path_per_step"] == pytest.approx(1.5)
    assert fields["verify_scale"] == pytest.approx(0.030 / 0.016)
    table = {row["depth"]: row for row in fields["best_tree"]["table"]}
    assert table[3]["step_ms"] == pytest.approx(30 + 2)  # as measured: verify and drafting
    assert table[1]["nodes"] == 2 and table[1]["step_ms"] == pytest.approx(0.013 / 0.016 * 30 + 2)
    json.dumps(fields)  # report.json holds it


# --------------------------------------------------------------------------- the report


def _method(tau, rate, plain_rate, **extra):
    return {"tau": tau, "tokens_per_s": rate, "speedup": rate / plain_rate, "identical_to_plain": True,
            "per_category": {}, "acceptance_rate": None, "per_position_acceptance": [], "draft_time_share": None,
            "verify_time_share": None, "overhead_ms_per_step": None, **extra}


def tree_report() -> dict:
    best = {"depth": 2, "branch": 4, "nodes": 8, "mean_nodes": 8.0, "expected_tokens_per_step": 2.1,
            "step_ms": 120.0, "expected_tokens_per_s": 15.5, "expected_speedup": 1.55, "measured": False}
    table = [{**best, "depth": 1, "nodes": 4, "expected_tokens_per_s": 12.0, "expected_speedup": 1.2}, best,
             {**best, "depth": 3, "expected_tokens_per_s": 15.0, "expected_speedup": 1.5, "measured": True}]
    tree = {"chain": "eagle3", "mixed": False, "shape": {"depth": 3, "branch": 4, "nodes": 8}, "steps": 40,
            "nodes_per_step": 7.9, "path_per_step": 1.6, "depth_per_step": 3.0,
            "per_depth_acceptance": [0.7, 0.5, 0.4], "verify_scale": 1.1,
            "best_tree": {"best": best, "plain_tokens_per_s": 10.0, "table": table}}
    methods = {"plain": _method(1.0, 10.0, 10.0),
               "eagle3": _method(2.2, 13.0, 10.0, tau_ci=[2.0, 2.4], speedup_ci=[1.2, 1.4]),
               "eagle3_tree": _method(2.6, 15.0, 10.0, tau_ci=[2.4, 2.8], speedup_ci=[1.4, 1.6],
                                      draft_time_share=0.25, verify_time_share=0.7, tree=tree)}
    return {"methods": methods, "per_category_tau": {}, "settings": {"num_draft_tokens": 2}}


def test_trees_table_sits_beside_the_chain():
    report = tree_report()
    header, _, row = trees_table(report).splitlines()
    assert "| its chain: tau / speedup | nodes verified / step | path / step | draft / verify time |" in header
    assert row == ("| eagle3_tree | 3 / 4 / 8 | 2.60 [2.40, 2.80] | 1.50x [1.40, 1.60] | 2.20 / 1.30x | 7.90 | 1.60 "
                   "| 25% / 70% | 2 / 4 / 8: 1.55x |")
    lines = best_tree_lines(report)
    assert lines[0] == "## Best tree" and "Estimated" in lines[2]
    assert any("best tree (estimated) = depth 2, branch 4, 8 nodes" in line and "3/4/8: 15.0 tok/s (1.50x, as run)"
               in line for line in lines)
    del report["methods"]["eagle3_tree"]
    assert trees_table(report) == "" and best_tree_lines(report) == []


def test_recommendation_deploys_a_tree_method_that_is_fastest():
    rec = recommend(tree_report())
    assert rec["deploy"] == "eagle3_tree" and rec["runner_up"] == "eagle3"
    assert "15.0 tokens/s" in rec["reasons"][0]
    assert any(a.startswith("eagle3_tree drafts trees of eagle3 (its chain: 1.30x plain)") and "chains only" in a
               for a in rec["alternatives"])
    # and a chain that beats it wins as any other method would
    report = tree_report()
    report["methods"]["eagle3"]["tokens_per_s"] = 16.0
    assert recommend(report)["deploy"] == "eagle3"


def test_markdown_carries_the_trees_table_and_best_tree():
    report = tree_report()
    report.update({"target": "tiny", "dtype": "float32", "device": "cpu", "torch_threads": 2, "num_prompts": 4,
                   "dataset": "x", "num_answers": 4, "best_k": 2, "best_k_method": "eagle3",
                   "conventions": {"tau": "t", "per_position_acceptance": "a", "speedup": "s"},
                   "forward_costs": {"context_len": 64, "ms_by_num_tokens": {1: 10.0, 2: 11.0}}})
    report["settings"].update({"temperature": 0, "max_new_tokens": 8, "warmup": 1})
    report["recommendation"] = recommend(report)
    markdown = render_markdown(report)
    assert "| tree method | depth / branch / nodes |" in markdown and "## Best tree" in markdown
    assert markdown.index("| tree method |") < markdown.index("## Recommendation")


# --------------------------------------------------------------------------- best k within the drafter's reach


def test_best_k_never_names_more_drafts_than_the_decoder_proposes(tiny_target):
    from specforge_lite.drafters import dflash
    from tests.unit.test_dflash import tiny_drafter

    decoder = dflash.decoder(tiny_drafter(tiny_target))  # block 4: at most 3 drafts a step
    assert decoder.max_drafts == 3
    # k = 4 was allowed but position 4 is never filled (alpha 0): a noisy cheaper width-5 forward
    # must not make it the best k
    entry = {"per_position_acceptance": [0.9, 0.9, 0.9, 0.0], "draft_ms_per_step": 1.0, "overhead_ms_per_step": 0.0}
    costs = {1: 0.100, 2: 0.120, 3: 0.121, 4: 0.122, 5: 0.118}
    plain = {"overhead_ms_per_step": 0.0}
    chain = choices.best_k_for(entry, NgramDrafter(), costs, (0.0, 100.0), plain)  # no limit of its own
    assert chain["best_k"] == 4
    capped = choices.best_k_for(entry, decoder, costs, (0.0, 100.0), plain)
    assert capped["best_k"] == 3 and [row["k"] for row in capped["table"]] == [1, 2, 3]


def test_a_small_evaluate_reports_its_tree_method(tmp_path):
    from tests.unit.test_evaluate import eval_cfg, write_prompts

    dataset = write_prompts(tmp_path / "prompts.jsonl")
    settings = [f"eval.dataset={dataset}", "eval.num_draft_tokens=2", "eval.methods=[ngram,ngram_tree]",
                "eval.tree.depth=3", "eval.tree.branch=2", "eval.tree.nodes=5", "eval.best_k_method=ngram"]
    evaluate.run(eval_cfg(tmp_path, *settings, "eval.max_prompts=2"))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    tree = report["methods"]["ngram_tree"]["tree"]
    assert tree["chain"] == "ngram" and tree["shape"] == {"depth": 3, "branch": 2, "nodes": 5}
    assert len(tree["per_depth_acceptance"]) == 3 and tree["steps"] > 0
    # every report times widths 1..16 (eval.cost_widths; the 5-node tree verifies 6 of them)
    assert set(map(int, report["forward_costs"]["ms_by_num_tokens"])) == set(range(1, 17))
    assert report["methods"]["ngram_tree"]["tau_ci"] and report["methods"]["ngram_tree"]["speedup_ci"]
    assert "best_k" not in report["methods"]["ngram_tree"]
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "| ngram_tree | 3 / 2 / 5 |" in markdown
    # fewer widths asked for: still every width a method verifies (the tree's 6)
    evaluate.run(eval_cfg(tmp_path, *settings, "eval.max_prompts=1", "eval.cost_widths=2", "eval.plots=false"))
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert set(map(int, report["forward_costs"]["ms_by_num_tokens"])) == set(range(1, 7))


# --------------------------------------------------------------------------- the export


def test_static_tree_is_breadth_first_node_paths():
    assert export.static_tree(3, 2, 5) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert export.static_tree(3, 1, 3) == [(0,), (0, 0), (0, 0, 0)]  # a chain
    assert export.static_tree(2, 4, 30) == export.static_tree(2, 4, full_tree_nodes(2, 4))  # at most the full tree


def test_export_readme_carries_the_evaluated_tree_as_vllm_node_paths(tmp_path):
    cfg = compose(["+recipe=smoke", f"run_dir={tmp_path}", "stage=export"])
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(tree_report()))
    tree = export.chosen_tree(cfg, "eagle3")
    assert (tree["depth"], tree["branch"], tree["nodes"]) == (2, 4, 8)  # the best tree, not the 3 / 4 / 8 it ran
    assert "best tree estimated from eagle3_tree" in tree["source"]
    assert tree["node_paths"] == [list(p) for p in export.static_tree(2, 4, 8)]
    assert export.chosen_tree(cfg, "medusa") is None  # chains only
    from specforge_lite.drafters import eagle3

    tree["command"] = export.tree_command("TARGET", eagle3.VLLM_SERVING, tree["node_paths"])
    readme = export.tree_readme(tree)
    assert "## As a draft tree" in readme and "breadth first" in readme and "vLLM 0.32" in readme
    assert "llama.cpp drafts chains only" in readme
    assert str([tuple(p) for p in tree["node_paths"]]) in readme
    command = readme.split("```bash\n")[1].split("\n```")[0]
    assert command.startswith("vllm serve TARGET \\\n  --speculative-config '")
    config = json.loads(command.split("--speculative-config '")[1].rstrip("'"))
    assert config["method"] == "eagle3" and config["num_speculative_tokens"] == 8
    assert ast.literal_eval(config["speculative_token_tree"]) == export.static_tree(2, 4, 8)
    # without an evaluated tree: eval.tree's shape, said to be unmeasured
    (tmp_path / "eval" / "report.json").write_text(json.dumps({"methods": {}}))
    unmeasured = export.chosen_tree(compose(["+recipe=smoke", f"run_dir={tmp_path}", "stage=export",
                                             "eval.tree.depth=2", "eval.tree.branch=1", "eval.tree.nodes=2"]), "eagle3")
    assert unmeasured["node_paths"] == [[0], [0, 0]] and "eval.tree" in unmeasured["source"]
    assert export.chosen_tree(compose(["+recipe=smoke", f"run_dir={tmp_path}", "stage=export", "eval.tree=null"]),
                              "eagle3") is None
