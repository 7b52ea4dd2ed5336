"""Beam search inside the engine, with stock ``generate(num_beams=...)`` semantics.

A :class:`BeamSearch` drives one batch of prompts in lockstep, exactly as transformers' ``_beam_search``
does (same candidate count, stopping rules, length penalty and early-stopping heuristic, the same tensor
operations in the same order, so the same ties break the same way). Each running beam is an engine
sequence: its log-prob row comes back from the runner, and when all rows of a step are in, the search picks
the next beams and returns them as a :class:`~hf_paged.core.scheduler_output.BeamUpdate` that the scheduler
applies: a beam continued by several new beams is forked (the new ones share its blocks, copy-on-write on
their next write); a beam continued by none is freed at once. The search holds sequence ids, not sequences.

Rows that finish early keep running until the whole batch stops, because stock beam search does the same
and its global stop condition depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hf_paged.core.scheduler_output import BeamUpdate
from hf_paged.core.sequence import Sequence
from hf_paged.sampling_params import BeamSearchParams, SamplingParams
from hf_paged.structured_params import CONSTRAINT_ERROR, dead_end_message

NEG = -1.0e9  # stock beam search's "impossible" score


@dataclass
class BeamSearchSequence:
    """One finished beam: its generated tokens and its score (``sum_logprobs / len ** length_penalty``)."""

    token_ids: list[int]
    score: float
    finish_reason: str  # "stop" (ended with a stop token) or "length"
    text: str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``num_return_sequences`` beams of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


def _gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


class BeamSearch:
    """One batch of prompts searched together.

    Args:
        prompts: Token ids of each prompt (no padding).
        params: Beam settings.
        eos_token_ids: Tokens that finish a beam (with ``params.stop_token_ids``), unless ``ignore_eos``.
        fill_token_id: Written after a finished beam's last token (stock: the pad token, else EOS).
        request_id: Base of the internal request ids.
        new_seq_id: Gives the id of a forked beam (the scheduler's sequence ids).
        keep_scores: Keep each step's processed log-probs (HF ``output_scores``).
        grammar: The compiled structured output every beam follows (``BeamSearchParams.structured_outputs``
            after the engine compiled it); the runner masks each beam's row with its own matcher.
        lora_int_id: The LoRA adapter every beam runs with (0: the base model); forked beams inherit it.
    """

    def __init__(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        eos_token_ids: frozenset[int],
        fill_token_id: int,
        request_id: str,
        new_seq_id,
        keep_scores: bool = False,
        device: torch.device | str = "cpu",
        grammar=None,
        lora_int_id: int = 0,
    ) -> None:
        self.prompts = prompts
        self.params = params
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops |= set(eos_token_ids)
        self.stop_ids = torch.tensor(sorted(stops), dtype=torch.long) if stops else None
        B, K, M = len(prompts), params.beam_width, params.max_tokens
        self.B, self.K, self.M = B, K, M
        self.beams_to_keep = max(2, 1 + (len(stops) if stops else 0)) * K
        self.top_num_beam_mask = torch.cat((torch.ones(K, dtype=torch.bool), torch.zeros(self.beams_to_keep - K, dtype=torch.bool)))
        self.running_sequences = torch.full((B, K, M), fill_token_id, dtype=torch.long)
        self.sequences = self.running_sequences.clone()
        self.running_beam_scores = torch.zeros(B, K)
        self.running_beam_scores[:, 1:] = NEG
        self.beam_scores = torch.full((B, K), NEG)
        self.is_sent_finished = torch.zeros(B, K, dtype=torch.bool)
        self.unsatisfied = torch.ones(B, 1, dtype=torch.bool)
        self.running_beam_indices = torch.full((B, K, M), -1, dtype=torch.int32)
        self.beam_indices = self.running_beam_indices.clone()
        self.batch_offset = torch.arange(B).view(-1, 1) * K
        self.t = 0  # tokens generated so far
        self.done = False
        self.error: str | None = None  # why the search failed (a failed engine step), if it did
        self.scores: list[torch.Tensor] | None = [] if keep_scores else None
        self.grammar_kind = grammar.kind if grammar is not None else None
        # Beams never stop by themselves: the search finishes them. Greedy params keep the runner from sampling.
        # With a grammar (compiled: ``grammar.compiled``), each beam's matcher ends at the search's stop tokens.
        if grammar is not None:
            engine_copy, grammar = grammar, replace(grammar)  # this search's copy (replace drops compiled)
            grammar.compiled, grammar.token_mask = engine_copy.compiled, engine_copy.token_mask
            grammar.stop_token_ids = frozenset(stops)
        seq_params = SamplingParams(max_tokens=M + 1, temperature=0.0, ignore_eos=True, structured_outputs=grammar)
        self.prompt_requests = []
        for b, prompt in enumerate(prompts):
            request = Sequence(f"{request_id}-beam{b}", prompt, seq_params, lora_int_id=lora_int_id)
            request.is_beam = True
            self.prompt_requests.append(request)
        self._new_seq_id = new_seq_id
        self._running: list[list[int]] | None = None  # seq ids of beam k of row b (prompts' ids until the first step)
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def running(self) -> list[list[int]]:
        """The running beams' sequence ids, ``[B][K]`` (a prompt's sequence until its first token)."""
        if self._running is None:
            return [[r.seq_id] * self.K for r in self.prompt_requests]
        return self._running

    # -- the engine's side ------------------------------------------------------------------------
    def waiting_for(self) -> set[int]:
        return {seq_id for row in self.running for seq_id in row}

    def add_rows(self, rows: dict[int, torch.Tensor]) -> BeamUpdate | None:
        """Take this step's log-prob rows; once every running beam has one, advance and return what the
        scheduler must do (``done`` tells whether the search finished)."""
        wanted = self.waiting_for()
        for seq_id, row in rows.items():
            if seq_id in wanted and seq_id not in self._rows:  # a recomputed beam repeats its row: keep the first
                self._rows[seq_id] = row
        if not self.done and len(self._rows) == len(wanted):
            return self._advance()
        return None

    def abort(self) -> list[int]:
        """End the search; the sequence ids the engine must abort."""
        self.done = True
        return sorted(self.waiting_for())

    def raise_if_failed(self) -> None:
        if self.error is not None:
            kind = ValueError if self.error.startswith(CONSTRAINT_ERROR) else RuntimeError  # the request's fault
            raise kind(f"beam search failed: {self.error}")

    # -- one step of stock beam search ------------------------------------------------------------
    def _processed_log_probs(self) -> torch.Tensor:
        B, K = self.B, self.K
        log_probs = torch.stack([self._rows[seq_id] for row in self.running for seq_id in row]).cpu()
        self._rows.clear()
        p = self.params
        if p.repetition_penalty != 1.0:  # HF's RepetitionPenaltyLogitsProcessor, on log-probs as in stock
            for i in range(B * K):
                b, k = divmod(i, K)
                seen = torch.tensor(self.prompts[b] + self.running_sequences[b, k, : self.t].tolist())
                picked = log_probs[i].gather(0, seen)
                picked = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
                log_probs[i].scatter_(0, seen, picked)
        if self.t < p.min_tokens and self.stop_ids is not None:
            log_probs[:, self.stop_ids] = float("-inf")
        return log_probs

    def _advance(self) -> BeamUpdate:
        B, K, t = self.B, self.K, self.t
        log_probs = self._processed_log_probs()  # [B * K, V]
        if self.scores is not None:
            self.scores.append(log_probs.clone())
        vocab = log_probs.shape[-1]
        acc = (log_probs.view(B, K, vocab) + self.running_beam_scores[:, :, None]).reshape(B, K * vocab)
        if self.grammar_kind is not None:  # every beam of an open prompt in a grammar dead end: nothing valid
            stuck = torch.isneginf(acc).all(dim=1) & self.unsatisfied[:, 0] & ~self.is_sent_finished.any(dim=1)
            if bool(stuck.any()):
                self.error = dead_end_message(self.grammar_kind, t)
                return BeamUpdate(frees=self.abort())

        # top continuations over all beams of each row
        topk_log_probs, topk_indices = torch.topk(acc, k=self.beams_to_keep)
        topk_beam = topk_indices // vocab
        topk_ids = topk_indices % vocab
        topk_running_sequences = _gather(self.running_sequences, topk_beam)
        topk_running_sequences[:, :, t] = topk_ids
        topk_running_beam_indices = _gather(self.running_beam_indices, topk_beam)
        topk_running_beam_indices[:, :, t] = (topk_beam + self.batch_offset).to(torch.int32)

        # which continuations stop (a stop token, or the length limit)
        hits = torch.full_like(topk_ids, t + 1 >= self.M, dtype=torch.bool)
        if self.stop_ids is not None:
            hits |= torch.isin(topk_ids, self.stop_ids)

        # the best K that go on
        topk_running_log_probs = topk_log_probs + hits.to(torch.float32) * NEG
        next_topk = torch.topk(topk_running_log_probs, k=K)[1]
        self.running_sequences = _gather(topk_running_sequences, next_topk)
        self.running_beam_scores = _gather(topk_running_log_probs, next_topk)
        self.running_beam_indices = _gather(topk_running_beam_indices, next_topk)

        # the best K finished so far
        p = self.params
        did_top_finish = hits & self.top_num_beam_mask[None, :]
        finished_scores = topk_log_probs / ((t + 1) ** p.length_penalty)
        rows_full = torch.all(self.is_sent_finished, dim=-1, keepdim=True) & (p.early_stopping is True)
        finished_scores += rows_full.to(torch.float32) * NEG
        finished_scores += (~self.unsatisfied).to(torch.float32) * NEG
        finished_scores += (~did_top_finish) * NEG
        merged_sequences = torch.cat((self.sequences, topk_running_sequences), dim=1)
        merged_scores = torch.cat((self.beam_scores, finished_scores), dim=1)
        merged_indices = torch.cat((self.beam_indices, topk_running_beam_indices), dim=1)
        merged_finished = torch.cat((self.is_sent_finished, did_top_finish), dim=1)
        best = torch.topk(merged_scores, k=K)[1]
        self.sequences = _gather(merged_sequences, best)
        self.beam_scores = _gather(merged_scores, best)
        self.beam_indices = _gather(merged_indices, best)
        self.is_sent_finished = _gather(merged_finished, best)

        self.t = t = t + 1
        best_len = self.M if p.early_stopping == "never" and p.length_penalty > 0.0 else t
        best_possible = self.running_beam_scores[:, :1] / (best_len ** p.length_penalty)
        worst_finished = torch.where(
            self.is_sent_finished, torch.min(self.beam_scores, dim=1, keepdim=True)[0], NEG
        )
        self.unsatisfied = self.unsatisfied & torch.any(best_possible > worst_finished, dim=-1, keepdim=True)
        open_beams = not (bool(torch.all(self.is_sent_finished)) and p.early_stopping is True)
        go_on = bool(torch.any(self.unsatisfied)) and open_beams and not bool(torch.all(hits))
        if go_on:
            return self._move_beams(t - 1)
        return BeamUpdate(frees=self.abort())

    def _move_beams(self, t: int) -> BeamUpdate:
        """New beam k of row b continues old beam ``parent``: in place for its first continuation, forked
        (sharing its blocks) for the others; old beams nobody continues are freed."""
        parents = (self.running_beam_indices[:, :, t] - self.batch_offset).tolist()
        tokens = self.running_sequences[:, :, t].tolist()
        update = BeamUpdate()
        new_running = []
        for b in range(self.B):
            used: set[int] = set()
            row = []
            for k in range(self.K):
                parent = self.running[b][parents[b][k]]
                if parent in used:
                    child = self._new_seq_id()
                    update.continues.append((parent, tokens[b][k], child, k))
                    row.append(child)
                else:
                    used.add(parent)
                    update.continues.append((parent, tokens[b][k], None, k))
                    row.append(parent)
            update.frees.extend(old for old in dict.fromkeys(self.running[b]) if old not in used)
            new_running.append(row)
        self._running = new_running
        return update

    # -- results ----------------------------------------------------------------------------------
    def outputs(self, num_return_sequences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stock's final tensors: ``sequences [B * n, new]`` (generated part, cropped to the longest kept
        beam), ``sequences_scores [B * n]`` and ``beam_indices [B * n, new]``."""
        n = num_return_sequences
        sequences = self.sequences[:, :n].reshape(self.B * n, self.M)
        scores = self.beam_scores[:, :n].reshape(self.B * n)
        indices = self.beam_indices[:, :n].reshape(self.B * n, self.M)
        length = int((indices + 1).bool().sum(dim=1).max())
        return sequences[:, :length], scores, indices[:, :length]

    def results(self, num_return_sequences: int, tokenizer=None) -> list[BeamSearchOutput]:
        sequences, scores, indices = self.outputs(num_return_sequences)
        lengths = (indices + 1).bool().sum(dim=1).tolist()
        out = []
        for b, prompt in enumerate(self.prompts):
            beams = []
            for j in range(b * num_return_sequences, (b + 1) * num_return_sequences):
                ids = sequences[j, : lengths[j]].tolist()
                stopped = self.stop_ids is not None and bool(ids) and ids[-1] in set(self.stop_ids.tolist())
                text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
                beams.append(BeamSearchSequence(ids, float(scores[j]), "stop" if stopped else "length", text))
            out.append(BeamSearchOutput(prompt, beams))
        return out
