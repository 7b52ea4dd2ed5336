"""The runner's side of speculative decoding: which proposer drafts for each sequence, and how many tokens.

Proposers are created on demand, one per distinct configuration (an n-gram lookup with given sizes, a draft
model, the target's first N layers), and each request names the one it uses by a key: the engine's
``speculative_config`` by default, or a per-request one (the HF drop-in's ``prompt_lookup_num_tokens`` and
``assistant_model``).

Per request ``k`` is its configuration's ``num_speculative_tokens``, lowered (or 0: off) by
``SamplingParams.num_speculative_tokens``, and capped so a verification can never emit past ``max_tokens``
or ``max_model_len``. It also adapts downward: each sequence keeps an exponential moving average of the
fraction of its drafts accepted (weight 0.3 on the newest verification) and gets ``ceil(2 * k * ema)``
drafts (at most k). Drafting pays only while that fraction beats what a draft token costs: a proposer's
``relative_cost`` is its forward cost per drafted token over the target's (0 for n-gram lookup; about the
draft's matmul parameters over the target's for a draft model), since k drafts gain ``ema * k`` tokens for
``relative_cost * k`` target steps of drafting. Below ``max(0.1, relative_cost)`` a sequence is idle: it
drafts one token every ``8 * (1 + round(4 * relative_cost))`` steps only, to notice when its text turns
predictable again. Idle sequences probe on the same steps (a step counter of the speculator, not one per
sequence): a draft model's forward costs about the same for one sequence as for a few, so scattered probes
would put a draft forward into most steps of a large batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hf_paged.spec_decode.config import SpeculativeConfig


def spec_key(config: SpeculativeConfig) -> str:
    """A name for the proposer a configuration needs (configs that differ only in k share one)."""
    if config.method == "ngram":
        return f"ngram:{config.prompt_lookup_min}:{config.prompt_lookup_max}"
    if config.self_draft_layers is not None:
        return f"self:{config.self_draft_layers}"
    if config.method in ("eagle3", "eagle"):
        return f"{config.method}:{id(config.model) if not isinstance(config.model, str) else config.model}"
    return f"draft:{id(config.model) if not isinstance(config.model, str) else config.model}"


class Speculator:
    def __init__(self) -> None:
        self.proposers: dict[str, object] = {}
        self.step = 0  # proposing steps so far: idle sequences probe together on multiples of their period

    def add(self, key: str, proposer) -> None:
        self.proposers.setdefault(key, proposer)  # a caller thread may add while the loop steps

    def num_drafts(self, state, max_model_len: int, cost: float = 0.0) -> int:
        """Drafts for ``state`` this step; ``cost`` is its proposer's ``relative_cost``."""
        k = state.spec_k
        wanted = state.params.num_speculative_tokens
        if wanted is not None:
            k = min(k, wanted)
        if k > 0 and state.spec_ema < 1.0:
            if state.spec_ema < max(0.1, cost):
                k = 1 if self.step % (8 * (1 + round(4 * cost))) == 0 else 0
            else:
                k = min(k, max(1, math.ceil(2 * k * state.spec_ema)))
        n_out = len(state.output_token_ids)
        num_tokens = len(state.prompt_token_ids) + n_out
        return max(0, min(k, state.params.max_tokens - n_out - 1, max_model_len - num_tokens - 1))

    def propose(
        self, states: Sequence, max_model_len: int, scheduled: Sequence, block_tables: Mapping[int, list[int]],
    ) -> dict[int, list[int]]:
        """Drafts for the next step of each sequence that just got tokens.

        A sequence that forked its samples this step shares its blocks with them: it drafts from the next
        step on (a draft model would write its lookahead KV into the shared blocks).
        """
        self.step += 1
        tables = {item.seq_id: block_tables[item.seq_id] for item in scheduled if not item.fork_seq_ids}
        by_key: dict[str, list] = {}
        for state in states:
            if state.spec_key is None or state.seq_id not in tables:
                continue
            k = self.num_drafts(state, max_model_len, getattr(self.proposers[state.spec_key], "relative_cost", 0.0))
            if k > 0:
                by_key.setdefault(state.spec_key, []).append((state, k))
        drafts: dict[int, list[int]] = {}
        for key, chosen in by_key.items():
            proposed = self.proposers[key].propose([s for s, _ in chosen], [k for _, k in chosen], tables)
            drafts.update({s.seq_id: d[:k] for (s, k), d in zip(chosen, proposed) if d})
        return drafts

    def observe(self, scheduled: Sequence, hidden: Mapping, states: Mapping) -> None:
        """Hand the step's captured target hidden states to the proposers that read them (EAGLE heads), each
        for the sequences it drafts for (``states``: the runner's, by sequence id)."""
        for key, proposer in list(self.proposers.items()):
            observe = getattr(proposer, "observe", None)
            if observe is not None and hidden:
                observe(scheduled, hidden, lambda seq_id, key=key: getattr(states.get(seq_id), "spec_key", None) == key)

    def settle(self, finished: Sequence[int], states: Mapping, tables: Mapping) -> None:
        """Before finished sequences are dropped: proposers with KV of their own that follows the target's
        blocks (EAGLE heads) complete it for the blocks those sequences leave in the prefix cache."""
        for key, proposer in list(self.proposers.items()):
            settle = getattr(proposer, "settle", None)
            if settle is not None:
                settle([states[s] for s in finished if getattr(states.get(s), "spec_key", None) == key], tables)

    def forget(self, finished: Sequence[int], preempted: Sequence[int]) -> None:
        for proposer in list(self.proposers.values()):
            proposer.forget(finished, preempted)

    def move_blocks(self, out) -> None:
        """Proposers with KV of their own apply the step's copy-on-write copies to it too."""
        for proposer in list(self.proposers.values()):
            move = getattr(proposer, "move_blocks", None)
            if move is not None:
                move(out)

    def close(self) -> None:
        for proposer in list(self.proposers.values()):
            close = getattr(proposer, "close", None)
            if close is not None:
                close()
        self.proposers.clear()
