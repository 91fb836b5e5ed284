"""A model as a Hugging Face folder (safetensors + tokenizer) that transformers and a stock
``vllm serve`` load directly: the trained policy after a fit, a checkpoint, or any model the
trainer loads (``builtin:`` ones, GGUF files) before training:

    gspo export-model --model builtin:tiny-successor --out models/tiny-successor
    gspo export-model --checkpoint runs/.../last.ckpt --out exported/
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import torch

from gspo_lightning.errors import ConfigError

log = logging.getLogger(__name__)


def save_policy(policy, tokenizer, out_dir: str | Path, source: str | None = None) -> Path:
    """``policy`` and ``tokenizer`` as a folder; a vision-language policy also gets the image
    processor of ``source`` (the model it was loaded from), which ``AutoImageProcessor`` loads."""
    from transformers.utils import logging as hf_logging

    from gspo_lightning.models.vision import is_vision_language, load_image_processor

    if is_vision_language(policy) and source is None:
        raise ConfigError("saving a vision-language policy needs the model it came from, for its image processor")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.config.use_cache = True  # inference default for whoever loads it
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar amid the run's output
    try:
        policy.save_pretrained(out, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    policy.config.use_cache = False
    tokenizer.save_pretrained(out)
    check_auto_tokenizer(tokenizer, out)
    if is_vision_language(policy):
        load_image_processor(source).save_pretrained(out)
    return out


def save_lora_policy(policy, tokenizer, out_dir: str | Path, lora, base_model: str) -> Path:
    """A LoRA policy, twice: the merged model in ``out_dir`` (Auto classes load it like any
    model) and the PEFT adapter folder in ``out_dir/adapter`` (``PeftModel.from_pretrained`` on
    the base ``base_model``)."""
    from gspo_lightning.models.lora import base_model_copy, merged_state_dict, save_adapter

    out = save_policy(base_model_copy(policy, merged_state_dict(policy)), tokenizer, out_dir, base_model)
    save_adapter(policy, out / "adapter", base_model, lora)
    return out


def export_after_fit(policy, tokenizer, folder: Path, *, sharded: bool, trainer, lora=None,
                     base_model: str | None = None) -> None:
    """``export_on_fit_end``: the policy saved into ``folder`` by rank 0 (with ``lora``: merged,
    and its adapter folder in ``folder/adapter``); a sharded policy is not gathered here (a
    warning: export from the checkpoint). With ``--export=best`` (a ``BestCheckpoint`` among the
    trainer's callbacks) the best evaluation's weights are exported, unless they are the last
    step's or no evaluation was kept."""
    from gspo_lightning.run.results import best_checkpoint

    if sharded:
        warnings.warn("export_on_fit_end is skipped for sharded policies: export from the checkpoint instead")
        return
    if not trainer.is_global_zero:
        return
    best, step = best_checkpoint(trainer), trainer.global_step
    if best is not None and best.best_model_path and Path(best.best_model_path).is_file() and best.best_step != step:
        export_checkpoint(best.best_model_path, folder)
        score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
        print(f"policy exported to {folder}: the best held-out evaluation, step {best.best_step} "
              f"({best.monitor} {score:.3g}; {best.best_model_path})")
        return
    if lora is not None:
        save_lora_policy(policy, tokenizer, folder, lora, base_model)
    else:
        save_policy(policy, tokenizer, folder, base_model)
    what = " (LoRA merged; the adapter folder in adapter/)" if lora is not None else ""
    if best is not None and not best.best_model_path:
        print(f"policy exported to {folder}{what}: the last step's (export: best, but no held-out evaluation was kept)")
    else:
        print(f"policy exported to {folder}{what}" + (": the last step's, which is also the best held-out evaluation" if best is not None else ""))


def check_auto_tokenizer(tokenizer, folder: Path) -> bool:
    """Whether ``AutoTokenizer`` reloads the saved tokenizer as the same tokenizer (users load
    exports with the Auto classes; transformers may swap in the architecture's own class)."""
    from transformers import AutoTokenizer

    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(len(tokenizer), 64)) if i not in special][:16]
    probe = tokenizer.decode(ids) + " 12 + 3 = 15"  # the tokenizer's own words, with spaces

    def round_trip(tok) -> tuple[list[int], str]:
        encoded = tok(probe, add_special_tokens=False)["input_ids"]
        return encoded, tok.decode(encoded)

    try:
        reloaded = AutoTokenizer.from_pretrained(folder)
        same = round_trip(reloaded) == round_trip(tokenizer)
    except Exception as err:  # noqa: BLE001 - a custom tokenizer that needs remote code, say
        log.warning("could not check the exported tokenizer with AutoTokenizer: %s", err)
        return False
    if not same:
        log.warning("AutoTokenizer loads the tokenizer in %s as %s, which tokenizes differently from the trained "
                    "one: load it with %s.from_pretrained instead", folder, type(reloaded).__name__, type(tokenizer).__name__)
    return same


def export_checkpoint(ckpt_path: str | Path, out_dir: str | Path) -> Path:
    """Rebuild the policy from a Lightning checkpoint's hyperparameters and weights.

    The checkpoint is read with ``weights_only=True``: no pickled code runs.
    """
    from gspo_lightning.models.gguf import resolve_model
    from gspo_lightning.models.loading import load_policy, load_tokenizer

    from gspo_lightning.models.settings import Policy
    from gspo_lightning.training.config import nest_flat_keys

    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    hparams, _ = nest_flat_keys(checkpoint.get("hyper_parameters", {}))  # an older checkpoint's flat keys: in blocks
    name = hparams.get("model_name_or_path")
    if name is None:
        raise ConfigError(f"{ckpt_path} has no model_name_or_path hyperparameter: is it a GSPOModule checkpoint?")
    loading = Policy(**hparams.get("policy") or {})
    name = resolve_model(name, loading.gguf_file)  # a GGUF source: its converted folder
    tokenizer = load_tokenizer(name, loading.trust_remote_code)
    policy = load_policy(name, tokenizer, loading.dtype, None, loading.trust_remote_code)
    lora = None
    if hparams.get("lora"):  # the checkpoint holds the adapters only: the base comes from model_name_or_path
        from gspo_lightning.models.lora import LoRA, attach_lora

        lora = LoRA(**hparams["lora"])
        policy = attach_lora(policy, lora)
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    if lora is not None:
        trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
        if unexpected or trainable - set(state):
            raise ConfigError(f"checkpoint does not match {name} with lora={hparams['lora']}: "
                             f"missing adapters {sorted(trainable - set(state))[:5]}, unexpected {unexpected[:5]}")
        return save_lora_policy(policy, tokenizer, out_dir, lora, name)
    tied = getattr(policy, "_tied_weights_keys", None) or []  # None on models without tied weights
    missing = [k for k in missing if k not in tied]
    if unexpected or (missing and not all("lm_head" in k for k in missing)):
        raise ConfigError(f"checkpoint does not match {name}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return save_policy(policy, tokenizer, out_dir, name)


def export_model(name_or_path: str, out_dir: str | Path, dtype: str = "float32", gguf_file: str | None = None,
                 trust_remote_code: bool = False, seed: int = 0) -> Path:
    """The model ``gspo fit`` would load for ``model_name_or_path`` (a ``builtin:`` model built
    here, its random weights drawn after ``torch.manual_seed(seed)``; a GGUF file converted; a
    folder), written as a folder ``vllm serve`` loads."""
    from gspo_lightning.models.gguf import resolve_model
    from gspo_lightning.models.loading import load_policy, load_tokenizer

    name = resolve_model(name_or_path, gguf_file)
    tokenizer = load_tokenizer(name, trust_remote_code)
    torch.manual_seed(seed)  # a builtin model's random weights: the same for the same seed
    policy = load_policy(name, tokenizer, dtype, None, trust_remote_code)
    return save_policy(policy, tokenizer, out_dir, name)


def _empty_or_new(folder: str) -> Path:
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"--out {folder} exists and is not an empty folder: export into a new folder (nothing "
                          "is overwritten)")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gspo export-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model the trainer loads: builtin:<name>, a folder, a .gguf file, a hub id")
    source.add_argument("--checkpoint", help="a gspo checkpoint (last.ckpt): the policy it holds")
    parser.add_argument("--out", required=True, help="a new (or empty) folder for config.json, model.safetensors, "
                                                     "the tokenizer")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the weights' dtype (--model only; default float32)")
    parser.add_argument("--gguf-file", help="the file inside a GGUF repository (--model only)")
    parser.add_argument("--seed", type=int, default=0, help="a builtin model's random weights are drawn after "
                                                           "seeding with it (--model only; default 0)")
    args = parser.parse_args(argv)
    out = _empty_or_new(args.out)
    if args.checkpoint:
        folder = export_checkpoint(args.checkpoint, out)
    else:
        folder = export_model(args.model, out, args.dtype, args.gguf_file, seed=args.seed)
    print(f"exported to {folder}: load it with transformers' Auto classes, or serve it: "
          f"python -m vllm.entrypoints.openai.api_server --model {folder}")


if __name__ == "__main__":
    main()
