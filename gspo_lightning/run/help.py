"""``gspo fit --help``: the keys most runs change, grouped by concern, printed without importing
anything (the full list, ``--help-all``, builds the LightningCLI parser: torch, Lightning,
transformers, seconds). ``tests/test_cli.py`` checks that every key named here is a real one."""

FIT_HELP = """usage: gspo fit --config cfg.yaml [--section.key=value ...]

Train a policy by GSPO. Every config key can also be given on the command line; these are the
ones most runs change. `gspo fit --help-all` lists every key; docs/config.md explains them.

run
  --config FILE                      a YAML config (configs/quickstart.yaml); several merge in order
  --print_config                     print the resolved config and exit
  --ckpt_path PATH                   resume from a checkpoint (<run folder>/csv/version_0/checkpoints/last.ckpt)
  --export {last,best}               the policy exported at the end: the last step's, or the best
                                     held-out evaluation's (kept as best.ckpt)
  --stop_grace_s S                   seconds a SIGTERM / Ctrl-C stop may take (10): a rollout is
                                     abandoned, an update finishes, then last.ckpt
  --debug                            tracebacks for errors (or GSPO_DEBUG=1)

trainer (Lightning's Trainer)
  --trainer.max_steps N              rollout steps to train
  --trainer.val_check_interval N     held-out evaluation every N steps
  --trainer.num_sanity_val_steps -1  and once before training (the untrained model, step 0)
  --trainer.default_root_dir DIR     the run folder: logs, checkpoints, the export
  --trainer.logger+=CLASS            add a logger (WandbLogger, MLFlowLogger...) to CSV and TensorBoard
  --trainer.accelerator, --trainer.devices, --trainer.strategy, --trainer.precision

model (the policy and how it samples)
  --model.model_name_or_path ID      hub id, folder, .gguf file or builtin:NAME
  --model.rewards LIST               reward functions: [{function: mymodule.score, weight: 1.0}]
  --model.engine CLASS               HFEngine (default), gspo_lightning.rollout.VLLMEngine, RemoteEngine
  --model.policy.dtype {float32,bfloat16,float16}
  --model.rollout.num_return_sequences_in_group G   responses per prompt
  --model.rollout.response_length T  most new tokens per response
  --model.rollout.temperature, --model.rollout.top_p, --model.rollout.top_k

algorithm
  --model.objective.importance_sampling {seq,seq-token,token}   GSPO, GSPO-token, GRPO
  --model.objective.policy_loss CLASS   PPOClip (default, GSPO's clip), SAPO, CISPO, GMPO or your own
  --model.update.num_mini_batches N, --model.update.mini_batch_size   optimizer steps per rollout step
  --model.advantages.adv_estimator {grpo,reinforce,rloo,dr_grpo}
  --model.objective.use_kl_loss, --model.objective.kl_loss_coef
  --model.optimizer CLASS            e.g. torch.optim.AdamW, with --model.optimizer.init_args.lr=1e-5
  --model.asynchronous.max_staleness K   asynchronous GSPO: generate K steps ahead (docs/async.md)

data
  --data.path PATH                   prompts: .jsonl, .parquet, a saved datasets folder, builtin:NAME
  --data.val_path, --data.val_size   held-out prompts (val_size rows of path when val_path is unset)
  --data.rollout_batch_size N        prompts per step
  --data.prompt_length N             longest prompt in tokens

checkpoints (Lightning's ModelCheckpoint)
  --checkpoint.every_n_train_steps N        last.ckpt every N steps (and at the end)
  --checkpoint.save_weights_only true       no optimizer state: about a third of the size; it
                                            exports and evaluates, but cannot resume a run
  --checkpoint.monitor=step --checkpoint.mode=max --checkpoint.save_top_k=K   keep the K newest
  --trainer.enable_checkpointing false      none at all
"""

__all__ = ["FIT_HELP"]
