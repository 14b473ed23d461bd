"""One exception hierarchy for rfork/ (the transport and the planner have their own)."""

from __future__ import annotations

# torch is the `torch` extra (a planner-only install leaves it out); said where an import of it fails
NEEDS_TORCH = (
    "loading, seeding and digesting need torch, which a planner-only install leaves out: "
    "pip install 'rfork[torch]' (or the torch build your framework uses)"
)


class RforkError(Exception):
    """Base of every error rfork/ raises on purpose."""


class ManifestError(RforkError, ValueError):
    """A rank manifest is malformed or disagrees with itself."""


class ChecksumMismatch(RforkError):
    """A pulled tensor's bytes do not match the seed's published checksum."""


class CheckpointError(RforkError):
    """A checkpoint directory is missing, malformed, or cannot be sharded as asked."""


class PullError(RforkError):
    """Pulling from one candidate failed (transport, timeout, checksum); the next one may work."""


class LoadFailed(RforkError):
    """Every candidate failed and there was no disk fallback."""


class LayoutError(RforkError, ValueError):
    """Tensors cannot be served or pulled in place (not contiguous, mixed devices, ...)."""


class DestinationMismatch(RforkError, ValueError):
    """The caller's destination tensors disagree with the manifest (names, dtypes or shapes)."""


class ConfigurationError(RforkError, ValueError):
    """A setting is wrong (a malformed planner URL, an unknown or absent provider, a missing or refused
    token): no retry or fallback can fix it, so the load stops at once. `setting` names it (`planner_url`,
    `providers`, `token`, `register_token`, `protocol`); the message says what to change."""

    def __init__(self, message: str, *, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class SeedRequired(RforkError):
    """No seed served a rank and the load was told not to fall back (`LoadOptions.require_seed`); the
    message says why no seed served it."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a load (`signum` says which). A KeyboardInterrupt, so that no
    `except Exception` swallows it: the load releases its lease and engine on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum
