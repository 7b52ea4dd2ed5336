"""The names ``hf-paged bench WORKLOAD --systems`` takes, per workload, checked before anything loads or runs."""

from __future__ import annotations


def system_names() -> dict[str, tuple[str, ...]]:
    """Per workload that takes ``--systems``, the names it knows (the others run a fixed set)."""
    from hf_paged.bench.arrival import SYSTEMS as ARRIVAL
    from hf_paged.bench.replicas import ROUTINGS
    from hf_paged.bench.serve import SYSTEMS as SERVE
    from hf_paged.bench.spec import SYSTEMS as SPEC
    from hf_paged.bench.workloads import EAGER, QUANTIZED, SYSTEMS, TP2_SYSTEMS

    return {
        "chat": (*SYSTEMS["chat"], EAGER, *TP2_SYSTEMS, *QUANTIZED),
        "mixed": SYSTEMS["mixed"],
        "latency": (*SYSTEMS["latency"], EAGER, *QUANTIZED),
        "prefix": SYSTEMS["prefix"],
        "spec": (*tuple(SPEC)[:-1], "eagle", *tuple(SPEC)[-1:]),  # eagle: with --eagle-head
        "serve": SERVE,
        "arrival": tuple(ARRIVAL),
        "replicas": ROUTINGS,
    }


def parse_systems(workload: str, text: str | None) -> set[str] | None:
    """``--systems`` of ``workload`` as a set of names (None when not given: the workload's default systems).

    Raises:
        ValueError: a name the workload does not know, an empty list, or ``--systems`` on a workload that runs
            one fixed set (the message lists the names it takes).
    """
    if text is None:
        return None
    known = system_names()
    if workload not in known:
        takes = ", ".join(sorted(known))
        raise ValueError(f"--systems does not apply to the {workload} workload (it runs a fixed set); "
                         f"the workloads that take it: {takes}")
    names = [n.strip() for n in text.split(",") if n.strip()]
    valid = known[workload]
    unknown = [n for n in names if n not in valid]
    if unknown:
        what = f"unknown system{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
    elif not names:
        what = f"no system named in {text!r}"
    else:
        return set(names)
    raise ValueError(f"--systems: {what} for the {workload} workload; valid: {', '.join(valid)}")
