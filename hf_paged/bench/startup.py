"""``hf-paged bench startup``: how long a fresh process takes to its first token, and where the time goes.

Each figure is a fresh Python process (the best of ``repeat`` runs, warm file cache: one untimed run first):

- ``python``: the interpreter alone (``python -c pass``), the floor of any command;
- ``import floor``: ``import torch`` and transformers' model classes for the default model (what any engine built
  on transformers pays before it can touch a weight);
- ``hf-paged generate``: the command line to its first (and only) token, ``--max-tokens 1``, re-exec included;
- the phases of one in-process start (import torch, import transformers' model classes, import the engine, load the
  model and tokenizer, construct ``PagedGenerator``, first token), from marks taken inside one fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from hf_paged.bench.common import machine_info

# Runs in a fresh interpreter: prints the time of each phase since the interpreter started running it.
_PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
marks = []
def mark(name):
    marks.append((name, time.perf_counter() - t0))
import torch; mark("import torch")
import transformers.models.llama.modeling_llama; mark("import transformers model classes")
from hf_paged import PagedGenerator, SamplingParams; mark("import hf_paged engine")
from hf_paged.model.default_model import load_default
model, tok = load_default(dtype=sys.argv[1]); mark("load model + tokenizer")
engine = PagedGenerator(model, tok, max_num_seqs=8); mark("PagedGenerator(...)")
engine.generate(["Hi"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False); mark("first token")
engine.close()
print("PHASES " + json.dumps(marks))
"""


def _wall(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done.stdout


def startup(dtype: str = "fp32", repeat: int = 1, **_) -> dict:
    """Print and return the start-up table (seconds, best of ``max(repeat, 3)`` fresh processes each)."""
    repeat = max(repeat, 3)
    env = dict(os.environ, TQDM_DISABLE="1")
    # as a default Python does: compiled modules cached in __pycache__ (a set PYTHONDONTWRITEBYTECODE would make
    # every run compile the package's sources again, ~0.2 s)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    python = sys.executable
    cli = [python, "-m", "hf_paged.cli", "generate", "--raw", "--max-tokens", "1", "--dtype", dtype, "Hi"]
    commands = {
        "python": [python, "-c", "pass"],
        "import floor": [python, "-c", "import torch, transformers.models.llama.modeling_llama"],
        "hf-paged generate": cli,
    }
    _wall(cli, env)  # untimed: fills the file cache, builds or loads the kernels and the tuning store
    best = {name: min(_wall(cmd, env)[0] for _ in range(repeat)) for name, cmd in commands.items()}
    phase_runs = []
    for _ in range(repeat):
        out = _wall([python, "-c", _PHASES, dtype], env)[1]
        line = next(x for x in out.splitlines() if x.startswith("PHASES "))
        phase_runs.append(json.loads(line[len("PHASES "):]))
    phases = min(phase_runs, key=lambda marks: marks[-1][1])
    steps, previous = {}, 0.0
    for name, at in phases:
        steps[name] = round(at - previous, 3)
        previous = at
    report = {"workload": "startup", "dtype": dtype, "machine": machine_info(), "repeat": repeat,
              "seconds": {k: round(v, 3) for k, v in best.items()},
              "phases": steps, "in_process_total": round(phases[-1][1], 3)}
    print(f"start-up ({dtype}, best of {repeat} fresh processes, warm file cache)")
    for name, seconds in report["seconds"].items():
        print(f"  {name:<36} {seconds:7.2f} s")
    print(f"  phases of one in-process start (total {report['in_process_total']:.2f} s):")
    for name, seconds in steps.items():
        print(f"    {name:<34} {seconds:7.2f} s")
    print(json.dumps(report))
    return report
