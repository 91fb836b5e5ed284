"""The Dockerfile, its docs and the CI script that builds it agree (the build itself runs in
CI: scripts/container_ci.sh, called by .ci/run)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SCRIPT = ROOT / "scripts" / "container_ci.sh"


def stages(text: str) -> list[str]:
    """The Dockerfile's stages, each from its FROM line (the text before the first is the global ARGs)."""
    return re.split(r"^FROM ", text, flags=re.M)[1:]


def declared_args(text: str) -> set[str]:
    return set(re.findall(r"^ARG (\w+)", text, flags=re.M))


def test_stages_finds_the_args_of_each_stage():
    text = "ARG BASE=x\nFROM ${BASE} AS build\nARG A\nRUN a\nFROM ${BASE}\nARG B=1\n"
    parts = stages(text)
    assert len(parts) == 2 and declared_args(parts[0]) == {"A"} and declared_args(parts[1]) == {"B"}


def test_every_build_arg_in_the_docs_and_ci_is_declared_in_the_dockerfile():
    declared = declared_args(DOCKERFILE)
    # predefined by Docker and podman, not declared
    predefined = {"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "FTP_PROXY", "ALL_PROXY"}
    for path in (ROOT / "docs" / "docker.md", SCRIPT):
        used = set(re.findall(r"--build-arg (\w+)=", path.read_text()))
        assert used, path
        assert used - predefined <= declared, f"{path.name}: {sorted(used - predefined - declared)} not ARGs of the Dockerfile"


def test_network_settings_stay_in_the_build_stage():
    build, image = stages(DOCKERFILE)
    assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_TRUSTED_HOST"} <= declared_args(build)
    assert "pip_ca" in build
    assert not re.search(r"PIP_|pip_ca|secret", image), "the image's stage must not see pip's network settings"
    assert "COPY --from=build /opt/venv /opt/venv" in image
    assert 'ENTRYPOINT ["gspo"]' in image and "WORKDIR /workspace" in image


def test_what_the_image_copies_is_not_ignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copied = {src for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, flags=re.M)
              for src in line.split()[:-1]}
    assert copied == {"pyproject.toml", "README.md", "gspo_lightning", "configs"}
    assert not copied & ignored


def test_configs_run_in_the_docs_and_ci_exist():
    for path in (ROOT / "docs" / "docker.md", SCRIPT):
        for config in re.findall(r"--config (configs/[\w/.-]+\.yaml)", path.read_text()):
            assert (ROOT / config).is_file(), f"{path.name}: {config}"


def test_ci_runs_the_container_stage_and_the_script_parses():
    assert "scripts/container_ci.sh" in (ROOT / ".ci" / "run").read_text()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert SCRIPT.stat().st_mode & 0o111, "scripts/container_ci.sh must be executable"
