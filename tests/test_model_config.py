"""``text_config``: the one place that picks a config's language-model part."""

import pathlib
import re
from types import SimpleNamespace

import transformers

from hf_paged.model.hf_config import text_config
from tests.helpers import make_model

# files that still spell the idiom inline, owned by work in progress elsewhere (the attention side, tensor
# parallelism); they may drop it, never add more
# attention/ sits below model/ in the layer table, so it keeps its own line rather than import model/hf_config
INLINE_ALLOWED = {"hf_paged/attention/function.py"}


def test_a_multimodal_config_gives_its_text_part():
    cfg = transformers.LlavaConfig(text_config=transformers.LlamaConfig(num_hidden_layers=3).to_dict())
    assert text_config(cfg) is cfg.get_text_config()
    assert text_config(cfg).num_hidden_layers == 3 and text_config(cfg) is not cfg


def test_a_model_gives_its_configs_text_part_and_a_plain_config_itself():
    model = make_model("llama")
    assert text_config(model) is model.config.get_text_config() is model.config
    plain = SimpleNamespace(num_hidden_layers=2)  # no get_text_config (an old or a custom config)
    assert text_config(plain) is plain
    assert text_config(SimpleNamespace(config=plain)) is plain


def test_no_module_spells_the_idiom_inline():
    root = pathlib.Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((root / "hf_paged").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "hf_paged/model/hf_config.py" or rel in INLINE_ALLOWED:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"hasattr\([^)]*[\"']get_text_config[\"']\)", line):
                found.append(f"{rel}:{lineno}: {line.strip()}")
    assert not found, "use hf_paged.model.hf_config.text_config instead:\n" + "\n".join(found)
