"""deploy/ stays true to the CLI and to the schemas it is written against.

- every rfork command line in compose, Kubernetes and systemd parses, and carries no secret;
- the Kubernetes manifests validate in strict mode against the Kubernetes API schemas that
  kubernetes-validate bundles (no network), and the check refuses an unknown field;
- the compose file holds together: every service it names, secret it mounts, `*_FILE` it reads and
  image target it builds exists, and no service both uses the host network and names others by name;
- the Dockerfiles pass hadolint, run as non-root with a healthcheck, and the planner stage has neither
  torch nor a compiler.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rfork.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
IMAGES = DEPLOY / "images"
# the Kubernetes versions the manifests are checked against: an old one still supported by the big
# clouds, and the newest schemas kubernetes-validate bundles
KUBERNETES_VERSIONS = ("1.30", "latest")
RFORK_IMAGES = ("rfork-planner", "rfork-loader", "rfork-vllm", "rfork-sglang")


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file:kind/name, object) of every Kubernetes object in deploy/kubernetes (not kustomization.yaml)."""
    out = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _documents(path):
            out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _kubernetes_commands() -> list[tuple[str, list[str]]]:
    """The rfork argv of every container of an rfork image (their ENTRYPOINT is `rfork`)."""
    found = []
    for where, obj in _manifests():
        for container in _containers(obj):
            if container["image"].split(":")[0] not in RFORK_IMAGES:
                continue
            argv = [*container.get("command", ["rfork"]), *container.get("args", [])]
            assert Path(argv[0]).name == "rfork", f"{where}: {container['name']} runs {argv[0]}, not rfork"
            found.append((f"{where}:{container['name']}", argv[1:]))
    return found


def _compose_commands() -> list[tuple[str, list[str]]]:
    """The `command` of every service on an rfork image (it replaces the image's CMD; ENTRYPOINT is rfork)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return [
        (f"docker-compose.yml:{name}", svc["command"])
        for name, svc in services.items()
        if str(svc.get("image", "")).split(":")[0] in RFORK_IMAGES and "command" in svc
    ]


def _systemd_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        for line in path.read_text().splitlines():
            m = re.match(r"^Exec\w+=(\S*/rfork)\s+(.*)$", line)
            if m:
                found.append((path.name, shlex.split(m.group(2))))
    return found


COMMANDS = _kubernetes_commands() + _compose_commands() + _systemd_commands()


def test_deploy_files_were_found() -> None:
    names = {where.split(":")[0] for where, _ in COMMANDS}
    assert {
        "docker-compose.yml",
        "planner.yaml",
        "vllm.yaml",
        "sglang.yaml",
        "pre-seed.yaml",
        "rfork-planner.service",
        "rfork-seed@.service",
    } <= names


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_command_line_parses(where: str, argv: list[str]) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"{where}: `rfork {' '.join(argv)}` is refused by the CLI (exit {exc.code})")
    assert args._module is not None


SERVER_COMMANDS = [(w, a) for w, a in COMMANDS if a[0] in ("vllm", "sglang")]


@pytest.mark.parametrize(("where", "argv"), SERVER_COMMANDS, ids=[w for w, _ in SERVER_COMMANDS])
def test_server_command_passes_the_hooks_own_checks(
    where: str, argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rfork vllm|sglang --dry-run` runs the checks a real start runs and prints the server's command."""
    from rfork.cli import main

    monkeypatch.setenv("RFORK_TOKEN_FILE", "/var/run/secrets/rfork/instance-token")  # as the pods have it
    assert main([argv[0], "--dry-run", *argv[1:]]) == 0, capsys.readouterr().err
    assert "--load-format rfork" in capsys.readouterr().out, where


SECRET_FLAGS = ("--db", "--token", "--register-token")
SECRET_TEXT = re.compile(r"://[^/\s:@]+:[^@\s]+@|rfi_|secret|password", re.IGNORECASE)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_no_secret_on_a_command_line(where: str, argv: list[str]) -> None:
    """Database URLs (with their password) and tokens go in files or the environment: argv is readable
    by every user of the host."""
    for flag in SECRET_FLAGS:
        assert flag not in argv, f"{where}: {flag} on the command line; use its RFORK_* variable"
    for word in argv:
        assert not SECRET_TEXT.search(word), f"{where}: {word!r} looks like a secret on the command line"


# ---- Kubernetes: strict schemas -------------------------------------------------------------------


def _validate(obj: dict[str, Any], version: str) -> None:
    """kubernetes_validate in strict mode (unknown fields refused); any failure raises."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(obj, latest_version() if version == "latest" else version, strict=True)


MANIFESTS = _manifests()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("where", "obj"), MANIFESTS, ids=[w for w, _ in MANIFESTS])
def test_manifest_is_valid_in_strict_mode(where: str, obj: dict[str, Any], version: str) -> None:
    _validate(obj, version)


def test_strict_validation_refuses_an_unknown_field() -> None:
    from kubernetes_validate.utils import ValidationError

    where, deployment = next((w, o) for w, o in MANIFESTS if o["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"memory": "1Gi"}}  # a typo
    with pytest.raises(ValidationError, match="resource"):
        _validate(bad, "latest")
    _validate(deployment, "latest")  # the original, for contrast


def test_kustomization_lists_every_manifest() -> None:
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]) == files


def _claims_and_secrets() -> tuple[set[str], set[tuple[str, str]]]:
    claims = {o["metadata"]["name"] for _, o in MANIFESTS if o["kind"] == "PersistentVolumeClaim"}
    mounted = set()
    for _, obj in MANIFESTS:
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "secret" in volume:
                for item in volume["secret"].get("items", []):
                    mounted.add((volume["secret"]["secretName"], item["key"]))
    return claims, mounted


def test_the_pods_hold_together() -> None:
    """Claims exist, pods run as non-root with memory requests, `*_FILE` paths lie on a mounted secret."""
    claims, _ = _claims_and_secrets()
    for where, obj in MANIFESTS:
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{where}: undefined claim"
        mounts = {m["mountPath"]: m["name"] for c in _containers(obj) for m in c.get("volumeMounts", [])}
        secret_files = {}
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                path = next(p for p, n in mounts.items() if n == volume["name"])
                items = volume["secret"].get("items")
                keys = [i["path"] for i in items] if items else None
                secret_files[path] = keys
        for container in _containers(obj):
            assert "memory" in container["resources"]["requests"], f"{where}: {container['name']} memory"
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            for env in container.get("env", []):
                if env["name"].endswith("_FILE"):
                    directory, _, key = env["value"].rpartition("/")
                    assert directory in secret_files, f"{where}: {env['name']} is not on a mounted secret"
                    keys = secret_files[directory]
                    assert keys is None or key in keys, f"{where}: {env['name']} names a key not mounted"
                elif "value" in env:
                    assert not SECRET_TEXT.search(str(env["value"])), f"{where}: {env['name']} holds a secret"


def test_device_resources_are_the_device_plugins_names() -> None:
    resources = {
        name
        for _, obj in MANIFESTS
        for container in _containers(obj)
        for name in container["resources"].get("limits", {})
    }
    assert {"nvidia.com/gpu", "vpc.amazonaws.com/efa", "rdma/rdma_shared_device_a"} <= resources
    assert "rdma/hca" not in resources


# ---- compose ---------------------------------------------------------------------------------------


def _dockerfile_targets(path: Path) -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", path.read_text(), re.MULTILINE | re.IGNORECASE))


def test_compose_holds_together() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services, secrets = doc["services"], doc["secrets"]
    for name, svc in services.items():
        assert svc.get("network_mode") != "host", f"{name}: host networking cannot resolve service names"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on {dep}, which is no service"
        for word in svc.get("command", []):
            for host in re.findall(r"https?://([\w.-]+):", word):
                assert host in services, f"{name}: {word} names {host}, which is no service"
        mounted = set(svc.get("secrets", []))
        assert mounted <= set(secrets), f"{name} mounts an undefined secret"
        for var, value in svc.get("environment", {}).items():
            if var.endswith("_FILE"):
                assert value.startswith("/run/secrets/"), f"{name}: {var}"
                assert value.removeprefix("/run/secrets/") in mounted, f"{name}: {var} is not mounted"
            if not var.endswith("_FILE"):
                assert not SECRET_TEXT.search(str(value)), f"{name}: {var} holds a secret"
        build = svc.get("build")
        if build:
            dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
            assert build["target"] in _dockerfile_targets(dockerfile), f"{name}: no stage {build['target']}"
    for name, secret in secrets.items():
        assert secret["file"].startswith("./secrets/"), name
    ignored = (COMPOSE.parent / ".gitignore").read_text().split()
    assert "secrets/" in ignored, "the secrets must never be committed"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_config_is_accepted(tmp_path: Path) -> None:
    """`docker-compose config` reads the file as written (secret files stand in as empty files)."""
    work = tmp_path / "compose"
    work.mkdir()
    shutil.copy(COMPOSE, work / "docker-compose.yml")
    (work / "secrets").mkdir()
    for secret in yaml.safe_load(COMPOSE.read_text())["secrets"].values():
        (work / secret["file"]).touch()
    proc = subprocess.run(
        ["docker-compose", "-f", str(work / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# ---- images ----------------------------------------------------------------------------------------


def _stages(path: Path) -> dict[str, str]:
    """Each named stage's instructions (FROM line to the next FROM, comments left out)."""
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
    out: dict[str, str] = {}
    for block in re.split(r"^(?=FROM\s)", text, flags=re.MULTILINE)[1:]:
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", block, re.IGNORECASE)
        assert m
        out[m.group(1) or f"unnamed{len(out)}"] = block
    return out


def test_final_images_are_non_root_with_a_healthcheck() -> None:
    stages = _stages(IMAGES / "Dockerfile")
    for final in ("planner", "loader"):
        text = stages[final]
        assert re.search(r"^USER\s+10001$", text, re.MULTILINE), final
        assert "HEALTHCHECK" in text, final
        assert 'ENTRYPOINT ["rfork"]' in text, final
    assert "torch" not in stages["planner"] + stages["planner-env"]
    for tool in ("gcc", "-dev", "pip install"):
        assert tool not in stages["planner"], f"the planner image installs {tool}"
        assert tool not in stages["loader"], f"the loader image installs {tool}"
    gpu = (IMAGES / "gpu.Dockerfile").read_text()
    assert re.search(r"^USER\s+10001$", gpu, re.MULTILINE)
    assert "HEALTHCHECK" in gpu


def test_images_install_what_the_setup_script_installs() -> None:
    """The wheel is built with the packages scripts/dev.sh installs, and the loader's torch is its pin."""
    stages = _stages(IMAGES / "Dockerfile")
    script = (ROOT / "scripts" / "dev.sh").read_text()
    for package in ("libfabric-dev", "libxxhash-dev"):
        assert package in stages["build"]
        assert package in script
    assert "libfabric1" in stages["loader"]
    pin = re.search(r"^TORCH_PIN=torch==([\d.]+)", script, re.MULTILINE)
    assert pin
    assert f"ARG TORCH_VERSION={pin.group(1)}" in stages["loader-env"]


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="no hadolint (the dev extra brings it)")
def test_dockerfiles_pass_hadolint() -> None:
    files = [str(p) for p in sorted(IMAGES.glob("*Dockerfile"))]
    proc = subprocess.run(
        ["hadolint", "--no-color", "--config", str(IMAGES / ".hadolint.yaml"), *files],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, values = expr["key"], expr.get("values", [])
        held = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if not held[expr["operator"]]:
            return False
    return True


def _admitted(source: dict[str, str], dest: dict[str, str], port: int, protocol: str = "TCP") -> bool:
    """Whether deploy/kubernetes' NetworkPolicies let a pod labelled `source` open `port` on a pod
    labelled `dest` of the same namespace (NetworkPolicy semantics: a pod no policy selects takes
    everything; else the union of the selecting policies' rules; a rule without `from` or `ports` matches
    every source or port; a port entry without a number matches every port of its protocol)."""
    policies = [obj for _, obj in MANIFESTS if obj["kind"] == "NetworkPolicy"]
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dest)]
    if not [p for p in selecting if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(
                set(peer) == {"podSelector"} and _selects(peer["podSelector"], source) for peer in peers
            ):
                continue
            ports = rule.get("ports")
            if ports is None or any(
                p.get("protocol", "TCP") == protocol
                and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"]))
                for p in ports
            ):
                return True
    return False


def _pod_labels(kind: str, name: str) -> dict[str, str]:
    (obj,) = [o for _, o in MANIFESTS if o["kind"] == kind and o["metadata"]["name"] == name]
    return dict(obj["spec"]["template"]["metadata"]["labels"])


def test_the_network_policy_admits_who_must_reach_a_seed_and_no_one_else() -> None:
    """Which pod may open which port, from the manifests' own pod labels: the planner's health probe
    reaches a seed's control endpoint (an ephemeral port), the fleet's pods reach one another's
    transport and control ports, a client reaches only the inference APIs."""
    planner = _pod_labels("Deployment", "rfork-planner")
    seeds = {
        "vllm": (_pod_labels("Deployment", "rfork-vllm-llama"), 8000),
        "sglang": (_pod_labels("Deployment", "rfork-sglang-llama"), 30000),
        "pre-seed": (_pod_labels("DaemonSet", "rfork-pre-seed-llama"), None),
    }
    client = {"app.kubernetes.io/name": "gateway"}
    control_port, transport_port = 41234, 47592  # both picked by the OS when the seed starts
    for name, (seed, api_port) in seeds.items():
        assert _admitted(planner, seed, control_port), f"planner -> {name}: the health probe is blocked"
        assert not _admitted(planner, seed, control_port, protocol="UDP"), f"planner -> {name} over UDP"
        for other, (peer, _) in seeds.items():
            assert _admitted(peer, seed, transport_port), f"{other} -> {name} transport"
            assert _admitted(peer, seed, control_port), f"{other} -> {name} control endpoint"
        assert not _admitted(client, seed, control_port), f"client -> {name} control endpoint"
        assert not _admitted(client, seed, transport_port), f"client -> {name} transport"
        if api_port is not None:
            assert _admitted(client, seed, api_port), f"client -> {name} inference API"
    assert _admitted(seeds["vllm"][0], planner, 8470)  # the planner takes the fleet's requests
