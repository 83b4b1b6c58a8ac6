"""kubectl against the real API server: apply the examples, get, and a transcript."""

from __future__ import annotations

import os
import pathlib
import shlex

import yaml

from tests.operator.harness import OperatorThread, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRANSCRIPT = ROOT / "docs" / "transcripts" / "operator-kubectl.txt"


def test_kubectl_apply_examples(control_plane, namespace):
    out = control_plane.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples")).stdout
    assert "lorabase.loraplane.dev/demo created" in out
    assert "loraadapter.loraplane.dev/support-bot created" in out
    listed = control_plane.kubectl("get", "loraadapters,lorabases", "-n", namespace).stdout
    assert "support-bot" in listed and "demo" in listed
    again = control_plane.kubectl("apply", "-n", namespace, "-f", str(ROOT / "examples")).stdout
    # Secrets written with stringData always read "configured" (the server stores only data); our kinds must not.
    assert "loraadapter.loraplane.dev/support-bot unchanged" in again
    assert "lorabase.loraplane.dev/demo unchanged" in again


def test_kubectl_get_shows_the_reconciled_adapter(world, artifacts):
    """The closing note's transcript: an example adapter, reconciled to Ready, as `kubectl get` shows it.

    LORAPLANE_WRITE_TRANSCRIPTS=1 pytest tests/operator/test_kubectl.py  rewrites docs/transcripts/operator-kubectl.txt
    """
    base = yaml.safe_load((ROOT / "examples" / "lorabase.yaml").read_text())
    adapter = yaml.safe_load((ROOT / "examples" / "loraadapter.yaml").read_text())
    ours = world.base_manifest("demo", replicas=2)
    base["metadata"]["namespace"] = adapter["metadata"]["namespace"] = world.ns
    base["spec"].update(
        {k: ours["spec"][k] for k in ("model", "storage", "trust", "adminTokenSecretRef", "engine")}
    )
    base["spec"].pop("auth")
    adapter["spec"]["source"]["uri"] = artifacts.uris["support_bot"]
    adapter["spec"]["version"] = "v1"
    manifests = world.plane.workdir / "apply.yaml"
    manifests.write_text(yaml.safe_dump_all([base, adapter]))
    with OperatorThread(world):
        applied = world.plane.kubectl("apply", "-f", str(manifests)).stdout
        world.add_pod(), world.add_pod()
        world.wait_ready("support-bot", version="v1")
        wait_for(lambda: "True" in world.plane.kubectl("get", "lorabase", "demo", "-n", world.ns).stdout)
        commands = [
            ("get", "loraadapters", "-n", world.ns),
            ("get", "loraadapters", "-n", world.ns, "-o", "wide"),
            ("get", "lorabases", "-n", world.ns),
            ("get", "loraadapter", "support-bot", "-n", world.ns, "-o",
             r'jsonpath={range .status.pods[*]}{.name}{"\t"}{.version}{"\t"}{.state}{"\n"}{end}'),
        ]  # fmt: skip
        lines = [
            "$ kubectl apply -f lorabase+loraadapter.yaml  # examples/, pointed at the test S3 and pods",
            applied,
        ]
        for command in commands:
            lines += [f"$ kubectl {shlex.join(command)}", world.plane.kubectl(*command).stdout]
    text = "\n".join(lines)
    assert "support-bot" in text and "True" in text and "v1" in text
    if os.environ.get("LORAPLANE_WRITE_TRANSCRIPTS") != "1":  # ages and names vary: refresh on demand
        return
    TRANSCRIPT.parent.mkdir(parents=True, exist_ok=True)
    TRANSCRIPT.write_text(
        "# kubectl 1.37 against the tests' kube-apiserver 1.37 (tests/controlplane), with the operator running\n"
        "# in-process and two fake server pods; written by tests/operator/test_kubectl.py.\n" + text
    )
