"""The engine under ``python -O``, which strips every ``assert``: nothing the engine needs may run inside one.

A subprocess runs a parity subset (fp32 greedy, stock ``generate`` as reference) with asserts off: the engine
with prefix-cache hits, preemption in a small pool (recomputed and swapped), chunked prefill and ``n`` > 1
samples forking shared blocks; and stock ``generate`` on a :class:`PagedCache` (greedy and beam search)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys

    if __debug__:
        sys.exit("asserts are on: this check must run under python -O")

    import torch
    from transformers import DynamicCache

    from hf_paged import PagedCache, PagedGenerator, SamplingParams
    from hf_paged.hf.cache import CACHE_KWARG
    from tests.helpers import make_model, make_prompts, stock_greedy

    def check(ok, what):  # no assert here either: it would be stripped
        if not ok:
            sys.exit("python -O: " + what)

    NEW = 16
    # mistral (a sliding window shorter than the long prompts): prefix-cache hits, chunked prefill, and 24 blocks
    # of 8 tokens for up to 4 sequences of up to 86 tokens: the pool runs out, sequences are preempted
    model = make_model("mistral", seed=3)
    shared = make_prompts(1, [40], seed=3)[0]  # a common prefix
    prompts = [shared + p for p in make_prompts(3, [5, 12, 1], seed=4)] + make_prompts(4, [70, 2, 33, 9], seed=5)
    want = [stock_greedy(model, p, NEW) for p in prompts]
    engine = PagedGenerator(model, max_num_seqs=4, num_blocks=24, block_size=8, max_num_batched_tokens=64,
                            enable_prefix_caching=True, max_itl_ratio=None)  # unpaced: prompts crowd the pool
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0), use_tqdm=False)
    check([list(o.outputs[0].token_ids) for o in outs] == want, "greedy tokens differ from stock")
    check(sum(engine.scheduler.num_preemptions.values()) > 0, "nothing was preempted")
    check(engine.kv_manager.prefix_hits > 0, "no prefix-cache hit")
    check(engine.kv_manager.num_free_blocks == 24, "blocks leaked")
    engine.close()

    # llama, n > 1: the samples of one prompt fork its blocks (copy-on-write of the partial one); the pool runs
    # out and samples are swapped out to host memory and back in, most needing a new block then
    model = make_model("llama", seed=3)
    prompts = make_prompts(3, [20, 9, 30], seed=7)
    want = [stock_greedy(model, p, NEW) for p in prompts]
    engine = PagedGenerator(model, max_num_seqs=8, num_blocks=30, block_size=4, max_num_batched_tokens=64,
                            enable_prefix_caching=True, preemption_mode="swap", swap_space=2**20,
                            prepack_weights=False)
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, n=3), use_tqdm=False)
    for o, w in zip(outs, want):
        check(len(o.outputs) == 3, f"{len(o.outputs)} samples, not 3")
        check(all(list(s.token_ids) == w for s in o.outputs), "n=3 samples differ from stock")
    check(engine.scheduler.num_preemptions["swap"] > 0, "nothing was swapped")
    check(engine.kv_manager.num_free_blocks == 30, "blocks leaked")
    engine.close()

    # stock generate on a PagedCache: rows sharing blocks (beams) write through one row (RowTables.append)
    short, long = make_prompts(2, [6, 21], seed=6)
    ids = torch.tensor([[0] * 15 + short, long])  # left-padded
    mask = torch.tensor([[0] * 15 + [1] * 6, [1] * 21])
    for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=2)):
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,
                                 **{CACHE_KWARG: DynamicCache()}, **kw)
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0,
                                 **{CACHE_KWARG: PagedCache(model, block_size=4)}, **kw)
        check(torch.equal(got, ref), f"PagedCache generate {kw} differs from DynamicCache")
    print("python -O parity ok")
""")


def test_engine_parity_with_asserts_stripped():
    proc = subprocess.run([sys.executable, "-O", "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "python -O parity ok" in proc.stdout
