"""The execution layer's seam (hf_paged/executor/): one executor, persistent block tables fed by diffs, one step
runner per step kind, attention metadata without backend flags."""

import dataclasses

import pytest
import torch

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.attention.function import AttentionMetadata
from hf_paged.core.scheduler_output import ScheduledSequence
from hf_paged.executor import Executor, UniProcExecutor
from hf_paged.executor.input_batch import BlockTables
from tests.helpers import make_model, make_prompts, stock_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def diff(seq_id, start, new):
    return ScheduledSequence(seq_id, 0, [1], new, False, block_ids_from=start)


def test_block_tables_follow_diffs_and_gather_rows_in_order():
    tables = BlockTables()
    tables.apply(diff(7, 0, [3, 4, 5]))
    tables.apply(diff(9, 0, list(range(40))))  # wider than the initial tensor: the columns grow
    tables.apply(diff(7, 3, [6]))  # a decode step's new block
    tables.apply(diff(7, 2, [11]))  # copy-on-write of entry 2 (and entry 3 dropped: truncated)
    assert tables.lists[7] == [3, 4, 11]
    got = tables.gather([9, 7], width=5)
    assert got.dtype == torch.int32 and got.tolist() == [[0, 1, 2, 3, 4], [3, 4, 11, 0, 0]]  # 0 past the end
    tables.drop(9)
    tables.apply(diff(12, 0, [8]))  # takes the freed row: nothing of 9's table shows through
    assert tables.gather([12], width=3).tolist() == [[8, 0, 0]]
    for s in range(100, 140):  # more sequences than rows: the rows grow
        tables.apply(diff(s, 0, [s]))
    assert tables.gather([139, 7, 100], width=3).tolist() == [[139, 0, 0], [3, 4, 11], [100, 0, 0]]
    with pytest.raises(KeyError, match="no block table for sequences \\[555\\]"):
        tables.gather([555], width=1)


def test_attention_metadata_carries_tensors_and_one_backend_object_only():
    assert {f.name for f in dataclasses.fields(AttentionMetadata)} == {
        "slot_mapping", "block_tables", "seq_lens", "cu_seqlens_q", "max_seqlen_q", "max_seqlen_k", "layers", "impl",
    }


def test_decode_steps_send_only_new_block_ids_and_match_stock_generate():
    model = make_model("llama", seed=3)
    prompts = make_prompts(3, [37, 5, 70], seed=8)
    with PagedGenerator(model, block_size=4, num_blocks=128, max_num_seqs=4) as engine:
        assert isinstance(engine.executor, Executor) and isinstance(engine.executor, UniProcExecutor)
        sent = []
        execute = engine.executor.execute_model

        def spy(out):
            sent.append([(item.block_ids_from, len(item.new_block_ids), item.num_new_tokens) for item in out.scheduled])
            return execute(out)

        engine.executor.execute_model = spy
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        for item_diffs in sent[3:]:  # decode steps: a sequence sends at most the one block its token opens
            assert all(n_new <= 1 and num_tokens == 1 for _, n_new, num_tokens in item_diffs), item_diffs
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == stock_greedy(model, prompt, 12)


def test_host_bench_runs_small():
    from hf_paged.bench.host import measure

    result = measure(num_seqs=4, context=64, steps=2)
    assert result["step_ms"] > 0 and result["schedule_ms"] > 0 and result["pack_ms"] > 0
    assert result["execute_ms"] >= result["pack_ms"]
