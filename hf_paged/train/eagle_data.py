"""Training data for an EAGLE-3 head: text the target writes itself, and its hidden states over that text.

The engine answers prompts (the shipped ones or a JSONL file), alternating greedy and sampled answers, until the
answers hold the tokens asked for. One plain forward of the target over each prompt + answer then records what
the head learns from: the outputs of the head's three layers (its input) and the target's final hidden state
(its soft targets: the target's logits restricted to the draft vocabulary), kept in fp16.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_TOPICS = ("the ocean", "volcanoes", "bread", "the moon", "chess", "rainforests", "bicycles", "trains", "music",
           "gardening", "the weather", "honey bees", "mountains", "computers", "friendship", "the desert", "coffee",
           "dinosaurs", "rivers", "photography", "the stars", "cooking pasta", "recycling", "birds", "libraries")
_TASKS = ("Write a short paragraph about {}.", "Explain {} to a ten-year-old.", "Give three facts about {}.",
          "Write a short poem about {}.", "What are the pros and cons of {}?", "Describe a day spent with {}.",
          "Summarize the history of {} in a few sentences.", "Write a list of tips about {}.")


def shipped_prompts() -> list[list[dict]]:
    """The prompts the trainer ships: chat conversations of one user turn, topic x task (200)."""
    return [[{"role": "user", "content": task.format(topic)}] for task in _TASKS for topic in _TOPICS]


def read_prompts(path: str) -> list:
    """Prompts from a JSONL file: each line ``{"messages": [...]}``, ``{"prompt": "..."}`` or a JSON string."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e}") from None
            if isinstance(item, dict) and isinstance(item.get("messages"), list):
                prompts.append(item["messages"])
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                prompts.append(item["prompt"])
            elif isinstance(item, str):
                prompts.append(item)
            else:
                raise ValueError(f"{path}:{number}: expected {{\"messages\": [...]}}, {{\"prompt\": \"...\"}} or a string")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def encode(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt: a conversation through the chat template, text as it is, ids unchanged."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; without one give token-id lists")
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
        prompt = "\n".join(m["content"] for m in prompt)
    return tokenizer(prompt)["input_ids"]


def generate_texts(model, tokenizer, prompts: list, tokens: int, max_tokens: int, seed: int,
                   engine_kwargs: dict | None = None, greedy_first: bool = False) -> list[list[int]]:
    """Prompt + answer token ids from the engine until the answers hold ``tokens`` tokens (greedy and sampled
    at temperature 0.8 in turn, cycling through ``prompts`` with new seeds). ``greedy_first``: the first pass
    over the prompts answers all of them greedily (the answers a greedy benchmark sees), later passes sample
    (greedy answers would repeat)."""
    from hf_paged import PagedGenerator, SamplingParams

    ids = [encode(tokenizer, p) for p in prompts]
    engine = PagedGenerator(model, tokenizer, **(engine_kwargs or {}))
    texts: list[list[int]] = []
    total, round_ = 0, 0
    try:
        while total < tokens:
            greedy = [(round_ == 0) if greedy_first else (i + round_) % 2 == 0 for i in range(len(ids))]
            params = [SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy[i] else 0.8,
                                     seed=seed + round_ * len(ids) + i) for i in range(len(ids))]
            for prompt, out in zip(ids, engine.generate(ids, params, use_tqdm=False)):
                if out.token_ids and total < tokens:
                    texts.append(prompt + list(out.token_ids))
                    total += len(out.token_ids)
            round_ += 1
            logger.info("EAGLE training text: %d of %d tokens", min(total, tokens), tokens)
    finally:
        engine.close()
    return texts


def draft_vocabulary(texts: list[list[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the texts (then the lowest ids), sorted: draft id -> target id."""
    size = min(size, vocab_size)
    counts = Counter(t for text in texts for t in text)
    chosen = [t for t, _ in counts.most_common(size)]
    if len(chosen) < size:
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


@dataclass
class Record:
    """One text and the target's states over it (fp16)."""

    tokens: torch.Tensor  # [n] long
    aux: torch.Tensor  # [n, 3 * H]: the head's three layers' outputs
    final: torch.Tensor  # [n, H]: the target's last hidden state after its final norm (its logits' input)


@torch.no_grad()
def target_states(model, tokens: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux [n, 3H], final [n, H])`` of one plain forward of the decoder over ``tokens``: the outputs of decoder
    layers ``layers`` (concatenated in that order) and the last hidden state after the final norm.

    Hooks on the layers live for this one forward only (``output_hidden_states`` would make transformers keep
    hooks on the decoder layers, and the CPU native decode program declines a model with hooks)."""
    from hf_paged.executor.step_runners import decoder_layers

    outputs: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, out):
            outputs[i] = (out[0] if isinstance(out, tuple) else out)[0]
        return hook

    device = next(model.parameters()).device
    handles = [decoder_layers(model)[i].register_forward_hook(keep(i)) for i in set(layers)]
    try:
        final = model.get_decoder()(input_ids=torch.tensor([tokens], device=device), use_cache=False).last_hidden_state[0]
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat([outputs[i] for i in layers], dim=-1), final


def record(model, texts: list[list[int]], layers: tuple[int, ...]) -> list[Record]:
    """The target's states over each text (one plain forward each), kept in fp16 on the CPU."""
    out = []
    for text in texts:
        aux, final = target_states(model, text, layers)
        out.append(Record(torch.tensor(text), aux.half().cpu(), final.half().cpu()))
    return out
