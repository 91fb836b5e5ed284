"""One measured ``trainer.fit`` for ``memory_model.py --check`` (launched by torchrun).

Memory is counted as the bytes of live tensor storages (:class:`LiveTensorBytes`), per
phase of each step; rank 0 writes the peaks of the steady-state steps (2 and later) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).parent))


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of every tensor storage alive, updated on each allocation and free.

    Why this and not RSS or the profiler: CPU has no allocator statistics; RSS counts
    glibc's cached pages, the Python heap and gloo's buffers, and lags frees. This counts
    exactly what the memory model predicts — tensor storages — whoever holds them
    (autograd's saved tensors included). Every op's outputs pass through the mode; a storage
    is counted once (weakly keyed) and released by a finalizer when it dies. FSDP2 frees
    and re-allocates unsharded parameters with ``UntypedStorage.resize_`` outside the
    dispatcher, so ``resize_`` is patched to adjust the count. Not seen: scratch buffers a
    kernel allocates and frees inside one op (matmul packing, the attention kernel's blocks).
    """

    def __init__(self):
        super().__init__()
        self.sizes = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0
        self.phase = None
        self.peaks: dict = {}
        self.entry: dict = {}  # live bytes when a phase first starts in a step
        self._resize = None

    def _add(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)
        if self.phase is not None and self.live > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = self.live

    def _free(self, storage_id: int) -> None:
        self._add(-self._finalizers.pop(storage_id)[1])

    def track(self, tensor) -> None:
        local = getattr(tensor, "_local_tensor", None)  # DTensor: its shard
        if local is not None:
            tensor = local
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if storage in self.sizes:
            return
        size = storage.nbytes()
        self.sizes[storage] = size
        self._finalizers[id(storage)] = (weakref.finalize(storage, self._free, id(storage)), size)
        self._add(size)

    def __enter__(self):
        self._finalizers = {}
        tracker = self
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            before = tracker.sizes.get(storage)
            result = original(storage, size)
            if before is not None:
                tracker.sizes[storage] = storage.nbytes()
                entry = tracker._finalizers[id(storage)]
                tracker._finalizers[id(storage)] = (entry[0], storage.nbytes())
                tracker._add(storage.nbytes() - before)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out


def phased(tracker: LiveTensorBytes, step: list, name: str, fn):
    """``fn`` wrapped so that its allocations count toward phase ``(step, name)``."""

    def wrapper(*args, **kwargs):
        outer = tracker.phase
        tracker.phase = (step[0], name)
        tracker.peaks[tracker.phase] = max(tracker.peaks.get(tracker.phase, 0), tracker.live)
        tracker.entry.setdefault(tracker.phase, tracker.live)
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.phase = outer

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    run = json.loads(args.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))

    import lightning as L

    from gspo_lightning.data.datamodule import PromptDataModule
    from gspo_lightning.training.module import GSPOModule
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.rollout import HFEngine
    from gspo_lightning.rollout.worker import RolloutWorker
    from gspo_lightning.training.update import PolicyUpdater

    import gspo_lightning.training.logprobs as logprobs

    # the chunked head at a size a CPU can run: the threshold is a keyword default of response_logprobs
    logprobs.response_logprobs.__kwdefaults__["max_unchunked_bytes"] = run["max_unchunked_bytes"]
    tracker = LiveTensorBytes()
    step = [0]
    widths = []
    rollout = RolloutWorker.rollout

    def rollout_recording_width(self, *args, **kwargs):
        result = rollout(self, *args, **kwargs)
        widths.append(int(result.response_mask.shape[1]))
        return result

    RolloutWorker.rollout = phased(tracker, step, "generate", rollout_recording_width)
    GSPOModule._logprobs_no_grad = phased(tracker, step, "logprobs", GSPOModule._logprobs_no_grad)
    PolicyUpdater.run = phased(tracker, step, "update", PolicyUpdater.run)
    torch.optim.AdamW.step = phased(tracker, step, "optimizer step", torch.optim.AdamW.step)

    class StepCounter(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            step[0] = batch_idx + 1

    with tracker:
        L.seed_everything(1234, verbose=False)
        module = GSPOModule(
            model_name_or_path=args.model_dir, dtype="bfloat16" if run["precision"] == "bf16" else "float32",
            gradient_checkpointing=run["gradient_checkpointing"],
            rewards=[RewardSpec(function="memory_model.check_reward")],
            engine=HFEngine(generation_batch_size=run["generation_batch_size"]),
            num_return_sequences_in_group=run["group_size"], response_length=run["response_length"],
            use_kl_loss=run["reference"], mini_batch_size=run["mini_batch_size"],
            micro_batch_size=run["micro_batch_size"], logprob_chunk_size=run["logprob_chunk_size"],
            export_on_fit_end=False, prompt_length=run["prompt_length"],
        )
        data = PromptDataModule(path="builtin:gsm8k", prompt_field="question", tokenizer=args.model_dir,
                                rollout_batch_size=run["rollout_batch_size"], prompt_length=run["prompt_length"],
                                overlong_prompts="truncate_left", val_size=0, shuffle=False)
        strategy = "ddp" if world > 1 else "auto"
        if run["strategy"] == "fsdp2":
            from lightning.pytorch.strategies import ModelParallelStrategy

            strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepCounter()], use_distributed_sampler=False,
            precision="bf16-true" if run["precision"] == "bf16" else "32-true",
            default_root_dir=str(Path(args.out).parent),
        )
        from gspo_lightning.run import attach_run_callbacks

        attach_run_callbacks(trainer)  # the run's callbacks (curves, records, export), as `gspo fit` attaches them
        trainer.fit(module, datamodule=data)

    steady = {}
    for (index, phase), peak in tracker.peaks.items():
        if index >= 2:
            steady[phase] = max(steady.get(phase, 0), peak)
    peaks = torch.tensor([steady.get(p, 0) for p in ("generate", "logprobs", "update", "optimizer step")], dtype=torch.float64)
    if torch.distributed.is_initialized():  # the largest rank
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    phases = dict(zip(("generate", "logprobs", "update", "optimizer step"), (int(v) for v in peaks.tolist())))
    if trainer.global_rank == 0:
        peak_phase = max(phases, key=phases.get)
        Path(args.out).write_text(json.dumps({"phases": phases, "peak": phases[peak_phase], "peak_phase": peak_phase,
                                              "world": world, "response_widths": widths,
                                              "entry": {f"{k[0]}:{k[1]}": v for k, v in tracker.entry.items()}}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
