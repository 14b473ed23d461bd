"""What a load produced: per rank what a seed serves (ServedRank), how it went (one Attempt per source),
and the hand-off (LoadResult).

A LoadResult is a record. Until a seed adopts it (`rfork.seed.Seed.adopt`) or it is closed, it holds the
engine the ranks' read-only registrations live on, and the planner client, so that the seed this
instance becomes registers nothing twice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from backends import Region, TransferEngine
from rfork.identity import SourceIdentity
from rfork.weights.rank_weights import RankWeights

if TYPE_CHECKING:
    from planner.contract import PlannerClient


class Serving(Protocol):
    """What a load keeps of the seed that adopted it (an `rfork.Seed`; pull/ does not import seed/)."""

    @property
    def instance_ids(self) -> list[str]: ...

    def close(self) -> None: ...


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


@dataclass(kw_only=True)
class Attempt:
    """One source tried for one rank: which, whether it worked, its figures."""

    source: str  # "rfork-tcp", "nccl", "disk", ...
    instance_id: str | None
    rank: int
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (see LoadResult.phases)


@dataclass(kw_only=True)
class LoadResult:
    """What a load produced: per rank what a seed serves (`ranks`: the weights, their registrations,
    the verified digests), how, and the seed it became. `verified` is true only when every tensor's
    digest was compared with a seed's.

    Until a seed adopts it (`Seed.adopt`: right after the load, or with `seed_later` when the caller
    says) it holds the engine the registrations live on; `close()` releases whatever it still holds.
    """

    identity: SourceIdentity
    ranks: dict[int, ServedRank]
    source: str
    bytes: int  # read from the sources (a rollout: only the tensors that differed)
    seconds: float
    verified: bool
    kept_bytes: int = 0  # already in the destination with the right digest (`LoadOptions.keep_matching`)
    attempts: list[Attempt] = field(default_factory=list)
    seed: Serving | None = None  # the `rfork.Seed` that adopted this load, once one did
    # why becoming a seed failed (the load itself succeeded); None when it did not fail or was not asked
    seed_error: str | None = None
    # Seconds per phase, summed over ranks: planner (assignment + report round trips), alloc (destination
    # buffers), register (main thread blocked on registration), transfer (first read posted -> last read
    # done), prefault (faulting fresh destination pages in on the registration thread, overlapped with
    # transfer), prefault_wait (the part of transfer that reads waited for it: first touch of fresh
    # memory), verify (checksum work on the verifier thread, mostly overlapped with transfer), verify_tail
    # (waiting for the verifier after the last read), engine (opening the transfer engine), read (disk),
    # other (the rest of `seconds`: manifest parsing, views, ...).
    phases: dict[str, float] = field(default_factory=dict)
    # held for the seed this load becomes: the engine the ranks' registrations are on, the planner client
    engine: TransferEngine | None = field(default=None, repr=False)
    client: PlannerClient | None = field(default=None, repr=False)

    @property
    def weights(self) -> dict[int, RankWeights]:
        """Each rank's weights (the caller's tensors, or buffers + views)."""
        return {rank: served.weights for rank, served in self.ranks.items()}

    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Rank `rank`'s tensors by name."""
        return self.ranks[rank].weights.tensors

    def assign_to(self, module: torch.nn.Module, rank: int = 0) -> None:
        """Point the module's parameters at the loaded views (no copy): `load_state_dict(assign=True)`.

        For `load()` results; `Loader.load_into(module)` pulls into the module's own tensors instead.
        """
        module.load_state_dict(self.state_dict(rank), strict=True, assign=True)

    def close(self) -> None:
        """Stop serving as a seed (drain, deregister), if this load became one; else release the engine
        and registrations held for one."""
        if self.seed is not None:
            self.seed.close()
            self.seed = None
        engine, self.engine = self.engine, None
        if engine is None:
            return
        for served in self.ranks.values():
            if served.registered_on(engine):
                for region in served.regions:
                    with contextlib.suppress(Exception):
                        engine.deregister(region)
            served.regions = []
        with contextlib.suppress(Exception):
            engine.close()
