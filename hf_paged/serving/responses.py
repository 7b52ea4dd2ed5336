"""The OpenAI API's response pieces the server builds: ids, ``usage``, and ``logprobs`` in the chat and completion
shapes (requests are checked in :mod:`hf_paged.serving.protocol`)."""

from __future__ import annotations

import uuid


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _ranked(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]] | None, k: int) -> dict | None:
    """``choices[].logprobs`` of a chat completion (``{"content": [{token, logprob, bytes, top_logprobs}]}``)."""
    if logprobs is None:
        return None
    content = []
    for token, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token)
        content.append({
            "token": text, "logprob": entry[token], "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := token_text(tokenizer, tid)), "logprob": lp, "bytes": list(t.encode())}
                             for tid, lp in _ranked(entry, k)],
        })
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]] | None, k: int,
                        offset: int = 0) -> dict | None:
    """``choices[].logprobs`` of a completion (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token)
        tokens.append(text)
        values.append(entry[token])
        tops.append({token_text(tokenizer, tid): lp for tid, lp in _ranked(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
