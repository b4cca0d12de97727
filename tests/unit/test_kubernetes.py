"""deploy/kubernetes, checked without a cluster: every kustomization renders (`kubectl
kustomize`), every object is valid against the Kubernetes schemas (kubernetes-validate,
strict) and the PyTorchJob against what Kubeflow's training operator accepts (a schema of
ours, tests/fixtures/kubernetes, plus the operator's own checks); every cohort command in
the pods parses with cohort's real CLI, and torchrun's with torch's parser, in the
environment Kubernetes (and the operator) would give them; the images are the README's
builds of the Dockerfile; the Secret the pods read is the one the README creates.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from cohort import acl
from cohort.cli import main as cohort_cli
from cohort.events.connection import RedisSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
EXAMPLES = ("example", "example-torchrun", "example-managed-redis", "example-tls")
KUBECTL = shutil.which("kubectl")
SCHEMA = ROOT / "tests" / "fixtures" / "kubernetes" / "pytorchjob-v1.schema.json"
OLDEST_KUBERNETES = "1.29.0"  # backoffLimitPerIndex and FailIndex, on by default since
POD_NAME = "cohort-pod-0"
NAMESPACED = {
    "ConfigMap", "Service", "Deployment", "StatefulSet", "Job", "PodDisruptionBudget",
    "PyTorchJob",
}  # fmt: skip

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed here: the kustomizations cannot render"
)

Doc = dict[str, Any]


@functools.cache
def rendered(example: str) -> tuple[Doc, ...]:
    """The objects `kubectl apply -k deploy/kubernetes/EXAMPLE` would send."""
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / example)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def pod_specs(doc: Doc) -> list[Doc]:
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    return []


def containers(docs: tuple[Doc, ...]) -> Iterator[tuple[Doc, Doc]]:
    """(object, container) for every container and init container of every pod template."""
    for doc in docs:
        for spec in pod_specs(doc):
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield doc, container


def config_map(docs: tuple[Doc, ...], name: str = "cohort-job") -> dict[str, str]:
    named = re.compile(rf"{name}(-[a-z0-9]{{10}})?")  # kustomize's hash suffix, where kept
    found = [d for d in docs if d["kind"] == "ConfigMap" and named.fullmatch(d["metadata"]["name"])]
    assert len(found) == 1, f"no ConfigMap {name!r} rendered"
    data: dict[str, str] = found[0]["data"]
    return data


def readme_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n### Kubernetes\n", 1)[1].split("\n### ", 1)[0]


def secret_keys() -> set[str]:
    """The keys of the Secret `cohort-redis` as the README tells users to create it."""
    command = re.search(r"kubectl create secret generic cohort-redis.*?```", readme_section(), re.S)
    assert command, "the README's Kubernetes section does not create the Secret cohort-redis"
    return set(re.findall(r"--from-literal=([a-z-]+)=", command.group(0)))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a variable defined earlier, else the text as it is."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def environment(container: Doc, docs: tuple[Doc, ...]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, a password standing for each key
    of the Secret (absent keys marked optional are left out, as the kubelet does)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = config_map(docs, ref["name"])[ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["name"] == "cohort-redis", f"{var['name']} reads Secret {ref['name']}"
            assert ref["key"] in secret_keys() or ref.get("optional"), ref
            env[var["name"]] = f"pw{ref['key'].split('-')[0]}"
        else:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", source
            env[var["name"]] = POD_NAME
    return env


def argv(container: Doc, env: dict[str, str]) -> list[str]:
    return [expand(arg, env) for arg in container.get("command", []) + container.get("args", [])]


def cohort_context(args: list[str], env: dict[str, str], monkeypatch: Any) -> click.Context:
    """`cohort ARGS` parsed by cohort's own CLI with `env`, nothing run: a misspelt flag, a
    bad value or a required option missing from the environment fails here."""
    for name in [n for n in os.environ if n.startswith("COHORT_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    name, *rest = args  # the subcommand first: no option of the group's before it
    group = click.Context(cohort_cli, info_name="cohort")
    command = cohort_cli.get_command(group, name)
    assert command is not None, f"`cohort {name}` is no command of cohort's"
    return command.make_context(name, rest, parent=group)


def runs_cohort(container: Doc) -> bool:
    return not container.get("command")  # the image's entry point is `cohort`


def in_image(path: str) -> bool:
    """Whether the Dockerfile's image holds `path` (relative to its WORKDIR), from this
    repository's files."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for line in lines:
        words = line.split()
        if words[:1] == ["COPY"] and len(words) == 3:
            source, target = words[1], words[2].removeprefix("./")
            if path.startswith(target + "/"):
                return (ROOT / source / path.removeprefix(target + "/")).is_file()
    return False


# ---------------------------------------------------------------- schemas


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_object_is_valid_for_kubernetes(example: str) -> None:
    validate = pytest.importorskip("kubernetes_validate")
    versions = (OLDEST_KUBERNETES, validate.latest_version())
    checked = []
    for doc in rendered(example):
        if doc["kind"] == "PyTorchJob":
            continue  # a custom resource: the next tests
        for version in versions:
            validate.validate(doc, version, strict=True)
        checked.append(doc["kind"])
    assert {"ConfigMap", "Deployment", "Service"} <= set(checked)  # at least the coordinators


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_everything_is_namespaced_and_nothing_holds_a_secret(example: str) -> None:
    docs = rendered(example)
    assert {d["kind"] for d in docs} <= NAMESPACED  # no Secret, no RBAC, no cluster objects
    assert all("namespace" not in d["metadata"] for d in docs)  # `-n` chooses it
    for _, container in containers(docs):
        for var in container.get("env", []):
            assert "@" not in var.get("value", "") or "$(COHORT_REDIS_PASSWORD)@" in var["value"]


@needs_kubectl
def test_the_pytorchjob_is_what_the_training_operator_accepts() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validate = pytest.importorskip("kubernetes_validate")
    [job] = [d for d in rendered("example-torchrun") if d["kind"] == "PyTorchJob"]
    jsonschema.validate(job, json.loads(SCHEMA.read_text()))
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "cohort"
    assert policy["rdzvId"] == config_map(rendered("example-torchrun"))["job"]
    for kind, replica in job["spec"]["pytorchReplicaSpecs"].items():
        # The operator's own checks (pytorch_validation.go): a container named pytorch, an
        # image in each, one Master at most; the elastic range holds the replicas.
        names = [c["name"] for c in replica["template"]["spec"]["containers"]]
        assert "pytorch" in names
        assert all(c.get("image") for c in replica["template"]["spec"]["containers"])
        assert kind != "Master" or replica.get("replicas", 1) == 1
        assert policy["minReplicas"] <= replica["replicas"] <= policy["maxReplicas"]
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        for version in (OLDEST_KUBERNETES, validate.latest_version()):
            validate.validate({**template, "template": replica["template"]}, version, True)


# ---------------------------------------------------------------- commands


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_cohort_command_parses_with_the_cli_in_its_pods_environment(
    example: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = rendered(example)
    parsed = {}
    for _, container in containers(docs):
        if not runs_cohort(container):
            continue
        env = environment(container, docs)
        context = cohort_context(argv(container, env), env, monkeypatch)
        parsed[context.info_name] = context.params
        assert context.params["job"] == config_map(docs)["job"]
    assert "coordinator" in parsed
    if "run" in parsed:
        script = parsed["run"]["command"][0]
        assert in_image(script), f"{script} is not in the image the Dockerfile builds"


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_each_pod_connects_as_its_role_with_the_secrets_password(example: str) -> None:
    docs = rendered(example)
    expected = {"coordinator": "coordinator", "train": "worker", "pytorch": "torchrun"}
    seen = set()
    for _, container in containers(docs):
        if container["name"] not in expected:
            continue
        env = environment(container, docs)
        role = expected[container["name"]]
        plain = {k: v for k, v in env.items() if not k.startswith("COHORT_REDIS_TLS_")}
        url = RedisSettings.resolve(None, env=plain).url  # the CA's file is the cluster's
        address = config_map(docs)["redis-address"]
        scheme = config_map(docs)["redis-scheme"]
        job = config_map(docs)["job"]
        assert url == f"{scheme}://cohort-{job}-{role}:pw{role}@{address}"
        if role != "torchrun":
            assert url.split("://")[1].startswith(acl.user(job, role) + ":")  # type: ignore[arg-type]
        seen.add(role)
    assert "coordinator" in seen


@needs_kubectl
def test_the_coordinators_are_ready_and_scraped_on_their_metrics_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = rendered("example")
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    [container] = pod["spec"]["containers"]
    env = environment(container, docs)
    port = cohort_context(argv(container, env), env, monkeypatch).params["metrics_port"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[container["readinessProbe"]["httpGet"]["port"]] == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/metrics"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert deployment["spec"]["replicas"] >= 2
    spread = pod["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


@needs_kubectl
def test_the_training_pods_are_nodes_that_never_share_a_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cohort.commands.run import _check_node

    docs = rendered("example")
    [job] = [d for d in docs if d["kind"] == "Job"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    env = environment(container, docs)
    params = cohort_context(argv(container, env), env, monkeypatch).params
    assert params["node"] == POD_NAME and params["no_coordinator"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # a new pod, a new name
    longest = f"{job['metadata']['name']}-{job['spec']['completions'] * 10}-abcde"
    _check_node(longest)  # exits 2 where a pod's name is no node name
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert params["stop_grace"] < grace  # the ranks leave before the kubelet kills them


@needs_kubectl
def test_torchrun_parses_its_flags_as_the_operator_starts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch")
    from torch.distributed.run import get_args_parser

    docs = rendered("example-torchrun")
    [(job, container)] = [(d, c) for d, c in containers(docs) if c["name"] == "pytorch"]
    env = environment(container, docs) | operator_environment(job)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = argv(container, env)
    assert command[0] == "torchrun"
    args = get_args_parser().parse_args(command[1:])  # torch reads PET_* as its defaults
    assert (args.rdzv_backend, args.rdzv_id, args.nnodes) == ("cohort", env["COHORT_JOB"], "1:4")
    assert args.rdzv_endpoint == ""  # so cohort's handler takes $COHORT_REDIS_URL:
    assert RedisSettings.resolve(args.rdzv_endpoint or None, env=env).url == env["COHORT_REDIS_URL"]
    assert in_image(args.training_script)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ddp_train  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert ddp_train.arguments(args.training_script_args).steps > 0


def operator_environment(job: Doc) -> dict[str, str]:
    """The PET_* variables Kubeflow's training operator gives a PyTorchJob's containers
    (pkg/controller.v1/pytorch/elastic.go): torchrun's defaults for its flags."""
    policy = job["spec"]["elasticPolicy"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    env = {
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_RDZV_ENDPOINT": f"{host}:{policy['rdzvPort']}",
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
    }
    optional = {"maxRestarts": "PET_MAX_RESTARTS", "rdzvId": "PET_RDZV_ID"}
    env |= {name: str(policy[key]) for key, name in optional.items() if key in policy}
    if "nprocPerNode" in job["spec"]:
        env["PET_NPROC_PER_NODE"] = job["spec"]["nprocPerNode"]
    return env


# ---------------------------------------------------------------- images, Redis, resources


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_the_images_are_the_readmes_builds_of_the_dockerfile(example: str) -> None:
    import tomllib

    builds = dict(re.findall(r"docker build (?:--target (\w+) )?-t (\S+) \.", readme_section()))
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert set(builds) == {"", "torch"} and all(i.endswith(f":{version}") for i in builds.values())
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", (ROOT / "Dockerfile").read_text(), re.M)
    assert ("cohort", "torch") in stages and stages[-1] == ("cohort", "")  # default: slim
    for _, container in containers(rendered(example)):
        image = container["image"]
        if image.startswith("redis:"):
            continue
        torchrun = container.get("command", [""])[0] == "torchrun"
        assert image == builds["torch" if torchrun else ""], container["name"]


@needs_kubectl
def test_redis_keeps_every_fact_evicts_nothing_and_loads_the_acl_file_written_for_it() -> None:
    docs = rendered("example")
    conf = dict(
        line.split(None, 1)
        for line in config_map(docs, "cohort-redis-config")["redis.conf"].splitlines()
        if line and not line.startswith("#")
    )
    assert conf["appendonly"] == "yes" and conf["maxmemory-policy"] == "noeviction"
    [redis_set] = [d for d in docs if d["kind"] == "StatefulSet"]
    spec = redis_set["spec"]["template"]["spec"]
    [init], [server] = spec["initContainers"], spec["containers"]
    script = config_map(docs, "cohort-redis-config")["write-acl.sh"]
    assert '"${ACL_FILE:-' + conf["aclfile"] + '}"' in script
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert Path(conf["aclfile"]).parent == Path(mounts["acl"])
    assert mounts["data"] == conf["dir"]
    assert server["image"].split(":")[1] == environment(init, docs)["REDIS_VERSION"]
    assert redis_set["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    limit = server["resources"]["limits"]["memory"]
    assert conf["maxmemory"] == "1gb" and limit == "2Gi"  # room for the AOF rewrite's fork


@needs_kubectl
@pytest.mark.parametrize("example", EXAMPLES)
def test_every_container_asks_for_cpu_and_memory_and_is_bounded_in_memory(example: str) -> None:
    for doc, container in containers(rendered(example)):
        resources = container.get("resources", {})
        where = f"{doc['kind']} {doc['metadata']['name']}: {container['name']}"
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
        assert "memory" in resources.get("limits", {}), where
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, where


def test_the_acl_script_writes_cohorts_roles_and_the_admin_for_redis(tmp_path: Path) -> None:
    """The Redis pod's init script, run here as there: `cohort acl`'s rules for the job's
    roles in ACL-file form, each with the Secret's password (hashed), `default` with the
    admin's; the torchrun user only where its password is given."""
    script = DEPLOY / "redis" / "write-acl.sh"
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COHORT_JOB": "demo",
        "COHORT_REDIS_ADDRESS": "redis:6379/2",
        "REDIS_ADMIN_PASSWORD": "pwadmin",
        "ACL_FILE": str(tmp_path / "users.acl"),
        **{acl.password_env(role): f"pw{role}" for role in acl.ROLES},
    }
    for torchrun in ("", "pwtorchrun"):
        done = subprocess.run(
            ["sh", str(script)],
            env={**env, "COHORT_ACL_TORCHRUN_PASSWORD": torchrun},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        lines = (tmp_path / "users.acl").read_text().splitlines()
        users = {line.split()[1]: line for line in lines}
        roles = {
            acl.user("demo", role): role for role in acl.ROLES if torchrun or role != "torchrun"
        }
        assert set(users) == {"default", *roles}
        assert acl.password_hash("pwadmin") in users["default"].split()
        for name, role in roles.items():
            assert acl.password_hash(f"pw{role}") in users[name].split()
            assert "+select|2" in users[name].split()
        assert not any('"' in line for line in lines)  # an ACL file takes no quotes
    rules = users["cohort-demo-torchrun"].split(maxsplit=5)[5]  # user NAME reset on #HASH
    assert rules == " ".join(acl.rules("demo", "torchrun", (7, 2), db=2))  # cohort acl's own
    assert list(tmp_path.iterdir()) == [tmp_path / "users.acl"]


def test_the_acl_script_refuses_to_write_users_without_their_passwords(tmp_path: Path) -> None:
    done = subprocess.run(
        ["sh", str(DEPLOY / "redis" / "write-acl.sh")],
        env={"PATH": os.environ["PATH"], "COHORT_JOB": "demo", "ACL_FILE": str(tmp_path / "a")},
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "COHORT_REDIS_ADDRESS" in done.stderr
    assert not (tmp_path / "a").exists()


@needs_kubectl
def test_with_tls_redis_serves_only_tls_and_every_client_verifies_it_with_the_ca() -> None:
    docs = rendered("example-tls")
    assert config_map(docs)["redis-scheme"] == "rediss"
    clients = 0
    for doc, container in containers(docs):
        spec = pod_specs(doc)[0]
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: secrets.get(m["name"]) for m in container.get("volumeMounts", [])}
        if container["name"] == "redis":
            command = container["command"]
            flags = dict(zip(command[2::2], command[3::2], strict=True))
            assert flags["--port"] == "0" and flags["--tls-port"] == "6379"
            for key in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
                assert mounts[str(Path(flags[key]).parent)] == "cohort-redis-tls"
            assert "--tls" in container["readinessProbe"]["exec"]["command"][-1]
        elif container["name"] != "acl":
            ca = environment(container, docs)["COHORT_REDIS_TLS_CA"]
            assert mounts[str(Path(ca).parent)] == "cohort-redis-tls", container["name"]
            clients += 1
    assert clients == 2  # the coordinators and the training Job
