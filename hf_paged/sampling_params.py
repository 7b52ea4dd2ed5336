"""Per-request sampling parameters (pure Python: the scheduling layer reads them too)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        max_tokens: Maximum number of tokens to generate (>= 1).
        temperature: Softmax temperature (>= 0); 0 means greedy (argmax).
        top_k: Keep only the k most likely tokens; 0 disables.
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1].
        min_p: Drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1].
        seed: Seed of this request's own random generator: the same seed gives the same tokens whatever
            else is in the batch.
        stop_token_ids: Extra token ids that end the request (the token is kept in the output).
        ignore_eos: Do not stop at the model's end-of-sequence token(s).
        min_tokens: Stop tokens (EOS and ``stop_token_ids``) cannot be produced before this many tokens.
        repetition_penalty: Divide positive (multiply negative) logits of every token already in the prompt
            or the output by this (HF semantics); 1.0 disables, > 0.
        stop: Strings that end the request when the generated text contains one; ``RequestOutput.text``
            stops before it (the tokens are kept). Needs a tokenizer.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be >= 0 (0 = greedy) and finite, got {self.temperature}")
        _check_int("top_k", self.top_k, 0)
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
            for tok in self.stop_token_ids:
                _check_int("stop_token_ids entry", tok, 0)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if isinstance(self.stop, bytes) or not hasattr(self.stop, "__iter__"):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
            self.stop = list(self.stop)
            for text in self.stop:
                if not isinstance(text, str) or not text:
                    raise ValueError(f"stop strings must be non-empty str, got {text!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
