"""backends' public surface is deliberate: the names `from backends import ...` offers, and those of its
paths, are pinned here, so moving a module never breaks a user silently."""

from __future__ import annotations

import subprocess
import sys

import backends

ENGINE = [
    "MAX_MESSAGE",
    "BackendUnavailable",
    "Channel",
    "ChannelError",
    "DigestJob",
    "EngineAddress",
    "EngineClosed",
    "ImmRange",
    "MemoryRegionDescriptor",
    "Message",
    "PeerUnreachable",
    "Region",
    "RemoteAccessError",
    "TransferEngine",
    "TransferError",
    "TransferTimeout",
    "native_digests_available",
    "provider_available",
]
PATHS = ["kv", "moe", "rl"]


def test_backends_exports_exactly_the_engine_its_types_and_the_paths() -> None:
    assert sorted(backends.__all__) == sorted(ENGINE + PATHS)
    for name in backends.__all__:
        assert getattr(backends, name) is not None, name


def test_the_paths_export_their_public_names() -> None:
    assert sorted(backends.kv.__all__) == [
        "IncomingRequest", "KvError", "KvGeometry", "KvPool", "KvReceiver", "KvSender", "MAX_LAYERS",
        "OutgoingRequest", "layer_spans",
    ]
    assert sorted(backends.rl.__all__) == [
        "RLError", "RLReceiver", "RLTrainer", "RankShard", "ReceiverSchedule", "Run", "Snapshot",
        "TensorSpec", "TrainerRank", "UpdateResult", "build_receiver_schedule", "model_specs",
        "shard_layout", "specs_digest",
    ]
    assert sorted(backends.moe.__all__) == [
        "Dispatched", "ExpertParallel", "MoEError", "MoETimeout", "moe_reference",
    ]
    for module in (backends.kv, backends.rl, backends.moe):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"


def test_every_error_is_a_transfer_error() -> None:
    for error in (backends.kv.KvError, backends.rl.RLError, backends.moe.MoEError, backends.ChannelError):
        assert issubclass(error, backends.TransferError)


def test_importing_backends_loads_no_path_and_no_torch() -> None:
    probe = "import backends, sys; print(sorted(m for m in sys.modules if m in ('torch', 'backends.kv', "
    probe += "'backends.rl', 'backends.moe')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_pure_modules_need_neither_the_binding_nor_the_engine() -> None:
    probe = "import backends.layout, backends.sharding, backends.nccl, sys; "
    probe += "print(sorted(m for m in sys.modules if m.startswith(('backends.providers', 'backends.eng'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
