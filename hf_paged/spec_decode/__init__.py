"""Speculative decoding inside continuous batching: proposers, verification, configuration."""

from hf_paged.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
