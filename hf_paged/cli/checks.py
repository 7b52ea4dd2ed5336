"""The ``hf-paged`` command line's input checks, made before any model loads: the model folder, a conversations
file, the server's host and port, numbers. Each failure is a :class:`UsageError` (one line, exit code 2)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def check_model_folder(path: str | None) -> None:
    if path is None:
        return
    if not os.path.isdir(path):
        raise UsageError(f"--model {path!r}: no such folder (give a local transformers model folder)")
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise UsageError(f"--model {path!r} is not a transformers model folder (it has no config.json)")
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--model {path!r}: config.json is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise UsageError(f"--model {path!r}: config.json must hold a JSON object, got {type(data).__name__}")
    if not any(_is_weights_file(name) for name in os.listdir(path)):
        raise UsageError(f"--model {path!r} has no weights (no *.safetensors or pytorch_model*.bin file): "
                         "give a folder written by save_pretrained")


def _is_weights_file(name: str) -> bool:
    """A name transformers may load weights from (the loader itself gives the exact error for the rest)."""
    return name.endswith((".safetensors", ".safetensors.index.json")) or (
        name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )


def _chat_messages(messages) -> list[dict]:
    """Chat messages checked exactly as the server checks them (roles, content parts; "developer" is
    "system"), raising the server's message."""
    from hf_paged.serving.protocol import chat_messages

    return chat_messages(messages)


def read_conversations(path: str) -> list[list[dict]]:
    if not os.path.isfile(path):
        raise UsageError(f"{path!r}: no such file")
    from hf_paged.serving.api_error import APIError

    conversations = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UsageError(f"{path}:{number}: expected a JSON object with a 'messages' list ({e})") from e
            if not isinstance(messages, list) or not messages:
                raise UsageError(f"{path}:{number}: 'messages' must be a non-empty list of chat messages")
            try:
                conversations.append(_chat_messages(messages))
            except APIError as e:
                raise UsageError(f"{path}:{number}: {e}") from e
    if not conversations:
        raise UsageError(f"{path!r} holds no conversations")
    return conversations


def check_port(host: str, port: int) -> None:
    """Bind (and free at once) host:port, so a port already taken is found before the model loads."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds it
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no user
            probe.bind((host, port))
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r}: unknown host ({e})") from e
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: {host}:{port} is already in use (another server?); "
                             "stop it or pick another --port") from e
        if e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host!r}: not an address of this machine ({e.strerror})") from e
        if e.errno == errno.EACCES:
            raise UsageError(f"--port {port}: not allowed to listen on {host}:{port} ({e.strerror}); "
                             "ports below 1024 need privileges") from e
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


# -- argparse types: a bad value is one line, exit code 2 ----------------------------------------------------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
