"""Documentation stays true to the code."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "config.md").read_text() == gen.render(), "run: python scripts/gen_config_docs.py"


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = [b.strip() for b in readme.split("```bash")[1:3]]
    commands = [b.split("```")[0].strip() for b in blocks]
    assert commands[0].endswith("gspo fit --config configs/quickstart.yaml")
    assert commands[1].endswith("python -m pytest -q -n 2 --dist worksteal")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"\n{commands[1].rpartition(' && ')[2]}\n" in ci and "torch==2.13.0" in ci


def test_docs_link_targets_exist():
    readme = (ROOT / "README.md").read_text()
    import re

    for target in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / target).exists(), target


def test_reward_example_in_the_config_reference_runs(tmp_path, monkeypatch):
    import re

    import yaml

    from gspo_lightning.rewards import RewardComposer

    text = (ROOT / "docs" / "config.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Reward functions"):], re.S).group(1)
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text[text.index("## Reward functions"):], re.S).group(1))
    (tmp_path / "myrewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    composer = RewardComposer(config["model"]["rewards"])
    total, parts, scored = composer(
        prompts=["q"] * 3, completions=["so #### 1,080", "#### 5", "no answer"], completion_ids=[[1], [2], [3]],
        columns={"answer": ["a\n#### 1080", "#### 6", ""]})
    assert parts["score"][:2] == [1.0, 0.0] and scored == [True, True, True]
    assert total[0] == 1.1  # score 1.0 + 0.1 x format_reward 1.0


def test_every_package_name_in_configs_and_docs_resolves():
    """Class paths, reward functions and modules named in shipped configs and docs exist (a move
    of a module must carry its docs along)."""
    import importlib
    import re

    def resolves(dotted: str) -> bool:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                value = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                value = getattr(value, attribute, None)
            return value is not None
        return False

    files = [*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    names = {(path.relative_to(ROOT), match) for path in files
             for match in re.findall(r"gspo_lightning(?:\.[A-Za-z_]\w*)+", path.read_text())}
    missing = sorted(f"{path}: {name}" for path, name in names if not resolves(name))
    assert len(names) > 30 and not missing, missing


def test_the_stock_vllm_engine_block_of_the_docs_builds():
    """docs/vllm.md's StockVLLMEngine block and configs/quickstart_stock_vllm.yaml build the engine
    they describe (its run against real servers: tests/test_stock_vllm.py, CI's vLLM stage)."""
    import yaml
    from jsonargparse import ArgumentParser

    from gspo_lightning.rollout import RolloutEngine, StockVLLMEngine

    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text[text.index("## On stock vLLM servers"):]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))["model"]["engine"]
    recipe = yaml.safe_load((ROOT / "configs" / "quickstart_stock_vllm.yaml").read_text())["model"]["engine"]
    parser = ArgumentParser()
    parser.add_argument("--engine", type=RolloutEngine)
    for config, urls in ((block, ["http://127.0.0.1:8000"]), (recipe, ["http://127.0.0.1:8000", "http://127.0.0.1:8001"])):
        engine = parser.instantiate_classes(parser.parse_object({"engine": config})).engine
        assert isinstance(engine, StockVLLMEngine) and engine.urls == urls and engine.api_key_env == "VLLM_API_KEY"
    assert "--logprobs-mode processed_logprobs" in section and "VLLM_SERVER_DEV_MODE=1" in section


def test_the_gspo_serve_replica_commands_of_the_scaling_docs_run(tmp_path):
    """docs/scaling.md's gspo serve + StockVLLMEngine commands, as written (a free port, 2 steps):
    the run trains on the served replica through vLLM's routes."""
    import os
    import shlex
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    text = (ROOT / "docs" / "scaling.md").read_text()
    block = re.search(r"### Starting replicas\n\n```bash\n(.*?)```", text, re.S).group(1)
    lines = [line.rstrip("\\").strip() for line in block.split("\n\n")[-1].splitlines() if not line.startswith("#")]
    joined = " ".join(lines)
    serve = joined[joined.index("gspo serve"):joined.index("gspo fit")].split()
    fit = shlex.split(joined[joined.index("gspo fit"):])
    assert serve[:2] == ["gspo", "serve"] and "--port" in serve and fit[:2] == ["gspo", "fit"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve[serve.index("--port") + 1] = str(port)
    fit = [arg.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for arg in fit]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # GSPO_SERVER_TOKEN: set for the tests (conftest.py)
    server = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", *serve[1:]], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "gspo serve exited"
                time.sleep(0.2)
        done = subprocess.run([sys.executable, "-m", "gspo_lightning.cli", *fit[1:], "--trainer.max_steps=2",
                               "--trainer.val_check_interval=1000", "--trainer.num_sanity_val_steps=0",
                               f"--trainer.default_root_dir={tmp_path}", "--model.export_on_fit_end=false",
                               "--trainer.enable_progress_bar=false"], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
    finally:
        server.terminate()
        server.wait(30)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generated by StockVLLMEngine" in done.stderr + done.stdout
    rows = [line for line in (next(tmp_path.rglob("metrics.csv"))).read_text().splitlines()[1:] if line]
    assert len(rows) >= 2
