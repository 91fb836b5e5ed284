"""models/cpu_attention.py: grouped-query attention in one SDPA call on CPU, same numbers as the copies."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config
from transformers.integrations import sdpa_attention

from gspo_lightning.models.cpu_attention import SWITCH, group_attention_on_cpu
from gspo_lightning.training.logprobs import response_logprobs
from tests.helpers_fit import fit, make_module


def test_the_switch_is_set_on_cpu_only_and_a_users_value_wins():
    environ = {}
    assert group_attention_on_cpu(torch.device("cpu"), environ) and environ == {SWITCH: "1"}
    environ = {}
    assert not group_attention_on_cpu(torch.device("cuda", 0), environ) and environ == {}
    environ = {SWITCH: "0"}
    assert not group_attention_on_cpu(torch.device("cpu"), environ) and environ == {SWITCH: "0"}


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    """A saved Qwen2 with 4 query heads sharing 2 key/value heads, loaded back as users load models."""
    folder = tmp_path_factory.mktemp("gqa")
    config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _logprobs_and_grads(folder, environ_value: str, monkeypatch) -> tuple[torch.Tensor, dict, int]:
    monkeypatch.setenv(SWITCH, environ_value)
    copies = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a, **k: copies.append(1) or real_repeat(*a, **k))
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").train()
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, 97, (3, 9), generator=generator).repeat_interleave(2, 0)  # 3 prompts x 2 samples
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[:2, :4] = 0  # left padding
    prompt_mask[2:4, :1] = 0
    responses = torch.randint(3, 97, (6, 7), generator=generator)
    response_mask = torch.ones_like(responses)
    response_mask[1, 5:] = 0  # right padding
    ids, mask = torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1)
    logprobs, _ = response_logprobs(model, ids, mask, prompts.shape[1])
    (logprobs * response_mask).sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}, len(copies)


def test_grouped_attention_gives_the_same_logprobs_and_gradients_without_copies(gqa_model_dir, monkeypatch):
    copied_lp, copied_grads, copies_off = _logprobs_and_grads(gqa_model_dir, "0", monkeypatch)
    grouped_lp, grouped_grads, copies_on = _logprobs_and_grads(gqa_model_dir, "1", monkeypatch)
    assert copies_off > 0 and copies_on == 0  # the switch took the other path
    torch.testing.assert_close(grouped_lp, copied_lp, rtol=0, atol=1e-6)
    for name, grad in copied_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_cpu_run_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    fit(make_module(), tmp_path, max_steps=1)
    assert os.environ.get(SWITCH) == "1"
