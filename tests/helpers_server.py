"""Helpers of the rollout server tests: the tiny successor policy with its ``EngineSpec``,
prompts for it, and a server started (and stopped) on a given localhost port in this process."""

from __future__ import annotations

import os

import socket
import threading

import torch

from gspo_lightning.data.tasks import build_tiny
from gspo_lightning.rollout import EngineSpec

MODEL = "builtin:tiny-successor"
HF = {"class_path": "gspo_lightning.rollout.HFEngine"}


def policy_and_spec(model=MODEL, seed=0):
    torch.manual_seed(seed)
    policy, tok = build_tiny(model)
    spec = EngineSpec(model_name_or_path=model, dtype="float32", prompt_length=8, response_length=6, seed=0,
                      eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, policy=policy, tokenizer=tok)
    return policy, tok, spec


def prompts(tok, k=3):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ["next 1", "next 7", "next 4", "next 2"][:k]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_on(port: int):
    """A fresh rollout server (new ``server_id``, no weights) on ``port``, in this process."""
    from gspo_lightning.rollout.server import RolloutServer, ServerSpec, http_server

    app = RolloutServer(ServerSpec(MODEL, prompt_length=8, response_length=6, engine=HF))
    app.start()
    httpd = http_server(app, "127.0.0.1", port, secret=os.environ["GSPO_SERVER_TOKEN"])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return app, httpd


def shut(httpd) -> None:
    httpd.shutdown()
    httpd.server_close()  # the port refuses connections, as when the process is gone
