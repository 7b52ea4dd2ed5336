"""Load a GGUF file into a stock ``transformers`` model whose linears keep the file's quantized weights.

``transformers`` reads GGUF files by dequantizing every tensor to floats. :func:`load_gguf` builds the same
model (same config, same classes, same tensor-name mapping and Llama Q/K row permutation) but puts each
Q8_0 / Q4_0 / Q4_1 linear weight into a :class:`~hf_paged.model.layers.quant_linear.QuantLinear` holding the file's
bytes as they are (no fp32 copy); a quantized token embedding becomes a :class:`QuantEmbedding` (rows
dequantized as they are looked up) and, where the LM head is tied to it, the head a ``QuantLinear`` over the
same bytes. F32 / F16 / BF16 tensors load as floats of ``dtype``. Other quantized types (Q4_K, Q6_K, ...)
raise ValueError naming the supported set, or with ``unsupported="dequantize"`` load dequantized (one warning).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from hf_paged.model.layers.quant_linear import BLOCK_BYTES, GROUP, QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)

KEPT = ("Q8_0", "Q4_0", "Q4_1")  # GGUF tensor types kept quantized
FLOATS = ("F32", "F16", "BF16")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, tokenizer: bool = True, config=None,
              unsupported: str = "error"):
    """Load a local GGUF file of a causal LM with its quantized linear weights kept as stored.

    Args:
        path: The ``.gguf`` file.
        dtype: dtype of the float tensors (norms, F32/F16 weights) and of the activations.
        tokenizer: Also build the tokenizer from the file (``transformers``' GGUF tokenizer conversion).
        config: A ``PretrainedConfig`` to use instead of the one read from the file.
        unsupported: What to do with a quantized tensor type other than Q8_0, Q4_0, Q4_1: "error" (ValueError)
            or "dequantize" (load it as floats, with one warning).

    Returns:
        ``(model, tokenizer)`` (tokenizer None when not asked for), the model in eval mode on CPU.
    """
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights, no_tie_weights
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, read_field,
    )

    if unsupported not in ("error", "dequantize"):
        raise ValueError(f"unsupported must be 'error' or 'dequantize', got {unsupported!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {str(path)!r}")
    if config is None:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with no_init_weights(), no_tie_weights():  # parameters are allocated but never written: not resident
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TENSOR_PROCESSORS.get(config.model_type, TensorProcessor))(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    loaded = _load_tensors(model, reader, names, processor, dtype, unsupported)
    _tie_head(model, config, loaded, dtype)
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded)
    if missing:
        raise ValueError(f"GGUF file {path.name!r} has no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name) if tokenizer else None
    return model.eval(), tok


def _load_tensors(model, reader, names: dict[str, str], processor, dtype: torch.dtype, unsupported: str) -> set[str]:
    from gguf import dequantize

    modules = dict(model.named_modules())
    loaded: set[str] = set()
    warned = False
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if tensor.name not in names:
            continue
        hf_name = names[tensor.name]
        owner, _, leaf = hf_name.rpartition(".")
        module = modules[owner]
        data = tensor.data
        if kind not in KEPT and kind not in FLOATS:
            if unsupported == "error":
                raise ValueError(
                    f"GGUF tensor {tensor.name!r} has type {kind}; hf_paged runs {', '.join(KEPT)} quantized and "
                    f"{', '.join(FLOATS)} as floats (pass unsupported='dequantize' to load it dequantized)"
                )
            if not warned:
                logger.warning("GGUF tensors of type %s (first: %s) are dequantized to %s", kind, tensor.name, dtype)
                warned = True
        quantized = kind in KEPT and leaf == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
        if not quantized:
            data = dequantize(data, tensor.tensor_type)
        data = processor.process(weights=data, name=tensor.name).weights  # the Llama Q/K row permutation
        if quantized:
            qweight = torch.from_numpy(np.ascontiguousarray(data).copy())  # the file's bytes, rows reordered
            replacement = _quantized(module, kind.lower(), qweight, dtype)
            parent, _, child = owner.rpartition(".")
            setattr(modules[parent] if parent else model, child, replacement)
            modules[owner] = replacement
        else:
            param = getattr(module, leaf)
            value = torch.from_numpy(np.array(data)).to(dtype).reshape(param.shape)  # a copy: the file is mapped read-only
            setattr(module, leaf, torch.nn.Parameter(value, requires_grad=False))
        loaded.add(hf_name)
    return loaded


def _quantized(module: torch.nn.Module, fmt: str, qweight: torch.Tensor, dtype: torch.dtype) -> torch.nn.Module:
    if isinstance(module, torch.nn.Embedding):
        dim, rows = module.embedding_dim, module.num_embeddings
    else:
        dim, rows = module.in_features, module.out_features
    expected = (rows, dim // GROUP * BLOCK_BYTES[fmt])
    if dim % GROUP or tuple(qweight.shape) != expected:
        raise ValueError(f"GGUF {fmt} tensor of shape {tuple(qweight.shape)} does not fit {module} (expected {expected})")
    if isinstance(module, torch.nn.Embedding):
        return QuantEmbedding(rows, dim, fmt, qweight, padding_idx=module.padding_idx, dtype=dtype)
    bias = module.bias  # a GGUF bias is a separate float tensor, loaded into this parameter afterwards
    layer = QuantLinear(dim, rows, fmt, qweight)
    if bias is not None:
        layer.bias = torch.nn.Parameter(torch.empty(rows), requires_grad=False)
    return layer


def _tie_head(model, config, loaded: set[str], dtype: torch.dtype) -> None:
    """A head without a tensor of its own (tied to the token embedding, as the file has no ``output.weight``)."""
    head = model.get_output_embeddings()
    if head is None or any(n.startswith(_name_of(model, head)) for n in loaded):
        return
    embed = model.get_input_embeddings()
    name = _name_of(model, head)
    if isinstance(embed, QuantEmbedding):
        tied = QuantLinear(embed.embedding_dim, embed.num_embeddings, embed.fmt, embed.qweight)  # same bytes
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, tied)
    else:
        head.weight = embed.weight
    loaded.add(f"{name}.weight")


def _name_of(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)
