"""The replicated server's pieces that need no running Ray: the prefix routing policy (exact), the merged
``/metrics`` text, and the CLI's and builder's checks of bad input."""

import pytest

from hf_paged.cli import main
from hf_paged.serving.prefix_routing import (
    CHUNK_CHARS, PrefixTable, prefix_hashes, rank_replicas, routing_text,
)
from hf_paged.serving.ray_metrics import MetricsBoard, merge_metrics

SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 8}


def chat(*messages) -> str:
    return routing_text("/v1/chat/completions", {"messages": [SYSTEM, *messages]})


def test_hash_chain_extends_with_the_conversation():
    turn1 = prefix_hashes(chat({"role": "user", "content": "Name a prime."}))
    turn2 = prefix_hashes(chat({"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
                               {"role": "user", "content": "Another?"}))
    other = prefix_hashes(chat({"role": "user", "content": "Name a color."}))
    assert len(turn2) > len(turn1) and turn2[:len(turn1) - 1] == turn1[:-1]  # the last chunk of turn 1 is partial
    shared = len(SYSTEM["content"]) // CHUNK_CHARS
    assert other[:shared] == turn1[:shared] and other[shared] != turn1[shared]
    # token-id prompts chunk by 16 ids; the first of several prompts decides; no prompt: no chain
    ids = list(range(40))
    assert prefix_hashes(routing_text("/v1/completions", {"prompt": [ids, [1]]})) == prefix_hashes(ids)
    assert len(prefix_hashes(ids)) == 3 and prefix_hashes(ids[:32]) == prefix_hashes(ids)[:2]
    assert routing_text("/v1/completions", {"prompt": 5}) is None and routing_text("/v1/models", {}) is None
    assert prefix_hashes(None) == [] and prefix_hashes("") == []


def test_longest_match_wins_then_load_then_a_stable_split():
    table = PrefixTable()
    a, b = prefix_hashes("a" * 300), prefix_hashes("b" * 300)
    table.insert(a[:2], "r0")
    table.insert(a, "r1")
    assert table.match(a) == {"r0": 2, "r1": len(a)} and table.match(b) == {}
    assert rank_replicas(["r0", "r1", "r2"], a, table, {}) == ["r1", "r0", "r2"]
    # no match: the least loaded, equal loads split by a hash of the first chunk (same answer every time)
    assert rank_replicas(["r0", "r1", "r2"], b, table, {"r0": 1, "r2": 1})[0] == "r1"
    firsts = {rank_replicas(["r0", "r1"], prefix_hashes(f"{i}" * 80), PrefixTable(), {})[0] for i in range(10)}
    assert firsts == {"r0", "r1"}
    assert rank_replicas(["r0", "r1"], b, table, {}) == rank_replicas(["r1", "r0"], b, table, {})


def test_a_much_busier_replica_spills_to_the_least_busy():
    table = PrefixTable()
    hashes = prefix_hashes("shared system prompt " * 20)
    table.insert(hashes, "r0")
    # within max(2 x least, least + 4) the prefix holder keeps the request
    assert rank_replicas(["r0", "r1"], hashes, table, {"r0": 4, "r1": 0})[0] == "r0"
    assert rank_replicas(["r0", "r1"], hashes, table, {"r0": 20, "r1": 10})[0] == "r0"
    # beyond it the request spills; the busy holder stays as the last resort
    assert rank_replicas(["r0", "r1"], hashes, table, {"r0": 5, "r1": 0}) == ["r1", "r0"]
    assert rank_replicas(["r0", "r1"], hashes, table, {"r0": 21, "r1": 10}) == ["r1", "r0"]
    assert rank_replicas(["r0", "r1"], hashes, table, {"r0": 5, "r1": 0}, imbalance_slack=8)[0] == "r0"


def test_table_is_bounded_and_forgets_dead_replicas():
    table = PrefixTable(capacity=4)
    old, new = prefix_hashes("x" * 256), prefix_hashes("y" * 256)
    table.insert(old, "r0")
    table.insert(new, "r1")
    assert len(table) == 4 and table.match(old) == {} and table.match(new) == {"r1": 4}
    table.insert(new, "r0")
    table.remove("r1")
    assert table.match(new) == {"r0": 4}
    table.remove("r0")
    assert len(table) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixTable(0)


REPLICA_TEXT = """# HELP hf_paged:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE hf_paged:prefix_cache_hits_total counter
hf_paged:prefix_cache_hits_total{{model_name="m"}} {hits}
# HELP hf_paged:kv_cache_usage_perc KV-cache usage.
# TYPE hf_paged:kv_cache_usage_perc gauge
hf_paged:kv_cache_usage_perc{{model_name="m"}} {usage}
# HELP hf_paged:e2e_request_latency_seconds Latency.
# TYPE hf_paged:e2e_request_latency_seconds histogram
hf_paged:e2e_request_latency_seconds_bucket{{le="1.0",model_name="m"}} {fast}
hf_paged:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="m"}} 3.0
hf_paged:e2e_request_latency_seconds_count{{model_name="m"}} 3.0
hf_paged:e2e_request_latency_seconds_sum{{model_name="m"}} 2.5
hf_paged:e2e_request_latency_seconds_created{{model_name="m"}} 1.7e9
"""


def test_metrics_are_labelled_per_replica_and_summed():
    from prometheus_client.parser import text_string_to_metric_families

    text = merge_metrics({"a": REPLICA_TEXT.format(hits=32, usage=0.5, fast=1),
                          "b": REPLICA_TEXT.format(hits=16, usage=0.25, fast=2)})
    values = {(s.name, s.labels.get("replica"), s.labels.get("le")): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert values[("hf_paged:prefix_cache_hits_total", "a", None)] == 32
    assert values[("hf_paged:prefix_cache_hits_total", "total", None)] == 48
    assert values[("hf_paged:kv_cache_usage_perc", "total", None)] == 0.375  # a fraction: the mean
    assert values[("hf_paged:e2e_request_latency_seconds_bucket", "total", "1.0")] == 3
    assert values[("hf_paged:e2e_request_latency_seconds_count", "total", None)] == 6
    assert not any(name.endswith("_created") for name, _, _ in values)
    board = MetricsBoard(stale_after=60)
    board.report("a", REPLICA_TEXT.format(hits=1, usage=0, fast=0))
    board.report("b", REPLICA_TEXT.format(hits=1, usage=0, fast=0))
    board.report("b", None)  # b shut down
    assert set(board.snapshots()) == {"a"} and 'replica="b"' not in board.render()


@pytest.mark.parametrize("argv, message", [
    (["--data-parallel-size", "0"], "--data-parallel-size: must be >= 1, got 0"),
    (["--data-parallel-size", "two"], "--data-parallel-size: must be an integer"),
    (["--routing", "prefix"], "--routing, --replica-num-cpus and --autoscaling-config need --data-parallel-size"),
    (["--data-parallel-size", "2", "--routing", "random"], "invalid choice: 'random'"),
    (["--data-parallel-size", "2", "--autoscaling-config", "{\"max_replicas\": 0}"], "max_replicas"),
    (["--data-parallel-size", "2", "--autoscaling-config", "[1]"], "must be a JSON object"),
    (["--data-parallel-size", "2", "--replica-num-cpus", "0"], "--replica-num-cpus: must be > 0"),
])
def test_cli_refuses_bad_replica_flags_before_loading(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_builder_refuses_bad_arguments():
    from hf_paged.serving.ray_app import EngineSpec
    from hf_paged.serving.replicas import build_application

    spec = EngineSpec(served_model_name="m")
    with pytest.raises(ValueError, match="--data-parallel-size.*got 0"):
        build_application(spec, 0)
    with pytest.raises(ValueError, match="routing must be one of"):
        build_application(spec, 2, routing="random")
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        build_application(spec, 2, autoscaling_config={"target_ongoing_requests": -1})
    with pytest.raises(ValueError, match=r"unknown autoscaling config keys \['max_replica'\]"):
        build_application(spec, 2, autoscaling_config={"max_replica": 4})
    # the initial count is --data-parallel-size within the config's bounds; a config Ray refuses is refused here
    build_application(spec, 1, autoscaling_config={"min_replicas": 2, "max_replicas": 4})
    build_application(spec, 8, autoscaling_config={"min_replicas": 1, "max_replicas": 4})
    with pytest.raises(ValueError, match="initial_replicas"):
        build_application(spec, 1, autoscaling_config={"min_replicas": 1, "max_replicas": 4, "initial_replicas": 9})


def test_a_replica_whose_engine_loop_stopped_or_failed_fails_its_health_check():
    from types import SimpleNamespace

    from hf_paged.serving.ray_app import EngineReplica

    replica = EngineReplica.__new__(EngineReplica)  # no Ray: only the check itself
    replica.replica_id = "r0"
    replica.loop = SimpleNamespace(is_running=True, failure=None, shutdown=lambda: None)
    replica.check_health()
    replica.loop.is_running = False
    with pytest.raises(RuntimeError, match="engine loop of replica r0 has stopped"):
        replica.check_health()
    replica.loop.failure = "engine failed: a tensor-parallel worker exited (rank 1, killed by SIGKILL)"
    with pytest.raises(RuntimeError, match=r"replica r0: engine failed: a tensor-parallel worker exited \(rank 1"):
        replica.check_health()
