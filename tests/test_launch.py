"""The ``hf-paged`` launcher's process tuning: bound OpenMP threads, a preloaded allocator, user settings kept."""

import os
import subprocess
import sys

import pytest

from hf_paged import launch


def _topology(tmp_path, cores: dict[int, tuple[int, int]]) -> str:
    for cpu, (package, core) in cores.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return str(tmp_path)


def test_core_cpus_keeps_one_smt_sibling_per_core(tmp_path):
    # 2 packages x 2 cores x 2 threads: siblings are cpu n and n+4
    layout = {c: (c // 2 % 2, c % 2) for c in range(8)}
    sysfs = _topology(tmp_path, layout)
    assert launch.core_cpus(set(range(8)), sysfs) == [0, 1, 2, 3]
    assert launch.core_cpus({1, 5, 6}, sysfs) == [1, 6]  # 5 is 1's sibling
    assert launch.core_cpus({3, 2}, str(tmp_path / "missing")) == [2, 3]  # unknown topology: each CPU a core


def test_tuned_environment_binds_threads_and_preloads_allocator(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    tuning = launch.tuned_environment({"PATH": "/bin"}, cpus=[0, 2], library_dirs=(str(tmp_path),))
    assert tuning.env["OMP_NUM_THREADS"] == "2"
    assert tuning.env["OMP_PLACES"] == "{0},{2}"
    assert tuning.env["OMP_PROC_BIND"] == "close"
    assert tuning.env["LD_PRELOAD"] == str(lib)
    assert tuning.env["PATH"] == "/bin"
    assert len(tuning.changes) == 3


def test_user_settings_win(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    user = {"OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": "1", "LD_PRELOAD": "/opt/libtcmalloc.so"}
    tuning = launch.tuned_environment(user, cpus=[0, 1], library_dirs=(str(tmp_path),))
    assert tuning.env == user and tuning.changes == []
    # threads set but no binding: bind, keep the thread count; another preload is kept behind the allocator
    tuning = launch.tuned_environment({"OMP_NUM_THREADS": "1", "LD_PRELOAD": "/x/libfoo.so"}, cpus=[0, 1],
                                      library_dirs=(str(tmp_path),))
    assert tuning.env["OMP_NUM_THREADS"] == "1" and tuning.env["OMP_PROC_BIND"] == "close"
    assert tuning.env["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"
    # no allocator on the machine: nothing preloaded, never an error
    tuning = launch.tuned_environment({}, cpus=[0], library_dirs=(str(tmp_path / "none"),), bind=False)
    assert tuning.changes == [] and "LD_PRELOAD" not in tuning.env


def test_explicit_allocator_and_switch_are_checked(tmp_path):
    with pytest.raises(ValueError, match="HF_PAGED_ALLOCATOR='/no/such.so': no such file"):
        launch.find_allocator({"HF_PAGED_ALLOCATOR": "/no/such.so"})
    lib = tmp_path / "mylib.so"
    lib.write_bytes(b"")
    assert launch.find_allocator({"HF_PAGED_ALLOCATOR": str(lib)}) == str(lib)
    assert launch.enabled({}) and launch.enabled({"HF_PAGED_TUNE": "1"})
    assert not launch.enabled({"HF_PAGED_TUNE": "0"}) and not launch.enabled({"HF_PAGED_TUNE": "applied"})
    with pytest.raises(ValueError, match="HF_PAGED_TUNE='maybe': use 1"):
        launch.enabled({"HF_PAGED_TUNE": "maybe"})


def test_only_offline_commands_bind_threads():
    assert launch.binds_threads(["batch", "f.jsonl"]) and launch.binds_threads(["-v", "bench", "chat"])
    assert launch.binds_threads(["generate", "serve me"])  # a prompt, not the serve command
    assert not launch.binds_threads(["serve", "--port", "8000"]) and not launch.binds_threads(["chat"])
    assert not launch.binds_threads(["bench", "serve", "--clients", "64"]) and not launch.binds_threads([])
    assert not launch.binds_threads(["bench", "replicas"])  # Ray's replica workers would inherit the binding


def test_tuning_reexecs_only_for_a_preload_and_never_after_torch(tmp_path):
    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    no_openmp = lambda: False  # noqa: E731
    # this test process has torch imported: too late to tune, nothing happens
    import torch  # noqa: F401

    launch.tune_process(["batch", "f.jsonl"], environ={}, execve=fake_execve, openmp_is_loaded=no_openmp)
    assert calls == []
    saved = sys.modules.pop("torch")
    try:
        for off in ({"HF_PAGED_TUNE": "applied"}, {"HF_PAGED_TUNE": "0"}):
            env = dict(off)
            launch.tune_process(["batch", "f.jsonl"], environ=env, execve=fake_execve, openmp_is_loaded=no_openmp)
            assert calls == [] and env == off
        # only OpenMP settings: set in this process, read when torch loads its OpenMP runtime; no re-exec
        env = {"LD_PRELOAD": "/x/libjemalloc.so.2", "PATH": "/bin"}  # an allocator of the user's: kept
        launch.tune_process(["batch", "f.jsonl"], environ=env, execve=fake_execve, openmp_is_loaded=no_openmp)
        assert calls == [] and env["HF_PAGED_TUNE"] == "applied" and env["OMP_PROC_BIND"] == "close"
        assert "OMP_PLACES=" in env["HF_PAGED_TUNED_WITH"] and env["PATH"] == "/bin"
        assert env["LD_PRELOAD"] == "/x/libjemalloc.so.2"
        # an OpenMP runtime loaded already has read its settings: re-exec
        launch.tune_process(["batch", "f.jsonl"], environ={}, execve=fake_execve, openmp_is_loaded=lambda: True)
        # an allocator to preload: re-exec, whatever OpenMP does
        launch.tune_process(["batch", "f.jsonl"], environ={"HF_PAGED_ALLOCATOR": str(lib)}, execve=fake_execve,
                            openmp_is_loaded=no_openmp)
    finally:
        sys.modules["torch"] = saved
    (path, args, env), (_, _, preload_env) = calls
    assert path == sys.executable and args[1:] == ["-m", "hf_paged.cli", "batch", "f.jsonl"]
    assert env["HF_PAGED_TUNE"] == "applied" and env["OMP_PROC_BIND"] == "close"
    assert preload_env["LD_PRELOAD"] == str(lib) and f"LD_PRELOAD={lib}" in preload_env["HF_PAGED_TUNED_WITH"]


def test_openmp_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert not launch.openmp_loaded(str(maps))
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /x/torch/lib/libgomp.so.1\n")
    assert launch.openmp_loaded(str(maps))
    assert launch.openmp_loaded(str(tmp_path / "missing"))  # unknown: re-exec, as before
    import torch  # noqa: F401 - torch loads its OpenMP runtime

    if sys.platform == "linux":
        assert launch.openmp_loaded()


def test_short_lived_commands():
    assert launch.ends_after_start_up(["generate", "hi"]) and launch.ends_after_start_up(["-v", "batch", "f.jsonl"])
    assert not launch.ends_after_start_up(["serve"]) and not launch.ends_after_start_up(["chat"])
    assert not launch.ends_after_start_up([])


def test_cli_process_runs_tuned_and_env_reports_it():
    env = {k: v for k, v in os.environ.items() if k not in launch.BINDING_VARS + ("OMP_NUM_THREADS", "HF_PAGED_TUNE")}
    out = subprocess.run([sys.executable, "-m", "hf_paged.cli", "env", "--json"], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    import json

    info = json.loads(out)
    assert info["tuning"]["HF_PAGED_TUNE"] == "applied"
    assert info["tuning"]["OMP_PROC_BIND"] == "close"
    assert int(info["tuning"]["OMP_NUM_THREADS"]) == len(launch.core_cpus())
    off = subprocess.run([sys.executable, "-m", "hf_paged.cli", "env", "--json"], env={**env, "HF_PAGED_TUNE": "0"},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert json.loads(off)["tuning"].get("OMP_PROC_BIND") is None
