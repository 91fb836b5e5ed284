"""The clip budget (gspo_lightning/objective/clip_budget.py): attribution worked out by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.objective.ppo import PPOClip
from gspo_lightning.objective.clip_budget import ClipBudget, attribute_clips, clip_budget_metrics, split_log_ratio

# GSPO's sequence range: log(1.0004) = 3.9992e-4 above, log(0.9997) = -3.0005e-4 below
LOW, HIGH = 3e-4, 4e-4


def sequence_parts():
    """Four responses of two tokens; the token values are twice the sequence part on the
    first token and 0 on the second, so each sequence part (the mean) is the number in the comment."""
    seq = {  # per response: numerics, staleness, update
        "numerics": [5e-4, 1e-4, -1e-4, 5e-4],
        "staleness": [0.0, 2e-4, 0.0, 0.0],
        "update": [1e-4, 2e-4, -3.5e-4, 0.0],
    }
    return {name: torch.tensor([[2 * v, 0.0] for v in values]) for name, values in seq.items()}


ADV = torch.tensor([1.0, 1.0, -1.0, -1.0])
MASK = torch.ones(4, 2, dtype=torch.bool)


def test_bypass_attribution_by_hand():
    counts = attribute_clips(sequence_parts(), ("numerics", "staleness", "update"), MASK, ADV, level="seq", objective=PPOClip(LOW, HIGH))
    # response 0: total 6e-4 > 4e-4, A > 0: clipped; largest part numerics (5e-4, alone beyond the range)
    # response 1: total 5e-4: clipped; staleness and update tie at 2e-4 -> staleness; none alone
    # response 2: total -4.5e-4 < -3e-4, A < 0: clipped; most negative part update (-3.5e-4, alone beyond)
    # response 3: total 5e-4 but A < 0: the clip is not active
    assert {k: float(v) for k, v in counts.items()} == {
        "units": 4.0, "clipped": 3.0, "numerics": 1.0, "staleness": 1.0, "update": 1.0,
        "numerics_alone": 1.0, "staleness_alone": 0.0, "update_alone": 1.0,
    }
    metrics = clip_budget_metrics(counts, ("numerics", "staleness", "update"))
    assert float(metrics["clip_budget/clip_frac"][0]) == 0.75
    assert sum(float(metrics[f"clip_budget/{p}"][0]) for p in ("numerics", "staleness", "update")) == 0.75
    assert float(metrics["clip_budget/numerics"][1]) == 4.0  # weighted by units


def test_decoupled_clip_sees_only_the_update():
    counts = attribute_clips(sequence_parts(), ("update",), MASK, ADV, level="seq", objective=PPOClip(LOW, HIGH))
    assert float(counts["clipped"]) == 1.0 and float(counts["update"]) == 1.0  # only response 2 (-3.5e-4)
    metrics = clip_budget_metrics(counts, ("numerics", "staleness", "update"))
    assert float(metrics["clip_budget/numerics"][0]) == 0.0 and float(metrics["clip_budget/update"][0]) == 0.25


def test_token_level_units_are_tokens():
    # token range 0.2 / 0.27: log(1.27) = 0.2390, log(0.8) = -0.2231
    parts = {"numerics": torch.tensor([[0.3, 0.0, 0.1]]), "staleness": torch.tensor([[0.0, 0.0, 0.0]]),
             "update": torch.tensor([[0.0, 0.1, -0.4]])}
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    counts = attribute_clips(parts, ("numerics", "staleness", "update"), mask, torch.tensor([[1.0, 1.0, -1.0]]),
                             level="token", objective=PPOClip(0.2, 0.27))
    # token 0: 0.3 > 0.239 (numerics); token 1: 0.1 no; token 2: -0.3 < -0.223 with A < 0 (update, alone)
    assert float(counts["units"]) == 3 and float(counts["clipped"]) == 2
    assert float(counts["numerics"]) == 1 and float(counts["update"]) == 1 and float(counts["update_alone"]) == 1


def test_padding_is_ignored():
    parts = {"update": torch.tensor([[1e-3, 5.0]])}  # 5.0 at a padded position must not count
    mask = torch.tensor([[1, 0]], dtype=torch.bool)
    counts = attribute_clips(parts, ("update",), mask, torch.tensor([1.0]), level="seq", objective=PPOClip(LOW, HIGH))
    assert float(counts["units"]) == 1 and float(counts["clipped"]) == 1  # 1e-3 > 4e-4, from the one valid token
    counts = attribute_clips(parts, ("update",), mask, torch.tensor([1.0]), level="token", objective=PPOClip(0.2, 0.27))
    assert float(counts["clipped"]) == 0


def test_split_and_the_hook_on_a_micro_batch():
    b = torch.tensor([[-1.0], [-1.0]])
    o_b = b + torch.tensor([[6e-4], [0.0]])  # engine numerics on response 0
    o = o_b + torch.tensor([[0.0], [-5e-4]])  # staleness on response 1
    lp = o + torch.tensor([[0.0], [0.0]])
    parts = split_log_ratio(lp, o, b, o_b)
    assert torch.allclose(parts["numerics"], torch.tensor([[6e-4], [0.0]]), atol=1e-7)
    assert set(split_log_ratio(lp, o, b, None)) == {"behaviour", "update"}

    hook = ClipBudget("seq", PPOClip(LOW, HIGH))
    hook.begin(old=o, behaviour=b, behaviour_old=o_b, old_is_behaviour=True)
    micro = SimpleNamespace(rows=torch.tensor([0, 1]), logprobs=lp, old_logprobs=b, mask=torch.ones(2, 1, dtype=torch.bool),
                            advantages=torch.tensor([1.0, -1.0]))
    metrics = {k: float(v[0]) for k, v in hook(micro).items()}
    assert metrics["clip_budget/numerics"] == 0.5 and metrics["clip_budget/staleness"] == 0.5
    assert metrics["clip_budget/update"] == 0.0 and metrics["clip_budget/clip_frac"] == 1.0
    assert metrics["clip_budget/behaviour"] == 1.0  # numerics and staleness together
    # stale, o_b unknown: numerics and staleness cannot be told apart
    hook.begin(old=o, behaviour=b, behaviour_old=None, old_is_behaviour=True)
    metrics = {k: float(v[0]) for k, v in hook(micro).items()}
    assert math.isnan(metrics["clip_budget/numerics"]) and math.isnan(metrics["clip_budget/staleness_alone"])
    assert metrics["clip_budget/behaviour"] == 1.0 and metrics["clip_budget/clip_frac"] == 1.0
    # decoupled: the same rollout, the clip on lp - o: nothing clips
    hook.begin(old=o, behaviour=b, behaviour_old=o_b, old_is_behaviour=False)
    assert float(hook(micro)["clip_budget/clip_frac"][0]) == 0.0
    # synchronous: o_b = o, so the staleness part is 0 and response 1's gap counts as numerics
    hook.begin(old=o, behaviour=b, behaviour_old=None, old_is_behaviour=True, same_weights=True)
    metrics = {k: float(v[0]) for k, v in hook(micro).items()}
    assert metrics["clip_budget/numerics"] == 1.0 and metrics["clip_budget/staleness"] == 0.0
    # bypass without recomputed old log-probs: nothing to split, no metrics
    hook.begin(old=None, behaviour=b, behaviour_old=None, old_is_behaviour=True)
    assert hook(micro) == {}


def test_bounds_are_the_log_of_the_ratio_range():
    parts = {"update": torch.tensor([[math.log1p(HIGH) * 0.999], [math.log1p(HIGH) * 1.001]])}
    counts = attribute_clips(parts, ("update",), torch.ones(2, 1, dtype=torch.bool), torch.tensor([1.0, 1.0]),
                             level="seq", objective=PPOClip(LOW, HIGH))
    assert float(counts["clipped"]) == pytest.approx(1.0)


def test_the_producer_computes_o_b_under_the_trainers_precision():
    """o_b is taken on the producer thread, where the training step's autocast (thread-local)
    does not reach: it must enter the trainer's precision itself, as the trainer's o does."""
    import threading
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.helpers_fit import make_module

    module = make_module()
    module._trainer = SimpleNamespace(precision_plugin=MixedPrecision("bf16-mixed", "cpu"))
    module._logprobs_no_grad = lambda model, rollout: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(module._behaviour_logprobs(None, None)))
    thread.start()
    thread.join()
    assert seen == [(True, torch.bfloat16)]
