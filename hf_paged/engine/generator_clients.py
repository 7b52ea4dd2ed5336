"""The consuming side of :class:`~hf_paged.engine.generator.PagedGenerator`: batch ``generate``, streams, queued outputs
and beam search.

A mixin: these methods drive the engine through its ``step`` and read what the step loop queued per request
(``outputs``, ``_finished_states``); the engine's state and its step loop stay in ``generator.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from hf_paged.engine.beam_search import BeamSearch, BeamSearchOutput
from hf_paged.engine.engine_setup import as_prompt_list, per_prompt, token_ids
from hf_paged.engine.detokenizer import DeltaTracker, delta_output
from hf_paged.outputs import RequestOutput
from hf_paged.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from hf_paged.engine.generator import Prompt
    from hf_paged.engine.output_processor import RequestState
    from hf_paged.lora.request import LoRARequest


class GeneratorClients:
    """The methods that drive ``PagedGenerator`` as its clients: streams, queued outputs, beam search."""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] = 0,
        lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt as one continuous batch; outputs come back in input order.

        Args:
            prompts: A str, a list of str, a list of token ids, a 1-D tensor or NumPy array (one prompt), or a
                list of token-id lists, tensors or arrays.
            sampling_params: One SamplingParams for all prompts, or one per prompt. Default: SamplingParams().
            use_tqdm: Show a progress bar of finished requests.
            priority: One priority for all prompts, or one per prompt (``scheduling_policy="priority"``).
            lora_request: One LoRA adapter for all prompts, or one per prompt (None: the base model), with
                ``enable_lora=True``; rows of different adapters run in the same batch.
        """
        prompt_list = as_prompt_list(prompts)
        params_list = per_prompt(sampling_params, len(prompt_list), "sampling params")
        priorities = per_prompt(priority, len(prompt_list), "priorities")
        loras = per_prompt(lora_request, len(prompt_list), "lora requests")
        with self._lock:  # every prompt is validated before any is admitted
            made = [self._make_request(p, sp, None, prio, lora_request=lr)
                    for p, sp, prio, lr in zip(prompt_list, params_list, priorities, loras)]
            for request, state in made:
                state.final_only = True  # read below, once finished: no output per step
                self._admit(request, state, queue_outputs=True)
        ids = [state.request_id for _, state in made]
        states = [state for _, state in made]
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            done = 0
            while done < len(states):
                if not all(s.finished for s in states):
                    self.step()
                now_done = sum(s.finished for s in states)
                bar.update(now_done - done)
                done = now_done
        finally:
            bar.close()
            for rid, s in zip(ids, states):
                if not s.finished:
                    self.abort(rid)
        results = [self.outputs.output(s) for s in states]
        for rid in ids:
            self._finished_states.pop(rid, None)
        return results

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield a request's output as it grows: each item carries only the new token ids and text.

        While no other thread steps the engine, the loop drives it itself (other queued requests progress
        too). Every item produced for the request arrives, whoever ran the step. Closing the iterator early
        aborts the request; an abort from elsewhere ends the stream with a ``finish_reason="abort"`` item.
        ``lora_request``: a LoRA adapter for it (``enable_lora``), or None.
        """
        with self._lock:
            request, state = self._make_request(prompt, sampling_params, request_id, priority, lora_request=lora_request)
            self._admit(request, state, queue_outputs=True)
        rid = state.request_id
        params = request.sampling_params
        # Text that could still turn out to be the start of a stop string is held back until it cannot.
        hold = max((len(s) - 1 for s in params.stop or ()), default=0)
        deltas = [DeltaTracker(self.tokenizer, hold) for _ in range(state.n)]
        try:
            while True:
                item = self._next_output(state)
                yield delta_output(item, deltas)
                if item.finished:
                    return
        finally:
            if not state.finished:
                self.abort(rid)

    def next_output(self, request_id: str) -> RequestOutput:
        """The next queued output of a request added with ``queue_outputs=True``, stepping the engine while
        none is queued."""
        state = self.outputs.state_of(request_id) or self._finished_states.get(request_id)
        if state is None or state.queue is None:
            raise ValueError(f"request {request_id!r} is unknown or was not added with queue_outputs=True")
        return self._next_output(state)

    def poll(self, request_id: str) -> list[RequestOutput]:
        """Every output queued for a request (added with ``queue_outputs=True``) since the last read."""
        state = self.outputs.state_of(request_id) or self._finished_states.get(request_id)
        if state is None or state.queue is None:
            return []
        with self.outputs.ready:
            items = list(state.queue)
            state.queue.clear()
        if items and items[-1].finished:
            self._finished_states.pop(request_id, None)
        return items

    def _next_output(self, state: RequestState) -> RequestOutput:
        while True:
            with self.outputs.ready:
                if state.queue:
                    item = state.queue.popleft()
                    if item.finished:
                        self._finished_states.pop(state.request_id, None)
                    return item
            with self._lock:
                if not state.queue:
                    self.step()

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (stock ``generate(num_beams=...)`` semantics), beams sharing blocks.

        All prompts are searched in lockstep inside the engine's continuous batch; other requests keep
        running beside them. ``lora_request``: every beam of every prompt runs with this LoRA adapter
        (``enable_lora``; one adapter per search), None: the base model.
        """
        params = BeamSearchParams() if params is None else params
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_ids = [token_ids(p, self.tokenizer, self.vocab_size)[0] for p in as_prompt_list(prompts)]
        search = self.start_beam_search(prompt_ids, params, lora_request=lora_request)
        self.run_until(lambda: search.done)
        search.raise_if_failed()
        return search.results(params.num_return_sequences, self.tokenizer)

    def start_beam_search(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Sequence[int] | None = None,
        fill_token_id: int | None = None, keep_scores: bool = False, lora_request: LoRARequest | None = None,
    ) -> BeamSearch:
        """Admit a beam search over token-id prompts; the engine's steps advance it (``search.done``).

        One LoRA adapter (or none) for the whole search: its beams wait in lockstep for each other, so prompts of
        more distinct adapters than ``max_loras`` could wait for each other forever."""
        if isinstance(lora_request, (list, tuple)):
            raise TypeError("beam search takes one lora_request for all its prompts (or None), not a list; run one "
                            "search per adapter")
        if params.structured_outputs is not None:  # compiled before the lock, as for sampled requests
            params = self.prepare_structured(params)
        grammar = params.structured_outputs
        with self._lock:
            self._check_usable()
            eos = self.eos_token_ids if eos_token_ids is None else frozenset(eos_token_ids)
            if fill_token_id is None:
                fill_token_id = min(eos) if eos else 0
            for prompt in prompts:
                if len(prompt) + params.max_tokens > self.max_model_len:
                    raise ValueError(
                        f"beam search of {params.max_tokens} tokens after a {len(prompt)}-token prompt exceeds "
                        f"max_model_len={self.max_model_len}"
                    )
            lora_id = self._lora_id(lora_request)
            search = BeamSearch(prompts, params, eos, fill_token_id, f"beam{next(self._ids)}", self.scheduler.next_seq_id,
                                keep_scores, grammar=grammar, lora_int_id=lora_id)
            for request in search.prompt_requests:
                self.scheduler.check_request(request)
            for request in search.prompt_requests:
                self.scheduler.add_request(request)
            self._beam_searches.append(search)
            return search

    def abort_beam_search(self, search: BeamSearch) -> None:
        with self._lock:
            self._abort_beam_search(search)

    def _abort_beam_search(self, search: BeamSearch) -> None:
        for seq_id in search.abort():
            self.scheduler.abort_request(seq_id)
        if search in self._beam_searches:
            self._beam_searches.remove(search)

    def run_until(self, done) -> None:
        """Step the engine until ``done()`` holds."""
        while not done():
            self.step()

    def scores_of(self, request_id: str) -> dict[int, list] | None:
        """Processed logits rows per sample index of a request added with ``return_scores=True``."""
        state = self.outputs.state_of(request_id) or self._finished_states.get(request_id)
        return None if state is None else state.scores
