"""The README's snippets run as written, and every ``hf-paged`` command line in the README and docs/ parses.

- Each ```python block of the README runs in its own subprocess (the default model, short generations); the
  first one must print a non-empty answer.
- Each ``hf-paged`` line of a ```bash block (README and docs/*.md) is parsed by the real CLI parser, so a
  renamed or removed flag fails here; the cheap ones run: ``generate`` with a small ``--max-tokens``, and
  ``--help`` of every other subcommand the README shows.
- Every ```python block of docs/*.md is at least valid Python, and every relative link (file and #anchor) of the
  README and docs/ resolves.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_TOKENS = 64  # the most tokens a README snippet may ask for, so this file stays fast
CLI = [sys.executable, "-m", "hf_paged.cli"]  # the console script's entry point, launcher included


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M)


def cli_lines(path: Path) -> list[list[str]]:
    """``hf-paged`` command lines of the file's bash blocks, as argv (leading ``VAR=value`` and comments dropped)."""
    lines = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if not re.match(r"([A-Z_][A-Z0-9_]*=\S*\s+)*hf-paged\s", line.strip() + " "):
                continue
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
                argv.pop(0)
            if argv and argv[0] == "hf-paged":
                lines.append(argv[1:])
    return lines


def run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # On a shared 2-core machine two spinning OpenMP threads competing with other processes made the engine's
    # start-up timing of its linear packings take ~30 s instead of ~3; one thread keeps this file fast.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


PYTHON_SNIPPETS = blocks(README, "python")


def test_readme_shows_the_six_snippets():
    assert len(PYTHON_SNIPPETS) == 6, "the engine, transformers, structured output, quantized-weights, LoRA, spec snippets"
    assert "PagedGenerator" in PYTHON_SNIPPETS[0] and "apply_chat_template" in PYTHON_SNIPPETS[0]
    assert all(name in PYTHON_SNIPPETS[1] for name in ("hf_paged.wrap", "model.generate", "pipeline("))
    assert "structured_outputs" in PYTHON_SNIPPETS[2]
    assert "quantized=True" in PYTHON_SNIPPETS[3]
    assert "enable_lora=True" in PYTHON_SNIPPETS[4] and "examples/lora_upper" in PYTHON_SNIPPETS[4]
    assert "speculative_config" in PYTHON_SNIPPETS[5] and "spec_decode" in PYTHON_SNIPPETS[5]
    commands = {argv[0] for argv in cli_lines(README) if argv}
    assert {"generate", "serve", "chat"} <= commands
    assert len(README.read_text().splitlines()) <= 200, "the README stays short: depth goes to docs/"


@pytest.mark.parametrize("index", range(len(PYTHON_SNIPPETS)))
def test_readme_python_snippet_runs(index):
    code = PYTHON_SNIPPETS[index]
    asked = [int(n) for n in re.findall(r"max_(?:new_)?tokens\s*=\s*(\d+)", code)]
    assert asked and max(asked) <= MAX_TOKENS, f"snippet {index} must bound its tokens (<= {MAX_TOKENS}), got {asked}"
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    if index == 0:
        answer = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
        assert re.search(r"[A-Za-z]", answer), f"no answer printed: {result.stdout!r}"
        assert "Paris" in answer, f"the chat template should make the Instruct model answer: {answer!r}"
    if index == 2:  # structured output: the printed answer is JSON valid under the snippet's schema
        import json

        assert "city" in json.loads(result.stdout.strip().splitlines()[-1])
    if index == 4:  # one batch: the base row answers as the base model, the example adapter's row in capitals
        import ast

        base, adapted = ast.literal_eval(result.stdout.strip().splitlines()[-1])
        letters = [c for c in adapted if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) > 0.8 * len(letters), adapted
        assert any(c.islower() for c in base), base


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_cli_lines_parse(path):
    parser = build_parser()
    for argv in cli_lines(path):
        if "--help" in argv or "-h" in argv:
            continue
        try:
            parser.parse_args(argv)
        except Exception as e:  # noqa: BLE001 - the CLI's UsageError, or a bad --speculative-config
            pytest.fail(f"{path.name}: `hf-paged {shlex.join(argv)}` does not parse: {e}")


def test_readme_cheap_commands_run():
    lines = cli_lines(README)
    generate = [argv for argv in lines if argv[0] == "generate"]
    assert generate, "the README shows hf-paged generate"
    for argv in generate:
        assert "--max-tokens" in argv and int(argv[argv.index("--max-tokens") + 1]) <= MAX_TOKENS
        result = run([*CLI, *argv])
        assert result.returncode == 0, result.stderr[-3000:]
        assert re.search(r"[A-Za-z]", result.stdout), f"`hf-paged {shlex.join(argv)}` printed nothing"
    for command in sorted({argv[0] for argv in lines} - {"generate"}):
        result = run([*CLI, command, "--help"], timeout=60)
        assert result.returncode == 0 and f"hf-paged {command}" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_python_blocks_are_valid_python(path):
    for code in blocks(path, "python"):
        ast.parse(code)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to missing {target}"
        if anchor:
            assert anchor in anchors(linked), f"{path.name}: no heading for #{anchor} in {linked.name}"
