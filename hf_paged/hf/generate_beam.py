"""``generate(num_beams=k)`` in the engine: stock beam search's results, beams sharing KV blocks."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput

from hf_paged.engine.engine_setup import token_id_list
from hf_paged.sampling_params import BeamSearchParams


def fill_token_id(gen_cfg: GenerationConfig) -> int:
    """What stock beam search writes after a finished beam: the pad token when it is nonzero, else the first
    EOS token (stock's ``pad or eos[0]``), and -1 without EOS."""
    eos = token_id_list(gen_cfg.eos_token_id)
    if not eos:
        return -1
    return int(gen_cfg.pad_token_id) if gen_cfg.pad_token_id else eos[0]


def beam_generate(
    engine, gen_cfg: GenerationConfig, prompts: list[list[int]], input_ids: torch.Tensor, max_new: int, min_new: int,
    lora_request=None,
):
    eos = token_id_list(gen_cfg.eos_token_id)
    n_return = gen_cfg.num_return_sequences or 1
    params = BeamSearchParams(
        beam_width=gen_cfg.num_beams,
        max_tokens=max_new,
        length_penalty=float(gen_cfg.length_penalty if gen_cfg.length_penalty is not None else 1.0),
        early_stopping=gen_cfg.early_stopping if gen_cfg.early_stopping is not None else False,
        num_return_sequences=n_return,
        ignore_eos=True,  # the call's eos_token_id replaces the engine's
        stop_token_ids=eos,
        min_tokens=min(min_new, max_new) if eos else 0,
        repetition_penalty=float(gen_cfg.repetition_penalty or 1.0),
    )
    want_scores = bool(gen_cfg.return_dict_in_generate and gen_cfg.output_scores)
    search = engine.start_beam_search(prompts, params, eos_token_ids=(), fill_token_id=fill_token_id(gen_cfg),
                                      keep_scores=want_scores, lora_request=lora_request)
    try:
        engine.run_until(lambda: search.done)
    finally:
        if not search.done:
            engine.abort_beam_search(search)
    search.raise_if_failed()
    generated, sequences_scores, beam_indices = search.outputs(n_return)
    prompt_part = input_ids.cpu().repeat_interleave(n_return, dim=0)
    sequences = torch.cat([prompt_part, generated.to(prompt_part.dtype)], dim=1).to(input_ids.device)
    if not gen_cfg.return_dict_in_generate:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=sequences_scores.to(input_ids.device) if gen_cfg.output_scores else None,
        scores=tuple(s.to(input_ids.device) for s in search.scores) if want_scores else None,
        beam_indices=beam_indices.to(input_ids.device),
    )
