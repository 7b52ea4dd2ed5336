"""What every proposer does: draft up to k tokens that likely follow a sequence."""

from __future__ import annotations

from typing import Protocol


class DraftRequest(Protocol):
    """The runner's view of a sequence that will be verified next step."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class Proposer(Protocol):
    relative_cost: float  # forward cost per drafted token over the target's (0: free); drives the idle rule

    def propose(
        self, requests: list[DraftRequest], num_tokens: list[int], tables: dict[int, list[int]]
    ) -> list[list[int]]:
        """Up to ``num_tokens[i]`` draft tokens for each request, following its prompt + output.

        ``tables`` holds each sequence's block table this step (with the slots set aside for drafting).
        """

    def forget(self, finished: list[int], preempted: list[int]) -> None:
        """Drop whatever is kept for finished sequences; preempted ones lost their KV."""
