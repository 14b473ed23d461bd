"""The `sglang.srt.plugins` entry point: adds `--load-format rfork` and the hooks that route it.

SGLang calls `register()` in every one of its processes (launcher, schedulers, detokenizer), so it
only extends the `--load-format` choices and registers hooks by dotted name; SGLang applies them
after all plugins ran. The hook bodies import rfork's loader lazily, and only for `rfork`:

- AROUND `LoadConfig._verify_load_format`: keeps the string "rfork" (SGLang would turn it into its
  `LoadFormat` enum, which has no such member); every other value goes through SGLang unchanged, so
  unknown formats are still rejected.
- AROUND `get_model_loader` (SGLang's loader selection): "rfork" gets `RforkModelLoader`; every
  other format gets what SGLang would have chosen.
- AFTER `ModelRunner.load_model`: the instance becomes a seed of what it loaded.
- BEFORE `_set_envs_and_config` (SGLang's main process, before it installs its SIGQUIT handler):
  imports what the drain needs, so that the handler never imports.
- BEFORE `kill_process_tree`: SGLang's main process drains the seeds before SIGKILLing schedulers
  (rfork.integrations.hook.drain; it drains them at exit too).
"""

from __future__ import annotations

import logging
from typing import Any

from rfork.integrations.hook import drain

log = logging.getLogger(__name__)

LOAD_FORMAT = "rfork"

HOOK_TARGETS = {
    "verify_load_format": "sglang.srt.configs.load_config.LoadConfig._verify_load_format",
    "get_model_loader": "sglang.srt.model_loader.loader.get_model_loader",
    "load_model": "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
    "kill_process_tree": "sglang.srt.utils.common.kill_process_tree",
    "set_envs_and_config": "sglang.srt.entrypoints.engine._set_envs_and_config",
}


def register() -> None:
    """Entry point: extend `--load-format` and register the hooks (cheap: nothing heavy imported)."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register(HOOK_TARGETS["verify_load_format"], keep_rfork_load_format, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS["get_model_loader"], select_model_loader, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS["load_model"], after_load_model, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS["kill_process_tree"], before_kill_process_tree, HookType.BEFORE)
    HookRegistry.register(HOOK_TARGETS["set_envs_and_config"], before_signal_handlers, HookType.BEFORE)
    drain.arm_drain_in_main_process()


def is_rfork_format(load_format: Any) -> bool:
    """True only for the string "rfork" (any case); SGLang's enum members and classes are never it."""
    return type(load_format) is str and load_format.lower() == LOAD_FORMAT


def keep_rfork_load_format(original: Any, load_config: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `LoadConfig._verify_load_format`."""
    if is_rfork_format(load_config.load_format):
        load_config.load_format = LOAD_FORMAT
        return None
    return original(load_config, *args, **kwargs)


def select_model_loader(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `get_model_loader(load_config, model_config=None)`."""
    load_config = kwargs.get("load_config", args[0] if args else None)
    if load_config is not None and is_rfork_format(load_config.load_format):
        # imported here: SGLang imports the plugin in each of its processes (start-up time)
        from rfork.integrations.sglang.model_loader import RforkModelLoader

        return RforkModelLoader(load_config)
    return original(*args, **kwargs)


def after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `ModelRunner.load_model`: an rfork-loaded runner becomes a seed of what it loaded."""
    loader = getattr(runner, "loader", None)
    if loader is None or type(loader).__name__ != "RforkModelLoader":
        return
    if getattr(runner, "is_draft_worker", False):
        log.info("rfork: a draft model's weights are not served")
        loader.release()  # the pull's engine and registrations: no seed adopts them
        return
    loader.become_seed_soon(runner.model)
    return


def before_kill_process_tree(*_args: Any, **_kwargs: Any) -> None:
    """BEFORE `kill_process_tree`: drain this server's seeds before their schedulers die."""
    if drain.armed_here():
        drain.drain_recorded()


def before_signal_handlers(*_args: Any, **_kwargs: Any) -> None:
    """BEFORE `_set_envs_and_config`, which installs SGLang's SIGQUIT handler: the drain it runs
    (before_kill_process_tree) must find its imports done."""
    if drain.armed_here():
        drain.prepare()
