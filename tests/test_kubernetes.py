"""The Kubernetes manifests render with `kubectl kustomize` (no cluster needed), and what they give
kvloopd is a configuration kvloopd accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import KVLOOPD

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE = ROOT / "deploy/kubernetes"


def render(folder: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing: apt-get install kubernetes-client (.ci/run does)"
    result = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {
        (
            d["kind"],
            d["metadata"]["name"].rsplit("-", 1)[0] if d["kind"] == "ConfigMap" else d["metadata"]["name"],
        ): d
        for d in docs
    }


@pytest.mark.parametrize(("folder", "replicas"), [("base", 1), ("overlays/ha", 2)])
def test_manifests_render_and_kvloopd_accepts_its_config(tmp_path, folder, replicas):
    docs = _by_kind(render(folder))
    assert {k for k, _ in docs} == {"Namespace", "ConfigMap", "Deployment", "Service"}
    assert all(d["metadata"].get("namespace") == "kvloop" for (k, _), d in docs.items() if k != "Namespace")
    kvloopd = docs["Deployment", "kvloopd"]
    assert kvloopd["spec"]["replicas"] == replicas
    pod = kvloopd["spec"]["template"]["spec"]
    [container] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"]  # kvloopd's gRPC health service
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    # the Deployment mounts the generated ConfigMap (name with its content hash)
    config_map = docs["ConfigMap", "kvloopd-config"]
    mounted = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert mounted == {config_map["metadata"]["name"]}
    service_ports = {p["name"]: p["targetPort"] for p in docs["Service", "kvloopd"]["spec"]["ports"]}
    assert service_ports == {"grpc": "grpc", "metrics": "metrics"}

    # what the pod gets is a configuration kvloopd accepts (a stand-in for the mounted Secret)
    config = tmp_path / "kvloopd.toml"
    config.write_text(config_map["data"]["kvloopd.toml"])
    password = tmp_path / "password"
    password.write_text("from-the-secret\n")
    text = config.read_text().replace("/etc/kvloop/secrets/password", str(password))
    config.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLOOP_")}
    checked = subprocess.run(
        [KVLOOPD, "--config", str(config), "--check-config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    assert int(ports["grpc"]) == 50051 and '"listen": "0.0.0.0:50051"' in checked.stdout
    # listening on the pod network without TLS or tokens: kvloopd says so
    assert "beyond loopback with neither [tls] nor [[tokens]]" in checked.stderr
