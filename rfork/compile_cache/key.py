"""The compile-cache key: everything that decides whether a compiled artifact is valid elsewhere.

A compiled graph is only reusable by an instance with the same weights layout (identity and rank),
the same engine and torch builds, the same compile settings and the same processor. The key hashes
the identity with the digest of all the others (the variant), so the planner can check which identity
a key belongs to; a cache is installed only under an equal key. The engine's own cache key (vLLM hashes
its config and the traced source files) may still differ, which is why installation is checked
afterwards from the engine's log (rfork.compile_cache.evidence).
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.contract import compile_cache_key

HEX64 = r"^[0-9a-f]{64}$"


@dataclass(frozen=True, kw_only=True)
class CompileCacheKey:
    """What a compiled artifact depends on; `digest()` is its name on the wire and at the planner."""

    identity_key: str  # SourceIdentity.key() of the weights the graphs were compiled for
    rank: int  # global rank: each rank compiles its own graphs
    engine: str  # "vllm", "sglang"
    engine_version: str
    torch_version: str
    settings_digest: str  # sha256 of the compile settings (the engine's config hash where it has one)
    processor: str  # processor_tag(): CPU architecture and instruction-set flags, or the GPU arch

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        for name in ("identity_key", "engine", "engine_version", "torch_version", "settings_digest"):
            if not getattr(self, name):
                raise ValueError(f"compile cache key: {name} is empty")

    def variant(self) -> str:
        """sha256 (64 hex) of the fields other than the identity, as canonical JSON: what the planner is
        shown to check that the key is the identity's (planner.contract.compile_cache_key)."""
        fields = asdict(self)
        del fields["identity_key"]
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def digest(self) -> str:
        """The key (64 hex): bound to its identity, planner.contract.compile_cache_key(identity, variant)."""
        return compile_cache_key(self.identity_key, self.variant())


def settings_digest(settings: object) -> str:
    """sha256 of compile settings given as JSON-able data (sorted keys; other objects as their repr)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def processor_tag(*, gpu: str | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """`<machine>:<16 hex of the sorted CPU flags>`, plus `:<gpu>` (e.g. "cuda:sm90") when given.

    Inductor emits C++ for the CPU it runs on (AVX-512 or not), so the flags belong in the key.
    """
    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):  # x86 / arm64
                flags.update(value.split())
    except OSError:
        pass
    tag = f"{platform.machine()}:{hashlib.sha256(' '.join(sorted(flags)).encode()).hexdigest()[:16]}"
    return f"{tag}:{gpu}" if gpu else tag
