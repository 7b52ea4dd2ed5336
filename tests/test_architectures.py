"""Compatibility matrix: exact greedy parity of the engine with stock ``generate`` on many architectures.

Each tiny random model (tests/arch_configs.py) serves a mixed-length batch through ``PagedGenerator`` with
a small block size and a token budget that chunks the prompts; the tokens must equal stock
``model.generate(do_sample=False)`` on each prompt alone, fp32. Guard tests show the features under test
(sliding windows, softcap, scaling) really change the output, and architectures the engine cannot serve
exactly must raise a clear NotImplementedError naming the class. ``python -m tests.arch_table`` turns the
results into the supported-models table of docs/getting_started.md.
"""

import pytest

from hf_paged import PagedGenerator, SamplingParams
from tests.arch_configs import ARCH_CONFIGS, LLAMA4_CHUNK, UNSUPPORTED, make_arch_model
from tests.helpers import make_prompts, stock_greedy

LENGTHS = [1, 150, 6, 57, 24, 90, 13]
NEW_TOKENS = 24
BLOCK_SIZE = 4
BUDGET = 40  # tokens per step: the long prompts run in several chunks, next to other requests' decodes
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)

_reference: dict[str, list[list[int]]] = {}


def prompts() -> list[list[int]]:
    return make_prompts(len(LENGTHS), LENGTHS, seed=3)


def reference(arch: str) -> list[list[int]]:
    if arch not in _reference:
        model = make_arch_model(arch)
        _reference[arch] = [stock_greedy(model, p, NEW_TOKENS) for p in prompts()]
    return _reference[arch]


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_parity_with_stock_generate(arch):
    """The default attention backend ("auto": the native CPU kernel where it builds)."""
    check_parity(arch, "auto")


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_parity_torch_backend(arch):
    check_parity(arch, "torch")


def check_parity(arch: str, backend: str) -> None:
    want = reference(arch)
    assert sum(len(set(w)) for w in want) > 4 * len(want), "degenerate reference: greedy repeats a few tokens"
    engine = PagedGenerator(
        make_arch_model(arch), block_size=BLOCK_SIZE, num_blocks=400, max_num_batched_tokens=BUDGET,
        attention_backend=backend,
    )
    try:
        outs = engine.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert engine.num_steps > NEW_TOKENS + 2  # prompts really were chunked
        assert engine.kv_manager.num_free_blocks == 400
    finally:
        engine.close()


# (arch, config change that removes the feature): stock output must change on some prompt, or the parity
# test above would not notice the engine ignoring the feature.
FEATURE_GUARDS = [
    ("mistral", {"sliding_window": None}),
    ("qwen3", {"use_sliding_window": False}),
    ("gemma2", {"layer_types": ["full_attention"] * 2}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),  # = head_dim: the default scaling
    ("gemma3", {"layer_types": ["full_attention"] * 2}),
    ("gemma3", {"query_pre_attn_scalar": 16}),
    ("phi3", {"sliding_window": None}),
    ("starcoder2", {"sliding_window": None}),
    ("granite", {"attention_multiplier": 0.25}),  # = head_dim ** -0.5
    ("cohere2", {"layer_types": ["full_attention"] * 2}),
    ("mixtral", {"sliding_window": None}),
    ("exaone4", {"layer_types": ["full_attention"] * 2}),
    ("ministral", {"layer_types": ["full_attention"] * 2}),
    ("llama4", {"attention_chunk_size": 32}),  # why the engine caps llama4 at one chunk
]


@pytest.mark.parametrize("arch,change", FEATURE_GUARDS, ids=[f"{a}-{next(iter(c))}" for a, c in FEATURE_GUARDS])
def test_feature_changes_stock_output(arch, change):
    want = reference(arch)
    changed = make_arch_model(arch, **change)
    long_ones = [i for i, n in enumerate(LENGTHS) if n > 40]
    assert any(stock_greedy(changed, prompts()[i], NEW_TOKENS) != want[i] for i in long_ones)


def test_chunked_attention_caps_max_model_len():
    model = make_arch_model("llama4")
    engine = PagedGenerator(model, block_size=BLOCK_SIZE, num_blocks=400)
    assert engine.max_model_len == LLAMA4_CHUNK
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, LLAMA4_CHUNK + 4)), GREEDY)
    engine.close()
    with pytest.raises(NotImplementedError, match="attention chunk .192 tokens. of Llama4ForCausalLM"):
        PagedGenerator(model, block_size=BLOCK_SIZE, num_blocks=400, max_model_len=LLAMA4_CHUNK + 1)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", list(UNSUPPORTED))
def test_unsupported_architecture_raises_clear_error(arch):
    model = make_arch_model(arch)
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=UNSUPPORTED[arch][3]):
        PagedGenerator(model, block_size=BLOCK_SIZE, num_blocks=64)
    assert model.config._attn_implementation == before  # a failed construction leaves the model alone
