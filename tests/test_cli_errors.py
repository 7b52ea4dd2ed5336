"""``hf-paged`` errors the user can fix: one line on stderr, exit code 2, and no model loaded for nothing.

A broken model folder, a port already taken, a chat role the server refuses; and ``--help`` that names each
default once.
"""

import argparse
import json
import re
import socket

import pytest

from hf_paged.cli import commands as cli
from hf_paged.cli import engine as cli_engine
from hf_paged.cli import main
from hf_paged.model.default_model import load_model
from tests.helpers import make_model


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""

    def refuse(args, **config):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(cli, "build_engine", refuse)  # every command's engine (one process or tensor-parallel)
    monkeypatch.setattr(cli_engine, "load", refuse)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hf-paged: error: "), err
    return err


def _tokenizer_files(folder) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture
def model_folder(tmp_path):
    """A tiny llama folder with config.json and tokenizer files, but no weights."""
    folder = tmp_path / "tiny"
    make_model("llama", seed=3).config.save_pretrained(folder)
    _tokenizer_files(folder)
    return folder


# -- a broken model folder ---------------------------------------------------------------------------------


def test_a_broken_config_json_is_one_line_before_loading(model_folder, capsys, no_loading):
    (model_folder / "config.json").write_text('{"model_type": "llama",')
    (model_folder / "model.safetensors").write_bytes(b"")
    for argv in (["generate", "hi"], ["serve", "--port", "0"]):
        assert main([*argv, "--model", str(model_folder)]) == 2
        err = one_error_line(capsys)
        assert "config.json is not valid JSON" in err and str(model_folder) in err, err
    (model_folder / "config.json").write_text("[1, 2]")
    assert main(["generate", "hi", "--model", str(model_folder)]) == 2
    assert "config.json must hold a JSON object, got list" in one_error_line(capsys)


def test_a_folder_without_weights_is_one_line_before_loading(model_folder, capsys, no_loading):
    assert main(["generate", "hi", "--model", str(model_folder)]) == 2
    err = one_error_line(capsys)
    assert f"--model {str(model_folder)!r} has no weights" in err and ".safetensors" in err, err


def test_load_model_errors_are_one_line_and_name_the_folder(model_folder, capsys):
    with pytest.raises(OSError) as info:
        load_model(str(model_folder))  # no weights
    message = str(info.value)
    assert "\n" not in message and str(model_folder) in message and "weights" in message, message
    (model_folder / "config.json").write_text("{not json")
    with pytest.raises(OSError) as info:
        load_model(str(model_folder))
    message = str(info.value)
    assert "\n" not in message and "config.json" in message and str(model_folder) in message, message
    (model_folder / "config.json").write_text("{}")
    with pytest.raises(ValueError) as info:  # transformers' ValueError, one line, the config named first
        load_model(str(model_folder))
    assert "\n" not in str(info.value) and "model_type" in str(info.value), info.value


def test_weights_that_do_not_load_end_in_one_line(model_folder, capsys):
    (model_folder / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["generate", "hi", "--model", str(model_folder), "--max-tokens", "2"]) == 2
    err = one_error_line(capsys)
    assert str(model_folder) in err and "weights" in err, err


# -- serve / chat on a port already taken ---------------------------------------------------------------------


def test_a_busy_port_is_found_before_loading(capsys, no_loading):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in ("serve", "chat"):
            assert main([command, "--host", "127.0.0.1", "--port", str(port)]) == 2
            err = one_error_line(capsys)
            assert f"127.0.0.1:{port} is already in use" in err and "--port" in err, err


def test_a_host_that_is_not_this_machines_is_one_line(capsys, no_loading):
    assert main(["serve", "--host", "203.0.113.7", "--port", "0"]) == 2  # TEST-NET-3: never local
    assert "--host '203.0.113.7'" in one_error_line(capsys)


# -- batch: the server's chat roles ---------------------------------------------------------------------------


def test_batch_rejects_a_role_the_server_rejects(tmp_path, capsys, no_loading):
    from hf_paged.serving.protocol import ROLES

    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    bad = {"messages": [{"role": "wizard", "content": "cast a spell"}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    assert main(["batch", str(data)]) == 2
    err = one_error_line(capsys)
    assert f"{data}:2: messages[0].role must be one of {list(ROLES)}, got 'wizard'" in err, err
    data.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    assert main(["batch", str(data)]) == 2
    assert f"{data}:1: messages[0].content must be a string" in one_error_line(capsys)


def test_batch_names_a_message_that_is_not_valid_unicode(tmp_path, capsys, no_loading):
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi \\ud800"}]}\n')  # JSON allows the escape
    assert main(["batch", str(data)]) == 2
    err = one_error_line(capsys)
    assert f"{data}:1: messages[0].content is not valid Unicode: it holds a lone surrogate" in err, err


def test_batch_reads_the_servers_message_shapes():
    data = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    assert cli._chat_messages(data) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": ""}]


# -- --help: each default once ------------------------------------------------------------------------------


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_names_each_default_once():
    parsers = list(_parsers(cli.build_parser()))
    assert len(parsers) == 8  # the top level and its 7 commands (train-eagle the newest)
    for parser in parsers:
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, text
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help is None or action.help is argparse.SUPPRESS:
                continue
            shown = formatter._expand_help(action)
            assert len(re.findall(r"default", shown, re.IGNORECASE)) <= 1, (parser.prog, shown)
    serve = " ".join(next(p for p in parsers if p.prog == "hf-paged serve").format_help().split())
    assert "port to listen on (default: 8000)" in serve and "(default: 127.0.0.1)" in serve, serve


# -- serve --request-workers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "message"), [("0", "must be >= 1, got 0"), ("-3", "must be >= 1, got -3"),
                                              ("two", "must be an integer, got 'two'")])
def test_request_workers_must_be_a_positive_int(value, message, capsys, no_loading):
    assert main(["serve", "--request-workers", value, "--port", "0"]) == 2
    assert one_error_line(capsys) == f"hf-paged: error: argument --request-workers: {message}"


def test_request_workers_reach_the_server(monkeypatch):
    from hf_paged.serving import server

    class Loop:
        max_model_len = 64

        def shutdown(self) -> None:
            pass

    built = {}
    monkeypatch.setattr(cli, "_engine_loop", lambda args, max_num_seqs: (Loop(), None))
    monkeypatch.setattr(server, "build_app", lambda loop, served, **kw: built.update(kw) or "app")
    monkeypatch.setattr(server, "run_server", lambda app, host, port, log_level, **kw: built.update(ran=app) or 0)
    assert main(["serve", "--port", "0", "--request-workers", "5"]) == 0
    assert built == {"api_key": None, "request_workers": 5, "ran": "app"}
    assert main(["serve", "--port", "0"]) == 0
    assert built["request_workers"] == 2  # build_app's default
    assert server.DEFAULT_REQUEST_WORKERS == 2


# -- serve --exit-on-engine-failure ---------------------------------------------------------------------------


def test_exit_on_engine_failure_reaches_the_server_and_its_status_is_the_exit_code(monkeypatch):
    from hf_paged.serving import server

    class Loop:
        max_model_len = 64

        def shutdown(self) -> None:
            pass

    loop, ran = Loop(), []
    monkeypatch.setattr(cli, "_engine_loop", lambda args, max_num_seqs: (loop, None))
    monkeypatch.setattr(server, "build_app", lambda loop, served, **kw: "app")

    def run_server(app, host, port, log_level, *, engine, exit_grace_s):
        ran.append((engine, exit_grace_s))
        return 1 if exit_grace_s is not None else 0  # as after an engine failure, when it watches for one

    monkeypatch.setattr(server, "run_server", run_server)
    assert main(["serve", "--port", "0"]) == 1  # on by default: the failed server exits non-zero
    assert main(["serve", "--port", "0", "--exit-grace-seconds", "0.5"]) == 1
    assert main(["serve", "--port", "0", "--no-exit-on-engine-failure"]) == 0
    assert ran == [(loop, 5.0), (loop, 0.5), (loop, None)]


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_exit_grace_seconds_must_be_a_finite_number_at_least_zero(value, capsys, no_loading):
    assert main(["serve", "--exit-grace-seconds", value, "--port", "0"]) == 2
    err = one_error_line(capsys)
    assert err.startswith("hf-paged: error: argument --exit-grace-seconds: must be a "), err
    assert repr(value) in err, err


# -- bench --systems ------------------------------------------------------------------------------------------


@pytest.fixture
def no_running(monkeypatch):
    """Record the workload a bench command would run, instead of running it."""
    from hf_paged.bench import workloads

    ran = []
    for name in workloads.WORKLOADS:
        monkeypatch.setitem(workloads.WORKLOADS, name, lambda name=name, **kw: ran.append((name, kw["systems"])))
    return ran


def test_bench_systems_must_be_the_workloads_own(capsys, no_running):
    from hf_paged.bench.systems import system_names

    known = system_names()
    bench = next(p for p in _parsers(cli.build_parser()) if p.prog == "hf-paged bench")
    choices = next(a for a in bench._actions if a.dest == "workload").choices
    for workload in choices:
        if workload not in known:  # runs a fixed set: --systems is refused, naming the workloads that take it
            assert main(["bench", workload, "--systems", "x"]) == 2
            assert f"--systems does not apply to the {workload} workload" in one_error_line(capsys)
            continue
        valid = known[workload]
        for bad in ("nope", f"{valid[0]},nope", ","):
            assert main(["bench", workload, "--systems", bad]) == 2
            err = one_error_line(capsys)
            assert f"for the {workload} workload; valid: {', '.join(valid)}" in err, err
        assert main(["bench", workload, "--systems", f" {valid[-1]}, {valid[0]}"]) == 0
    assert not [r for r in no_running if r[1] is None]
    assert no_running == [(w, {known[w][-1], known[w][0]}) for w in choices if w in known]
    assert main(["bench", "chat"]) == 0 and no_running[-1] == ("chat", None)  # no --systems: its default set
    assert {"tp2", "int4-a8", "eager", "padded"} <= set(known["chat"]) and set(known["replicas"]) == {"pow2", "prefix"}


# -- KV tiers ---------------------------------------------------------------------------------------------------


def test_kv_tier_flags_reach_the_engine_and_bad_ones_are_one_line(tmp_path, capsys, no_loading):
    args = cli.build_parser().parse_args(["serve", "--kv-offload-gb", "1.5", "--kv-offload-dtype", "int8",
                                          "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-gb", "2"])
    assert cli_engine.engine_options(args) == {"kv_offload_gb": 1.5, "kv_offload_dtype": "int8",
                                               "prefix_cache_dir": str(tmp_path), "prefix_cache_disk_gb": 2.0}
    assert cli_engine.engine_options(cli.build_parser().parse_args(["serve"])) == {}  # defaults: no tiers
    assert main(["serve", "--kv-offload-gb", "-1", "--port", "0"]) == 2
    assert "argument --kv-offload-gb" in one_error_line(capsys)
    assert main(["generate", "hi", "--kv-offload-dtype", "fp8"]) == 2
    assert "argument --kv-offload-dtype" in one_error_line(capsys)


def test_bench_spec_eagle_head_and_batch_sizes(tmp_path, capsys, monkeypatch):
    from hf_paged.bench import workloads

    ran = []
    monkeypatch.setitem(workloads.WORKLOADS, "spec", lambda **kw: ran.append(kw))
    assert main(["bench", "spec", "--systems", "no_spec,eagle"]) == 2
    assert "--systems eagle needs --eagle-head DIR" in one_error_line(capsys)
    assert main(["bench", "spec", "--eagle-head", str(tmp_path)]) == 2
    assert "not an EAGLE head folder (no config.json)" in one_error_line(capsys)
    assert main(["bench", "chat", "--eagle-head", str(tmp_path)]) == 2
    assert "apply to the spec workload, not chat" in one_error_line(capsys)
    assert main(["bench", "spec", "--batch-sizes", "1,32"]) == 2
    assert "each must be 1, 16 or 64" in one_error_line(capsys)
    (tmp_path / "config.json").write_text("{}")
    assert main(["bench", "spec", "--eagle-head", str(tmp_path), "--batch-sizes", "1,64"]) == 0
    assert ran[-1]["eagle_head"] == str(tmp_path) and ran[-1]["batches"] == (1, 64)
    assert not ran[:-1]
    assert main(["bench", "spec", "--eagle-k", "2"]) == 2
    assert "--eagle-k needs --eagle-head DIR" in one_error_line(capsys)
    assert main(["bench", "latency", "--spec-prompts", "chat"]) == 2
    assert "apply to the spec workload, not latency" in one_error_line(capsys)
    assert main(["bench", "spec", "--spec-prompts", "poems"]) == 2
    assert main(["bench", "spec", "--eagle-head", str(tmp_path), "--eagle-k", "2", "--spec-prompts", "chat"]) == 0
    assert ran[-1]["eagle_k"] == 2 and ran[-1]["prompt_set"] == "chat"


def test_bench_restart_is_the_prefix_workloads_own(capsys, no_running, monkeypatch):
    from hf_paged.bench import kv_tiers

    ran = []
    monkeypatch.setattr(kv_tiers, "prefix_restart", lambda **kw: ran.append(kw))
    assert main(["bench", "chat", "--restart"]) == 2
    assert "--restart and --prompt-len apply to the prefix workload, not chat" in one_error_line(capsys)
    assert main(["bench", "prefix", "--prompt-len", "64"]) == 2
    assert "--prompt-len applies to prefix --restart" in one_error_line(capsys)
    assert main(["bench", "prefix", "--restart", "--prompt-len", "64"]) == 0
    assert ran == [{"dtype": "fp32", "prompt_len": 64}] and not no_running
