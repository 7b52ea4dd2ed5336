"""The ``hf-paged`` process's garbage collection pause and quick exit (hf_paged/cli/lifetime.py)."""

import gc
import subprocess
import sys
import textwrap

from hf_paged.cli import lifetime

_SCRIPT = """
import atexit, gc, sys, weakref
from hf_paged.cli import lifetime

lifetime.enable(long_lived={long_lived})
atexit.register(lambda: print("atexit handler ran", flush=True))  # registered later: runs before the exit


class Held:  # kept by a module global: the interpreter's teardown deletes it, a quick exit does not
    def __del__(self):
        print("teardown ran", flush=True)


held = Held()
weakref.finalize(held, print, "finalizer ran")  # weakref finalizers run at exit like atexit handlers
with lifetime.start_up():
    assert not gc.isenabled()
    cycle = []
    cycle.append(cycle)  # start-up garbage
    del cycle
assert gc.isenabled() and gc.get_freeze_count() > 0
print("garbage frozen" if {long_lived} is False else "garbage collected", flush=True)
sys.stdout.write("unflushed\\n")  # a pipe: block-buffered until the exit flushes it
{ending}
"""


def _run(ending: str, long_lived: bool = False) -> subprocess.CompletedProcess:
    code = _SCRIPT.format(ending=ending, long_lived=long_lived)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_quick_exit_runs_atexit_handlers_and_skips_the_teardown():
    done = _run("sys.exit(lifetime.quick_exit(3))")
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert "atexit handler ran" in lines and "finalizer ran" in lines
    assert "teardown ran" not in done.stdout  # no teardown: the object is never deleted
    assert done.stdout.startswith("garbage frozen") and "unflushed" in done.stdout  # stdout flushed before the exit


def test_a_command_ending_in_an_exception_gets_the_usual_exit():
    done = _run("lifetime.quick_exit(0)\nlifetime.usual_exit()\nraise SystemExit(4)", long_lived=True)
    assert done.returncode == 4
    assert "atexit handler ran" in done.stdout and "teardown ran" in done.stdout
    assert done.stdout.startswith("garbage collected") and done.stderr == ""


def test_without_enable_nothing_changes():
    # a program (or this test process) calling the commands keeps its collector and its exit
    assert not lifetime._enabled
    was = gc.isenabled()
    with lifetime.start_up():
        assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0
    assert lifetime.quick_exit(5) == 5 and lifetime._exit_status is None


def test_cli_exits_with_the_commands_status():
    done = subprocess.run([sys.executable, "-m", "hf_paged.cli", "generate", "hi", "--max-tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "hf-paged: error: --max-tokens must be >= 1, got 0"
