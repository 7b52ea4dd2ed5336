"""The command line's model and engine: the flags that pick the weights (``--model``, ``--dtype``,
``--quantization``) and the engine options (``--kv-cache-dtype``, ``--tensor-parallel-size``)."""

from __future__ import annotations

from hf_paged.cli.lifetime import start_up
from hf_paged.cli.checks import UsageError


def load(args):
    from hf_paged.model.default_model import load_default, load_model

    quantization = getattr(args, "quantization", None)
    try:
        if args.model:
            if quantization == "gguf":
                raise UsageError("--quantization gguf keeps the default model's GGUF weights as stored; with --model "
                                 "use int8 or int4 (or hf_paged.load_gguf(path) for a GGUF file)")
            return load_model(args.model, dtype=args.dtype)
        return load_default(dtype=args.dtype, quantized=quantization == "gguf")
    except (OSError, ImportError) as e:  # a folder transformers cannot read, a missing package: one line
        raise UsageError(" ".join(str(e).split()) or type(e).__name__) from e


def engine_options(args) -> dict:
    """Engine keywords from the flags: --quantization int8/int4 (gguf is a way of loading, see load),
    --quant-activations, --kv-cache-dtype and --tensor-parallel-size."""
    q = getattr(args, "quantization", None)
    out = {"quantization": q} if q in ("int8", "int4") else {}
    if getattr(args, "quant_activations", "float") != "float":
        out["quant_activations"] = args.quant_activations
    kv = getattr(args, "kv_cache_dtype", "auto")
    if kv != "auto":
        out["kv_cache_dtype"] = kv
    out.update(tier_options(args))
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        if q == "gguf":
            raise UsageError("--quantization gguf cannot be used with --tensor-parallel-size > 1: each rank reads its "
                             "slices from the model folder (use int8 or int4; in Python, PagedGenerator("
                             "hf_paged.load_gguf(path), tensor_parallel_size=N) shards a GGUF model kept quantized)")
        out["tensor_parallel_size"] = tp
    return out


def tier_options(args) -> dict:
    """Engine keywords of the KV-tier flags (--kv-offload-gb, --kv-offload-dtype, --prefix-cache-dir,
    --prefix-cache-disk-gb) that differ from their defaults."""
    out = {}
    for name, default in (("kv_offload_gb", 0.0), ("kv_offload_dtype", "auto"), ("prefix_cache_dir", None),
                          ("prefix_cache_disk_gb", None)):
        value = getattr(args, name, default)
        if value != default:
            out[name] = value
    return out


def build_engine(args, **config):
    """``(engine, tokenizer)`` for the command's flags. With --tensor-parallel-size N every rank loads the folder
    (the default model's too) and keeps its shard; under torchrun, ranks other than 0 serve as workers here and
    exit when rank 0 is done."""
    config.update(engine_options(args))
    if config.get("tensor_parallel_size", 1) > 1:  # the collector is not paused: worker ranks serve in here
        from transformers import AutoTokenizer

        from hf_paged import PagedGenerator
        from hf_paged.model.default_model import default_model_path

        path = args.model or str(default_model_path())
        tokenizer = AutoTokenizer.from_pretrained(path)
        return PagedGenerator.from_pretrained(path, tokenizer, dtype=args.dtype, **config), tokenizer
    with start_up():  # imports torch and transformers, loads, builds: the collector waits until done
        from hf_paged import PagedGenerator

        model, tokenizer = load(args)
        return PagedGenerator(model, tokenizer, **config), tokenizer
