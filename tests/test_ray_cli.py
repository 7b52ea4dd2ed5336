"""``hf-paged serve --data-parallel-size 2`` as a user runs it: a child process that starts its own local Ray
instance, serves a saved tiny model from two replicas, and removes everything on Ctrl-C (SIGINT)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serving_helpers import tiny_chat_loader


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    model, tokenizer = tiny_chat_loader()
    folder = tmp_path_factory.mktemp("tiny-chat")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_serve_data_parallel_runs_two_replicas_and_stops_on_ctrl_c(model_folder, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_PAGED_TUNE": "0", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:  # a file, not a pipe: Ray's logs would fill a pipe nobody reads
        child = subprocess.Popen(
            [sys.executable, "-m", "hf_paged.cli", "serve", "--data-parallel-size", "2", "--model",
             str(model_folder), "--port", str(port), "--replica-num-cpus", "0.5", "--max-num-seqs", "4"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 240
        while "hf-paged serve:" not in log.read_text():  # printed once every replica is up
            assert child.poll() is None, f"the server exited with {child.poll()}: {log.read_text()[-3000:]}"
            assert time.time() < deadline, "the replicated server did not start"
            time.sleep(0.5)
        banner = next(line for line in log.read_text().splitlines() if "hf-paged serve:" in line)
        assert "2 replicas on a local Ray instance, prefix routing" in banner
        url = f"http://127.0.0.1:{port}"
        name = model_folder.name
        replicas = set()
        for i in range(16):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": name, "prompt": f"{i} distinct prompt {i}", "max_tokens": 3})
            assert r.status_code == 200, r.text
            replicas.add(r.headers["x-hf-paged-replica"])
        assert len(replicas) == 2  # new prefixes spread over both replicas (all on one: 2 in 2**16)
    finally:
        child.send_signal(signal.SIGINT)
        try:
            code = child.wait(90)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    assert code == 0
    with pytest.raises(httpx.ConnectError):  # Serve's proxy went with the local Ray instance
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
