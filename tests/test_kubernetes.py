"""The Kubernetes manifests: valid against the API's schemas, and their commands and environment start the services.

No cluster is needed. Each overlay is rendered with ``kubectl kustomize`` (or ``kustomize build``), every object is
validated strictly (unknown fields fail) against the Kubernetes OpenAPI schemas that kubernetes-validate ships, and the
InferencePool against the vendored CRD's schema. Then the pod's scheduler runs here as a local process with the
manifest's command and environment, re-pointed at 127.0.0.1 and free ports as tests/test_compose.py does, beside the
model-free shadow executor: every probe must pass, and the scheduler's liveness still once the executor is gone.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import stack
from executor_svc.__main__ import build_parser as executor_parser
from executor_svc.__main__ import options_from_args
from scheduler_svc.api.grpc_service import SERVER_STOP_GRACE_S
from scheduler_svc.config import parse_config
from tests.service_fixtures import ROOT, free_port

KUBERNETES = ROOT / "deploy" / "kubernetes"
CRD = KUBERNETES / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
# The oldest Kubernetes these manifests target (native gRPC probes are GA since 1.27) and the newest schema.
SCHEMA_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
OVERLAYS = ["cpu", "gpu", "tp2"]
# The Shepherd Model Gateway in front of the cpu overlay's pods, in place of the InferencePool's picker.
GATEWAY = "smg"
TARGETS = ["base", *OVERLAYS, "cpu+api-key+tls"]  # the last: an overlay plus components, as docs/deploy.md has it
GPUS = {"cpu": 0, "gpu": 1, "tp2": 2}
GAUGES = {"queuedRequestsSpec": "nanoserve:num_requests_waiting",
          "runningRequestsSpec": "nanoserve:num_requests_running",
          "kvUsageSpec": "nanoserve:kv_cache_usage_perc", "cacheInfoSpec": "nanoserve:cache_config_info"}
# The json names of the fields of EndpointPickerConfig (TypeMeta inline) at gateway-api-inference-extension v1.5.0,
# the picker the manifests pin: it decodes its config strictly, so any other key stops it.
EPP_CONFIG_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector",
                   "dataLayer", "flowControl", "parser"}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 30.0


@functools.cache
def kustomize_tool() -> list[str] | None:
    return next((tool for tool in (["kubectl", "kustomize"], ["kustomize", "build"]) if shutil.which(tool[0])), None)


@functools.cache
def render(target: str) -> tuple[dict, ...]:
    """The objects ``kubectl apply -k`` would send for ``target``: base, an overlay, or overlay+component+..."""
    tool = kustomize_tool()
    if tool is None:
        pytest.skip("neither kubectl nor kustomize is installed, so the kustomizations cannot be rendered")
    if target == "base":
        folder, flags = KUBERNETES / "base", []
    elif target in (*OVERLAYS, GATEWAY):
        folder, flags = KUBERNETES / "overlays" / target, []
    else:  # overlay+component...: a kustomization of its own, outside the tree, as a user would write it
        overlay, *components = target.split("+")
        folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanoserve-kustomize-{os.getpid()}-{target}"
        folder.mkdir(exist_ok=True)
        rel = os.path.relpath(KUBERNETES, folder)
        (folder / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [f"{rel}/overlays/{overlay}"], "components": [f"{rel}/components/{c}" for c in components]}))
        flags = ["--load-restrictor", "LoadRestrictionsNone"]
    result = subprocess.run([*tool, *flags, str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return tuple(yaml.safe_load_all(result.stdout))


def find(objects: tuple[dict, ...], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def containers(objects: tuple[dict, ...]) -> dict[str, dict]:
    return {c["name"]: c for c in find(objects, "Deployment", "nanoserve")["spec"]["template"]["spec"]["containers"]}


def env_of(container: dict) -> dict[str, str]:
    """The container's environment; a Secret's value stands in as ``secret:<name>/<key>``."""
    def value(item: dict) -> str:
        return item["value"] if "value" in item else "secret:{name}/{key}".format(**item["valueFrom"]["secretKeyRef"])

    return {item["name"]: value(item) for item in container.get("env", [])}


def strict(schema: dict) -> dict:
    """The CRD schema as the API server's strict field validation applies it: unknown fields fail."""

    def close(node: dict) -> dict:
        if "properties" in node:
            node.setdefault("additionalProperties", False)
        nested = [node[key] for key in ("items", "additionalProperties") if isinstance(node.get(key), dict)]
        for child in (*node.get("properties", {}).values(), *nested):
            close(child)
        return node

    return close(copy.deepcopy(schema))


@functools.cache
def inference_pool_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def validate(document: dict, version: str) -> None:
    if document["kind"] == "InferencePool":
        assert document["apiVersion"] == "inference.networking.k8s.io/v1"
        jsonschema.validate(document, inference_pool_schema())
    else:
        kubernetes_validate.validate(document, version, strict=True)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_manifest_is_valid_against_the_schemas(target: str, version: str) -> None:
    objects = render(target)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "InferencePool", "ConfigMap"} <= kinds
    for document in objects:
        validate(document, version)


def test_the_validation_is_strict() -> None:
    deployment = copy.deepcopy(find(render("cpu"), "Deployment", "nanoserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["grpcProbe"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, SCHEMA_VERSIONS[-1], strict=True)
    pool = copy.deepcopy(find(render("cpu"), "InferencePool", "nanoserve"))
    pool["spec"]["targetPortNumber"] = 8000  # the pre-v1 field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, inference_pool_schema())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_pod_holds_a_scheduler_and_its_executor_on_localhost(overlay: str) -> None:
    objects = render(overlay)
    pod, spec = containers(objects), find(objects, "Deployment", "nanoserve")["spec"]["template"]["spec"]
    assert set(pod) == {"scheduler", "executor"}
    scheduler_env, executor_env = env_of(pod["scheduler"]), env_of(pod["executor"])
    scheduler = parse_config(pod["scheduler"].get("args", []), scheduler_env)
    executor = executor_parser(executor_env).parse_args(pod["executor"].get("args", []))
    assert scheduler.executor == f"127.0.0.1:{executor.port}"
    assert (scheduler.host, executor.host) == ("0.0.0.0", "127.0.0.1"), "only the scheduler may call the executor"
    assert {p["containerPort"] for p in pod["scheduler"]["ports"]} == {scheduler.port, scheduler.http_port} \
        == {50051, 8000}
    assert "ports" not in pod["executor"]
    assert {"cpu", "memory"} <= set(pod["executor"]["resources"]["requests"]), "not the node's first to OOM-kill"
    options = options_from_args(executor)
    gpus = int(pod["executor"]["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    assert gpus == GPUS[overlay]
    assert "nvidia.com/gpu" not in str(pod["scheduler"].get("resources")), "the scheduler needs no GPU"
    if gpus:
        assert (options.device, options.dtype, options.tensor_parallel_size) == ("cuda", "bfloat16", gpus)
        assert options.model == "/models", "the model comes from the volume"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "nanoserve-models"
        claim = find(objects, "PersistentVolumeClaim", "nanoserve-models")["spec"]
        assert claim["accessModes"] == ["ReadWriteOnce"], "what dynamic provisioners give, and a pod can fill"
        fill = yaml.safe_load((KUBERNETES / "components" / "model-volume" / "fill.yaml").read_text())
        for version in SCHEMA_VERSIONS:
            validate(fill, version)
        assert [v["persistentVolumeClaim"] for v in fill["spec"]["volumes"]] == [{"claimName": "nanoserve-models"}]
        assert fill["spec"]["containers"][0]["volumeMounts"] == [{"name": "models", "mountPath": "/models"}], "writable"
        assert pod["executor"]["image"] == "nanoserve-executor:cuda"
    else:
        assert (options.device, options.dtype, options.tensor_parallel_size) == ("cpu", None, 1), "the CPU's choice"
        assert options.model == "smollm2-135m-instruct", "the embedded model, converted into the cache"
        assert executor_env["NANOSERVE_CACHE"] == "/cache"
        assert pod["executor"]["image"] == "nanoserve-executor:cpu"
    assert pod["scheduler"]["image"] == "nanoserve-scheduler:latest"
    # Service links would give the pods NANOSERVE_PORT=tcp://<IP>:8000 for the Service nanoserve: no --port.
    link = f"tcp://10.96.0.12:{find(objects, 'Service', 'nanoserve')['spec']['ports'][0]['port']}"
    with pytest.raises(SystemExit):
        parse_config([], {"NANOSERVE_PORT": link})
    assert spec["enableServiceLinks"] is False


def pre_stop_seconds(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_the_drain(overlay: str) -> None:
    objects = render(overlay)
    spec = find(objects, "Deployment", "nanoserve")["spec"]["template"]["spec"]
    pod = {c["name"]: c for c in spec["containers"]}
    grace = parse_config([], env_of(pod["scheduler"])).shutdown_grace
    scheduler_stop = pre_stop_seconds(pod["scheduler"])
    assert grace == 30.0
    # SIGTERM after the preStop, the drain (--shutdown-grace), then its API process and gRPC server stop; 10 s spare.
    stopped = scheduler_stop + grace + 2 * SERVER_STOP_GRACE_S
    assert stopped + 10 <= spec["terminationGracePeriodSeconds"] <= stopped + 30
    picker = find(objects, "Deployment", "nanoserve-epp")["spec"]["template"]["spec"]
    assert picker["terminationGracePeriodSeconds"] >= spec["terminationGracePeriodSeconds"]
    # The executor gets SIGTERM only after the scheduler's drain is over.
    assert pre_stop_seconds(pod["executor"]) >= scheduler_stop + grace
    for name, container in pod.items():
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60, f"{name}: too short a model load"


@pytest.mark.parametrize("target", TARGETS)
def test_every_probe_names_a_port_the_services_bind(target: str) -> None:
    pod = containers(render(target))
    for name, container in pod.items():
        env = env_of(container)
        declared = {p["containerPort"] for p in container.get("ports", [])}
        for kind in PROBES:
            probe = container[kind]
            if "grpc" in probe:
                assert probe["grpc"] == {"port": int(env["NANOSERVE_PORT"]), "service": ""}, f"{name} {kind}"
                assert "NANOSERVE_TLS_CERT" not in env, "the kubelet's gRPC probes speak plaintext only"
            elif "httpGet" in probe:  # the TLS component: HTTPS /health on the HTTP API
                assert probe["httpGet"] == {"path": "/health", "port": int(env["NANOSERVE_HTTP_PORT"]),
                                            "scheme": "HTTPS" if "NANOSERVE_TLS_CERT" in env else "HTTP"}
            elif "tcpSocket" in probe:
                assert probe["tcpSocket"] == {"port": int(env["NANOSERVE_PORT"])}, f"{name} {kind}"
            else:  # the executor on loopback: the CLI inside its container, as docker/services.yml asks it
                server = f"127.0.0.1:{env['NANOSERVE_PORT']}"
                assert probe["exec"]["command"] == ["nanoserve", "health", "--server", server, "--timeout", "5"]
                assert probe["timeoutSeconds"] > 5, "the CLI's start, then up to 5 s for its call"
            port = next((probe[k]["port"] for k in ("grpc", "httpGet", "tcpSocket") if k in probe), None)
            assert port is None or port in declared, f"{name} {kind}"
    # Only that the scheduler listens: its health is NOT_SERVING through an executor outage it reconnects from.
    assert set(pod["scheduler"]["livenessProbe"]) & {"grpc", "httpGet", "exec"} == set()


def test_the_components_add_the_secrets() -> None:
    scheduler = containers(render("cpu+api-key+tls"))["scheduler"]
    env = env_of(scheduler)
    assert env["NANOSERVE_API_KEY"] == "secret:nanoserve-api-key/api-key"
    mounts = {m["name"]: m for m in scheduler["volumeMounts"]}
    assert env["NANOSERVE_TLS_CERT"] == mounts["tls"]["mountPath"] + "/tls.crt"
    assert env["NANOSERVE_TLS_KEY"] == mounts["tls"]["mountPath"] + "/tls.key"
    assert "NANOSERVE_API_KEY" not in env_of(containers(render("cpu"))["scheduler"]), "the base needs no Secret"


def test_services_pdb_and_inference_pool_select_the_pods() -> None:
    objects = render("cpu")
    template = find(objects, "Deployment", "nanoserve")["spec"]["template"]
    labels = template["metadata"]["labels"]
    port_names = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    for name in ("nanoserve", "nanoserve-grpc-headless"):
        service = find(objects, "Service", name)["spec"]
        assert service["selector"].items() <= labels.items()
        assert all(port_names[p["targetPort"]] == p["port"] for p in service["ports"])
    assert find(objects, "Service", "nanoserve-grpc-headless")["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in find(objects, "Service", "nanoserve-grpc-headless")["spec"]["ports"]] == [50051]
    budget = find(objects, "PodDisruptionBudget", "nanoserve")["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    pool = find(objects, "InferencePool", "nanoserve")["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert pool["targetPorts"] == [{"number": port_names["http"]}]
    picker = find(objects, "Service", pool["endpointPickerRef"]["name"])["spec"]
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["ports"]]


def test_the_endpoint_picker_reads_nanoserves_gauges() -> None:
    objects = render("cpu")
    epp = find(objects, "Deployment", "nanoserve-epp")["spec"]["template"]["spec"]["containers"][0]
    args = epp["args"]
    assert args[args.index("--pool-name") + 1] == "nanoserve"
    path = args[args.index("--config-file") + 1]
    mount = next(m for m in epp["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    config = yaml.safe_load(find(objects, "ConfigMap", "nanoserve-epp")["data"][Path(path).name])
    assert mount["name"] == "config" and config["kind"] == "EndpointPickerConfig"
    assert set(config) <= EPP_CONFIG_KEYS, f"the picker refuses {set(config) - EPP_CONFIG_KEYS}"
    sources = [(s["pluginRef"], [e["pluginRef"] for e in s["extractors"]]) for s in config["dataLayer"]["sources"]]
    assert sources == [("metrics-data-source", ["core-metrics-extractor"])]
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    assert {k: engine[k] for k in GAUGES} == GAUGES
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    scored = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= scored
    # The picker serves ext-proc over TLS unless --secure-serving=false: only then is the port cleartext h2c.
    (ext_proc,) = [p for p in find(objects, "Service", "nanoserve-epp")["spec"]["ports"] if p["port"] == 9002]
    assert ext_proc.get("appProtocol") == ("kubernetes.io/h2c" if "--secure-serving=false" in args else None)


def passes(probe: dict, ports: dict[int, int]) -> bool:
    """What the kubelet asks, without a key, of the port the probe names moved to where the test runs its service."""
    if "grpc" in probe:
        with grpc.insecure_channel(f"{stack.HOST}:{ports[probe['grpc']['port']]}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return check.status == health_pb2.HealthCheckResponse.SERVING
    if "tcpSocket" in probe:
        with socket.create_connection((stack.HOST, ports[probe["tcpSocket"]["port"]]), timeout=5):
            return True
    argv, at = probe["exec"]["command"], probe["exec"]["command"].index("--server") + 1
    host, port = argv[at].rsplit(":", 1)
    argv = [str(BIN / argv[0]), *argv[1:at], f"{host}:{ports[int(port)]}", *argv[at + 1:]]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return (result.returncode, result.stdout) == (0, "SERVING\n")


@pytest.mark.parametrize("target", ["cpu", "cpu+api-key"])
def test_the_pods_commands_and_environment_start_the_services(target: str) -> None:
    """The scheduler exactly as the pod runs it, only host and ports moved, in front of a model-free executor."""
    pod = containers(render(target))
    env = env_of(pod["scheduler"])
    executor_port = int(env_of(pod["executor"])["NANOSERVE_PORT"])
    ports = {int(env[k]): free_port() for k in ("NANOSERVE_PORT", "NANOSERVE_HTTP_PORT")} | {executor_port: free_port()}
    assert env.pop("NANOSERVE_HOST") == "0.0.0.0"
    assert env["NANOSERVE_EXECUTOR"] == f"127.0.0.1:{executor_port}"
    env.update(NANOSERVE_HOST=stack.HOST, NANOSERVE_PORT=str(ports[int(env["NANOSERVE_PORT"])]),
               NANOSERVE_HTTP_PORT=str(ports[int(env["NANOSERVE_HTTP_PORT"])]),
               NANOSERVE_EXECUTOR=f"{stack.HOST}:{ports[executor_port]}")
    if "NANOSERVE_API_KEY" in env:
        env["NANOSERVE_API_KEY"] = "k8s-test-key"
    command = pod["scheduler"]["command"]
    scheduler = stack.Service("scheduler", [str(BIN / command[0]), *command[1:], *pod["scheduler"].get("args", [])],
                              env, f"{stack.HOST}:{env['NANOSERVE_PORT']}")
    shadow = [sys.executable, "-m", "executor_svc.fakes.shadow_server",
              "--host", stack.HOST, "--port", str(ports[executor_port])]
    executor = stack.Service("executor", shadow, {}, f"{stack.HOST}:{ports[executor_port]}")
    processes = stack.Stack()
    try:
        for service in (executor, scheduler):
            processes.start(service)
            assert processes.wait_serving(service, START_TIMEOUT_S), f"the {service.name} never became SERVING"
        for name, container in pod.items():
            assert all(passes(container[kind], ports) for kind in PROBES), name
        answer = httpx.get(f"http://{stack.HOST}:{ports[8000]}/health", timeout=10)
        assert answer.status_code == 200
        # The executor gone: the scheduler leaves the Services (readiness) but is not restarted (liveness).
        processes.running[0][1].terminate()
        deadline = time.monotonic() + START_TIMEOUT_S
        while passes(pod["scheduler"]["readinessProbe"], ports):
            assert time.monotonic() < deadline, "the scheduler stayed ready without its executor"
            time.sleep(0.1)
        assert passes(pod["scheduler"]["livenessProbe"], ports)
    finally:
        processes.stop()
    assert [p.returncode for _, p in processes.running] == [0, 0], "SIGTERM (the pod's stop) must end both cleanly"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_the_gateway_overlay_is_valid_and_leaves_the_picker_out(version: str) -> None:
    objects = render(GATEWAY)
    for document in objects:
        validate(document, version)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Deployment", "nanoserve") in kinds and ("Deployment", "nanoserve-gateway") in kinds
    assert not {o for o in kinds if o[0] == "InferencePool" or o[1] == "nanoserve-epp"}, "no CRD needed"


def test_the_gateway_finds_every_scheduler_on_its_grpc_port() -> None:
    """The gateway's arguments, parsed by smg's own parser, select the nanoserve pods and their gRPC port, which the
    NetworkPolicy opens; its Role lets it watch pods, and its probes name its own port."""
    launch_router = pytest.importorskip("smg.launch_router", reason="smg is not installed: pip install smg")
    objects = render(GATEWAY)
    spec = find(objects, "Deployment", "nanoserve-gateway")["spec"]["template"]["spec"]
    (gateway,) = spec["containers"]
    assert gateway["args"][0] == "launch"
    args = launch_router.parse_router_args(gateway["args"][1:])
    pod = find(objects, "Deployment", "nanoserve")["spec"]["template"]
    assert args.service_discovery and args.selector.items() <= pod["metadata"]["labels"].items()
    grpc_port = next(p["containerPort"] for p in containers(objects)["scheduler"]["ports"] if p["name"] == "grpc")
    assert args.service_discovery_port == grpc_port
    assert args.service_discovery_namespace == "$(NAMESPACE)"
    assert {e["name"] for e in gateway["env"]} == {"NAMESPACE"}
    assert args.policy == "cache_aware"
    policy = find(objects, "NetworkPolicy", "nanoserve")["spec"]
    assert grpc_port in [port["port"] for rule in policy["ingress"] for port in rule["ports"]]
    role = find(objects, "Role", spec["serviceAccountName"])
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    binding = find(objects, "RoleBinding", spec["serviceAccountName"])
    assert binding["subjects"][0]["name"] == spec["serviceAccountName"]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports["http"] == args.port and ports["metrics"] == args.prometheus_port
    for kind in ("readinessProbe", "livenessProbe"):
        assert gateway[kind]["httpGet"]["port"] == "http"
    labels = find(objects, "Deployment", "nanoserve-gateway")["spec"]["template"]["metadata"]["labels"]
    assert find(objects, "Service", "nanoserve-gateway")["spec"]["selector"].items() <= labels.items()
