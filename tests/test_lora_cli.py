"""``hf-paged serve --enable-lora --lora-modules name=path ... --max-loras N``: the flags reach the engine and the
served model's adapter list; a bad adapter folder or a malformed NAME=PATH is one error line (exit 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("fastapi")

from hf_paged import PagedGenerator  # noqa: E402
from hf_paged.cli import commands as cli  # noqa: E402
from hf_paged.cli import main  # noqa: E402
from tests.helpers import make_model  # noqa: E402
from tests.test_lora import make_adapter  # noqa: E402


@pytest.fixture
def served(monkeypatch):
    """Runs ``serve`` on the tiny llama with the server itself stubbed: what the engine and the app were given."""
    from hf_paged.serving import server

    built: dict = {}

    def build_engine(args, **config):
        built["config"] = config
        built["engine"] = PagedGenerator(make_model("llama"), num_blocks=32, **config)
        return built["engine"], None

    monkeypatch.setattr(cli, "build_engine", build_engine)
    monkeypatch.setattr(server, "build_app", lambda loop, served, **kw: built.update(served=served) or "app")
    monkeypatch.setattr(server, "run_server", lambda app, host, port, log_level, **kw: 0)
    return built


def test_lora_flags_reach_the_engine_and_the_served_models(served, tmp_path):
    for i, name in enumerate(("a", "b")):
        make_adapter(make_model("llama"), tmp_path / name, seed=70 + i, r=4, target_modules=["q_proj"])
    args = ["serve", "--port", "0", "--lora-modules", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}",
            "--max-loras", "3", "--max-lora-rank", "8"]
    assert main(args) == 0
    assert {k: served["config"][k] for k in ("enable_lora", "max_loras", "max_lora_rank")} == {
        "enable_lora": True, "max_loras": 3, "max_lora_rank": 8}  # --lora-modules implies --enable-lora
    modules = served["served"].lora_modules
    assert {name: (r.lora_int_id, r.lora_path) for name, r in modules.items()} == {
        "a": (1, str(tmp_path / "a")), "b": (2, str(tmp_path / "b"))}
    assert main(["serve", "--port", "0", "--enable-lora"]) == 0
    assert (served["config"]["max_loras"], served["config"]["max_lora_rank"]) == (4, 16)  # the defaults
    assert served["served"].lora_modules == {}
    assert main(["serve", "--port", "0"]) == 0
    assert "enable_lora" not in served["config"] and served["served"].lora_modules == {}


def test_a_bad_adapter_folder_is_one_error_line(served, tmp_path, capsys):
    assert main(["serve", "--port", "0", "--lora-modules", f"bad={tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hf-paged: error: --lora-modules bad="), err
    assert "is not a folder" in err
    assert served["engine"]._closed  # the engine it built was closed


@pytest.mark.parametrize("value", ["nopath", "=x", "name="])
def test_lora_modules_must_be_name_equals_path(value, capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_engine", lambda args, **config: pytest.fail("loaded before the check"))
    assert main(["serve", "--port", "0", "--lora-modules", value]) == 2
    err = capsys.readouterr().err.strip()
    assert "argument --lora-modules" in err and "expected NAME=PATH" in err, err


def test_peft_is_in_the_lora_extra_and_make_install():
    """``pip install hf-paged[lora]`` brings peft, and ``make install`` installs the dev extra, which holds lora."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"peft\b", dep) for dep in extras["lora"])
    assert "hf-paged[lora]" in extras["dev"]
    install = re.search(r"pip install -q -e '\.\[([^\]]+)\]'", (root / "Makefile").read_text())
    assert install is not None and "dev" in install.group(1).split(",")
