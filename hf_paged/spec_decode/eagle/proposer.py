"""EAGLE-3 proposer: the head drafts from the target's hidden states, with its KV paged in a pool of its own.

Every step the target runs, its runner captures the outputs of the head's three layers for all of the step's
rows (``Step.hidden_layers``, no second pass), and :meth:`EagleProposer.observe` keeps, per sequence, the rows
the head has not consumed yet (``pending``: a start position and ``[m, 3H]``). At proposal time (the sequence
now has ``n`` tokens) the head position ``p`` pairs the embedding of token ``p + 1`` with ``fc`` of the target's
hidden state at ``p``; every pending ``p <= n - 2`` is valid (rows of rejected drafts are dropped), so one
varlen forward over all proposing sequences catches the head's KV up and its last row drafts token ``n``.
Each further draft is a one-token forward for the batch at the next head position, fed the head's own output.

The head's KV pool has the target's block size and block count and is indexed by the target's block tables
and slots (the scheduler sets aside ``k`` lookahead slots per proposing sequence, as for a draft model), so it
needs no memory management of its own. Every move of the target's blocks moves the head's KV of those blocks
too (:meth:`move_blocks`): copy-on-write copies, swaps to host memory and back (the head pool has as many host
blocks as the target's), and the host KV tier's demotions and promotions (the head keeps host slots of its own,
as many as the tier). So after a prefix-cache hit in the pool or in the host tier, or a swap-in, the head reads
the KV it wrote when those positions were computed, and drafts as if the target had computed them again.
Drafted head positions are overwritten by the next catch-up. A forked sample (n > 1) inherits its parent's
pending rows. When a sequence finishes, the head catches up over the rows it still holds in full blocks
(:meth:`settle`), so a later request that hits those cached blocks finds the head's KV there even if the
sequence drafted nothing lately (its acceptance kept it idle). A *dormant* sequence, one the scheduler stopped
from drafting (``disable_by_batch_size``, or the speculation gate at a batch size where drafting costs), is not
settled: catching the head up over every token it ran would cost a few percent of the very steps the gate
spared, for a later prefix hit that may never come. Blocks it leaves in the cache, blocks read back from the
disk tier (its files hold the target's KV only) and rows past ``MAX_PENDING`` leave head positions unwritten;
there the head reads what its pool holds, so drafts may be worse, and output never changes (verification).
A dormant sequence keeps its rows (as chunks, cheap to append), so if drafting resumes its first proposal
catches the head up over them.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.attention.layer import AttentionFacts
from hf_paged.core.scheduler_output import ScheduledSequence, SchedulerOutput
from hf_paged.executor.kv_pool import KVPool, LayerKVSpec, copy_blocks
from hf_paged.executor.kv_tiers import HostTier
from hf_paged.spec_decode.draft_model import matmul_params
from hf_paged.spec_decode.eagle.head import EagleHead

logger = logging.getLogger(__name__)

# most target rows kept per sequence between its proposals (a sequence that does not draft for a long time, e.g.
# over disable_by_batch_size, keeps its newest rows only: older head positions are then never computed, which
# can only lower its acceptance)
MAX_PENDING = 4096


class PendingRows:
    """A sequence's target rows ``[length, 3H]`` from position ``start`` on, kept as the steps' chunks (joined
    only when the head reads them: appending a step's row to one growing tensor would copy all of it each step)."""

    __slots__ = ("start", "chunks", "length")

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.start = start
        self.chunks = [rows]
        self.length = rows.shape[0]

    @property
    def end(self) -> int:
        """The position after the last row."""
        return self.start + self.length

    def append(self, rows: torch.Tensor) -> None:
        self.chunks.append(rows)
        self.length += rows.shape[0]

    def tensor(self, n: int | None = None) -> torch.Tensor:
        """The first ``n`` rows (all by default) as one tensor."""
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        rows = self.chunks[0]
        return rows if n is None else rows[:n]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows."""
        if n < self.length:
            self.chunks = [self.tensor(n)] if n else []
            self.length = n

    def drop_front(self, n: int) -> None:
        self.chunks = [self.tensor()[n:]]
        self.start += n
        self.length -= n

    def copy(self) -> PendingRows:
        other = PendingRows.__new__(PendingRows)
        other.start, other.chunks, other.length = self.start, list(self.chunks), self.length
        return other


class EagleProposer:
    """Greedy drafts from an EAGLE-3 head (see the module docstring).

    Args:
        head: The loaded head (on the target's device and dtype).
        layers: The target's decoder layers whose outputs the head reads, in ``fc`` order.
        target: The engine's model (for the head's relative cost).
        target_pool: The engine's KV pool (the head's pool copies its block size and count).
        prepare_batch: The model runner's ``prepare_batch`` (packs sequences over attention layers and tables).
        attention_layers: The model runner's ``attention_layers`` (layer objects over a pool, engine backend).
        tier_slots: The host KV tier's slot count (0: the engine has none); the head keeps as many of its own.
    """

    def __init__(self, head: EagleHead, layers: tuple[int, ...], target: torch.nn.Module, target_pool: KVPool,
                 prepare_batch, attention_layers, tier_slots: int = 0) -> None:
        self.head = head
        self.layers = tuple(layers)
        self.prepare_batch = prepare_batch
        cfg = head.config
        dtype = next(head.parameters()).dtype
        facts = AttentionFacts(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim,
                               cfg.head_dim ** -0.5)
        spec = LayerKVSpec(cfg.num_key_value_heads, cfg.head_dim, dtype, "auto", facts)
        self.pool = KVPool([spec], target_pool.num_blocks, target_pool.block_size, target_pool.device,
                           target_pool.num_host_blocks)
        # the host tier's copies of the head's KV (exact: the drafts then do not depend on where a block was)
        self.tier = HostTier(self.pool, tier_slots, compress=False) if tier_slots else None
        self.attention = attention_layers(self.pool)
        self.block_size = target_pool.block_size
        self.pending: dict[int, PendingRows] = {}  # seq -> the target rows the head has not consumed yet
        self.active: set[int] = set()  # sequences whose last step asked for drafts (the rest are dormant)
        shared = getattr(head, "_shared_lm_head", [None])[0]  # an EAGLE-1 head runs the target's lm_head
        own = matmul_params(head) + (shared.weight.numel() if shared is not None and hasattr(shared, "weight") else 0)
        self.relative_cost = own / max(1, matmul_params(target))
        logger.info("EAGLE head: KV pool of %.1f MiB, %.3f of a target forward per drafted token",
                    self.pool.total_bytes / 2**20, self.relative_cost)

    def close(self) -> None:
        self.pool.kv_caches.clear()
        self.pool.host_caches.clear()
        self.tier = None
        self.pending.clear()
        self.active.clear()

    def forget(self, finished, preempted=()) -> None:
        # a preempted sequence keeps its rows: swapped, it continues where it stopped (its head KV moved with its
        # blocks); recomputed, the target's new rows replace them from where it starts again (observe)
        for seq_id in finished:
            self.pending.pop(seq_id, None)
            self.active.discard(seq_id)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """The step's moves of the target's blocks, done to the head's KV too, in the runner's order."""
        self.pool.commit(out.blocks_high_water)
        moves = out.tier_moves
        if self.tier is not None and moves is not None:
            self.tier.demote(moves.demote)
        self.pool.swap_out(out.swap_out)
        self.pool.swap_in(out.swap_in)
        copy_blocks(self.pool.kv_caches, out.block_copies)
        if self.tier is not None and moves is not None:
            self.tier.promote(moves.promote)

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[int, torch.Tensor], mine) -> None:
        """Keep this step's target hidden states of the sequences ``mine(seq_id)`` says this proposer drafts for."""
        if not all(layer in hidden for layer in self.layers):
            return
        rows = None
        offset = 0
        for item in scheduled:
            n = item.num_new_tokens
            if mine(item.seq_id):
                if item.sample:  # a step that samples says whether the sequence drafts next
                    (self.active.add if item.propose else self.active.discard)(item.seq_id)
                if rows is None:
                    rows = torch.cat([hidden[layer] for layer in self.layers], dim=-1)
                self._append(item.seq_id, item.start, rows[offset : offset + n])
                for child in item.fork_seq_ids:  # the same prompt: the samples start from the parent's rows
                    self.pending[child] = self.pending[item.seq_id].copy()
            offset += n

    def _append(self, seq_id: int, start: int, rows: torch.Tensor) -> None:
        held = self.pending.get(seq_id)
        if held is not None and held.start <= start <= held.end:
            held.truncate(start - held.start)  # drop rows from the rewritten positions on
            held.append(rows)
        else:
            held = self.pending[seq_id] = PendingRows(start, rows)
        if held.length > MAX_PENDING:
            held.drop_front(held.length - MAX_PENDING)

    @torch.inference_mode()
    def settle(self, states, tables) -> None:
        """Catch the head's KV up over the rows finished sequences still hold, in their full blocks (the ones the
        prefix cache keeps). This runs before the step's forward: a block already handed to a new sequence gets
        its head KV rewritten by that sequence's own catch-up before the head reads it."""
        batch, rows = [], []
        for state in states:
            pend, table = self.pending.pop(state.seq_id, None), tables.get(state.seq_id)
            if pend is None or table is None or state.seq_id not in self.active:
                continue  # dormant (the engine stopped drafting at this batch size): no catch-up for the cache
            tokens = state.prompt_token_ids + state.output_token_ids
            start = pend.start
            end = min(pend.end, len(tokens) - 1, len(table) * self.block_size)
            end = end // self.block_size * self.block_size  # full blocks only: a partial one is never cached
            if end <= start:
                continue
            batch.append(ScheduledSequence(state.seq_id, start, tokens[start + 1 : end + 1], [], True))
            rows.append(pend.tensor(end - start))
        if batch:
            self._forward(batch, tables, self.head.feed(torch.cat(rows)))

    @torch.inference_mode()
    def propose(self, states, num_tokens: list[int], tables: dict[int, list[int]]) -> list[list[int]]:
        jobs = []  # (seq id, tokens, k, first head position, target rows)
        for state, k in zip(states, num_tokens):
            table = tables.get(state.seq_id)
            pend = self.pending.get(state.seq_id)
            if table is None or pend is None:
                continue
            tokens = state.prompt_token_ids + state.output_token_ids
            last = len(tokens) - 2  # the newest head position: token n - 1 with the target's state at n - 2
            k = min(k, len(table) * self.block_size - len(tokens) + 1)  # the slots the scheduler set aside
            start = pend.start
            if k <= 0 or start > last or pend.end <= last:
                continue
            del self.pending[state.seq_id]
            jobs.append((state.seq_id, tokens, k, start, pend.tensor(last - start + 1)))
        if not jobs:
            return [[] for _ in states]
        head = self.head
        batch = [ScheduledSequence(seq, start, tokens[start + 1 :], [], True) for seq, tokens, _, start, _ in jobs]
        fed = head.feed(torch.cat([rows for *_, rows in jobs]))
        prenorm = self._forward(batch, tables, fed)  # catch-up; its last row per sequence drafts the first token
        wanted = {seq: k for seq, _, k, _, _ in jobs}
        drafts: dict[int, list[int]] = {seq: [] for seq in wanted}
        while True:
            tokens_now = head.to_target(head.logits(prenorm).argmax(dim=-1)).tolist()
            active = []  # (next one-token item, its row in prenorm)
            for row, (item, token) in enumerate(zip(batch, tokens_now)):
                drafts[item.seq_id].append(token)
                if len(drafts[item.seq_id]) < wanted[item.seq_id]:
                    active.append((ScheduledSequence(item.seq_id, item.seq_len, [token], [], True), row))
            if not active:
                break
            batch = [b for b, _ in active]
            prenorm = self._forward(batch, tables, prenorm[[r for _, r in active]])
        return [drafts.get(state.seq_id, []) for state in states]

    def _forward(self, batch: list[ScheduledSequence], tables: dict[int, list[int]], hidden: torch.Tensor) -> torch.Tensor:
        """The head over ``batch`` (head positions, tokens after them) with ``hidden`` rows; ``prenorm`` at each
        sequence's last row."""
        inputs = self.prepare_batch(batch, self.attention, tables)
        meta = inputs.metadata
        layer = meta.layers[0]
        out = self.head(inputs.input_ids[0], inputs.position_ids[0], hidden,
                        lambda q, k, v: layer(q, k, v, meta))
        return out.index_select(0, inputs.logits_indices)
