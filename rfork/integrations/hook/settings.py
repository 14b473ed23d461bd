"""Hook settings: `--model-loader-extra-config` keys first, then `RFORK_*` variables, then defaults.

The planner tokens come only from the environment: SGLang and vLLM log their whole argument list at
startup, so a token in the extra config would end up in every log; it is refused with a message saying
so. A hook pulls with the load role and publishes its seed with the register role: either one token
holding both (`$RFORK_TOKEN`; the planner's RFORK_INSTANCE_TOKEN is such a token) or a pair,
`$RFORK_TOKEN` (load) and `$RFORK_REGISTER_TOKEN` (register); each may be a file, `$..._FILE`.
The SGLang and vLLM hooks take the same settings (their DefaultModelLoaders take the same pass-through keys).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rfork.env_secrets import SecretFileError, env_secret
from rfork.errors import ConfigurationError

if TYPE_CHECKING:
    from rfork.pull.options import LoadOptions

MODES = ("checkpoint", "parameters")
# Keys SGLang's and vLLM's DefaultModelLoader accept in the extra config; passed on when rfork falls back.
DEFAULT_LOADER_KEYS = frozenset({"enable_multithread_load", "num_threads"})
# extra-config key -> environment variable
ENV_FOR_KEY = {
    "planner_url": "RFORK_PLANNER_URL",
    "mode": "RFORK_MODE",
    "providers": "RFORK_PROVIDERS",
    "serve": "RFORK_SERVE",
    "model": "RFORK_MODEL_NAME",
    "revision": "RFORK_REVISION",
    "transfer_timeout_s": "RFORK_TRANSFER_TIMEOUT_S",
    "compile_cache": "RFORK_COMPILE_CACHE",
    "require_seed": "RFORK_REQUIRE_SEED",
    "metrics_port": "RFORK_METRICS_PORT",
    "metrics_host": "RFORK_METRICS_HOST",
    "require_crypto_digest": "RFORK_REQUIRE_CRYPTO_DIGEST",
}
TOKEN_ENV = "RFORK_TOKEN"
TOKEN_FILE_ENV = "RFORK_TOKEN_FILE"
REGISTER_TOKEN_ENV = "RFORK_REGISTER_TOKEN"
REGISTER_TOKEN_FILE_ENV = "RFORK_REGISTER_TOKEN_FILE"


class SettingsError(ConfigurationError):
    """A hook setting is missing, unknown or malformed; the message names the key or variable."""

    def __init__(self, message: str, *, setting: str = "hook") -> None:
        super().__init__(message, setting=setting)


@dataclass(frozen=True, kw_only=True)
class HookSettings:
    """What a framework hook needs to find a source and to publish itself."""

    planner_url: str | None = None
    token: str | None = None  # the load role (and register, without a register_token)
    register_token: str | None = None  # the register role, to become a seed (default: token)
    mode: str = "checkpoint"
    providers: tuple[str, ...] = ("tcp",)
    serve: bool = True  # become a seed after loading
    model: str | None = None  # identity model name (default: config.json's name or the path's last part)
    revision: str = "main"
    transfer_timeout_s: float = 5.0
    compile_cache: bool = True  # fetch the engine's compile cache from a seed, and serve one's own
    require_seed: bool = False  # no seed served the weights: fail the load instead of the disk fallback
    # rfork's Prometheus metrics (rfork.metrics) on metrics_port + the worker's global rank; None: off
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    require_crypto_digest: bool = False  # pull only under BLAKE3 (LoadOptions.require_crypto_digest)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SettingsError(f"rfork mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not self.providers:
            raise SettingsError("rfork providers: give at least one (tcp, shm, efa, verbs, nccl)")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise SettingsError(f"rfork metrics_port must be a port number, got {self.metrics_port}")
        if self.transfer_timeout_s <= 0:
            raise SettingsError(f"rfork transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.planner_url is not None:
            _planner_url(self.planner_url)

    @classmethod
    def resolve(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> HookSettings:
        """Settings from the framework's extra-config dict and the environment; raises SettingsError."""
        env = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        if "token" in extra:
            raise SettingsError(
                "do not put the planner token in --model-loader-extra-config (the server logs its "
                f"arguments); set ${TOKEN_ENV} instead"
            )
        unknown = set(extra) - set(ENV_FOR_KEY) - DEFAULT_LOADER_KEYS
        if unknown:
            raise SettingsError(
                f"unknown --model-loader-extra-config key(s) {sorted(unknown)} for --load-format rfork; "
                f"known: {sorted(set(ENV_FOR_KEY) | DEFAULT_LOADER_KEYS)}"
            )
        raw: dict[str, Any] = {}
        for key, var in ENV_FOR_KEY.items():
            if key in extra:
                raw[key] = extra[key]
            elif env.get(var):
                raw[key] = env[var]
        kwargs: dict[str, Any] = {
            "token": _token(env, TOKEN_ENV),
            "register_token": _token(env, REGISTER_TOKEN_ENV),
        }
        if "planner_url" in raw:
            kwargs["planner_url"] = _planner_url(_text(raw["planner_url"], "planner_url"))
        if "mode" in raw:
            kwargs["mode"] = _text(raw["mode"], "mode").lower()
        if "providers" in raw:
            kwargs["providers"] = _providers(raw["providers"])
        if "serve" in raw:
            kwargs["serve"] = _flag(raw["serve"], "serve")
        if "compile_cache" in raw:
            kwargs["compile_cache"] = _flag(raw["compile_cache"], "compile_cache")
        if "require_seed" in raw:
            kwargs["require_seed"] = _flag(raw["require_seed"], "require_seed")
        if "require_crypto_digest" in raw:
            kwargs["require_crypto_digest"] = _flag(raw["require_crypto_digest"], "require_crypto_digest")
        if "model" in raw:
            kwargs["model"] = _text(raw["model"], "model")
        if "revision" in raw:
            kwargs["revision"] = _text(raw["revision"], "revision")
        if "metrics_port" in raw:
            try:
                kwargs["metrics_port"] = int(raw["metrics_port"])
            except (TypeError, ValueError) as exc:
                given = raw["metrics_port"]
                raise SettingsError(f"rfork metrics_port: not a port number: {given!r}") from exc
        if "metrics_host" in raw:
            kwargs["metrics_host"] = _text(raw["metrics_host"], "metrics_host")
        if "transfer_timeout_s" in raw:
            try:
                kwargs["transfer_timeout_s"] = float(raw["transfer_timeout_s"])
            except (TypeError, ValueError) as exc:
                raise SettingsError(
                    f"rfork transfer_timeout_s: not a number: {raw['transfer_timeout_s']!r}"
                ) from exc
        return cls(**kwargs)

    @property
    def seed_token(self) -> str | None:
        """The token a seed registers with: register_token, else the one token."""
        return self.register_token or self.token

    def to_extra_config(self) -> dict[str, Any]:
        """The extra-config keys for these settings (never the token); what the launcher passes on."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "providers": list(self.providers),
            "serve": self.serve,
            "revision": self.revision,
            "transfer_timeout_s": self.transfer_timeout_s,
            "compile_cache": self.compile_cache,
        }
        if self.require_seed:
            out["require_seed"] = True
        if self.require_crypto_digest:
            out["require_crypto_digest"] = True
        if self.planner_url:
            out["planner_url"] = self.planner_url
        if self.model:
            out["model"] = self.model
        if self.metrics_port is not None:
            out["metrics_port"] = self.metrics_port
            out["metrics_host"] = self.metrics_host
        return out

    def load_options(self) -> LoadOptions:
        """Options of the hook's own pull: these providers and timeout; the hook seeds by itself after
        the framework's post-load steps, adopting the pull's engine and registrations when it serves."""
        # imported here: the frameworks import the plugin in each of their processes (start-up time)
        from rfork.pull.options import LoadOptions

        return LoadOptions(
            providers=self.providers,
            transfer_timeout_s=self.transfer_timeout_s,
            become_seed=False,
            seed_later=self.serve,
            pull_torch_threads=None,
            require_seed=self.require_seed,
            require_crypto_digest=self.require_crypto_digest,
        )


def default_loader_config(load_config: Any, load_format: Any) -> Any:
    """The framework's `load_config` (a dataclass) for its own DefaultModelLoader: `load_format`, and
    only the extra-config keys that loader understands."""
    return dataclasses.replace(
        load_config,
        load_format=load_format,
        model_loader_extra_config=default_loader_extra(load_config.model_loader_extra_config),
    )


def default_loader_extra(extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The part of the extra config the framework's DefaultModelLoader understands (it rejects the rest)."""
    return {k: v for k, v in (extra_config or {}).items() if k in DEFAULT_LOADER_KEYS}


def _token(env: Mapping[str, str], name: str) -> str | None:
    """$name, else the contents of the file $name_FILE names (rfork.env_secrets); SettingsError when
    that file is unreadable or empty, or both are set."""
    try:
        return env_secret(name, env)
    except SecretFileError as exc:
        raise SettingsError(str(exc), setting=name) from exc


def _planner_url(value: str) -> str | None:
    """The planner URL checked (rfork.pull.checks): a typo is a SettingsError, never a disk load."""
    if not value:
        return None
    # imported here: the frameworks import the plugin in each of their processes (start-up time)
    from rfork.pull.checks import check_planner_url

    try:
        return check_planner_url(value)
    except ValueError as exc:
        raise SettingsError(f"rfork planner_url: {exc}") from exc


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise SettingsError(f"rfork {key}: expected a string, got {value!r}")
    return value.strip()


def _providers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise SettingsError(f"rfork providers: expected a list or a comma-separated string, got {value!r}")
    out = tuple(p.strip() for p in items if p.strip())
    if not out:
        raise SettingsError("rfork providers: empty")
    return out


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"rfork {key}: expected true or false, got {value!r}")
