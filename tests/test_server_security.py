"""The rollout server against hostile and broken clients, on 127.0.0.1 only (docs/scaling.md#security).

The promise: only a client holding the secret can make the server generate, load weights or read
files; no client can make it hang, grow or crash. Every attack below runs against a real server
(``http_server`` on a free loopback port, the tiny successor model) and is followed by a good
request that must still be served. The client's own checks of what a server replies are here too.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from gspo_lightning.errors import RolloutServerError
from gspo_lightning.rollout import EngineSpec, RemoteEngine, SamplingParams
from gspo_lightning.rollout.remote import _Unreachable, request_json
from gspo_lightning.rollout.replies import check_generation_reply, check_weights_reply
from gspo_lightning.rollout.server import RolloutServer, ServerLimits, ServerSpec, http_server
from gspo_lightning.rollout.server.auth import authorized, is_loopback, read_secret
from gspo_lightning.rollout.transport import FolderTransport
from gspo_lightning.rollout.weight_sync import iter_policy_weights
from gspo_lightning.data.tasks import build_tiny

MODEL = "builtin:tiny-successor"
SECRET = "a-test-secret-of-32-characters-x"
SESSION = "trainer-session-1"
TIMEOUT_S = 1.0  # the server's request_timeout_s here
LIMITS = ServerLimits(request_timeout_s=TIMEOUT_S, max_connections=6, max_body_mb=0.25, max_prompts=8,
                      max_prompt_tokens=16, max_n=8, max_responses=32)
ROOT = Path(__file__).resolve().parents[1]


class Served:
    """A server with a secret, and counters of the work it did (engine generations, weight loads)."""

    def __init__(self, weights_root: Path):
        self.app = RolloutServer(ServerSpec(MODEL, prompt_length=8, response_length=6,
                                            engine={"class_path": "gspo_lightning.rollout.HFEngine"}),
                                 limits=LIMITS, weights_root=str(weights_root))
        self.app.start()
        self.generations, self.loads = [], []
        engine_generate, load_pairs = self.app.engine.generate, self.app._load_pairs
        self.app.engine.generate = lambda *a, **k: self.generations.append(1) or engine_generate(*a, **k)
        self.app._load_pairs = lambda *a, **k: self.loads.append(1) or load_pairs(*a, **k)
        self.httpd = http_server(self.app, "127.0.0.1", 0, secret=SECRET)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def call(self, path: str, body=None, secret=SECRET, timeout=10.0):
        return request_json(self.url, path, body, timeout=timeout, secret=secret)

    def good(self) -> None:
        """A trainer's request is still served (retried while the server answers busy)."""
        deadline = time.monotonic() + 4 * TIMEOUT_S + 5
        while True:
            try:
                self.call("/session", {"token": SESSION})
                reply = self.call("/generate", {"token": SESSION, "prompt_ids": [[3, 4], [5]], "n": 2,
                                                "params": {"max_new_tokens": 3}, "seed": 0})
                break
            except _Unreachable:  # busy (503) or closed before the request was read: a trainer retries
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert len(reply["completion_ids"]) == 4 and all(1 <= len(row) <= 3 for row in reply["completion_ids"])
        self.call("/session/close", {"token": SESSION})  # free for the next test's trainer

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.app.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("weights-root"))
    yield server
    server.close()


def raw(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, float]:
    """Send ``data`` as is; the reply's status, JSON body and seconds to the end of the reply."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        reply = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
            if length and len(body) >= length[0]:
                break
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}, time.monotonic() - start


def post(path: str, body: bytes, headers: str = "", secret: str = SECRET, length: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {secret}\r\n" if secret else ""
    size = f"Content-Length: {len(body) if length is None else length}\r\n" if length != "" else ""
    return f"POST {path} HTTP/1.1\r\nHost: t\r\n{auth}{size}{headers}\r\n".encode() + body


def closed_within(conn: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``conn`` (failing past ``seconds``)."""
    start = time.monotonic()
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept a half-sent request open past {seconds} s")
    return time.monotonic() - start


# -- the secret ---------------------------------------------------------------------------------------
def test_without_the_secret_only_health_answers_and_nothing_is_done(served, tmp_path):
    before = (served.app.version, served.app.lease._token, len(served.generations), len(served.loads))
    assert served.call("/health", secret=None) == {"ok": True}
    weights = FolderTransport(path=served.app.weights_root).send(iter_policy_weights(build_tiny(MODEL)[0]), 1)
    requests = [("/info", None), ("/session", {"token": "intruder"}), ("/session/close", {"token": SESSION}),
                ("/weights", {"token": "intruder", "version": 1, "manifest": weights}),
                ("/generate", {"token": "intruder", "prompt_ids": [[3]], "n": 1, "params": {"max_new_tokens": 2}, "seed": 0})]
    wrong = [None, "", SECRET[:-1] + "y", SECRET[:-1], SECRET + "x", SECRET.upper()]
    for path, body in requests:
        for secret in wrong:
            with pytest.raises(RolloutServerError, match=r"refused this trainer's secret \(401\).*GSPO_SERVER_TOKEN"):
                served.call(path, body, secret=secret)
    for header in (f"Basic {SECRET}", SECRET, f"Bearer{SECRET}", f"Token {SECRET}"):  # the secret, but not as a Bearer
        status, reply, _ = raw(served.port, f"GET /info HTTP/1.1\r\nHost: t\r\nAuthorization: {header}\r\n\r\n".encode())
        assert status == 401 and reply["kind"] == "unauthorized" and "fingerprint" not in reply
    assert (served.app.version, served.app.lease._token, len(served.generations), len(served.loads)) == before
    served.good()


def test_the_secret_is_compared_in_constant_time(monkeypatch):
    from gspo_lightning.rollout.server import auth

    calls = []
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or a == b)
    assert authorized(f"Bearer {SECRET}", SECRET) and authorized(f"bearer  {SECRET} ", SECRET)
    assert not authorized(f"Basic {SECRET}", SECRET) and not authorized(None, SECRET)
    assert len(calls) == 4  # every check went through compare_digest, a wrong scheme too
    assert not authorized(None, None) and not authorized(f"Bearer {SECRET}", None)  # no secret: nothing is authorized


def test_a_secret_comes_from_the_environment_or_a_file_and_must_be_long(tmp_path):
    assert read_secret(None, {}) is None and read_secret(None, {"GSPO_SERVER_TOKEN": "  "}) is None
    assert read_secret(None, {"GSPO_SERVER_TOKEN": f" {SECRET}\n"}) == SECRET
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    assert read_secret(str(token_file), {"GSPO_SERVER_TOKEN": "other-secret-of-enough-length"}) == SECRET  # the file wins
    with pytest.raises(ValueError, match="has 5 characters; use at least 16"):
        read_secret(None, {"GSPO_SERVER_TOKEN": "short"})
    for bad in ("a secret with spaces in it", "a-secret-with-\x07-a-bell", "a-secret-with-an-ümlaut-in-it"):
        with pytest.raises(ValueError, match="whitespace, control or non-ASCII characters"):
            read_secret(None, {"GSPO_SERVER_TOKEN": bad})
    with pytest.raises(ValueError, match="cannot read the rollout server's token file"):
        read_secret(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("::1", True),
                                            ("[::1]", True), ("0.0.0.0", False), ("", False), ("::", False),
                                            ("10.0.0.5", False), ("gpu-node-1", False)])
def test_only_loopback_addresses_count_as_this_machine(host, loopback):
    assert is_loopback(host) is loopback


def test_gspo_serve_refuses_to_serve_other_machines_without_a_secret(monkeypatch, capsys):
    from gspo_lightning.run.serve import main

    monkeypatch.delenv("GSPO_SERVER_TOKEN", raising=False)
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        main(["--config", str(ROOT / "configs/quickstart_server.yaml"), "--host", "0.0.0.0", "--port", "0"])
    message = str(stop.value.code)
    assert "--host 0.0.0.0 serves other machines, and no secret is set" in message and "GSPO_SERVER_TOKEN" in message
    assert "SSH tunnel or a TLS proxy" in message and time.monotonic() - start < 5  # before the model loads
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out  # the help suggests no address for other machines without a secret
    assert "0.0.0.0" not in out and "GSPO_SERVER_TOKEN" in out and "--max_body_mb" in out


def test_http_server_binds_no_address_without_a_secret(served):
    for host in ("0.0.0.0", "127.0.0.1"):  # loopback too: other users of the machine reach it
        with pytest.raises(ValueError, match="needs a secret"):
            http_server(served.app, host, 0)


def test_gspo_serve_given_no_secret_makes_one_only_its_user_can_read(tmp_path, monkeypatch):
    """A stranger on the machine (any process without the secret) can neither push weights nor hand
    the server an NCCL rendezvous; the trainer's user reads the secret from the printed file."""
    import os
    import stat
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GSPO_SERVER_TOKEN"}
    env.update(XDG_RUNTIME_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-m", "gspo_lightning.cli", "serve", "--config",
                               str(ROOT / "configs/quickstart_server.yaml"), "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = [server.stdout.readline() for _ in range(2)]
        url = lines[0].split(" on ")[1].split(" ")[0]
        secret_file = Path(lines[1].split("token_file=")[1].strip())
        assert secret_file.parent == tmp_path / "gspo-lightning"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600 and stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
        secret = read_secret(str(secret_file))
        stranger = [("/weights", {"token": "t", "version": 1, "manifest": {"kind": "folder", "path": str(tmp_path)}}),
                    ("/weights", {"token": "t", "version": 1, "manifest": {"kind": "nccl", "host": "10.0.0.9", "port": 29500,
                                                                           "world_size": 2}}),
                    ("/session", {"token": "t"}), ("/info", None)]
        for path, body in stranger:
            with pytest.raises(RolloutServerError, match=r"\(401\)"):
                request_json(url, path, body, timeout=10, secret=None)
            with pytest.raises(RolloutServerError, match=r"\(401\)"):
                request_json(url, path, body, timeout=10, secret="a-guess-of-enough-characters-000")
        assert request_json(url, "/info", timeout=10, secret=secret)["version"] == -1  # its user's trainer is served
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert not secret_file.exists()  # removed with the server


def test_a_weights_folder_others_can_write_into_is_refused(served, tmp_path):
    """/dev/shm is shared: a folder any user may write into is not the trainer's."""
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ValueError, match="others may write into it"):
        FolderTransport(path=str(tmp_path)).folder_of({"path": str(folder)})


def test_the_trainer_sends_the_secret_from_its_environment_or_a_token_file(served, monkeypatch, tmp_path):
    torch.manual_seed(0)
    policy, tok = build_tiny(MODEL)
    spec = EngineSpec(model_name_or_path=MODEL, dtype="float32", prompt_length=8, response_length=6, seed=0,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok)
    transport = {"path": served.app.weights_root}
    monkeypatch.delenv("GSPO_SERVER_TOKEN", raising=False)
    with pytest.raises(RolloutServerError, match=r"refused this trainer's secret \(401\): set GSPO_SERVER_TOKEN"):
        RemoteEngine(urls=[served.url], transport=FolderTransport(**transport)).start(spec)
    token_file = tmp_path / "token"
    token_file.write_text(SECRET)
    for env, kwargs in ((SECRET, {}), (None, {"token_file": str(token_file)})):
        if env:
            monkeypatch.setenv("GSPO_SERVER_TOKEN", env)
        else:
            monkeypatch.delenv("GSPO_SERVER_TOKEN")
        client = RemoteEngine(urls=[served.url], transport=FolderTransport(**transport), **kwargs)
        client.start(spec)
        client.update_weights(iter_policy_weights(policy), 5)
        generation = client.generate([[3, 4]], 2, SamplingParams(4), 0)
        assert generation.weights_version == 5 and generation.completion_ids.shape[0] == 2
        client.close()


# -- half-sent requests, many connections ----------------------------------------------------------------
def test_a_half_sent_request_is_dropped_within_the_timeout_while_a_good_client_is_served(served):
    half_headers = socket.create_connection(("127.0.0.1", served.port))
    half_headers.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\n")
    half_body = socket.create_connection(("127.0.0.1", served.port))
    half_body.sendall(post("/generate", b'{"token": "', length="1000"))
    trickled = {}

    def trickle() -> None:  # one byte at a time, each well within the socket timeout
        with socket.create_connection(("127.0.0.1", served.port)) as conn:
            start = time.monotonic()
            try:
                for byte in b"POST /generate HTTP/1.1\r\nHost: t\r\n" * 10:
                    conn.sendall(bytes([byte]))
                    time.sleep(TIMEOUT_S / 5)
            except OSError:
                trickled["dropped_after"] = time.monotonic() - start

    thread = threading.Thread(target=trickle)
    thread.start()
    opened = time.monotonic()
    served.good()  # while all three are held
    closed_within(half_headers, TIMEOUT_S + 3)
    headers_s = time.monotonic() - opened
    closed_within(half_body, TIMEOUT_S + 3)
    body_s = time.monotonic() - opened
    thread.join(30)
    print(f"dropped after: half headers <= {headers_s:.2f} s, half body <= {body_s:.2f} s, "
          f"trickle {trickled.get('dropped_after', math.inf):.2f} s (request_timeout_s {TIMEOUT_S})")
    # the whole request's deadline, not a per-read timeout (the trickle never waits that long per byte)
    assert trickled.get("dropped_after", math.inf) < TIMEOUT_S + 3
    half_headers.close()
    half_body.close()
    served.good()


def test_many_connections_are_bounded_and_the_server_recovers(served):
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(4 * LIMITS.max_connections)]
    time.sleep(0.3)
    # one thread per served connection, at most max_connections; the others were answered 503 and closed
    assert threading.active_count() - threads_before <= LIMITS.max_connections
    served.good()  # busy until the watchdog drops the idle ones (request_timeout_s), then served
    for conn in idle:
        conn.close()
    served.good()


def test_a_busy_server_says_so_with_503(served):
    idle = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(LIMITS.max_connections)]
    time.sleep(0.2)
    status, reply, seconds = raw(served.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    assert status == 503 and reply["kind"] == "busy" and "--max_connections" in reply["error"] and seconds < 1
    for conn in idle:
        conn.close()
    served.good()


# -- bodies ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length, headers, status", [
    ("-1", "", 400), ("abc", "", 400), ("1e3", "", 400), ("+5", "", 400), (str(10**12), "", 413),
    (str(LIMITS.max_body_bytes + 1), "", 413), ("", "", 411), ("", "Transfer-Encoding: chunked\r\n", 411),
    ("2", "Content-Length: 2\r\n", 400),
])
def test_content_length_is_checked_before_the_body_is_read(served, length, headers, status):
    code, reply, seconds = raw(served.port, post("/generate", b"", headers=headers, length=length))
    assert code == status and reply["kind"] in ("bad_request", "too_large") and seconds < TIMEOUT_S
    served.good()


@pytest.mark.parametrize("body", [b"[1, 2]", b'"a string"', b"42", b"null", b"not json", b'{"token": NaN}',
                                  b'{"token": Infinity}', b"[" * 50_000, b'{"a": 1'])
def test_a_body_that_is_not_one_json_object_is_refused(served, body):
    generations = len(served.generations)
    code, reply, _ = raw(served.port, post("/generate", body))
    assert code == 400 and reply["kind"] == "bad_request" and len(served.generations) == generations
    served.good()


def generate_body(**change):
    body = {"token": SESSION, "prompt_ids": [[3, 4]], "n": 2, "params": {"max_new_tokens": 3, "temperature": 1.0},
            "seed": 0}
    params = change.pop("params", {})
    return {**body, **change, "params": {**body["params"], **params} if isinstance(params, dict) else params}


@pytest.mark.parametrize("change, says", [
    ({"n": 10**9}, r"n=1000000000 is outside \[1, 8\].*--max_n"), ({"n": 0}, r"outside \[1, 8\]"),
    ({"n": "2"}, "n must be an integer"), ({"n": True}, "n must be an integer"),
    ({"prompt_ids": [[3]] * 9}, "9 prompts.*at most 8.*--max_prompts"), ({"prompt_ids": []}, "non-empty list"),
    ({"prompt_ids": [[3] * 17]}, "1 to 16 token ids.*--max_prompt_tokens"), ({"prompt_ids": [[]]}, "1 to 16 token ids"),
    ({"prompt_ids": "3 4"}, "non-empty list"), ({"prompt_ids": [[3, 10**6]]}, r"token ids must be integers in \[0, "),
    ({"prompt_ids": [[-1]]}, r"integers in \[0, "), ({"prompt_ids": [[True]]}, r"integers in \[0, "),
    ({"prompt_ids": [[3]] * 5, "n": 7}, "5 prompts x n=7 responses exceed.*32.*--max_responses"),
    ({"params": {"max_new_tokens": 10**6}}, r"max_new_tokens=1000000 is outside \[1, 6\]"),
    ({"params": {"temperature": "nan"}}, "temperature must be a finite number"),
    ({"params": {"temperature": -1.0}}, "temperature must be a finite number >= 0"),
    ({"params": {"top_p": 0.0}}, r"top_p must be in \(0, 1\]"), ({"params": {"top_k": -3}}, "top_k"),
    ({"params": {"beam_width": 4}}, "unknown sampling parameters"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"params": None}, "params must be a JSON object"), ({"token": 7}, "token must be the session's token"),
])
def test_generation_arguments_are_bounded_and_finite(served, change, says):
    generations = len(served.generations)
    with pytest.raises(RolloutServerError, match=says):
        served.call("/generate", generate_body(**change))
    assert len(served.generations) == generations  # refused before the engine ran
    served.good()


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), "1e999"])
def test_a_nan_or_infinite_temperature_is_refused(served, temperature):
    text = json.dumps(generate_body(params={"temperature": temperature}))  # Python writes NaN, Infinity
    text = text.replace('"1e999"', "1e999")  # a finite-looking literal that parses to inf
    generations = len(served.generations)
    code, reply, _ = raw(served.port, post("/generate", text.encode()))
    assert code == 400 and "finite" in reply["error"] and len(served.generations) == generations
    served.good()


# -- files --------------------------------------------------------------------------------------------------
@pytest.fixture
def push(served, tmp_path):
    """A valid push under the server's weights root, and a valid copy of it outside the root."""
    policy, _ = build_tiny(MODEL)
    transport = FolderTransport(path=served.app.weights_root)
    manifest = transport.send(iter_policy_weights(policy), 11)
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in manifest["files"]:
        (outside / entry["file"]).write_bytes((Path(manifest["path"]) / entry["file"]).read_bytes())
    yield manifest, outside
    transport.close()


def test_folder_manifests_outside_the_weights_root_are_refused_alike(served, push):
    manifest, outside = push
    root = Path(served.app.weights_root)
    (root / "link-out").unlink(missing_ok=True)
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    served.call("/session", {"token": SESSION})
    version, loads = served.app.version, len(served.loads)
    refusals = {}
    for name, path in {"outside": str(outside), "traversal": f"{root}/../{outside.parent.name}/outside",
                       "missing under the root": str(root / "no-such-folder"), "relative": "v11",
                       "link out of the root": str(root / "link-out"), "system": "/etc", "the root itself": str(root),
                       "not a string": 7}.items():
        with pytest.raises(RolloutServerError) as refused:
            served.call("/weights", {"token": SESSION, "version": 12, "manifest": {**manifest, "path": path}})
        refusals[name] = str(refused.value).replace(repr(str(path)[:200]), "<path>")
    # one message whatever exists there: a client learns nothing of the filesystem
    assert len(set(refusals.values())) == 1, refusals
    assert "is not a folder under this server's weights root" in refusals["outside"]
    assert served.app.version == version and len(served.loads) == loads  # nothing read, the served version kept
    served.good()


def test_bucket_files_must_be_plain_files_right_in_the_folder(served, push):
    manifest, outside = push
    folder = Path(manifest["path"])
    (folder / "linked.safetensors").symlink_to(outside / manifest["files"][0]["file"])
    first = manifest["files"][0]
    served.call("/session", {"token": SESSION})
    for name in (f"../../{outside.parent.name}/outside/{first['file']}", str(outside / first["file"]),
                 "linked.safetensors", "..", "", "missing.safetensors", None):
        files = [{**first, "file": name}] + manifest["files"][1:]
        with pytest.raises(RolloutServerError, match="is not a regular file in the weights folder"):
            served.call("/weights", {"token": SESSION, "version": 12, "manifest": {**manifest, "files": files}})
    reply = served.call("/weights", {"token": SESSION, "version": 11, "manifest": manifest})  # the valid push loads
    assert reply["version"] == 11 == served.app.version and reply["checksum"] == manifest["checksum"]
    served.good()


# -- the client's checks of replies ---------------------------------------------------------------------------
def good_reply(rows=2, length=3):
    return {"completion_ids": [[1] * length] * rows, "logprobs": [[-0.5] * length] * rows, "truncated": [False] * rows,
            "version": 3, "checksum": "abc"}


@pytest.mark.parametrize("change, says", [
    ({"completion_ids": [[1, 2, 3]]}, "has 1 completion_ids rows for 2 responses"),
    ({"truncated": [False]}, "has 1 truncated rows"), ({"logprobs": "x"}, "has str logprobs rows"),
    ({"completion_ids": [[1] * 5, [1] * 3]}, r"row 0\) of 5 tokens; asked for 1 to 4"),
    ({"completion_ids": [[], [1] * 3]}, "of 0 tokens"),
    ({"completion_ids": [[1, 2, 50], [1] * 3]}, r"token id outside \[0, 50\)"),
    ({"completion_ids": [[1, -1, 2], [1] * 3]}, "token id outside"),
    ({"completion_ids": [[1, 2.0, 2], [1] * 3]}, "token id outside"),
    ({"logprobs": [[-0.5, float("nan"), -1], [-1] * 3]}, "not a finite number <= 0 in row 0"),
    ({"logprobs": [[-0.5, -1], [-1] * 3]}, "2 log-probs for the 3 tokens of row 0"),
    ({"logprobs": [[-1] * 3, [-1, 0.5, -1]]}, "not a finite number <= 0 in row 1"),
    ({"logprobs": [[-1] * 3, [-1, float("-inf"), -1]]}, "not a finite number"),
    ({"truncated": [0, False]}, "truncated '0' in row 0"), ({"version": "3"}, "version '3', not an integer"),
    ({"version": None}, "not an integer"),
])
def test_the_client_refuses_a_malformed_generation_reply(change, says):
    assert check_generation_reply("http://s", good_reply(), 2, 4, 50) == good_reply()
    with pytest.raises(RolloutServerError, match=f"rollout refused: the reply of the rollout server at http://s .*{says}"):
        check_generation_reply("http://s", {**good_reply(), **change}, 2, 4, 50)
    with pytest.raises(RolloutServerError, match="is a JSON list, not an object"):
        check_generation_reply("http://s", [], 2, 4, 50)
    with pytest.raises(RolloutServerError, match="no finite seconds"):
        check_weights_reply("http://s", {"version": 1, "checksum": "a", "seconds": float("inf")})


def test_a_reply_above_the_clients_limit_is_refused(served):
    with pytest.raises(RolloutServerError, match="replied 12 bytes, above the client's limit of 5"):
        request_json(served.url, "/health", max_bytes=5)
    assert request_json(served.url, "/health", max_bytes=12) == {"ok": True}


def test_a_served_reply_that_breaks_the_rules_stops_the_rollout(served, monkeypatch):
    monkeypatch.setenv("GSPO_SERVER_TOKEN", SECRET)
    torch.manual_seed(0)
    policy, tok = build_tiny(MODEL)
    spec = EngineSpec(model_name_or_path=MODEL, dtype="float32", prompt_length=8, response_length=6, seed=0,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok)
    client = RemoteEngine(urls=[served.url], transport=FolderTransport(path=served.app.weights_root))
    client.start(spec)
    client.update_weights(iter_policy_weights(policy), 21)
    generate = served.app.generate
    try:
        for lie, says in ((lambda r: {**r, "version": 22, "checksum": "x" * 64}, "version 22, which this trainer never pushed"),
                          (lambda r: {**r, "completion_ids": r["completion_ids"][:-1]}, "completion_ids rows"),
                          (lambda r: {**r, "logprobs": [[0.7] * len(x) for x in r["logprobs"]]}, "finite number <= 0")):
            served.app.generate = lambda *a, lie=lie, **k: lie(generate(*a, **k))
            with pytest.raises(RolloutServerError, match=says):
                client.generate([[3, 4]], 2, SamplingParams(4), 0)
    finally:
        served.app.generate = generate
    assert client.generate([[3, 4]], 2, SamplingParams(4), 0).weights_version == 21
    client.close()


# -- the NCCL transport's handshake (no GPU here: its rendezvous and communicator are fakes) -----------------
class FakeCommunicator:
    def __init__(self, log: list):
        self.log = log

    def broadcast(self, tensor, src):
        self.log.append((tuple(tensor.shape), src))
        if src == 0:
            tensor.fill_(1.0)  # what the trainer sent


def test_a_refused_nccl_push_fails_fast_instead_of_waiting_at_the_rendezvous():
    from concurrent.futures import ThreadPoolExecutor

    from gspo_lightning.rollout.transport import connect_unless_refused

    never = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(lambda: (_ for _ in ()).throw(RolloutServerError("refused this trainer's secret (401)")))
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match="401"):
            connect_unless_refused(lambda: never.wait(60), refused, timeout_s=60)
        assert time.monotonic() - start < 2  # not the rendezvous timeout
        answered = pool.submit(lambda: {"version": 1})
        with pytest.raises(RuntimeError, match="answered the NCCL push before joining"):
            connect_unless_refused(lambda: never.wait(60), answered, timeout_s=60)
        slow = pool.submit(lambda: never.wait(5))
        assert connect_unless_refused(lambda: "communicator", slow, timeout_s=5) == "communicator"
        with pytest.raises(TimeoutError, match="did not join the NCCL rendezvous within 0 s"):
            connect_unless_refused(lambda: never.wait(60), slow, timeout_s=0.2)
    never.set()


def test_nccl_keeps_one_communicator_per_session_on_both_sides(served, monkeypatch):
    from gspo_lightning.rollout.transport import NCCLTransport

    connects, log = [], []
    monkeypatch.setattr(NCCLTransport, "_require_cuda", staticmethod(lambda: None))
    monkeypatch.setattr(NCCLTransport, "_connect", lambda self, host, port, rank, device: connects.append(rank)
                        or FakeCommunicator(log))
    monkeypatch.setattr(NCCLTransport, "receive_device", "cpu")
    weights = [("a", torch.zeros(2, 3)), ("b", torch.zeros(4))]

    def send(self, pairs, version):
        self._pending = list(pairs)
        return self.describe(self._pending, version)

    monkeypatch.setattr(NCCLTransport, "send", send)
    trainer = NCCLTransport(port=29999)
    for version in (1, 2):  # the second push reuses the first communicator (it deadlocked on a new one)
        # the server answers once it has received (a while after joining)
        manifest, reply = trainer.push(iter(weights), version, lambda m: time.sleep(0.3) or {"loaded": m["version"]})
        assert reply == {"loaded": version}
    assert connects == [0] and log == [((2, 3), 0), ((4,), 0)] * 2
    # the server side: one receiver per session, which connects once
    first = served.app._receiver("nccl", "session-a")
    assert served.app._receiver("nccl", "session-a") is first
    for _ in range(2):
        received = list(first.receive(manifest))
        assert [(n, tuple(t.shape)) for n, t in received] == [("a", (2, 3)), ("b", (4,))]
        assert all(torch.equal(t, torch.ones_like(t)) for _, t in received)
    assert connects == [0, 1]
    assert served.app._receiver("nccl", "session-b") is not first  # another trainer: a new communicator
    with pytest.raises(ValueError, match="dtype one of"):
        first.receive({**manifest, "dtypes": ["load", "float32"]})  # checked before anything is joined
    with pytest.raises(ValueError, match="host .* and port"):
        first.receive({**manifest, "port": "29999"})
    assert connects == [0, 1]


def test_a_restarted_server_is_not_sent_a_broadcast_again(served, monkeypatch):
    from gspo_lightning.rollout.transport import NCCLTransport

    monkeypatch.setenv("GSPO_SERVER_TOKEN", SECRET)
    torch.manual_seed(0)
    policy, tok = build_tiny(MODEL)
    spec = EngineSpec(model_name_or_path=MODEL, dtype="float32", prompt_length=8, response_length=6, seed=0,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok)
    client = RemoteEngine(urls=[served.url], transport=NCCLTransport())
    client.start(spec)
    client.pushed = {"version": 3, "manifest": {"kind": "nccl"}}
    client.server_ids[served.url] = "the server before its restart"
    with pytest.raises(RolloutServerError, match="NCCLTransport cannot send it the last push .* resume the run"):
        client._recover(served.url)
    client.close()


def test_a_started_server_gets_the_secret_in_its_environment_not_on_its_command_line(monkeypatch, tmp_path):
    import subprocess

    from gspo_lightning.rollout.child_server import ChildServer

    seen = {}

    class Exited:
        pid = 1

        def __init__(self, command, env, **_):
            seen.update(command=command, env=env)

        def poll(self):
            return 3

    monkeypatch.setattr(subprocess, "Popen", Exited)
    child = ChildServer(ServerSpec(MODEL), secret=SECRET, weights_root=str(tmp_path))
    with pytest.raises(RolloutServerError, match="did not come up"):
        child.start(5)
    assert seen["env"]["GSPO_SERVER_TOKEN"] == SECRET and not any(SECRET in part for part in seen["command"])  # ps shows argv
    assert seen["command"][seen["command"].index("--weights_root") + 1] == str(tmp_path.resolve())


def test_a_started_server_that_crashed_leaves_its_log_behind(monkeypatch, tmp_path, capsys):
    """The log's path is printed at start; a server that crashed mid-run keeps it (moved out of the
    folder the run cleans up, into one only its user reads), one that stopped cleanly does not."""
    import subprocess

    from gspo_lightning.rollout.child_server import ChildServer

    class Started:
        pid, code = 1, None

        def __init__(self, command, env, stdout, **_):
            stdout.write("serving\nTraceback (most recent call last):\n  ...\nRuntimeError: out of memory\n")
            stdout.flush()
            Path(command[command.index("--port_file") + 1]).write_text("8123")

        def poll(self):
            return self.code

        def terminate(self):
            self.code = 0

        def wait(self, timeout=None):
            return self.code

    monkeypatch.setattr(subprocess, "Popen", Started)
    child = ChildServer(ServerSpec(MODEL), secret=SECRET)
    assert child.start(5) == "http://127.0.0.1:8123"
    folder = Path(child.folder.name)
    child.process.code = -9  # killed while the run went on
    child.stop()
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("rollout server log kept: "))
    kept = Path(line.split(": ", 1)[1].split(" (")[0])
    assert "RuntimeError: out of memory" in kept.read_text() and not folder.exists()
    assert (kept.parent.stat().st_mode & 0o777) == 0o700
    shutil.rmtree(kept.parent)


def test_the_vocabulary_bound_is_the_output_heads_rows_even_when_zero3_partitions_it():
    from gspo_lightning.rollout.remote import output_rows

    policy, _ = build_tiny(MODEL)
    rows = policy.get_output_embeddings().weight.shape[0]
    assert output_rows(policy) == rows
    head = policy.get_output_embeddings()
    partitioned = torch.nn.Parameter(torch.empty(0))  # ZeRO-3's local view: empty, the full shape in ds_shape
    partitioned.ds_shape = torch.Size([rows + 64, 32])
    head.weight = partitioned
    assert output_rows(policy) == rows + 64
