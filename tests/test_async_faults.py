"""What a failure leaves behind: a restarted rollout server gets the weights again however
long the request that found it waited, a failed push's files go, a killed run's weight
folder is removed by the next run, and a finished fit closes its engine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_lightning.rollout import FolderTransport, HFCopyEngine, RemoteEngine, SamplingParams
from gspo_lightning.rollout.transport import remove_dead_runs_folders
from gspo_lightning.rollout.weight_sync import iter_policy_weights


def test_a_restarted_server_is_re_pushed_even_when_the_request_that_found_it_waited_past_reconnect_s():
    """The restarted server makes the generation wait for the version it lacks (0.5 s here, its
    version_wait_s) and answers 409; with reconnect_s = 0 that wait already used the budget. The
    client must still check the server, find it restarted, push the weights again and retry."""
    from tests.helpers_server import free_port, policy_and_spec, prompts, serve_on, shut

    port = free_port()
    _, httpd = serve_on(port)
    policy, tok, spec = policy_and_spec(seed=4)
    client = RemoteEngine(urls=[f"http://127.0.0.1:{port}"], reconnect_s=0.0)
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 7)
    before = client.generate(prompts(tok), 4, SamplingParams(6), 3)
    shut(httpd)
    app, httpd = serve_on(port)  # restarted: a new server_id, no weights
    app.version_wait_s = 0.5
    try:
        after = client.generate(prompts(tok), 4, SamplingParams(6), 3)
        assert app.version == 7 and after.weights_version == 7
        assert torch.equal(before.completion_ids, after.completion_ids)
    finally:
        client.close()
        shut(httpd)


def test_a_failed_push_leaves_no_weights_behind_and_keeps_the_last_good_one(tmp_path):
    transport = FolderTransport(path=str(tmp_path))
    weights = [("w", torch.ones(3))]
    manifest, _ = transport.push(iter(weights), 1, lambda m: None)
    transport.sent(manifest)

    def refused(manifest):
        raise RuntimeError("the server refused the load")

    try:
        transport.push(iter(weights), 2, refused)
        raise AssertionError("the push should have raised")
    except RuntimeError as error:
        assert "refused" in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # v2 removed, v1 (loaded) kept
    transport.close()


def test_weight_folders_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # the process has exited: no such pid (unless reused at once)
    folders = {name: tmp_path / name for name in (f"gspo-weights-{dead_pid}-a1", f"gspo-weights-{os.getpid()}-b2",
                                                   "gspo-weights-c3", "other-123-d4")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "bucket-00000.safetensors").write_bytes(b"x")
    removed = remove_dead_runs_folders(tmp_path)
    assert removed == [folders[f"gspo-weights-{dead_pid}-a1"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(folders) - {f"gspo-weights-{dead_pid}-a1"})


def test_an_own_weight_folder_names_the_process_that_owns_it():
    transport = FolderTransport()
    root = transport._root()
    try:
        assert Path(root).name.startswith(f"gspo-weights-{os.getpid()}-")
    finally:
        transport.close()
    assert not Path(root).exists()


def test_the_end_of_fit_closes_the_engine(tmp_path):
    from tests.helpers_fit import fit, make_module

    module = make_module(engine=HFCopyEngine(dtype="float32"))
    fit(module, tmp_path, max_steps=1)
    assert module.worker.started is False


def _collective_order_worker(rank, port, out_dir):
    """Rank 0 all-reduces on the trainer's group before the engines' RankZeroShare shares a push outcome (on
    another thread); rank 1 the other way round, as a producer thread and a training thread may."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    from gspo_lightning.rollout.rank_zero import RankZeroShare

    ranks = RankZeroShare()  # what RemoteEngine and StockVLLMEngine share a push outcome with
    ranks.setup(world_size=2)
    shared = []
    producer = threading.Thread(target=lambda: (time.sleep(0.5 if rank == 0 else 0.0),
                                                shared.append(ranks.share(("manifest of rank", rank)))))
    producer.start()
    time.sleep(0.0 if rank == 0 else 0.5)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    producer.join(30)
    torch.save({"sum": float(total), "shared": shared}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_engines_collective_from_another_thread_does_not_mix_with_the_trainers(tmp_path):
    """On the trainer's own group the two orders pair rank 0's all-reduce with rank 1's
    broadcast: gloo times out (checked once by hand); on the engine's group both complete."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_collective_order_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result == {"sum": pytest.approx(3.0), "shared": [("manifest of rank", 0)]}, rank
