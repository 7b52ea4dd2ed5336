"""Request fields this server does not honour: a 400 naming the field when it would change the output.

OpenAI's and vLLM's request fields that change what is generated, and that this server does not implement,
are refused unless they hold their neutral value; a client that relies on one never gets a silent 200.
Fields accepted and ignored on purpose (they change nothing generated): ``user``, ``metadata``, ``store``,
``service_tier``, ``prediction`` (a speed hint), ``guided_decoding_backend`` ("xgrammar" / "auto"),
``skip_special_tokens`` true and ``spaces_between_special_tokens`` true (what the server does anyway).
"""

from __future__ import annotations

from typing import Any

from hf_paged.serving.api_error import APIError

# field -> the values that change nothing (anything else is a 400)
_BOTH: dict[str, tuple] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "early_stopping": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "prompt_logprobs": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "min_p_tokens": (None,),
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),
}
_CHAT: dict[str, tuple] = {
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None, []),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}


def check_unhonoured(body: dict[str, Any], kind: str) -> None:
    """Raise a 400 (``APIError``) naming the first field that would change the output and is not honoured."""
    table = {**_BOTH, **_CHAT} if kind == "chat" else _BOTH
    for name, neutral in table.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise APIError(f"{name} is not supported by this server (it would change the output); leave it out",
                           param=name, code="unsupported_parameter")
