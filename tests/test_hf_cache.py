"""The KV cache's name across transformers versions: ``past_key_values`` up to 5.23, ``cache``
from 5.24 (the old name warns there and goes in 5.40)."""

import warnings

import torch
from torch import nn

from gspo_lightning.models.hf_cache import cache_kwargs, output_cache


class OldModel(nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return {"past_key_values": past_key_values}


class NewModel(nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return {"cache": cache}


def test_each_version_gets_the_name_its_forward_takes():
    assert cache_kwargs(OldModel(), "kv") == {"past_key_values": "kv"}
    assert cache_kwargs(NewModel(), "kv") == {"cache": "kv"}


class Output(dict):  # ModelOutput: a dict of its non-None fields, also read as attributes
    def __getattr__(self, name):
        return self.get(name)


def test_the_cache_is_read_under_either_name():
    assert output_cache(Output(cache="new")) == "new"
    assert output_cache(Output(past_key_values="old")) == "old"
    assert output_cache(Output(logits=1)) is None


def test_generation_and_shared_prompt_logprobs_give_no_cache_deprecation_warning(tiny_gsm8k):
    # with transformers >= 5.24 (what a fresh install gets) the old name raised a FutureWarning
    # on every decode step of the generic cache loop and every shared-prompt log-prob pass
    from gspo_lightning.training.logprobs import response_logprobs
    from gspo_lightning.rollout.engine import SamplingParams
    from tests.helpers_engine import make_engine, prompts, rollout_batch

    engine, tok = make_engine(tiny_gsm8k)
    engine.model.model.layers[0].register_forward_hook(lambda *args: None)  # the generic cache loop, not kv_decode's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen, full, attn, width = rollout_batch(engine, tok, prompts(tok), 2, SamplingParams(max_new_tokens=6), seed=1)
        with torch.no_grad():  # groups share their prompt: its cache feeds the responses
            logprobs, _ = response_logprobs(engine.model, full, attn, width)
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert torch.allclose(logprobs[gen.mask], gen.logprobs[gen.mask], atol=1e-5)  # the cache was used right
