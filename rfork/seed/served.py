"""What a seed serves: each rank's weights with their read-only registrations, on one engine.

A pull hands this over (`rfork.pull.result.LoadResult.hand_off`): the engine it read with and the
registrations its reads landed through, which are read-only already. A seed adopts it, so a buffer is
registered once per process lifetime (per provider); registration is the expensive step on a real
NIC. Ranks a pull filled without registering (disk, NCCL, GPU bounce slots) are registered when the
seed starts, once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from backends import Region, TransferEngine
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServedRank:
    """One rank as a seed serves it: its weights (tensors, and in `weights.checksums` the digests a
    pull verified) and their read-only registrations, one per region ([] until registered)."""

    weights: RankWeights
    regions: list[Region] = field(default_factory=list)

    def registered_on(self, engine: TransferEngine) -> bool:
        """Whether every region is registered, alive, on `engine` (a fence may have closed another)."""
        return bool(self.regions) and all(r.engine is engine and not r.closed for r in self.regions)

    def descriptors(self) -> list[bytes]:
        """What peers need to read each region, in region order."""
        return [bytes(r.descriptor.to_bytes()) for r in self.regions]


class RankServer:
    """One provider's engine serving some ranks' regions (read-only). Thread-safe close.

    `ranks`: registrations made on `engine` already (a pull's), adopted as they are.
    """

    def __init__(
        self, *, engine: TransferEngine, owns_engine: bool = True, ranks: Iterable[ServedRank] = ()
    ) -> None:
        self.engine = engine
        self.provider = str(getattr(engine, "provider", "tcp"))
        self._owns_engine = owns_engine
        self.ranks: dict[int, ServedRank] = {}
        for served in ranks:
            if served.registered_on(engine):
                self.ranks[served.weights.rank] = served

    def serve(self, weights: RankWeights) -> ServedRank:
        """Register the weights' regions read-only, unless this engine serves them already (adopted)."""
        held = self.ranks.pop(weights.rank, None)
        if held is not None:
            if held.weights is weights:
                self.ranks[weights.rank] = held
                return held
            self._deregister(held)  # other tensors of that rank are served from now on
        t0 = time.perf_counter()
        targets = weights.registrables()
        if weights.device.type == "cuda" and not getattr(self.engine, "device_memory", False):
            targets = weights.host_mirrors()  # no FI_HMEM here: serve a host copy (not run on a GPU)
        regions = [self.engine.register(target, access="read") for target in targets]
        log.info(
            "registered %d region(s), %d bytes, for rank %d on %s in %.3f s",
            len(regions),
            sum(weights.layout.region_sizes),
            weights.rank,
            self.provider,
            time.perf_counter() - t0,
        )
        served = ServedRank(weights=weights, regions=regions)
        self.ranks[weights.rank] = served
        return served

    def address_bytes(self) -> bytes:
        """The engine's address, as the planner publishes it (base64 on the wire)."""
        return bytes(self.engine.address)

    def close(self) -> None:
        """Deregister every served region, then close the engine if this server owns it."""
        for served in self.ranks.values():
            self._deregister(served)
        self.ranks.clear()
        if self._owns_engine:
            with contextlib.suppress(Exception):
                self.engine.close()

    def _deregister(self, served: ServedRank) -> None:
        for reg in served.regions:
            with contextlib.suppress(Exception):
                self.engine.deregister(reg)
