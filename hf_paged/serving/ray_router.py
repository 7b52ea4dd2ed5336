"""The prefix-aware Ray Serve request router of the engine replicas (``RequestRouterConfig.request_router_class``).

The ingress passes each request's prefix chain (``prefix_routing.prefix_hashes``) as the keyword argument
``prefix_hashes`` of its call to an engine replica; this router ranks the replicas with
:func:`~hf_paged.serving.prefix_routing.rank_replicas` and remembers where each chain went. Each process holding
a handle to the engine deployment (the ingress replica) has its own router and table. Needs ``hf-paged[ray]``.
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hf_paged.serving.prefix_routing import DEFAULT_TABLE_SIZE, PrefixTable, rank_replicas

logger = logging.getLogger(__name__)

HASHES_KWARG = "prefix_hashes"


class PrefixAwareRouter(RequestRouter):
    """Longest known prefix first, unless that replica is much busier than the least busy one.

    Loads are the requests this router sent to each replica and that have not completed yet.
    """

    def initialize_state(self, imbalance_factor: float = 2.0, imbalance_slack: int = 4,
                         table_size: int = DEFAULT_TABLE_SIZE, **kwargs) -> None:
        if kwargs:
            raise TypeError(f"unknown PrefixAwareRouter options: {sorted(kwargs)}")
        if not imbalance_factor >= 1:
            raise ValueError(f"imbalance_factor must be >= 1, got {imbalance_factor!r}")
        if isinstance(imbalance_slack, bool) or not isinstance(imbalance_slack, int) or imbalance_slack < 0:
            raise ValueError(f"imbalance_slack must be an int >= 0, got {imbalance_slack!r}")
        self.imbalance_factor = float(imbalance_factor)
        self.imbalance_slack = imbalance_slack
        self.table = PrefixTable(table_size)
        self.loads: dict[ReplicaID, int] = {}

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None:
            return []
        hashes = pending_request.kwargs.get(HASHES_KWARG)
        return list(hashes) if isinstance(hashes, (list, tuple)) else []

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        order = rank_replicas(list(by_id), self._hashes(pending_request), self.table, self.loads,
                              imbalance_factor=self.imbalance_factor, imbalance_slack=self.imbalance_slack)
        # One replica per rank: Ray tries them in this order, skipping a replica whose queue is full.
        return [[by_id[rid]] for rid in order]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.loads[replica_id] = self.loads.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if replica_id in self.loads:
            self.loads[replica_id] = max(0, self.loads[replica_id] - 1)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        self.table.insert(self._hashes(pending_request), replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        for gone in [rid for rid in self.loads if rid not in alive]:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        logger.info("forgetting replica %s", replica_id)
        self.loads.pop(replica_id, None)
        self.table.remove(replica_id)
