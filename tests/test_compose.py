"""The compose stacks: valid files, and the CPU stack's services run as local processes serve a generation.

Docker is not needed: each service's command and environment are read from the compose
files (``extends`` applied, ``${VAR:-default}`` set to its default) and started here, with
the compose network's names and ports replaced by 127.0.0.1 and free ports.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from client import Client, stack
from scheduler_svc.api.grpc_service import SERVER_STOP_GRACE_S
from scheduler_svc.config import parse_config
from tests.service_fixtures import ROOT, free_port

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
DEFAULT_VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")
BIN = Path(sys.executable).parent
EXECUTOR_ADDRESS = "executor:50052"
# The first start converts the embedded model into the cache; later ones take seconds.
START_TIMEOUT_S = 300.0


@functools.cache
def compose_tool() -> list[str] | None:
    """``docker compose`` (v2) or ``docker-compose`` (v1), whichever works here."""
    for tool in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(tool[0]) and subprocess.run([*tool, "version"], capture_output=True).returncode == 0:
            return tool
    return None


def merge(base: dict, override: dict) -> dict:
    """Compose's merge for what these files use: mappings merge key by key, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def load_services(path: Path) -> dict[str, dict]:
    """The services of a compose file with ``extends`` applied and variables at their defaults."""
    document = yaml.safe_load(DEFAULT_VARIABLE.sub(r"\2", path.read_text()))
    services = {}
    for name, service in document["services"].items():
        extends = service.pop("extends", None)
        base = load_services(path.parent / extends["file"])[extends["service"]] if extends else {}
        services[name] = merge(base, service)
    return services


def as_strings(env: dict) -> dict[str, str]:
    return {key: str(value) for key, value in env.items()}


def local_service(name: str, service: dict, ports: dict[str, int]) -> stack.Service:
    """A compose service as a local process: the same command and environment, re-pointed at 127.0.0.1."""
    env = as_strings(service["environment"])
    assert env.pop("NANOSERVE_HOST") == "0.0.0.0", "a container must listen on every interface"
    env["NANOSERVE_HOST"] = stack.HOST
    env["NANOSERVE_PORT"] = str(ports[name])
    if "NANOSERVE_HTTP_PORT" in env and f"{name}_http" in ports:
        env["NANOSERVE_HTTP_PORT"] = str(ports[f"{name}_http"])
    if env.get("NANOSERVE_EXECUTOR") == EXECUTOR_ADDRESS:
        env["NANOSERVE_EXECUTOR"] = f"{stack.HOST}:{ports['executor']}"
    if "NANOSERVE_CACHE" in env:  # the volume: the cache this machine's executor uses anyway
        env["NANOSERVE_CACHE"] = os.environ.get("NANOSERVE_CACHE", str(Path.home() / ".cache" / "nanoserve"))
    command = service["command"]
    return stack.Service(name, [str(BIN / command[0]), *command[1:]], env, f"{stack.HOST}:{ports[name]}")


def healthcheck_argv(service: dict, port: int) -> list[str]:
    """The service's compose health probe, pointed at ``port``."""
    kind, *argv = service["healthcheck"]["test"]
    assert kind == "CMD"
    return [str(BIN / argv[0]), *(re.sub(r":\d+$", f":{port}", a) if a.startswith("127.0.0.1:") else a
                                  for a in argv[1:])]


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_compose_file_is_valid(compose_file: str) -> None:
    tool = compose_tool()
    if tool is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed, so the file cannot be validated")
    result = subprocess.run([*tool, "-f", compose_file, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_our_reading_of_the_compose_file_matches_the_tool(compose_file: str) -> None:
    tool = compose_tool()
    if tool is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed to compare with")
    result = subprocess.run([*tool, "-f", compose_file, "config"], cwd=ROOT, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")})
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    ours = load_services(ROOT / compose_file)
    for name in ("executor", "scheduler"):
        assert ours[name]["command"] == theirs[name]["command"]
        assert as_strings(ours[name]["environment"]) == as_strings(theirs[name]["environment"])
        assert ours[name]["healthcheck"]["test"] == theirs[name]["healthcheck"]["test"]


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_only_the_scheduler_is_published_and_it_waits_for_a_healthy_executor(compose_file: str) -> None:
    services = load_services(ROOT / compose_file)
    assert "ports" not in services["executor"]
    assert [p.rsplit(":", 1)[-1] for p in services["scheduler"]["ports"]] == ["50051", "8000"]
    assert services["scheduler"]["environment"]["NANOSERVE_HTTP_PORT"] == "8000"
    assert services["scheduler"]["depends_on"] == {"executor": {"condition": "service_healthy"}}
    assert services["scheduler"]["environment"]["NANOSERVE_EXECUTOR"] == EXECUTOR_ADDRESS


@pytest.mark.parametrize("compose_file", COMPOSE_FILES)
def test_compose_waits_for_the_schedulers_drain_and_its_stop(compose_file: str) -> None:
    scheduler = load_services(ROOT / compose_file)["scheduler"]
    grace = parse_config([], as_strings(scheduler["environment"])).shutdown_grace
    # The drain, then its API process and its gRPC server stop; at least 10 s to spare before compose kills it.
    stopped = grace + 2 * SERVER_STOP_GRACE_S
    assert stopped + 10 <= float(scheduler["stop_grace_period"].removesuffix("s")) <= stopped + 30


def test_the_gpu_stack_reserves_a_gpu_and_the_cpu_stack_none() -> None:
    gpu, cpu = (load_services(ROOT / f)["executor"] for f in COMPOSE_FILES)
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert gpu["environment"]["NANOSERVE_DEVICE"] == "cuda"
    assert "deploy" not in cpu and cpu["environment"]["NANOSERVE_DEVICE"] == "cpu"


def test_make_run_starts_what_the_cpu_stack_runs() -> None:
    services = load_services(ROOT / "docker-compose.cpu.yml")
    ports = {"executor": stack.EXECUTOR_PORT, "scheduler": stack.SCHEDULER_PORT}
    for made in (stack.executor_service(stack.EXECUTOR_PORT, shadow=False),
                 stack.scheduler_service(stack.SCHEDULER_PORT, stack.EXECUTOR_PORT, stack.HTTP_PORT)):
        compose = local_service(made.name, services[made.name], ports)
        compose.env.pop("NANOSERVE_CACHE", None)  # make run keeps the user's own cache
        assert (made.argv, made.env, made.target) == (compose.argv, compose.env, compose.target)


def test_cpu_stack_generates_when_its_services_run_as_local_processes() -> None:
    """Both services exactly as docker-compose.cpu.yml runs them: the embedded SmolLM2 on CPU behind the scheduler."""
    services = load_services(ROOT / "docker-compose.cpu.yml")
    ports = {"executor": free_port(), "scheduler": free_port(), "scheduler_http": free_port()}
    processes = stack.Stack()
    try:
        for name in ("executor", "scheduler"):
            service = local_service(name, services[name], ports)
            processes.start(service)
            assert processes.wait_serving(service, START_TIMEOUT_S), f"the {name} never became SERVING"
            probe = subprocess.run(healthcheck_argv(services[name], ports[name]), capture_output=True, text=True,
                                   timeout=30)
            assert (probe.returncode, probe.stdout) == (0, "SERVING\n"), f"the {name}'s compose health probe fails"
        with Client(f"{stack.HOST}:{ports['scheduler']}", timeout=60) as client:
            completion = client.generate("The capital of France is", max_tokens=4, temperature=0)
        assert "Paris" in completion.text
        assert completion.finish_reason == "length" and completion.usage.completion_tokens == 4
        over_http = httpx.post(f"http://{stack.HOST}:{ports['scheduler_http']}/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert over_http.json()["choices"][0]["text"] == completion.text
    finally:
        processes.stop()
    assert [p.returncode for _, p in processes.running] == [0, 0], "SIGTERM (docker stop) must end both cleanly"


def start_make_run(*flags: str) -> tuple[subprocess.Popen, str, str]:
    """``python -m client.stack`` as ``make run`` starts it (its HTTP API on a free port), and the two lines it
    prints once both serve: the CLI's command and the curl one."""
    process = subprocess.Popen([sys.executable, "-m", "client.stack", "--http-port", str(free_port()), *flags],
                               cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready = process.stdout.readline()
    assert ready.startswith("nanoserve: ready."), f"the stack printed {ready!r} instead of its ready line"
    curl = process.stdout.readline()
    assert curl.startswith("nanoserve: or over HTTP"), f"the stack printed {curl!r} instead of its curl line"
    return process, ready, curl.split(": ", 2)[2]


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_make_run_prints_how_to_generate_and_stops_both_on_ctrl_c() -> None:
    port, executor_port = free_port(), free_port()
    process, ready, curl = start_make_run("--shadow", "--port", str(port), "--executor-port", str(executor_port))
    try:
        assert f"nanoserve generate --server 127.0.0.1:{port} --json --token-ids 1,2,3" in ready
        argv = shlex.split(curl)
        if shutil.which("curl"):
            answer = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout)
        else:  # the same request
            answer = httpx.post(argv[1], content=argv[-1], headers={"Content-Type": "application/json"}).json()
        assert len(answer["choices"][0]["token_ids"]) == 16
        children = child_pids(process.pid)
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            assert len(client.generate(token_ids=[1, 2, 3], max_tokens=3).token_ids) == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert not any(Path(f"/proc/{pid}").exists() for pid in children), "a service outlived the stack"
    finally:
        process.kill()
        process.wait()


def test_make_run_stops_the_scheduler_when_the_executor_dies() -> None:
    process, _, _ = start_make_run("--shadow", "--port", str(free_port()), "--executor-port", str(free_port()))
    try:
        executor, scheduler = child_pids(process.pid)
        os.kill(executor, signal.SIGKILL)
        assert process.wait(timeout=30) == 1
        assert not Path(f"/proc/{scheduler}").exists(), "the scheduler outlived the executor"
    finally:
        process.kill()
        process.wait()
