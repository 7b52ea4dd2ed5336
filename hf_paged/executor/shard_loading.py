"""Where a tensor-parallel rank's weights come from: :class:`ModelSource`.

- A local folder of safetensors files: the rank builds the model's modules without weights, shards them
  (:func:`~hf_paged.executor.tensor_parallel.shard_model` on empty tensors) and reads from the files only the
  slices it keeps (``safe_open(...).get_slice``) and the replicated tensors: its memory holds its shard, never
  the full model. A folder whose tensor names do not match the model's (a checkpoint transformers converts
  while loading) falls back to a full ``from_pretrained`` and slices it.
- A model already in memory: its tensors are passed to spawned ranks through shared memory (no copy), and
  each rank slices its part.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_paged.executor.tensor_parallel import parallelize, shard_model

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """How each rank gets its shard: from a local folder, or from the tensors of a model in memory."""

    path: str | None = None
    dtype: str = "float32"
    model_class: type | None = None
    config: object = None
    generation_config: object = None
    tensors: dict[str, torch.Tensor] | None = None
    # the in-memory model's quantized modules (a GGUF file kept, quantize_model): name -> how to rebuild it
    quantized: dict[str, dict] | None = None
    device: str = "cpu"  # "cuda": rank r runs on GPU LOCAL_RANK (torchrun) or r (spawned), with NCCL

    @classmethod
    def of(cls, model) -> ModelSource:
        if isinstance(model, ModelSource):
            return model
        if isinstance(model, (str, os.PathLike)):
            return cls(path=os.fspath(model))
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers model or a folder path, got {type(model).__name__}")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("tensor parallelism from a model in memory needs it on the CPU; give a folder path instead")
        from hf_paged.model import patches as model_patches

        if model_patches.current(model, "quantization") is not None:  # its layers are another engine's, for now
            raise ValueError("tensor parallelism: another engine on this model quantized its linears (or set their "
                             "activation mode) for as long as it runs; close it first, or give the float model")
        tensors = {name: t.detach() for name, t in model.named_parameters(remove_duplicate=False)}
        tensors.update({name: t for name, t in model.named_buffers(remove_duplicate=False)})
        return cls(model_class=type(model), config=model.config, generation_config=getattr(model, "generation_config", None),
                   tensors=tensors, quantized=_quantized_specs(model))

    def skeleton(self) -> torch.nn.Module:
        """The model's modules with empty (meta) weights; buffers computed at build (rotary) are real."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            if self.path is not None:
                from transformers import AutoConfig, AutoModelForCausalLM

                return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.path))
            model = self.model_class(copy.deepcopy(self.config))
        for name, spec in (self.quantized or {}).items():  # the same quantized modules, empty
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, _empty_quantized(spec))
        return model

    def rank_device(self, rank: int) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))

    def load_shard(self, rank: int, world: int) -> torch.nn.Module:
        """Rank ``rank``'s shard of ``world``, in eval mode, on its device."""
        if self.path is not None:
            model, shard = _load_folder_shard(self.path, self.dtype, rank, world)
        else:
            model = self.skeleton()
            shard = shard_model(model, rank, world)
            _fill(model, shard.slices, self.tensors.get, self.model_class._tied_weights_keys, whole=True)
            if self.generation_config is not None:
                model.generation_config = copy.deepcopy(self.generation_config)
        return parallelize(model, shard).to(self.rank_device(rank)).eval()


def _quantized_specs(model: torch.nn.Module) -> dict[str, dict]:
    """How to rebuild each quantized module of ``model`` (empty): its class and shapes."""
    from hf_paged.model.layers.quant_linear import QuantEmbedding, QuantLinear

    specs = {}
    for name, m in model.named_modules():
        if type(m) is QuantLinear:
            specs[name] = dict(kind="linear", args=(m.in_features, m.out_features, m.fmt), rows=tuple(m.qweight.shape),
                               scales=m.scales is not None, bias=m.bias is not None, activations=m.activations)
        elif type(m) is QuantEmbedding:
            specs[name] = dict(kind="embedding", args=(m.num_embeddings, m.embedding_dim, m.fmt),
                               rows=tuple(m.qweight.shape), padding_idx=m.padding_idx, dtype=m.dtype)
    return specs


def _empty_quantized(spec: dict) -> torch.nn.Module:
    from hf_paged.model.layers.quant_linear import QuantEmbedding, QuantLinear

    qweight = torch.empty(spec["rows"], dtype=torch.uint8, device="meta")
    if spec["kind"] == "embedding":
        return QuantEmbedding(*spec["args"], qweight, padding_idx=spec["padding_idx"], dtype=spec["dtype"])
    out = spec["args"][1]
    scales = torch.empty(out, device="meta") if spec["scales"] else None
    bias = torch.empty(out, device="meta") if spec["bias"] else None
    return QuantLinear(*spec["args"], qweight, scales, bias, spec["activations"])


def _safetensors_files(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> its file, for a folder of safetensors (one file or an index); None otherwise."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return dict.fromkeys(f.keys(), single)
    return None


def _load_folder_shard(path: str, dtype: str, rank: int, world: int) -> tuple[torch.nn.Module, object]:
    from hf_paged.model.default_model import load_model, load_model_generation_config, parse_dtype

    files = _safetensors_files(Path(path))
    source = ModelSource(path=path, dtype=dtype)
    model = source.skeleton() if files is not None else None
    if model is not None:
        shard = shard_model(model, rank, world)
        names = [n for n, _ in model.named_parameters()]
        tied = type(model)._tied_weights_keys or {}
        if all(n in files or (n in tied and tied[n] in files) for n in names):
            from safetensors import safe_open

            handles: dict[Path, object] = {}

            def read(name: str, part=None):
                file = files.get(name)
                if file is None:
                    return None
                if file not in handles:
                    handles[file] = safe_open(str(file), "pt")
                view = handles[file].get_slice(name)
                if part is None:
                    return view[:]
                dim, start, stop = part
                size = view.get_shape()[dim]
                index = (slice(None),) * dim + (slice(min(start, size), min(stop, size)),)
                return view[index]

            _fill(model, shard.slices, read, tied, parse_dtype(dtype))
            handles.clear()
            model.generation_config = load_model_generation_config(Path(path))
            return model, shard
        logger.info("%s: tensor names differ from the model's; loading it whole, then slicing", path)
    model = load_model(path, dtype=dtype)[0]
    return model, shard_model(model, rank, world)


def _fill(model: torch.nn.Module, slices: dict, read, tied: dict | None, dtype: torch.dtype | None = None,
          whole: bool = False) -> None:
    """Give every empty parameter of a sharded skeleton its data. ``whole``: ``read(name)`` is the full tensor (a
    model in memory; its buffers are taken too); else ``read(name, (dim, start, stop))`` reads just that part
    (files). A kept part is a contiguous copy of its own; a replicated tensor of a model in memory is shared."""
    tied = tied or {}
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        source = name if name not in tied or read(name) is not None else tied[name]
        part = slices.get(name)
        if part is None:
            data = read(source)
        elif whole:
            full = read(source)
            dim, start, stop = part
            start, stop = min(start, full.shape[dim]), min(stop, full.shape[dim])
            data = None if full is None else full.narrow(dim, start, stop - start).clone()
        else:
            data = read(source, part)
        if data is None:
            raise ValueError(f"{type(model).__name__}: no tensor for {name} in the source")
        if data.shape != param.shape:  # the LM head's last rows past the vocabulary: zeros
            data = torch.cat([data, data.new_zeros(param.shape[0] - data.shape[0], *data.shape[1:])])
        if dtype is not None and data.dtype != dtype:
            data = data.to(dtype)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(data, requires_grad=False)
    if whole:
        for name, buffer in list(model.named_buffers()):
            data = read(name)
            if data is None:
                continue
            part = slices.get(name)  # a quantized layer's bytes or scales: its slice, padded like a parameter
            if part is not None:
                dim, start, stop = part
                start, stop = min(start, data.shape[dim]), min(stop, data.shape[dim])
                data = data.narrow(dim, start, stop - start).clone()
                if data.shape != buffer.shape:
                    data = torch.cat([data, data.new_zeros(buffer.shape[0] - data.shape[0], *data.shape[1:])])
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = data
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{type(model).__name__}: no tensor for {left[:3]} in the source")
