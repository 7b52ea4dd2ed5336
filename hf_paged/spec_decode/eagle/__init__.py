"""EAGLE-3 draft heads: a one-layer head that reads the target's hidden states (head, loading, proposer)."""

from hf_paged.spec_decode.eagle.head import EagleHead, EagleHeadConfig
from hf_paged.spec_decode.eagle.loading import load_head, save_head

__all__ = ["EagleHead", "EagleHeadConfig", "load_head", "save_head"]
