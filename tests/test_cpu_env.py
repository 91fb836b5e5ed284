"""The `gspo` command sets OpenMP's wait policy before torch loads; a user's own value wins."""

import os
import subprocess
import sys
from pathlib import Path

from gspo_lightning.run.cpu_env import configure_cpu_env

ROOT = Path(__file__).resolve().parents[1]

# Records OMP_WAIT_POLICY at the moment `import torch` starts, then imports the CLI module.
PROBE = """
import importlib.abc, os, sys
seen = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY", "<unset>"))
        return None
sys.meta_path.insert(0, Watch())
import gspo_lightning.run.command  # the module that imports Lightning, hence torch
print("AT_TORCH_IMPORT=" + seen[0])
"""


def _policy_at_torch_import(extra_env: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra_env, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().rsplit("AT_TORCH_IMPORT=", 1)[1]


def test_cli_sets_the_wait_policy_before_torch_loads_and_the_users_value_wins():
    assert _policy_at_torch_import({}) == "PASSIVE"
    assert _policy_at_torch_import({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_configure_cpu_env_fills_only_unset_values():
    env = {"OMP_NUM_THREADS": "3"}
    assert configure_cpu_env(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    mine = {"OMP_WAIT_POLICY": "active"}
    assert configure_cpu_env(mine) == {} and mine == {"OMP_WAIT_POLICY": "active"}
