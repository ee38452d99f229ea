"""helm/carpool without a cluster: lint, render over the CI values files, Kubernetes and CRD schemas, the values
schema's refusals, and the drift between the chart's CARPOOL_* variables and the settings classes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from pydantic_settings import BaseSettings

from deploy.serve_app import worker_config
from deploy.settings import ClusterSettings, ServiceSettings
from gateway.settings import GatewaySettings
from tests.packaging.chart_support import (
    CHART,
    CI_VALUES,
    KUBERNETES_VERSIONS,
    ROOT,
    Manifest,
    containers,
    load_values,
    of_kind,
    pod_specs,
    render,
    validate,
)
from worker.serve.app import application_name

CI_IDS = [p.stem for p in CI_VALUES]
SECRET_ONLY = ("CARPOOL_DATABASE_URL", "CARPOOL_REDIS_URL", "CARPOOL_SECRET_KEY", "CARPOOL_HUB_TOKEN_HUGGINGFACE",
               "CARPOOL_HUB_TOKEN_MODELSCOPE", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {path.stem: render(load_values(path)) for path in CI_VALUES}


def test_there_are_three_ci_values_files_covering_the_documented_shapes() -> None:
    assert {"minimal-cpu-values", "production-gpu-values", "external-secrets-values"} <= set(CI_IDS)


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_lint_strict_is_clean(values_file: Path) -> None:
    report = helm.lint(CHART, load_values(values_file), strict=True, namespace="ml")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_is_valid_for_kubernetes(rendered: dict[str, list[Manifest]], values_file: Path,
                                                        version: str) -> None:
    manifests = rendered[values_file.stem]
    assert manifests
    for manifest in manifests:
        try:
            validate(manifest.obj, version)
        except Exception as exc:  # the template and kind make the failure findable
            pytest.fail(f"{manifest.template} {manifest.kind}/{manifest.name} invalid for {version}: {exc}")


def test_the_production_file_renders_every_optional_part(rendered: dict[str, list[Manifest]]) -> None:
    kinds = {m.kind for m in rendered["production-gpu-values"]}
    assert {"Ingress", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor",
            "NetworkPolicy", "RayService", "Job", "ConfigMap", "ServiceAccount"} <= kinds
    ingress = of_kind(rendered["production-gpu-values"], "Ingress")[0].obj
    assert ingress["spec"]["tls"] == [{"secretName": "carpool-tls", "hosts": ["carpool.example.com"]}]
    gateway = _deployment(rendered["production-gpu-values"], "gateway")
    assert "replicas" not in gateway["spec"], "the HPA owns the replica count"


def test_a_scheduler_deployment_and_a_rayservice_per_base_model(rendered: dict[str, list[Manifest]]) -> None:
    values = load_values(CHART / "ci" / "external-secrets-values.yaml")
    manifests = rendered["external-secrets-values"]
    schedulers = [m for m in of_kind(manifests, "Deployment")
                  if m.obj["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"]
    commands = sorted(m.obj["spec"]["template"]["spec"]["containers"][0]["command"][-1] for m in schedulers)
    assert commands == sorted(model["name"] for model in values["baseModels"])
    assert all(m.obj["spec"]["replicas"] >= 2 for m in schedulers)
    assert len(of_kind(manifests, "RayService")) == len(values["baseModels"])


def test_rayservice_declares_the_worker_application_with_gpus(rendered: dict[str, list[Manifest]]) -> None:
    values = load_values(CHART / "ci" / "external-secrets-values.yaml")
    by_model = {}
    for manifest in of_kind(rendered["external-secrets-values"], "RayService"):
        spec = manifest.obj["spec"]
        assert spec["upgradeStrategy"] == {"type": "NewCluster"}  # what this file chose
        serve = yaml.safe_load(spec["serveConfigV2"])
        (app,) = serve["applications"]
        by_model[app["args"]["base_model"]] = (app, spec["rayClusterConfig"])
    for model in values["baseModels"]:
        app, cluster = by_model[model["name"]]
        assert app["name"] == application_name(model["name"])  # the chart's hash equals the code's
        assert app["import_path"] == "deploy.serve_app:build_worker_app"
        config = worker_config(app["args"], ClusterSettings())  # the builder accepts what the chart passes
        (spec,) = config.base_models
        assert (spec.name, spec.source, spec.replicas, spec.num_gpus) == (
            model["name"], model["source"], model["replicas"], model["gpusPerReplica"])
        assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
        (group,) = cluster["workerGroupSpecs"]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == model["replicas"]
        assert group["rayStartParams"]["num-gpus"] == str(model["gpusPerReplica"])
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == model["gpusPerReplica"]


def test_default_upgrade_strategy_never_starts_a_second_gpu_cluster() -> None:
    (service,) = of_kind(render(load_values(CHART / "ci" / "minimal-cpu-values.yaml")), "RayService")
    assert service.obj["spec"]["upgradeStrategy"] == {"type": "None"}


def test_migrations_run_as_a_pre_install_hook_reading_only_an_existing_secret() -> None:
    values = load_values(CHART / "ci" / "minimal-cpu-values.yaml")
    (job,) = of_kind(render(values), "Job")
    annotations = job.obj["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    pod = job.obj["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["carpool", "migrate"]
    # Nothing the release itself creates: at pre-install time none of it exists yet.
    assert "serviceAccountName" not in pod and "volumes" not in pod and "envFrom" not in container
    assert [e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]] == ["carpool-connections"]
    unhooked = copy.deepcopy(values)
    unhooked["migrations"] = {"useHelmHooks": False}
    (plain,) = of_kind(render(unhooked), "Job")
    assert "annotations" not in plain.obj["metadata"]


def test_gateways_and_schedulers_wait_for_the_schema(rendered: dict[str, list[Manifest]]) -> None:
    for manifest in of_kind(rendered["minimal-cpu-values"], "Deployment"):
        init = manifest.obj["spec"]["template"]["spec"]["initContainers"]
        assert [c["command"] for c in init] == [["carpool", "migrate", "--check"]], manifest.name


def test_no_credential_is_rendered_into_a_configmap(rendered: dict[str, list[Manifest]]) -> None:
    for manifests in rendered.values():
        assert not of_kind(manifests, "Secret"), "the chart never creates a Secret"
        for config_map in of_kind(manifests, "ConfigMap"):
            leaked = set(config_map.obj.get("data", {})) & set(SECRET_ONLY)
            assert not leaked, f"{config_map.name} holds {leaked}"


def test_labels_follow_the_recommended_set_and_carry_no_tenant(rendered: dict[str, list[Manifest]]) -> None:
    recommended = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                   "app.kubernetes.io/managed-by", "helm.sh/chart"}
    for manifest in rendered["production-gpu-values"]:
        labels = manifest.obj["metadata"]["labels"]
        assert recommended <= set(labels), manifest.name
        assert not any("tenant" in key or "tenant" in str(value) for key, value in labels.items())
    settings = of_kind(rendered["production-gpu-values"], "ConfigMap")
    assert any(c.obj["data"].get("CARPOOL_METRICS_PER_TENANT") == "false" for c in settings)


def test_only_the_gateway_takes_outside_traffic(rendered: dict[str, list[Manifest]]) -> None:
    policies = {m.name: m.obj["spec"] for m in of_kind(rendered["production-gpu-values"], "NetworkPolicy")}
    internal = next(spec for name, spec in policies.items() if name.endswith("-internal"))
    (components,) = [e["values"] for e in internal["podSelector"]["matchExpressions"]
                     if e["key"] == "app.kubernetes.io/component"]
    assert set(components) == {"scheduler", "hub-worker", "worker"}
    from_release = internal["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert from_release["app.kubernetes.io/instance"] == "carpool-test"
    assert internal["ingress"][1]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    operator = internal["ingress"][2]
    assert operator["ports"] == [{"port": 8265, "protocol": "TCP"}]
    assert operator["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kuberay-system"}
    services = [m.obj["metadata"]["labels"]["app.kubernetes.io/component"]
                for m in of_kind(rendered["production-gpu-values"], "Service")]
    assert services == ["gateway"]


def test_hub_worker_liveness_reads_its_heartbeat_file(rendered: dict[str, list[Manifest]]) -> None:
    worker = _deployment(rendered["production-gpu-values"], "hub-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    probe = container["livenessProbe"]["exec"]["command"]
    heartbeat = {e["name"]: e.get("value") for e in container["env"]}["CARPOOL_HUB_HEARTBEAT_FILE"]
    assert heartbeat in probe[-1] and "inspect" not in " ".join(probe)
    assert pod["terminationGracePeriodSeconds"] >= 600
    assert not any(_component(m) == "hub-worker" for m in rendered["minimal-cpu-values"]), "off by default"


def test_helm_test_pod_calls_healthz(rendered: dict[str, list[Manifest]]) -> None:
    (pod,) = of_kind(rendered["minimal-cpu-values"], "Pod")
    assert pod.obj["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "/api/v1/healthz" in pod.obj["spec"]["containers"][0]["command"][-1]


def test_every_pod_runs_as_non_root(rendered: dict[str, list[Manifest]]) -> None:
    for manifest, pod in pod_specs(rendered["production-gpu-values"]):
        assert pod["securityContext"]["runAsNonRoot"] is True, manifest.name
        assert pod.get("automountServiceAccountToken") is False, manifest.name
        for container in containers(pod):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, manifest.name


# -- the values schema refuses bad input at install time ---------------------------------------------------

def _minimal() -> dict[str, Any]:
    return load_values(CHART / "ci" / "minimal-cpu-values.yaml")


def _with(path: str, value: Any, *, drop: bool = False) -> dict[str, Any]:
    values = _minimal()
    *parents, last = path.split(".")
    node: Any = values
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if drop:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return values


@pytest.mark.parametrize(("values", "message"), [
    pytest.param(_with("gateway.replicaCount", -1), "/gateway/replicaCount", id="negative-replicas"),
    pytest.param(_with("scheduler.replicaCount", 1), "/scheduler/replicaCount", id="single-scheduler"),
    pytest.param(_with("gateway.replicaCont", 2), "replicaCont", id="typo-key"),
    pytest.param(_with("gatway", {}), "gatway", id="unknown-top-level-key"),
    pytest.param(_with("baseModels.0.source", None, drop=True), "source", id="model-without-source"),
    pytest.param(_with("baseModels", []), "/baseModels", id="no-model"),
    pytest.param(_with("baseModels.0.gpusPerReplica", "one"), "/baseModels/0/gpusPerReplica", id="wrong-type"),
    pytest.param(_with("connections.existingSecret", ""), "/connections/existingSecret", id="no-connections"),
    pytest.param(_with("connections.s3", {"enabled": True}), "url", id="s3-without-url"),
    pytest.param(_with("workers.upgradeStrategy", "Rolling"), "/workers/upgradeStrategy", id="bad-enum"),
    pytest.param(_with("settings.extra", {"MAX_RANK": "8"}), "MAX_RANK", id="extra-not-carpool"),
    pytest.param(_with("gateway.ingress", {"enabled": True, "hosts": []}), "hosts", id="ingress-without-host"),
])
def test_values_schema_refuses(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as refused:
        render(values)
    assert message in str(refused.value)


def test_values_schema_requires_the_connection_secret_by_default() -> None:
    with pytest.raises(helm.HelmValuesError, match="existingSecret"):
        render({})


# -- drift: the chart's CARPOOL_* variables against the settings classes ------------------------------------

PROCESS_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "serve": (ClusterSettings, GatewaySettings),
    "scheduler": (ClusterSettings,),
    "hub-worker": (ClusterSettings,),
    "migrate": (ServiceSettings,),
    "ray": (ClusterSettings,),
}
"""Which settings classes the process a container runs reads (Ray pods run deploy.serve_app's builder)."""

NEEDED = {
    # Defaults that cannot work in a cluster: SQLite, Redis on localhost, a relative data dir, the built-in
    # model list, loopback binding; the server key that encrypts hub tokens.
    "serve": {"CARPOOL_DATABASE_URL", "CARPOOL_REDIS_URL", "CARPOOL_SECRET_KEY", "CARPOOL_BASE_MODELS",
              "CARPOOL_DATA_DIR", "CARPOOL_REDIS_PREFIX", "CARPOOL_HOST", "CARPOOL_PORT"},
    "scheduler": {"CARPOOL_DATABASE_URL", "CARPOOL_REDIS_URL", "CARPOOL_BASE_MODELS", "CARPOOL_DATA_DIR",
                  "CARPOOL_REDIS_PREFIX", "CARPOOL_METRICS_PORT", "CARPOOL_HOST"},
    "hub-worker": {"CARPOOL_DATABASE_URL", "CARPOOL_REDIS_URL", "CARPOOL_SECRET_KEY", "CARPOOL_DATA_DIR",
                   "CARPOOL_REDIS_PREFIX", "CARPOOL_METRICS_PORT", "CARPOOL_HOST", "CARPOOL_HUB_HEARTBEAT_FILE"},
    "migrate": {"CARPOOL_DATABASE_URL"},
    "ray": {"CARPOOL_REDIS_URL", "CARPOOL_BASE_MODELS", "CARPOOL_DATA_DIR", "CARPOOL_REDIS_PREFIX"},
}


def _process(container: dict[str, Any]) -> str | None:
    command = container.get("command", [])
    if not command:
        return "ray" if container["name"].startswith("ray-") else None
    if command[0] != "carpool":
        return None
    return command[1]


def _environment(container: dict[str, Any], config_maps: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for entry in container.get("env", []):
        env[entry["name"]] = entry.get("value", "<from secret>")
    return env


def _setting_names(classes: tuple[type[BaseSettings], ...]) -> set[str]:
    return {f"CARPOOL_{name.upper()}" for cls in classes for name in cls.model_fields}


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_drift_every_chart_variable_is_a_setting_and_every_needed_one_is_set(
        rendered: dict[str, list[Manifest]], values_file: Path) -> None:
    manifests = rendered[values_file.stem]
    config_maps = {m.name: m.obj.get("data", {}) for m in of_kind(manifests, "ConfigMap")}
    seen = set()
    for manifest, pod in pod_specs(manifests):
        for container in containers(pod):
            process = _process(container)
            env = _environment(container, config_maps)
            carpool = {name for name in env if name.startswith("CARPOOL_")}
            if process is None:
                assert not carpool, f"{manifest.name}/{container['name']} sets {carpool} but runs no Carpool process"
                continue
            if "--check" in container.get("command", []):
                process = "migrate"
            seen.add(process)
            unknown = carpool - _setting_names(PROCESS_SETTINGS[process])
            assert not unknown, f"{manifest.name}/{container['name']} ({process}) sets non-settings {unknown}"
            missing = NEEDED[process] - carpool
            assert not missing, f"{manifest.name}/{container['name']} ({process}) lacks {missing}"
            _check_values_parse(process, env)
    assert {"serve", "scheduler", "migrate", "ray"} <= seen


def _check_values_parse(process: str, env: dict[str, str]) -> None:
    """The plain (non-secret) values the chart sets are accepted by the settings classes."""
    plain = {k.removeprefix("CARPOOL_").lower(): v for k, v in env.items()
             if k.startswith("CARPOOL_") and v != "<from secret>"}
    for cls in PROCESS_SETTINGS[process]:
        known = {k: v for k, v in plain.items() if k in cls.model_fields}
        cls.model_validate(known)


def test_drift_ports_and_paths_agree_with_the_containers(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["production-gpu-values"]
    config_maps = {m.name: m.obj.get("data", {}) for m in of_kind(manifests, "ConfigMap")}
    for manifest, pod in pod_specs(manifests):
        mounts = {v["name"]: v["mountPath"] for c in pod["containers"] for v in c.get("volumeMounts", [])}
        for container in pod["containers"]:
            env = _environment(container, config_maps)
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            if "CARPOOL_DATA_DIR" in env:
                assert env["CARPOOL_DATA_DIR"] == mounts["data"], manifest.name
            if _process(container) == "serve":
                assert (env["CARPOOL_HOST"], int(env["CARPOOL_PORT"])) == ("0.0.0.0", ports["http"])
            if "CARPOOL_METRICS_PORT" in env:  # served on CARPOOL_HOST: it must be reachable from outside the pod
                assert int(env["CARPOOL_METRICS_PORT"]) == ports["metrics"], manifest.name
                assert env["CARPOOL_HOST"] == "0.0.0.0", manifest.name


# -- packaging facts ------------------------------------------------------------------------------------------

def test_chart_app_version_is_the_package_version() -> None:
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert str(chart_yaml["appVersion"]) == project["version"]


def test_chart_dashboard_is_the_metrics_dashboard() -> None:
    source = ROOT / "deploy" / "grafana" / "carpool.json"
    shipped = CHART / "dashboards" / "carpool.json"
    assert json.loads(shipped.read_text()) == json.loads(source.read_text()), "run `make helm-dashboards`"
    manifests = render({**_minimal(), "grafana": {"dashboards": {"enabled": True}}})
    (board,) = [m for m in of_kind(manifests, "ConfigMap") if m.obj["metadata"]["labels"].get("grafana_dashboard")]
    assert json.loads(board.obj["data"]["carpool.json"]) == json.loads(source.read_text())


def test_yamllint_is_clean_on_chart_values_and_rendered_manifests(tmp_path: Path) -> None:
    from tests.packaging.chart_support import rendered_text

    rendered_file = tmp_path / "production.yaml"
    rendered_file.write_text(rendered_text(load_values(CHART / "ci" / "production-gpu-values.yaml")))
    config = ROOT / "helm" / ".yamllint.yaml"
    # Rendered lines hold whole commands and dashboard JSON: every rule but the line length applies there.
    rendered_config = f"{{extends: {config}, rules: {{line-length: disable}}}}"
    for options, files in ((["-c", str(config)], [CHART / "Chart.yaml", CHART / "values.yaml", *CI_VALUES]),
                           (["-d", rendered_config], [rendered_file])):
        run = subprocess.run([sys.executable, "-m", "yamllint", "--strict", *options, *map(str, files)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr


def test_the_documented_example_is_the_production_rendering() -> None:
    from tests.packaging.chart_support import rendered_text

    example = ROOT / "docs" / "deploy.example.yaml"
    expected = rendered_text(load_values(CHART / "ci" / "production-gpu-values.yaml"))
    assert example.read_text() == expected, "run `make helm-example`"


def _deployment(manifests: list[Manifest], component: str) -> dict[str, Any]:
    (found,) = [m.obj for m in of_kind(manifests, "Deployment") if _component(m) == component]
    return found


def _component(manifest: Manifest) -> str:
    return str(manifest.obj["metadata"]["labels"].get("app.kubernetes.io/component"))


def test_probe_overrides_reach_the_hub_worker_and_the_ray_pods() -> None:
    values = _minimal()
    tcp = {"tcpSocket": {"port": "metrics"}, "periodSeconds": 20}
    values["hubWorker"] = {"enabled": True, "probes": {"livenessProbe": tcp}}
    values["workers"]["worker"]["probes"] = {"readinessProbe": {"exec": {"command": ["true"]}}}
    manifests = render(values)
    (hub,) = _deployment(manifests, "hub-worker")["spec"]["template"]["spec"]["containers"]
    assert hub["livenessProbe"] == tcp
    (service,) = of_kind(manifests, "RayService")
    cluster = service.obj["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    assert worker["readinessProbe"] == {"exec": {"command": ["true"]}}
    assert "readinessProbe" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_hub_downloads_are_cached_on_the_shared_volume(rendered: dict[str, list[Manifest]]) -> None:
    (settings,) = of_kind(rendered["external-secrets-values"], "ConfigMap")
    mount = load_values(CHART / "ci" / "external-secrets-values.yaml")["storage"]["mountPath"]
    assert settings.obj["data"]["HF_HOME"].startswith(mount + "/")
    assert settings.obj["data"]["MODELSCOPE_CACHE"].startswith(mount + "/")


def test_a_chart_release_alone_does_not_change_the_ray_pod_templates() -> None:
    """Under upgradeStrategy NewCluster any pod-template change starts a second GPU cluster."""
    values = load_values(CHART / "ci" / "external-secrets-values.yaml")
    for manifest in of_kind(render(values), "RayService"):
        cluster = manifest.obj["spec"]["rayClusterConfig"]
        templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
        for template in templates:
            labels = template["metadata"]["labels"]
            assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_drift_every_command_the_chart_runs_exists_with_its_options(rendered: dict[str, list[Manifest]],
                                                                    values_file: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app as cli

    commands = {tuple(c["command"][1:]) for _, pod in pod_specs(rendered[values_file.stem])
                for c in containers(pod) if c.get("command", [None])[0] == "carpool"}
    assert commands
    for args in commands:
        # Options are parsed up to --help: an unknown option or command fails with exit code 2.
        result = CliRunner().invoke(cli, [*args, "--help"])
        assert result.exit_code == 0, f"carpool {' '.join(args)}: {result.output}"
