"""The sampling seeds (rollout/sampling.py), one formula for every stream: values worked out by hand."""

from gspo_lightning.rollout.sampling import SEED_MODULUS, mix_seed, round_seed, server_share_seed, step_seed


def test_step_seed_by_hand():
    # ((1 * 1_000_003 + 2) * 1031 + 3) = 1_000_005 * 1031 + 3
    assert step_seed(1, 2, 3) == 1_031_005_158
    assert step_seed(0, 0, 0) == 0
    # a seed above 2**63 - 1 wraps: (2**63 * 1_000_003) mod (2**63 - 1) = 1_000_003, then * 1031
    assert step_seed(2**63, 0, 0) == 1_000_003 * 1031
    seeds = {step_seed(777, step, rank) for step in range(200) for rank in range(8)}
    assert len(seeds) == 1600 and max(seeds) < SEED_MODULUS


def test_server_shares_and_dynamic_rounds_by_hand():
    assert server_share_seed(42, 0) == 42  # one server samples as the colocated engine would
    assert server_share_seed(42, 2) == 42 * 1_000_003 + 2
    assert round_seed(5, 1) == 5 * 1_000_033 + 7919 and round_seed(5, 2) == 5 * 1_000_033 + 2 * 7919
    assert mix_seed(SEED_MODULUS, 4, 10) == 4
