"""Draft-model distillation: the truncated student, vocabulary checks, the loss on
identities, LoRA merge equivalence, the HF export and its reload."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from specforge_lite import SpecforgeError
from specforge_lite.targets.surgery import truncated_copy
from specforge_lite.drafters import distilled as distill
from specforge_lite.drafters.distilled.model import load_student, truncated_student
from specforge_lite.drafters.distilled.model import merged as merged_student


def cfg(**drafter):
    base = {"student": None, "student_layers": 2, "loss": "forward_kl", "temperature": 1.0, "lora": False,
            "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj"],
            "simulated_k": 3}
    return OmegaConf.create({"drafter": {**base, **drafter}, "train": {"seed": 0},
                             "target": {"path": "builtin:tiny-llama", "dtype": "float32", "device": "cpu",
                                        "chat_template": None, "trust_remote_code": False},
                             "recipe_name": "test"})


def batch_for(model, ids, mask):
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    last = model.model(input_ids=ids).last_hidden_state.detach()
    return batch, last


def test_truncated_student_is_an_independent_copy_of_the_first_layers(tiny_target):
    model, _ = tiny_target
    student = truncated_student(model, 2)
    assert student.config.num_hidden_layers == 2 and model.config.num_hidden_layers > 2
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        assert torch.allclose(student(input_ids=ids).logits, truncated_copy(model, 2)(input_ids=ids).logits,
                              atol=1e-6)
        before = model.model.layers[0].mlp.up_proj.weight.clone()
        student.model.layers[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before)
    with pytest.raises(SpecforgeError, match="student_layers=99"):
        truncated_student(model, 99)


def test_student_with_another_vocabulary_is_refused(tiny_target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, _ = tiny_target
    other = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size + 7, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SpecforgeError, match=r"vocabulary of 327 tokens, the target 320"):
        load_student(str(tmp_path / "other"), model)


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "tvd", "jsd"])
def test_student_equal_to_target_has_zero_loss_and_full_agreement(tiny_target, loss):
    model, _ = tiny_target
    student = distill.build(cfg(student_layers=model.config.num_hidden_layers, loss=loss, temperature=2.0),
                            model, None)
    ids = torch.randint(0, 256, (2, 12))
    mask = torch.zeros_like(ids)
    mask[:, 4:] = 1
    mask[1, 9:] = 0
    batch, last = batch_for(model, ids, mask)
    distill.batch_preparer(student, model)(batch, None, last, True)
    assert int(batch["num_positions"]) == int(mask[:, 1:].sum()) == 8 + 5
    value, num, metrics = distill.loss_and_metrics(student, batch, cfg(loss=loss, temperature=2.0))
    assert num == 13 and abs(float(value)) < 1e-4
    assert metrics["correct"] == metrics["total"] == [13]
    # chains of j+1 consecutive agreeing positions: row 0 has 8 positions in a row, row 1 has 5
    assert metrics["chain"] == [13, 7 + 4, 6 + 3]


def test_untrained_truncated_student_has_positive_loss_and_learns(tiny_target):
    model, _ = tiny_target
    student = distill.build(cfg(), model, None)
    ids = torch.randint(0, 256, (2, 16))
    batch, last = batch_for(model, ids, torch.ones_like(ids))
    distill.batch_preparer(student, model)(batch, None, last, True)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        value, _, _ = distill.loss_and_metrics(student, batch, cfg())
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
        losses.append(float(value.detach()))
    assert losses[0] > 0 and losses[-1] < losses[0]


def test_dummy_share_has_no_positions(tiny_target):
    model, _ = tiny_target
    student = distill.build(cfg(), model, None)
    ids = torch.randint(0, 256, (1, 8))
    batch, last = batch_for(model, ids, torch.ones_like(ids))
    distill.batch_preparer(student, model)(batch, None, last, False)
    assert int(batch["num_positions"]) == 0 and batch["target_logits"].shape[0] == 0


def test_lora_merge_gives_the_adapted_model(tiny_target, tmp_path):
    model, _ = tiny_target
    student = distill.build(cfg(lora=True), model, None)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapters do something (B starts at zero)
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.randint(0, 256, (2, 10))
    select = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        adapted = student(ids, torch.ones_like(ids), select)
        merged = merged_student(student)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(input_ids=ids).logits.reshape(-1, adapted.shape[-1]), adapted, atol=1e-5)
        base_only = truncated_student(model, 2)(input_ids=ids).logits.reshape(-1, adapted.shape[-1])
        assert not torch.allclose(base_only, adapted, atol=1e-3)  # the adapters changed the model
    distill.save(student, tmp_path / "saved")
    reloaded = distill.load(tmp_path / "saved", model)
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits.reshape(-1, adapted.shape[-1]), adapted, atol=1e-5)


def test_checkpoint_weights_round_trip_with_tied_embeddings(tiny_target):
    model, _ = tiny_target
    student = distill.build(cfg(), model, None)
    weights = distill.trained_weights(student)
    fresh = distill.build(cfg(), model, None)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(weights, strict=False)
    ids = torch.randint(0, 256, (1, 6))
    select = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(fresh(ids, torch.ones_like(ids), select), student(ids, torch.ones_like(ids), select))


def test_export_is_a_plain_hf_dir_with_tokenizer(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = tiny_target
    student = distill.build(cfg(), model, None)
    distill.save(student, tmp_path / "trained")
    info = distill.export(cfg(), tmp_path / "trained", tmp_path / "export", model, tokenizer, 3, "test", "tiny")
    out = tmp_path / "export" / "draft_model"
    assert info["path"] == "draft_model" and info["speculative_tokens"] == 3  # relative to the folder given
    assert '"method": "draft_model"' in (out / "README.md").read_text()
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, distill.load(tmp_path / "trained", model)(input_ids=ids).logits)
