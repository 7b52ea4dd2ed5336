"""The chat demo's live engine panel: counters, the running batch, and a picture of the KV block pool.

:func:`take_snapshot` runs on the engine loop's thread (between two steps) and copies out plain data;
:func:`render_panel` turns it into HTML. Neither needs Gradio.
"""

from __future__ import annotations

import html
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from hf_paged.outputs import EngineStats

# Colours for requests (cycled); free, cached-free and shared blocks have their own look.
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#2f4b7c", "#a05195", "#d45087", "#665191", "#ff7c43", "#00876c", "#7f7f7f"]
FREE = "#eceff3"
CACHED = "#c9ced6"


@dataclass
class RequestInfo:
    request_id: str
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_blocks: int


@dataclass
class PoolSnapshot:
    """Plain data copied out of the engine between two steps."""

    stats: EngineStats
    owners: list[list[str]]  # per block id: the request ids holding it (empty: free)
    cached: list[bool]  # per block id: holds a registered prefix hash
    refs: list[int] = field(default_factory=list)  # per block id: sequences holding it (ref_cnt)
    requests: list[RequestInfo] = field(default_factory=list)
    block_size: int = 16
    taken_at: float = field(default_factory=time.time)


def take_snapshot(engine) -> PoolSnapshot:
    """Copy the pool's ownership and the live requests (call on the engine loop's thread)."""
    kv, sched = engine.kv_manager, engine.scheduler
    blocks = kv.pool.blocks
    owners: list[list[str]] = [[] for _ in blocks]
    per_request: dict[str, RequestInfo] = {}
    for seq_id, table in kv.tables.items():
        request = sched.sequences.get(seq_id)
        rid = request.request_id if request is not None else f"seq {seq_id}"
        for block in table:
            if rid not in owners[block.block_id]:
                owners[block.block_id].append(rid)
        if request is not None:
            info = per_request.get(rid)
            if info is None:
                info = per_request[rid] = RequestInfo(rid, request.status.value, request.num_prompt_tokens, 0, 0)
            info.num_output_tokens = max(info.num_output_tokens, request.num_output_tokens)
    for rid, info in per_request.items():
        info.num_blocks = sum(rid in o for o in owners)
    for request in sched.sequences.values():  # waiting ones hold no blocks yet
        if request.request_id not in per_request:
            per_request[request.request_id] = RequestInfo(
                request.request_id, request.status.value, request.num_prompt_tokens, request.num_output_tokens, 0)
    cached = [b.block_hash is not None for b in blocks]
    refs = [b.ref_cnt for b in blocks]
    return PoolSnapshot(engine.stats(), owners, cached, refs,
                        sorted(per_request.values(), key=lambda r: r.request_id), kv.block_size)


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 request``, ``0 requests``, ``2 requests`` (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def colour_of(request_id: str, order: dict[str, int]) -> str:
    return PALETTE[order.setdefault(request_id, len(order)) % len(PALETTE)]


def render_panel(snap: PoolSnapshot, tok_per_s: float, num_waiting: int, finished: dict[str, int] | None = None,
                 mine: Collection[str] = ()) -> str:
    """HTML of the panel: counters, the running requests and the block pool (one cell per block).

    ``mine``: the request ids of the tab viewing the panel; their rows get a "you" badge."""
    s = snap.stats
    order: dict[str, int] = {}
    for info in snap.requests:
        colour_of(info.request_id, order)
    running = [r for r in snap.requests if r.status in ("running", "preempted", "swapped")]
    waiting = [r for r in snap.requests if r.status == "waiting"]
    preempt = ", ".join(f"{k} {v}" for k, v in s.num_preemptions.items())
    counters = [
        ("running", f"{plural(s.num_running, 'seq')} / {plural(len(running), 'request')}"),
        ("waiting", str(num_waiting)),
        ("throughput", f"{tok_per_s:.1f} tok/s"),
        ("KV usage", f"{100 * s.kv_usage:.1f}% ({s.num_kv_blocks_used}/{plural(s.num_kv_blocks, 'block')}, "
                     f"{s.num_kv_blocks_cached} cached free)"),
        ("prefix-cache hit rate", f"{100 * s.prefix_cache_hit_rate:.1f}% ({s.prefix_cache_hits}/"
                                  f"{plural(s.prefix_cache_queries, 'token')})"),
        ("preemptions", preempt or "0"),
        ("steps", str(s.num_steps)),
        ("finished", ", ".join(f"{k} {v}" for k, v in (finished or {}).items() if v) or "0"),
    ]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td id='hfp-{html.escape(k.split()[0].lower())}'>"
                   f"{html.escape(v)}</td></tr>" for k, v in counters)
    batch = "".join(_request_row(r, colour_of(r.request_id, order), r.request_id in mine) for r in running + waiting)
    batch_title = (f"one continuous batch of {len(running)} requests" if len(running) > 1
                   else f"{plural(len(running), 'request')} running")
    cells = []
    refs = snap.refs or [len(o) for o in snap.owners]
    for block_id, (holders, is_cached, ref) in enumerate(zip(snap.owners, snap.cached, refs)):
        if not holders:
            colour, kind = (CACHED, "cached") if is_cached else (FREE, "free")
            title = f"block {block_id}: {'free, holds a cached prefix' if is_cached else 'free'}"
        else:
            colour = colour_of(holders[0], order)
            shared = ref > 1
            kind = "shared" if shared else ("prefix" if is_cached else "used")
            title = f"block {block_id}: {', '.join(holders)}" + (f" (shared by {ref} sequences)" if shared else "") + (
                " (cached prefix)" if is_cached else "")
        cells.append(f"<i class='hfp-b hfp-{kind}' style='background:{colour}' title='{html.escape(title)}'></i>")
    legend = ("<span class='hfp-sw' style='background:#4e79a7'></span>held by a request (colour) "
              "<span class='hfp-sw hfp-prefix' style='background:#4e79a7'></span>full block in the prefix cache "
              "<span class='hfp-sw hfp-shared' style='background:#4e79a7'></span>shared by several sequences "
              f"<span class='hfp-sw' style='background:{CACHED}'></span>free, cached prefix "
              f"<span class='hfp-sw' style='background:{FREE}'></span>free")
    return (
        f"<div class='hfp-panel'><style>{_CSS}</style>"
        f"<table class='hfp-stats'>{rows}</table>"
        f"<div class='hfp-batch'><b>{batch_title}</b><ul>{batch or '<li>idle</li>'}</ul></div>"
        f"<div class='hfp-pool-title'><b>KV block pool</b> ({plural(len(snap.owners), 'block')} of "
        f"{plural(snap.block_size, 'token')})</div>"
        f"<div class='hfp-pool' id='hfp-pool'>{''.join(cells)}</div><div class='hfp-legend'>{legend}</div></div>"
    )


def _request_row(r: RequestInfo, colour: str, mine: bool) -> str:
    """One line of the batch list; the viewing tab's own request is highlighted and badged "you"."""
    attrs = " class='hfp-req hfp-mine' aria-current='true'" if mine else " class='hfp-req'"
    badge = "<span class='hfp-you' title='the request of this tab'>you</span> " if mine else ""
    return (f"<li{attrs}><span class='hfp-sw' style='background:{colour}'></span>{badge}"
            f"{html.escape(r.request_id)}: {r.status}, {plural(r.num_prompt_tokens, 'prompt token')} + "
            f"{plural(r.num_output_tokens, 'output token')}, {plural(r.num_blocks, 'block')}</li>")


_CSS = """
.hfp-panel{font-size:12px;line-height:1.4}
.hfp-panel table.hfp-stats{border-collapse:collapse;margin-bottom:6px;width:auto}
.hfp-panel table.hfp-stats,.hfp-panel table.hfp-stats tr,.hfp-panel table.hfp-stats td{border:0 !important;background:none !important}
.hfp-panel table.hfp-stats td{padding:1px 10px 1px 0}
.hfp-panel table.hfp-stats td:first-child{color:#666}
.hfp-batch ul{margin:2px 0 6px 0;padding-left:16px}
.hfp-pool{display:flex;flex-wrap:wrap;gap:1px;max-height:360px;overflow:auto}
.hfp-b{display:inline-block;width:9px;height:9px;border-radius:1px}
.hfp-prefix{box-shadow:inset 0 0 0 2px rgba(255,255,255,.75)}
.hfp-shared{background-image:repeating-linear-gradient(45deg,rgba(255,255,255,.65) 0 2px,transparent 2px 4px)!important}
.hfp-cached{opacity:.9}
.hfp-sw{display:inline-block;width:10px;height:10px;margin:0 3px 0 8px;vertical-align:middle}
.hfp-legend{margin-top:4px;color:#444}
.hfp-mine{background:#fff4c2;border-radius:2px;font-weight:600}
.hfp-you{display:inline-block;padding:0 4px;margin-right:4px;border-radius:6px;background:#1f6feb;color:#fff;font-size:10px}
"""
