"""Draft-model proposer: a smaller model with the target's vocabulary, or the target's own first N layers,
drafts greedily.

A second model gets a paged KV pool of its own, with the target's block size and number of blocks and
driven by the same block tables and slot mapping, so it needs no memory management of its own: the
scheduler allocates slots ``spec_lookahead`` tokens past each sequence that is about to propose. Its KV is
trusted only up to the tokens it saw when it last proposed (``computed``); each proposal first catches up
on the tokens since (the prompt, accepted drafts, the target's token) in one varlen forward, then runs k-1
more one-token forwards for the whole batch. A preempted sequence lost its blocks, so it starts over.

``"self:N"`` drafts with the target's first N decoder layers and its final norm and head, reading and
writing the target's own KV of those layers: the target's KV is valid for every token it computed, so only
the token just emitted has to be run before drafting, and the target overwrites the drafted positions
when it verifies them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hf_paged.model import patches as model_patches
from hf_paged.core.scheduler_output import ScheduledSequence, SchedulerOutput
from hf_paged.executor.kv_pool import KVPool, copy_blocks, probe_kv_layout
from hf_paged.model.hf_config import text_config

logger = logging.getLogger(__name__)


def truncated_view(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The same model object graph with only its first ``num_layers`` decoder layers (weights shared)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise NotImplementedError(
            f"self-speculative drafting needs a decoder with a 'layers' ModuleList; {type(model).__name__} has none"
        )
    if not 1 <= num_layers < len(layers):
        raise ValueError(f"speculative_config model 'self:{num_layers}' needs 1 <= N < {len(layers)} (the model's layers)")
    new_decoder = _shallow(decoder)
    new_decoder._modules["layers"] = torch.nn.ModuleList(list(layers)[:num_layers])
    view = _shallow(model)
    for name, child in model._modules.items():
        if child is decoder:
            view._modules[name] = new_decoder
            break
    else:
        raise NotImplementedError(f"cannot find the decoder of {type(model).__name__} among its modules")
    return view


def matmul_params(model: torch.nn.Module) -> int:
    """Weights of the linear layers a token runs through (the output head included, tied or not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._modules = dict(module._modules)
    return copy


# (batch, attention layers, tables, model, fast runner) -> logits [N, V] at the batch's sampled rows: the batch
# packed over those layers' KV pool with those block tables (seq id -> block ids) and run through ``model``, on
# the fast runner (the draft's native decode program) where it takes the step, else eagerly
DraftForward = Callable[[list[ScheduledSequence], object, dict[int, list[int]], torch.nn.Module, object], torch.Tensor]
# (draft model, its attention layers) -> (its fast step runner or None, a function giving back what making it took)
DraftRunner = Callable[[torch.nn.Module, object], tuple[object, Callable[[], None]]]


class DraftModelProposer:
    """Greedy drafts from a draft model (see the module docstring).

    Args:
        target: The engine's model.
        target_pool: The engine's KV pool (a draft model's pool copies its format, block size and block count;
            ``self_layers`` drafts in it).
        forward: Runs a draft step (:data:`DraftForward`; the model runner's ``draft_logits``).
        attention_layers: The attention layer objects over a pool, with the engine's backend (the model runner's
            ``attention_layers``; the target's own for None).
        draft: A causal LM with the target's vocabulary; None with ``self_layers``.
        self_layers: Draft with the target's first this-many layers instead.
        max_model_len: The engine's longest sequence; a draft model must handle it.
        announce: Called with ``(batch, tables)`` before each draft forward (a tensor-parallel engine's rank 0
            sends it to the other ranks, whose shards of the ``self_layers`` run the same forward with it).
    """

    def __init__(self, target: torch.nn.Module, target_pool: KVPool, forward: DraftForward, attention_layers,
                 draft: torch.nn.Module | None, self_layers: int | None, max_model_len: int,
                 announce=None, fast_runner: DraftRunner | None = None) -> None:
        self.forward = forward
        self.announce = announce
        self.block_size = target_pool.block_size
        self.shares_target_kv = self_layers is not None
        if self.shares_target_kv:
            self.model = truncated_view(target, self_layers)
            self.kv_caches = target_pool.kv_caches
            self.pool = None
        else:
            _check_compatible(target, draft, max_model_len)
            model_patches.acquire_attention(draft)
            try:
                specs = probe_kv_layout(draft, target_pool.kv_cache_dtype)  # the target's pool format
                self.pool = KVPool(specs, target_pool.num_blocks, target_pool.block_size, target_pool.device)
            except BaseException:
                model_patches.release_attention(draft)
                raise
            self.model = draft
            self.kv_caches = self.pool.kv_caches
            logger.info("draft model %s: KV pool of %.1f MiB", type(draft).__name__, self.pool.total_bytes / 2**20)
        self.attention = attention_layers(self.pool)  # its attention layer objects, with the engine's backend
        self.fast, self._give_back = None, None
        if fast_runner is not None:  # the draft's own native decode program (its steps are decode-sized too)
            try:
                self.fast, self._give_back = fast_runner(self.model, self.attention)
            except BaseException:
                self.close()
                raise
        self.computed: dict[int, int] = {}  # tokens of each sequence whose draft KV is valid
        # forward cost of one drafted token over the target's: the matmul weights each one runs through
        self.relative_cost = matmul_params(self.model) / max(1, matmul_params(target))
        logger.info("draft model costs %.2f of a target forward per token", self.relative_cost)

    def close(self) -> None:
        self.fast = None
        if self._give_back is not None:
            self._give_back()
            self._give_back = None
        if self.pool is not None:
            model_patches.release_attention(self.model)
            self.pool.kv_caches.clear()

    def forget(self, finished, preempted=()) -> None:
        for seq_id in (*finished, *preempted):
            self.computed.pop(seq_id, None)

    def move_blocks(self, out: SchedulerOutput) -> None:
        if self.pool is not None:  # swapped sequences start over (forget); copy-on-write copies apply here too
            self.pool.commit(out.blocks_high_water)
            copy_blocks(self.kv_caches, out.block_copies)

    @torch.inference_mode()
    def propose(self, states, num_tokens: list[int], tables: dict[int, list[int]]) -> list[list[int]]:
        bs = self.block_size
        jobs = []  # (state, tokens, k, table)
        for state, k in zip(states, num_tokens):
            table = tables.get(state.seq_id)
            tokens = state.prompt_token_ids + state.output_token_ids
            if table is None:
                continue
            k = min(k, len(table) * bs - len(tokens) + 1)  # the slots the scheduler set aside
            if k > 0:
                jobs.append((state, tokens, k, table))
        drafts: dict[int, list[int]] = {}
        if not jobs:
            return [[] for _ in states]
        batch = []
        for state, tokens, _, table in jobs:
            start = len(tokens) - 1 if self.shares_target_kv else min(self.computed.get(state.seq_id, 0), len(tokens) - 1)
            batch.append(ScheduledSequence(state.seq_id, start, tokens[start:], [], True))
            self.computed[state.seq_id] = len(tokens)
        last = self._greedy(batch, tables)
        for (state, tokens, k, table), token in zip(jobs, last):
            drafts[state.seq_id] = [token]
        for step in range(1, max(k for _, _, k, _ in jobs)):
            active = [(state, tokens, table) for state, tokens, k, table in jobs if k > step]
            batch = [ScheduledSequence(state.seq_id, len(tokens) - 1 + step, [drafts[state.seq_id][-1]], [], True)
                     for state, tokens, table in active]
            for (state, _, _), token in zip(active, self._greedy(batch, tables)):
                drafts[state.seq_id].append(token)
        return [drafts.get(state.seq_id, []) for state in states]

    def _greedy(self, batch: list[ScheduledSequence], tables: dict[int, list[int]]) -> list[int]:
        if self.announce is not None:
            self.announce(batch, tables)
        return self.forward(batch, self.attention, tables, self.model, self.fast).argmax(dim=-1).tolist()


def _out_rows(head: torch.nn.Module) -> int:
    return getattr(head, "out_features", None) or head.weight.shape[0]  # nn.Linear or QuantLinear


def _check_compatible(target: torch.nn.Module, draft: torch.nn.Module, max_model_len: int) -> None:
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise TypeError(f"speculative_config model must be a transformers model, a folder or 'self:N', got {type(draft).__name__}")
    t_vocab, d_vocab = (_out_rows(m.get_output_embeddings()) for m in (target, draft))
    if t_vocab != d_vocab:
        raise ValueError(f"the draft model's vocabulary ({d_vocab} tokens) differs from the target's ({t_vocab})")
    if next(draft.parameters()).device != next(target.parameters()).device:
        raise ValueError("the draft model must be on the target's device")
    draft_len = getattr(text_config(draft), "max_position_embeddings", None)
    if isinstance(draft_len, int) and draft_len < max_model_len:
        raise ValueError(
            f"the draft model handles {draft_len} positions, fewer than the engine's max_model_len={max_model_len}; "
            "pass a smaller max_model_len or another draft model"
        )
