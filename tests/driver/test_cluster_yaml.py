"""``cluster.yaml`` passes Ray's own cluster-launcher validation (no cloud calls) and fits the job."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from gnnray import stack

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def _prepared(config: dict) -> dict:
    """What ``ray up`` checks before it talks to the cloud: defaults filled in, then the schema and rules."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _pinned() -> dict[str, Requirement]:
    """The ``dependencies`` of pyproject.toml, by name."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    reqs = [Requirement(r) for r in re.findall(r'"([^"]+)"', block)]
    return {r.name: r for r in reqs}


def _installed(commands: list[str]) -> dict[str, Requirement]:
    """Requirements that ``pip install`` commands name, by name."""
    found = {}
    for command in commands:
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            for w in words[2:]:
                if not w.startswith("-") and not w.startswith("http"):
                    r = Requirement(w)
                    found[r.name] = r
    return found


def test_ray_validates_cluster_yaml(config):
    prepared = _prepared(config)
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"] == {"CPU": 0}  # the head schedules no work
    gpu = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    cpu = [n for n, t in types.items() if n != prepared["head_node_type"] and not t["resources"].get("GPU")]
    assert len(gpu) == 2 and len(cpu) == 1
    for node_type in (*gpu, types[cpu[0]]):  # room for a train worker / sampler actor; autoscaled
        assert node_type["resources"]["CPU"] >= 1 and 0 <= node_type["min_workers"] < node_type["max_workers"]
    # Elastic runs: a spot GPU type from 0, set up as the on-demand one.
    spot = types["gpu_spot_worker"]
    assert spot["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"} and spot["min_workers"] == 0
    assert spot.get("worker_setup_commands") == types["gpu_worker"].get("worker_setup_commands")
    assert sum(t["max_workers"] for n, t in types.items() if n != prepared["head_node_type"]) <= prepared["max_workers"]


def test_validation_is_real(config):
    """Ray's validation rejects what ``ray up`` would: an unknown field, and min_workers above max_workers."""
    import jsonschema

    typo = copy.deepcopy(config)
    typo["available_node_types"]["cpu_worker"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _prepared(typo)
    too_many = copy.deepcopy(config)
    too_many["available_node_types"]["cpu_worker"]["min_workers"] = config["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        _prepared(too_many)


def test_setup_commands_install_the_pinned_stack(config):
    """Every node, GPU nodes included, installs from PyPI the exact stack the driver's check demands (gnnray/stack.py's
    CLUSTER, within pyproject's ranges) and pyproject's other dependencies, each pinned exactly: the train workers need
    torch only (its PyPI wheel brings CUDA), so no node type swaps in DGL's CUDA build or another package index."""
    prepared = _prepared(config)
    pinned = _pinned()
    for name, node_type in prepared["available_node_types"].items():
        # A node type's own worker_setup_commands would replace the common ones on its nodes.
        assert "worker_setup_commands" not in node_type, name
    assert config["setup_commands"] == [stack.setup_command()]  # written from the one place
    exact = {name: version for name, version in stack.CLUSTER.items() if name != "python"}
    assert set(exact) == set(stack.versions()) - {"python", "gnnray"}  # what the check compares, Python aside
    for commands in (prepared["head_setup_commands"], prepared["worker_setup_commands"]):
        installed = _installed(commands)
        assert set(pinned) <= set(installed) <= set(pinned) | {"boto3"}, commands  # Ray's default: boto3 on the head
        for name, req in pinned.items():
            assert installed[name].extras == req.extras, name
            (pin,) = installed[name].specifier  # one exact version: a node added later installs the same one
            assert pin.operator == "==" and pin.version in req.specifier, name
            if name in exact:
                assert pin.version == exact[name], name
            assert all(not Version(s.version).local for s in installed[name].specifier), name  # no +cuXXX build
        words = [w for c in commands for w in shlex.split(c)]
        assert not {"-f", "--find-links", "-i", "--index-url", "--extra-index-url"} & set(words), commands
    assert "data.dgl.ai" not in (REPO / "cluster.yaml").read_text()


def test_no_secrets_in_cluster_yaml():
    text = (REPO / "cluster.yaml").read_text()
    assert not re.search(r"AKIA[0-9A-Z]{16}|aws_secret_access_key|\b\d{12}\b|ssh_private_key:|KeyName:", text)


def test_nodes_keep_runs_in_s3_with_the_roles_cluster_iam_makes(config):
    """No shared file system: the recipe keeps runs in S3, and every node has an instance profile of
    cluster-iam.yaml that may write the bucket; the head's may also hand workers theirs (iam:PassRole), which
    Ray's default head role cannot, so workers would start without credentials."""
    template = yaml.safe_load((REPO / "cluster-iam.yaml").read_text())
    resources = template["Resources"]
    profiles = {r["Properties"]["InstanceProfileName"]: r["Properties"]["Roles"][0]["Ref"]
                for r in resources.values() if r["Type"] == "AWS::IAM::InstanceProfile"}
    prepared = _prepared(config)
    for name, node_type in prepared["available_node_types"].items():
        want = "gnnray-head" if name == prepared["head_node_type"] else "gnnray-worker"
        assert node_type["node_config"]["IamInstanceProfile"] == {"Name": want}, name
    assert set(profiles) == {"gnnray-head", "gnnray-worker"}

    access = resources["RunsAccess"]["Properties"]["PolicyDocument"]["Statement"]
    objects = next(s for s in access if s["Resource"] == {"Fn::Sub": "arn:aws:s3:::${BucketName}/*"})
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= set(objects["Action"])
    assert any("s3:ListBucket" in s["Action"] for s in access)
    for role in profiles.values():
        assert {"Ref": "RunsAccess"} in resources[role]["Properties"]["ManagedPolicyArns"], role
    head = resources[profiles["gnnray-head"]]["Properties"]
    passes = [s for p in head["Policies"] for s in p["PolicyDocument"]["Statement"] if s["Action"] == "iam:PassRole"]
    assert passes == [{"Effect": "Allow", "Action": "iam:PassRole",
                       "Resource": {"Fn::GetAtt": [profiles["gnnray-worker"], "Arn"]}}]
    assert "arn:aws:iam::aws:policy/AmazonEC2FullAccess" in head["ManagedPolicyArns"]  # as Ray's default role

    text = (REPO / "cluster.yaml").read_text()
    assert "--storage-path s3://$BUCKET/runs" in text and "EFS" not in text and "nfs" not in text


def test_every_image_runs_the_pinned_python_and_ray(config):
    """Python is the one part of the stack the images bring: their tag names CLUSTER's Python and the pinned Ray."""
    images = [config["docker"]["image"]] + [t["docker"]["worker_image"] for t in config["available_node_types"].values()
                                            if "worker_image" in t.get("docker", {})]
    tag = f"{stack.RAY}-py{stack.CLUSTER['python'].replace('.', '')}-"
    assert len(images) >= 2 and all(image.split(":")[1].startswith(tag) for image in images), images


def test_the_stack_module_writes_cluster_yamls_setup(tmp_path):
    """`python -m gnnray.stack FILE` replaces only the setup_commands, so updating the pins is one command."""
    copy_ = tmp_path / "cluster.yaml"
    text = (REPO / "cluster.yaml").read_text()
    copy_.write_text(text.replace(stack.CLUSTER["torch"], "1.0.0"))
    stack._write_setup(str(copy_))
    assert copy_.read_text() == text
