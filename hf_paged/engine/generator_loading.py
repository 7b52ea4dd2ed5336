"""``PagedGenerator.from_pretrained``: an engine over a local model folder, with tensor parallelism every rank
loading its own shard."""

from __future__ import annotations

import os
import sys

import torch

from hf_paged.config import EngineConfig


def from_pretrained(cls, path: str, tokenizer=None, dtype: str | torch.dtype = "float32", device: str = "cpu",
                    **config: object):
    """An engine over the causal LM in the local folder ``path``; ``tokenizer``: a tokenizer, None (the
    folder's) or False (none: prompts are token ids); ``device``: "cpu" or "cuda" (with tensor parallelism,
    rank r on GPU ``LOCAL_RANK`` under torchrun, else GPU r, NCCL between them).

    With ``tensor_parallel_size=N`` > 1 every rank loads the folder itself and keeps its shard; under
    ``torchrun`` the ranks other than 0 serve as workers here until rank 0 closes its engine, then exit with
    status 0: code after this call runs on rank 0 only.
    """
    from hf_paged.model.default_model import load_model
    from hf_paged.executor.tp_worker import ModelSource, worker_entry

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    elif tokenizer is False:
        tokenizer = None
    tp = config.get("tensor_parallel_size", 1)
    if tp == 1:
        return cls(load_model(path, dtype=dtype, device=device)[0], tokenizer, **config)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' with tensor_parallel_size > 1, got {device!r}")
    source = ModelSource(path=str(path), dtype=str(dtype).removeprefix("torch."), device=device)
    if worker_entry(source, EngineConfig.from_kwargs(**config)):
        # this worker rank is done: exit at once (interpreter teardown can race c10d's threads into an abort)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return cls(source, tokenizer, **config)
