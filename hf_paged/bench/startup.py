"""``hf-paged bench startup``: how long a fresh process takes to its first token, and where the time goes.

Each figure is a fresh Python process (the best of ``repeat`` runs, warm file cache: one untimed run first):

- ``python``: the interpreter alone (``python -c pass``), the floor of any command;
- ``import floor``: ``import torch`` and transformers' model classes for the default model (what any engine built
  on transformers pays before it can touch a weight), as a plain ``python -c`` runs it, exit included;
- ``import floor, as hf-paged runs it``: the same imports with the collector paused and no interpreter
  teardown, as the ``hf-paged`` process runs them (:mod:`hf_paged.cli.lifetime`), after ``import hf_paged``,
  whose stored copy of transformers' table of its model modules spares transformers' scan of ~3,000 source files
  (:mod:`hf_paged._transformers_index`): the floor of the command; ``..., table not stored``: the same with
  ``HF_PAGED_TRANSFORMERS_INDEX=0`` (what the command paid before);
- ``hf-paged generate``: the command line, ``--max-tokens 1``, to its first token (the first byte it prints)
  and to its exit; ``hf_paged's share`` is the first token less the import floor as hf-paged runs it;
- the phases of one in-process start through the Python API, as a program calling it pays them (no process
  tuning; ``import hf_paged`` first, as the stored table needs: a program that imports transformers before
  hf_paged pays transformers' scan, ~1 s more): import torch, import transformers' model classes, import the
  engine, load the model and tokenizer, construct ``PagedGenerator``, first token; from marks taken inside one
  fresh process.

The load average before and after is printed with the table: the hosts are shared, and every figure moves with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from hf_paged.bench.common import machine_info

# Runs in a fresh interpreter: prints the time of each phase since the interpreter started running it.
_PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
marks = []
def mark(name):
    marks.append((name, time.perf_counter() - t0))
import hf_paged, torch; mark("import torch")
import transformers.models.llama.modeling_llama; mark("import transformers model classes")
from hf_paged import PagedGenerator, SamplingParams; mark("import hf_paged engine")
from hf_paged.model.default_model import load_default
model, tok = load_default(dtype=sys.argv[1]); mark("load model + tokenizer")
engine = PagedGenerator(model, tok, max_num_seqs=8); mark("PagedGenerator(...)")
engine.generate(["Hi"], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False); mark("first token")
engine.close()
print("PHASES " + json.dumps(marks))
"""

_FLOOR = "import torch, transformers.models.llama.modeling_llama"
# the same imports as the hf-paged process makes them: the collector paused, no teardown (hf_paged/cli/lifetime.py)
_FLOOR_AS_CLI = f"import gc, os, sys\ngc.disable()\nimport hf_paged\n{_FLOOR}\nsys.stdout.flush()\nos._exit(0)"


def run_process(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[float, float, str]:
    """``(seconds to the first byte on stdout, seconds to exit, stdout)`` of one fresh process; a process that
    prints nothing has its exit as its first byte."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            first = proc.stdout.read(1)
            first_s = time.perf_counter() - start
            out = first + proc.stdout.read()
            code = proc.wait()
            exit_s = time.perf_counter() - start
        finally:
            timer.cancel()
        if code != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({code}): {err.read().decode(errors='replace')[-2000:]}")
    return (first_s if first else exit_s), exit_s, out.decode(errors="replace")


def startup(dtype: str = "fp32", repeat: int = 1, **_) -> dict:
    """Print and return the start-up table (seconds, best of ``max(repeat, 3)`` fresh processes each)."""
    repeat = max(repeat, 3)
    env = dict(os.environ, TQDM_DISABLE="1")
    # as a default Python does: compiled modules cached in __pycache__ (a set PYTHONDONTWRITEBYTECODE would make
    # every run compile the package's sources again, ~0.2 s)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    load_before = os.getloadavg()
    python = sys.executable
    cli = [python, "-m", "hf_paged.cli", "generate", "--raw", "--max-tokens", "1", "--dtype", dtype, "Hi"]
    run_process(cli, env)  # untimed: fills the file cache, builds or loads the kernels and the tuning store
    commands = {"python": [python, "-c", "pass"], "import floor": [python, "-c", _FLOOR],
                "import floor, as hf-paged runs it": [python, "-c", _FLOOR_AS_CLI]}
    seconds = {name: min(run_process(cmd, env)[1] for _ in range(repeat)) for name, cmd in commands.items()}
    unstored = dict(env, HF_PAGED_TRANSFORMERS_INDEX="0")
    seconds["import floor, as hf-paged runs it, table not stored"] = min(
        run_process(commands["import floor, as hf-paged runs it"], unstored)[1] for _ in range(repeat))
    runs = [run_process(cli, env)[:2] for _ in range(repeat)]
    seconds["hf-paged generate, first token"] = min(first for first, _ in runs)
    seconds["hf-paged generate, exit"] = min(end for _, end in runs)
    seconds["hf_paged's share (first token - floor)"] = (seconds["hf-paged generate, first token"]
                                                         - seconds["import floor, as hf-paged runs it"])
    phase_runs = []
    for _ in range(repeat):
        out = run_process([python, "-c", _PHASES, dtype], env)[2]
        line = next(x for x in out.splitlines() if x.startswith("PHASES "))
        phase_runs.append(json.loads(line[len("PHASES "):]))
    phases = min(phase_runs, key=lambda marks: marks[-1][1])
    steps, previous = {}, 0.0
    for name, at in phases:
        steps[name] = round(at - previous, 3)
        previous = at
    load = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    report = {"workload": "startup", "dtype": dtype, "machine": machine_info(), "repeat": repeat,
              "seconds": {k: round(v, 3) for k, v in seconds.items()},
              "phases": steps, "in_process_total": round(phases[-1][1], 3), "load_average": load}
    print(f"start-up ({dtype}, best of {repeat} fresh processes, warm file cache; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, {load[3]:.2f} {load[4]:.2f} {load[5]:.2f} after)")
    for name, value in report["seconds"].items():
        print(f"  {name:<52} {value:7.2f} s")
    print(f"  phases of one in-process start through the API (total {report['in_process_total']:.2f} s):")
    for name, value in steps.items():
        print(f"    {name:<50} {value:7.2f} s")
    print(json.dumps(report))
    return report
