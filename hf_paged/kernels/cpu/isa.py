"""The instruction-set level the CPU kernels run at: the host's own, or one forced by ``HF_PAGED_ISA``.

CPUs differ between machines (AMX Xeons, AVX-512 Zen 4/5, AVX2-only Zen 3 and older Intel), and each fast path
is picked by probing the host. ``HF_PAGED_ISA`` lets a developer on a bigger CPU run (and measure, and test) the
paths a smaller one takes:

- ``avx2``: our C kernels are built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512, no AVX-VNNI, no AMX), and
  torch's own kernels are capped likewise (``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA``, MKL's
  ``MKL_ENABLE_INSTRUCTIONS``), so the engine takes every choice an AVX2-only CPU takes.
- ``avx512``: AVX-512 (with whatever AVX-512 extensions the host has), no AMX.
- ``amx``, ``native`` or unset: everything the host has.

A level above the host's is refused (the kernels would crash). The torch caps are set when this module is
imported (``hf_paged`` imports it before it runs any torch kernel) unless the user set those variables already;
torch reads them at its first kernel call.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

ENV = "HF_PAGED_ISA"
LEVELS = ("avx2", "avx512", "amx")
_ALIASES = {"": None, "native": None, "auto": None}

# What each forced level means for torch's own kernels (variables read at torch's first kernel call).
_TORCH_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {},
}
_MARCH = {
    None: ("-march=native",),
    # x86-64-v3 is exactly the AVX2 + FMA + F16C + BMI baseline, whatever the host adds
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "avx512": ("-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"),
    "amx": ("-march=native",),
}


@lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` names; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_level(flags: frozenset[str] | None = None) -> str | None:
    """The highest level of :data:`LEVELS` this CPU has, or None (not x86, or below AVX2)."""
    flags = host_flags() if flags is None else flags
    if not {"avx2", "fma"} <= flags:
        return None
    if {"amx_tile", "avx512f"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    return "avx2"


def forced_level(value: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """The level ``HF_PAGED_ISA`` (or ``value``) forces, or None for the host's own.

    Raises:
        ValueError: an unknown level, or one above this CPU's (naming what the CPU has).
    """
    raw = os.environ.get(ENV, "") if value is None else value
    key = raw.strip().lower()
    if key in _ALIASES:
        return None
    if key not in LEVELS:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(LEVELS)} or native")
    have = host_level(flags)
    if platform.machine() not in ("x86_64", "AMD64") or have is None:
        raise ValueError(f"{ENV}={raw!r}: this CPU ({platform.machine()}) has no x86 AVX2 level to force")
    if LEVELS.index(key) > LEVELS.index(have):
        raise ValueError(f"{ENV}={raw!r}: this CPU only goes up to {have}")
    return key


def level() -> str:
    """The level the kernels run at: the forced one, else the host's (``"native"`` on a CPU below AVX2 or not
    x86)."""
    forced = forced_level()
    return forced or host_level() or "native"


def describe() -> str:
    """One line for benchmark tables and ``hf-paged env``: the level, and whether it is forced."""
    forced = forced_level()
    if forced is None:
        return f"{host_level() or 'native'} (host)"
    return f"{forced} (forced by {ENV}; host {host_level()})"


def march_flags() -> tuple[str, ...]:
    """The compiler's target flags for our C kernels at the current level."""
    return _MARCH[forced_level()]


def cache_key() -> str:
    """What distinguishes one level's builds from another's (the CPU's flags, masked by the forced level)."""
    return f"{forced_level() or 'native'}:{' '.join(sorted(host_flags()))}"


def apply_torch_caps() -> None:
    """Cap torch's own kernels at the forced level (no-op when none is forced or the user set the variables)."""
    try:
        forced = forced_level()
    except ValueError:
        return  # reported where the level is used (building the kernels, hf-paged env)
    for name, value in _TORCH_CAPS.get(forced, {}).items():
        os.environ.setdefault(name, value)
