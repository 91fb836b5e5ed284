#!/usr/bin/env bash
# CI stage: the CPU image built from scratch with podman and run with no network
# (docs/docker.md). On a fresh Debian machine, as root (or with passwordless sudo):
#   1. podman, runc and debootstrap from the apt mirror; the containers.conf settings this
#      kind of machine needs;
#   2. a Debian bookworm base made with debootstrap (no container registry is needed);
#   3. the image built from the repository's Dockerfile (CPU build arguments);
#   4. inside, offline: `gspo --help`, then the quickstart writing to a mounted folder as a
#      non-root user: it must learn (reward and held-out accuracy >= 0.9), its files must
#      belong to that user;
#   5. the exported model loaded outside the container with transformers' Auto classes;
#   6. trainer and rollout server in two containers on a podman network (SERVER_PAIR=0 skips).
# Every part is timed; any failure stops the script with a message naming the part.
# STAGE=build runs parts 1-3 only (mostly downloads and unpacking: .ci/run runs it beside the
# tests), STAGE=run parts 4-6 on the image built before; the default, all, runs every part.
#
# Settings (environment): PYTHON (a Python with transformers for part 5; default .venv/bin/python,
# the environment .ci/run made), KEEP_BASE=1 / KEEP_IMAGE=1 reuse an existing base / image, PIP_CA (default the
# host's CA bundle, given to pip in the build as a secret), WHEELS (default /opt/wheels where it
# exists: a folder of wheels mounted into the build; the CPU torch wheel is there on these machines;
# without one, PIP_EXTRA_INDEX_URL defaults to PyTorch's CPU index), PIP_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

BASE=${BASE:-localhost/debian:bookworm}
IMAGE=${IMAGE:-localhost/gspo-lightning:cpu}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
# pip in the build: the host's CA bundle (a TLS-inspecting proxy re-signs PyPI here), the local
# wheel folder where there is one, else PyTorch's CPU index for torch==2.13.0+cpu
[ -f /etc/ssl/certs/ca-certificates.crt ] && PIP_CA=${PIP_CA-/etc/ssl/certs/ca-certificates.crt} || PIP_CA=${PIP_CA-}
[ -d /opt/wheels ] && WHEELS=${WHEELS-/opt/wheels} || WHEELS=${WHEELS-}
[ -n "$WHEELS" ] || [ -n "${PIP_INDEX_URL:-}" ] || PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-https://download.pytorch.org/whl/cpu}
SERVER_PAIR=${SERVER_PAIR:-1}
STAGE=${STAGE:-all}
case "$STAGE" in all|build|run) ;; *) echo "STAGE=$STAGE: use all, build or run" >&2; exit 2;; esac
SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
PODMAN="$SUDO podman"
WORK=$(mktemp -d /tmp/gspo-container-ci.XXXXXX)
NET=gspo-ci-$$
SERVER=gspo-ci-server-$$

PART=setup
declare -a TIMES=()
t_all=$(date +%s)
t0=$t_all
begin() { PART=$1; t0=$(date +%s); echo; echo "=== container CI: $PART"; }
end() { TIMES+=("$(printf '%-40s %4d s' "$PART" $(( $(date +%s) - t0 )))"); }
report() {
    echo; echo "=== container CI timings"
    for line in "${TIMES[@]}"; do echo "  $line"; done
    echo "  $(printf '%-40s %4d s' total $(( $(date +%s) - t_all )))"
}
cleanup() {
    local rc=$?
    $PODMAN rm -f -i "$SERVER" >/dev/null 2>&1 || true
    $PODMAN network rm -f "$NET" >/dev/null 2>&1 || true
    $SUDO rm -rf "$WORK"
    if [ $rc -ne 0 ]; then
        report
        # a full disk fails far from its cause (podman: "read/write on closed pipe")
        echo "=== disk"; df -h / /tmp /var/lib/containers /var/tmp 2>/dev/null | awk 'NR == 1 || !seen[$1]++'
        echo "=== container CI FAILED in part: $PART (exit $rc)" >&2
    fi
    exit $rc
}
trap cleanup EXIT

if [ "$STAGE" != run ]; then
# --- 1. podman from the apt mirror, and the settings this machine needs
begin "install podman, runc, debootstrap"
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
fi
# podman asks for 1048576 open files by default, more than a container may raise its limit to
# here: the machine's hard limits instead (nproc at most 32768). crun 1.8 refuses hybrid cgroups
# ("cgroups in hybrid mode not supported"): runc.
nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
$SUDO mkdir -p /etc/containers/containers.conf.d
printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n\n[engine]\nruntime = "runc"\n' \
    "$nofile" "$nofile" "$nproc" "$nproc" | $SUDO tee /etc/containers/containers.conf.d/50-gspo-ci.conf >/dev/null
$PODMAN --version
end

# --- 2. the base image, from the apt mirror
begin "base image (debootstrap)"
if [ "${KEEP_BASE:-0}" = 1 ] && $PODMAN image exists "$BASE"; then
    echo "reusing $BASE (KEEP_BASE=1)"
else
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$mirror" ] || mirror=$(awk '/^deb / && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "debootstrap bookworm from $mirror"
    $SUDO debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    echo "deb $mirror bookworm-updates main" | $SUDO tee -a "$WORK/rootfs/etc/apt/sources.list" >/dev/null
    $SUDO rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
    $SUDO tar -C "$WORK/rootfs" -c . | $PODMAN import --quiet --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    $SUDO rm -rf "$WORK/rootfs"
fi
end

# --- 3. the image, from scratch (no layer cache)
begin "build the CPU image"
if [ "${KEEP_IMAGE:-0}" = 1 ] && $PODMAN image exists "$IMAGE"; then
    echo "reusing $IMAGE (KEEP_IMAGE=1)"
else
    build_args=(--build-arg BASE_IMAGE="$BASE" --build-arg TORCH=torch==2.13.0+cpu --build-arg EXTRAS=
                --build-arg BUILD_PACKAGES= --build-arg RUNTIME_PACKAGES=)
    [ -n "$PIP_CA" ] && build_args+=(--secret id=pip_ca,src="$PIP_CA")
    [ -n "$WHEELS" ] && build_args+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
    [ -n "${PIP_INDEX_URL:-}" ] && build_args+=(--build-arg PIP_INDEX_URL="$PIP_INDEX_URL")
    [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && build_args+=(--build-arg PIP_EXTRA_INDEX_URL="$PIP_EXTRA_INDEX_URL")
    $PODMAN build --no-cache --layers=false --network host "${build_args[@]}" -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
        || { tail -40 "$WORK/build.log"; exit 1; }
    grep -E "STEP [0-9]+/[0-9]+: (FROM|RUN)|^COMMIT|Successfully installed .*torch" "$WORK/build.log" | cut -c1-140 || true
fi
end

begin "inspect the image"
size=$($PODMAN image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE: $(( size / 1000000 )) MB"
# nothing of the build's network settings is kept: not in the environment, not in the history
$PODMAN image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$IMAGE" | tee "$WORK/env.txt"
$PODMAN history --no-trunc --format '{{.CreatedBy}}' "$IMAGE" >"$WORK/history.txt"
if grep -nE 'PIP_|pip_ca|/wheels|ca-certificates\.crt' "$WORK/env.txt" "$WORK/history.txt"; then
    echo "the image keeps build-time network settings (above)" >&2; exit 1
fi
$PODMAN run --rm --network none --entrypoint python "$IMAGE" -c \
    "import torch, os; assert torch.version.cuda is None, torch.version.cuda; assert not os.path.exists('/run/secrets/pip_ca'); print('torch', torch.__version__)"
end
fi
if [ "$STAGE" = build ]; then report; echo "=== container CI: image built"; exit 0; fi
$PODMAN image exists "$IMAGE" || { echo "no image $IMAGE to run: STAGE=build first" >&2; exit 1; }

# --- 4. offline runs
begin "gspo --help (--network none)"
$PODMAN run --rm --network none "$IMAGE" --help >"$WORK/help.txt"
head -5 "$WORK/help.txt"
grep -q "fit" "$WORK/help.txt" || { echo "gspo --help does not list fit" >&2; exit 1; }
end

begin "quickstart (--network none)"
# as a non-root user whose files they are: the invoking user, or uid 1000 when that is root
RUN_UID=$(id -u); RUN_GID=$(id -g)
[ "$RUN_UID" -eq 0 ] && { RUN_UID=1000; RUN_GID=1000; }
mkdir -p "$WORK/runs"
$SUDO chown "$RUN_UID:$RUN_GID" "$WORK/runs"
$PODMAN run --rm --network none --user "$RUN_UID:$RUN_GID" -v "$WORK/runs:/workspace/runs" "$IMAGE" \
    fit --config configs/quickstart.yaml --trainer.enable_progress_bar=false 2>&1 | tail -15
run=$WORK/runs/quickstart/csv/version_0
not_theirs=$(find "$WORK/runs" \( ! -uid "$RUN_UID" -o ! -gid "$RUN_GID" \) -print | head -5)
[ -z "$not_theirs" ] || { echo "files not owned by $RUN_UID:$RUN_GID: $not_theirs" >&2; exit 1; }
echo "$(find "$WORK/runs" | wc -l) files and folders under the mounted runs/, owned by $RUN_UID:$RUN_GID"
python3 - "$run/metrics.csv" <<'PY'
import csv, sys

rows = list(csv.DictReader(open(sys.argv[1])))
reward = [float(r["reward/mean"]) for r in rows if r.get("reward/mean")]
acc = [float(r["val/accuracy"]) for r in rows if r.get("val/accuracy")]
tenth = max(1, len(reward) // 10)
first, last = sum(reward[:tenth]) / tenth, sum(reward[-tenth:]) / tenth
print(f"quickstart in the container: {len(reward)} steps, reward {first:.3f} -> {last:.3f}, "
      f"held-out accuracy {acc[0]:.3f} -> {acc[-1]:.3f}")
assert last >= 0.9, f"the quickstart did not learn in the container: reward {last:.3f} < 0.9"
assert acc[-1] >= 0.9, f"held-out accuracy {acc[-1]:.3f} < 0.9 at the end"
PY
end

# --- 5. the export, outside the container
begin "load the export outside (transformers)"
"$PYTHON" - "$run/hf_model" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder).eval()
scores = []
with torch.no_grad():
    for digit in range(10):  # the successor task: "next 7" -> "8 8 8 8"
        ids = tokenizer(f"next {digit}", return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        words = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).split()[:4]
        scores.append(sum(w == str((digit + 1) % 10) for w in words) / 4)
score = sum(scores) / len(scores)
print(f"export loaded outside by {type(model).__name__}: greedy successor score {score:.3f} on the 10 digits")
assert score >= 0.9, f"the exported model scores {score:.3f} < 0.9 outside the container"
PY
end

# --- 6. trainer and rollout server, two containers on a podman network
if [ "$SERVER_PAIR" = 1 ]; then
    begin "trainer + rollout server containers"
    # the server's shared secret (at least 16 characters), passed to both through the environment
    GSPO_SERVER_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
    export GSPO_SERVER_TOKEN
    mkdir -p "$WORK/weights" "$WORK/runs_server"
    $SUDO chown "$RUN_UID:$RUN_GID" "$WORK/weights" "$WORK/runs_server"
    $PODMAN network create "$NET" >/dev/null
    # the port published on the host's loopback only
    $PODMAN run -d --name "$SERVER" --network "$NET" --user "$RUN_UID:$RUN_GID" -e GSPO_SERVER_TOKEN \
        -v "$WORK/weights:/weights" -p 127.0.0.1::8000 "$IMAGE" \
        serve --config configs/quickstart_server.yaml --host 0.0.0.0 --port 8000 --weights_root /weights >/dev/null
    port=$($PODMAN port "$SERVER" 8000/tcp | sed 's/.*://')
    python3 - "$port" <<'PY' || { $PODMAN logs "$SERVER" 2>&1 | tail -20; false; }
import sys, time, urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}/health"
for _ in range(120):
    try:
        print("server on the host's loopback:", url, urllib.request.urlopen(url, timeout=2).read().decode())
        break
    except OSError:
        time.sleep(1)
else:
    sys.exit(f"the server container did not answer on {url}")
PY
    $PODMAN run --rm --network "$NET" --user "$RUN_UID:$RUN_GID" -e GSPO_SERVER_TOKEN \
        -v "$WORK/weights:/weights" -v "$WORK/runs_server:/workspace/runs" "$IMAGE" \
        fit --config configs/quickstart_server.yaml --trainer.enable_progress_bar=false \
        --model.export_on_fit_end=false \
        "--model.engine.init_args.urls=[http://$SERVER:8000]" \
        --model.engine.init_args.transport=gspo_lightning.rollout.transport.FolderTransport \
        --model.engine.init_args.transport.init_args.path=/weights 2>&1 | tail -8
    $PODMAN logs "$SERVER" 2>&1 | tail -3
    python3 - "$WORK/runs_server/quickstart_server/csv/version_0/metrics.csv" <<'PY'
import csv, sys

rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("reward/mean")]
tenth = max(1, len(rows) // 10)
first = sum(float(r["reward/mean"]) for r in rows[:tenth]) / tenth
last = sum(float(r["reward/mean"]) for r in rows[-tenth:]) / tenth
print(f"trainer + server containers: {len(rows)} steps, reward {first:.3f} -> {last:.3f}")
assert last >= 0.9, f"the server quickstart did not learn across containers: reward {last:.3f} < 0.9"
PY
    end
fi

report
echo "=== container CI passed"
