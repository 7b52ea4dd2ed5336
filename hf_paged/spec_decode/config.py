"""``speculative_config``: which proposer drafts tokens, and how many (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3", "eagle")


@dataclass
class SpeculativeConfig:
    """How the engine speculates.

    Args:
        method: "ngram" (prompt lookup: copy what followed an earlier occurrence of the sequence's suffix)
            or "draft_model" (a smaller model, or the target's own first layers, drafts greedily), or
            "eagle3" (an EAGLE-3 head reads the target's hidden states of three layers and drafts greedily), or
            "eagle" (an EAGLE-1 head reads the target's last hidden state and drafts greedily).
        num_speculative_tokens: Drafts proposed per step and request (k >= 1).
        prompt_lookup_min: Shortest suffix n-gram the n-gram proposer matches (>= 1).
        prompt_lookup_max: Longest suffix n-gram it tries first (>= prompt_lookup_min).
        model: For "draft_model": a ``transformers`` causal LM with the target's vocabulary, a local folder
            to load one from, or ``"self:N"`` for the target's own first N layers (no second model). For
            "eagle3": the folder of an EAGLE-3 head (vLLM's and SpecForge's layout), or a loaded
            :class:`~hf_paged.spec_decode.eagle.EagleHead`. For "eagle": the folder of an EAGLE-1 head (vLLM's
            ``llama_eagle.py`` layout), or a loaded :class:`~hf_paged.spec_decode.eagle.Eagle1Head`.
        disable_by_batch_size: Speculate only while fewer sequences than this are queued; ``"auto"`` (the
            default): at the batch sizes where the engine's own measured steps show that speculation gives more
            tokens per second than plain decoding (:mod:`hf_paged.core.spec_gate`; batch 1 always speculates);
            None (vLLM's default): at any batch size. Each sequence's drafting still adapts to its acceptance.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Any = None
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"speculative_config {name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"speculative_config {name} must be >= {low}, got {value}")
        if self.num_speculative_tokens > 15:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be <= 15 (1 + k query tokens per sequence), "
                f"got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size != "auto":
            value = self.disable_by_batch_size
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config disable_by_batch_size must be an int >= 1, 'auto' or None, "
                                 f"got {value!r}")
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError("speculative_config method 'draft_model' needs a model (a model, a folder or 'self:N')")
            if isinstance(self.model, str) and self.model.startswith("self:"):
                n = self.model[5:]
                if not n.isdigit() or int(n) < 1:
                    raise ValueError(f"speculative_config model {self.model!r}: expected 'self:N' with N >= 1 layers")
        elif self.method in ("eagle3", "eagle"):
            kind = "EAGLE-3" if self.method == "eagle3" else "EAGLE-1"
            if self.model is None:
                raise ValueError(f"speculative_config method {self.method!r} needs a model: the folder of an {kind} head")
            if isinstance(self.model, str) and self.model.startswith("self:"):
                raise ValueError(f"speculative_config method {self.method!r} needs an {kind} head folder, not {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"speculative_config model is for methods 'draft_model', 'eagle3' and 'eagle', not {self.method!r}")

    @property
    def self_draft_layers(self) -> int | None:
        if self.method == "draft_model" and isinstance(self.model, str) and self.model.startswith("self:"):
            return int(self.model[5:])
        return None

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(value).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise TypeError(f"unknown speculative_config key(s) {unknown}; allowed: {sorted(allowed)}")
        return cls(**value)
