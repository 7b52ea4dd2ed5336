"""Per-request sampling parameters (pure Python: the scheduling layer reads them too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from hf_paged.structured_params import StructuredOutputsParams

# Temperatures below this mean greedy (vLLM's convention): dividing logits by a denormal overflows them.
SAMPLING_EPS = 1e-5
MAX_SEED = 2**64 - 1  # what a torch.Generator accepts


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_stop_token_ids(value: object) -> list[int] | None:
    """None, or ``value`` as a list of non-negative ints (any iterable of them but a str or bytes)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"stop_token_ids must be a list of ints, got {value!r}")
    ids = list(value)
    for tok in ids:
        _check_int("stop_token_ids entry", tok, 0)
    return ids


# float32's smallest normal and largest values: a penalty outside them becomes 0 or inf in the logits' dtype,
# and 0 turns a masked logit (-inf * 0) into NaN
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


def _check_penalty(value: float) -> None:
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(
            f"repetition_penalty must be > 0 and finite in float32 (from {FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g}), "
            f"got {value}"
        )


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


def _check_callables(name: str, value: object) -> list[Callable] | None:
    """None or a list of callables (a ``LogitsProcessorList`` is a list; a bare callable is refused)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of callables, got {value!r} ({type(value).__name__})")
    items = list(value)
    for item in items:
        if not callable(item):
            raise TypeError(f"{name} entries must be callable (input_ids, scores), got {item!r} ({type(item).__name__})")
    return items or None


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    Args:
        max_tokens: Maximum number of tokens to generate (>= 1).
        temperature: Softmax temperature (>= 0); 0, and anything below 1e-5, means greedy (argmax).
        top_k: Keep only the k most likely tokens; 0 disables; a k larger than the vocabulary keeps every
            token (clamped to the vocabulary size).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1].
        min_p: Drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1].
        seed: Seed of this request's own random generator, in [0, 2**64 - 1] (with ``n`` samples, ``seed + n -
            1`` must be too): the same seed gives the same tokens whatever else is in the batch.
        stop_token_ids: Extra token ids that end the request (the token is kept in the output).
        ignore_eos: Do not stop at the model's end-of-sequence token(s).
        min_tokens: Stop tokens (EOS and ``stop_token_ids``) cannot be produced before this many tokens.
        repetition_penalty: Divide positive (multiply negative) logits of every token already in the prompt
            or the output by this (HF semantics); 1.0 disables, > 0.
        stop: Strings that end the request when the generated text contains one; ``RequestOutput.text``
            stops before it (the tokens are kept). Needs a tokenizer.
        n: Number of samples of the prompt (>= 1). The prompt is prefilled once; the samples then share its
            KV blocks until they diverge (copy-on-write). With ``seed``, sample ``i`` uses ``seed + i``.
        logprobs: When set (>= 0), each generated token comes with its log-probability under the model
            and the ``logprobs`` most likely alternatives (``CompletionOutput.logprobs``).
        num_speculative_tokens: With speculative decoding on, lowers this request's drafts per step (0: this
            request does not speculate); None: the engine's.
        structured_outputs: Constrain the output to a JSON schema, any JSON object, a regex, a choice of
            strings or an EBNF grammar (:class:`StructuredOutputsParams`, or a dict of its fields). Needs the
            engine's tokenizer and ``pip install 'hf-paged[structured]'``.
        logits_processors: Callables with HF's ``LogitsProcessor`` signature, ``(input_ids: LongTensor [1, L],
            scores: FloatTensor [1, V]) -> FloatTensor [1, V]``, applied in order to this sequence's logits row
            after ``repetition_penalty`` and the ``min_tokens`` stop-token ban and before temperature, top-k,
            top-p and min-p (HF's order); ``input_ids`` is the prompt + the tokens generated so far. Each is
            called once per generated token per sequence, in order (``n`` samples share the objects). A request
            with processors does not speculate.
        stopping_criteria: Callables with HF's ``StoppingCriteria`` signature, ``(input_ids: LongTensor [1, L],
            scores: FloatTensor [1, V]) -> BoolTensor [1]`` (or a bool), called after each generated token with
            ``input_ids`` ending with it and ``scores`` the logits row it was picked from (fp32, before any
            processing); True ends the sequence (``finish_reason="stop"``, the token kept). A request with
            criteria does not speculate.
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
    n: int = 1
    logprobs: int | None = None
    num_speculative_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logits_processors: list[Callable] | None = field(default=None)
    stopping_criteria: list[Callable] | None = field(default=None)

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
            _check_int("seed", self.seed, 0, MAX_SEED)
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        _check_penalty(self.repetition_penalty)
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if isinstance(self.stop, bytes) or not hasattr(self.stop, "__iter__"):
                raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
            self.stop = list(self.stop)
            for text in self.stop:
                if not isinstance(text, str) or not text:
                    raise ValueError(f"stop strings must be non-empty str, got {text!r}")

        _check_int("n", self.n, 1)
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed + n - 1 must be <= {MAX_SEED} (sample i uses seed + i), got seed={self.seed}, n={self.n}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.logits_processors = _check_callables("logits_processors", self.logits_processors)
        self.stopping_criteria = _check_callables("stopping_criteria", self.stopping_criteria)

    @property
    def has_hooks(self) -> bool:
        """Whether Python callables (logits processors, stopping criteria) run for this request each token."""
        return bool(self.logits_processors or self.stopping_criteria)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass
class BeamSearchParams:
    """Beam search settings (HF ``generate(num_beams=...)`` semantics).

    Args:
        beam_width: Beams kept per prompt (>= 1).
        max_tokens: Most tokens generated per beam (>= 1).
        length_penalty: Finished beams are ranked by ``sum_logprobs / generated_len ** length_penalty``.
        early_stopping: True: stop a prompt once ``beam_width`` beams finished; False: stop once no running
            beam can still beat the finished ones (HF's heuristic); "never": the exact canonical test.
        num_return_sequences: Finished beams returned per prompt (<= beam_width).
        ignore_eos: Never finish a beam at the end-of-sequence token.
        stop_token_ids: Extra tokens that finish a beam.
        min_tokens: Stop tokens are forbidden before this many generated tokens.
        repetition_penalty: HF's repetition penalty, applied to each beam's log-probabilities.
        structured_outputs: Constrain every beam to a JSON schema, any JSON object, a regex, a choice or an EBNF
            grammar (as :class:`SamplingParams`): each beam follows its own grammar matcher, and tokens the
            grammar forbids get log-probability -inf. Needs the engine's tokenizer; not with ``min_tokens``.
    """

    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        if self.length_penalty in (float("inf"), float("-inf")):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        _check_int("num_return_sequences", self.num_return_sequences, 1, self.beam_width)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self.stop_token_ids = _check_stop_token_ids(self.stop_token_ids)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        _check_penalty(self.repetition_penalty)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
