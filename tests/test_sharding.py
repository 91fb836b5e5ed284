"""FSDP2 (2 gloo ranks on CPU): the chunked log-prob path under sharding, the sharded
reference, and generation that gathers once per call (``gspo_lightning/training/sharding.py``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "distributed" / "sharding_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           "--out_dir", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_chunked_logprobs_and_gradients_under_fsdp2_equal_one_process(ranks):
    """Each rank scores its own rows through the chunked path (the decoder and the head
    called separately, each gathering its unit); gradients are the ranks' average."""
    for out in ranks:
        assert out["world"] == 2 and out["same_weights"]
        assert out["module_takes_the_head_path"]  # GSPOModule no longer sends sharded policies to full logits
        torch.testing.assert_close(out["logprobs"], out["expected_logprobs"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["entropy"], out["expected_entropy"], atol=1e-5, rtol=1e-5)
        assert out["grads"].keys() == out["expected_grads"].keys()
        for name, grad in out["grads"].items():
            torch.testing.assert_close(grad, out["expected_grads"][name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_logit_buffer_holds_one_chunk_under_fsdp2(ranks):
    """4 rows x 7 response tokens: the full path allocates (28+, vocab) logits, the chunked
    path (chunk 3) never more than 3 rows of them."""
    for out in ranks:
        assert out["largest_logit_rows"]["chunked"] == 3
        assert out["largest_logit_rows"]["full"] >= 28


def test_the_reference_is_sharded_and_scores_like_the_unsharded_policy(ranks):
    for out in ranks:
        assert out["reference_all_dtensor"]
        assert out["reference_local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert not out["reference_shares_policy_storage"]
        torch.testing.assert_close(out["reference_logprobs"], out["expected_logprobs"], atol=1e-5, rtol=1e-5)


def test_generation_gathers_once_per_call_and_samples_like_the_unsharded_engine(ranks):
    """Responses of up to 3 and up to 9 tokens: the same number of all-gathers (one per
    FSDP unit), and the same tokens and log-probs as the unsharded policy."""
    for out in ranks:
        assert out["generation_same_samples"]
        assert out["generated_tokens_9"] > out["generated_tokens_3"]
        gathers = out["generation_all_gathers"]
        assert gathers[3] == gathers[9] > 0
