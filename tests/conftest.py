import os
import warnings

import pytest
import torch

# Tiny models run fastest on one thread, and two test processes on two cores with two
# threads each spin against each other.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rollout servers always need a secret: the servers these tests start in process, and the trainers
# that call them, share this one (tests of a missing or wrong secret remove or change it)
os.environ.setdefault("GSPO_SERVER_TOKEN", "tests-" + __import__("secrets").token_hex(16))
warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(scope="session")
def tiny_echo():
    """(model, tokenizer) of builtin:tiny-echo, fixed weights."""
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    return build_tiny("builtin:tiny-echo")


@pytest.fixture(scope="session")
def tiny_gsm8k():
    from gspo_lightning.data.tasks import build_tiny

    torch.manual_seed(0)
    return build_tiny("builtin:tiny-gsm8k")


def pytest_collection_modifyitems(config, items):
    # the slow tests first: with the tests shared by two worker processes (pytest -n 2), a long
    # test started last would leave the other worker idle for its whole length
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
