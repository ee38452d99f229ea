"""Rendering and validating helm/carpool without a cluster: the chart's test kit.

`render(values)` runs Helm itself (helm-python-sdk binds Helm's Go SDK, so schema validation, template
functions and hooks behave as in `helm template`) and returns the parsed objects. `validate(obj, version)`
checks one object against the Kubernetes schema of that version (kubernetes-validate, strict: unknown
fields fail) or, for the custom resources the chart renders, against the project's own schemas in
tests/packaging/schemas/ whose pod templates and metadata resolve to the same Kubernetes definitions.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "carpool"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "carpool-test"
NAMESPACE = "ml"

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
OLDEST_KUBERNETES = "1.29.0"
NEWEST_KUBERNETES = kubernetes_validate.latest_version()
KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, NEWEST_KUBERNETES)

CUSTOM_SCHEMAS = {
    ("ray.io/v1", "RayService"): "rayservice-ray.io-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com-v1.json",
}


@dataclass(frozen=True)
class Manifest:
    """One rendered object and the template it came from."""

    template: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


@cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(values: Mapping[str, Any] | None = None, *, upgrade: bool = False) -> list[Manifest]:
    """Every object the chart renders for `values` (as `helm template` would), NOTES.txt left out."""
    rendered = chart().render(dict(values or {}), name=RELEASE, namespace=NAMESPACE, revision=2 if upgrade else 1,
                              is_install=not upgrade, is_upgrade=upgrade)
    manifests = []
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        manifests.extend(Manifest(template, doc) for doc in yaml.safe_load_all(text) if doc)
    return manifests


def rendered_text(values: Mapping[str, Any] | None = None) -> str:
    """The rendered manifests as one YAML stream in template order (what `make helm-example` writes)."""
    rendered = chart().render(dict(values or {}), name=RELEASE, namespace=NAMESPACE, revision=1, is_install=True)
    parts = [f"# Source: {template}\n{text.strip().removeprefix('---').strip()}"
             for template, text in sorted(rendered.items())
             if not template.endswith("NOTES.txt") and text.strip()]
    return "---\n" + "\n---\n".join(parts) + "\n"


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m.kind == kind]


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    """(manifest, pod spec) of every pod the chart defines, Ray head and worker groups included."""
    for m in manifests:
        spec = m.obj.get("spec", {})
        if m.kind in ("Deployment", "Job"):
            yield m, spec["template"]["spec"]
        elif m.kind == "Pod":
            yield m, spec
        elif m.kind == "RayService":
            cluster = spec["rayClusterConfig"]
            yield m, cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster.get("workerGroupSpecs", []):
                yield m, group["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@cache
def _kubernetes_definitions(version: str) -> Resource:
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    return Resource.from_contents(json.loads((base / f"v{version}-local-strict" / "_definitions.json").read_text()))


@cache
def _custom_validator(schema_file: str, version: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / schema_file).read_text())
    registry = Registry().with_resource("https://kubernetes.io/api/_definitions.json", _kubernetes_definitions(version))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(obj: dict[str, Any], version: str) -> None:
    """Raise if `obj` is not a valid object of Kubernetes `version` (custom resources: the project schemas)."""
    custom = CUSTOM_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if custom is not None:
        _custom_validator(custom, version).validate(obj)
        return
    kubernetes_validate.validate(obj, version, strict=True)


if __name__ == "__main__":  # `make helm-example`: the production rendering attached to docs/deploy.md
    sys.stdout.write(rendered_text(load_values(CHART / "ci" / "production-gpu-values.yaml")))
