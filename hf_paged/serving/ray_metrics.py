"""``/metrics`` of a replicated server: every replica's Prometheus text, labelled ``replica="<id>"``, and the
sum over replicas labelled ``replica="total"``.

Counters, histogram buckets, sums and counts, and gauges of things (requests, blocks) add up; a fraction
(``kv_cache_usage_perc``) is averaged instead. In PromQL, aggregate over ``replica!="total"`` or read the total.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

REPLICA_LABEL = "replica"
TOTAL = "total"
_AVERAGED_SUFFIXES = ("_perc",)


@dataclass
class _Family:
    name: str
    kind: str
    doc: str
    # (sample name, sorted labels without replica) -> {replica: value}
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, float]] = field(default_factory=dict)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value)) if value != int(value) else f"{int(value)}.0"


def _labels(labels: tuple[tuple[str, str], ...], replica: str) -> str:
    items = [*labels, (REPLICA_LABEL, replica)]
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def merge_metrics(snapshots: dict[str, str]) -> str:
    """One exposition text from ``{replica id: that replica's /metrics text}``."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, _Family] = {}
    for replica, text in sorted(snapshots.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, _Family(fam.name, fam.type, fam.documentation))
            for sample in fam.samples:
                if sample.name.endswith("_created"):  # creation timestamps do not add up
                    continue
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != REPLICA_LABEL))
                merged.samples.setdefault((sample.name, labels), {})[replica] = sample.value
    lines = []
    for fam in families.values():
        if not fam.samples:
            continue
        exposed = fam.name + ("_total" if fam.kind == "counter" else "")
        lines.append(f"# HELP {exposed} {fam.doc} (per replica, and the {TOTAL} over replicas)")
        lines.append(f"# TYPE {exposed} {fam.kind}")
        average = fam.name.endswith(_AVERAGED_SUFFIXES)
        for (sample_name, labels), by_replica in fam.samples.items():
            for replica, value in by_replica.items():
                lines.append(f"{sample_name}{_labels(labels, replica)} {_format_value(value)}")
            total = sum(by_replica.values())
            if average:
                total /= len(by_replica)
            lines.append(f"{sample_name}{_labels(labels, TOTAL)} {_format_value(total)}")
    return "\n".join(lines) + "\n"


class MetricsBoard:
    """The latest metrics text each replica reported, dropped once older than ``stale_after`` seconds (a replica
    that died stops reporting; its replacement reports under its own id)."""

    def __init__(self, stale_after: float = 15.0) -> None:
        self.stale_after = stale_after
        self._latest: dict[str, tuple[float, str]] = {}

    def report(self, replica: str, text: str | None) -> None:
        """Store ``replica``'s text; None forgets the replica (it is shutting down)."""
        if text is None:
            self._latest.pop(replica, None)
        else:
            self._latest[replica] = (time.monotonic(), text)

    def snapshots(self) -> dict[str, str]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._latest.items() if now - t > self.stale_after]:
            del self._latest[replica]
        return {r: text for r, (_, text) in self._latest.items()}

    def render(self) -> str:
        return merge_metrics(self.snapshots())
