"""EAGLE draft heads: one layer that reads the target's hidden states (EAGLE-3: three layers; EAGLE-1: the last).

Modules: head (the EAGLE-3 head), eagle1 (the EAGLE-1 head), head_files (reading a head folder), loading / eagle1_loading (head folders), proposer.
"""

from hf_paged.spec_decode.eagle.eagle1 import Eagle1Head
from hf_paged.spec_decode.eagle.head import EagleHead, EagleHeadConfig
from hf_paged.spec_decode.eagle.loading import load_head, save_head

__all__ = ["Eagle1Head", "EagleHead", "EagleHeadConfig", "load_head", "save_head"]
