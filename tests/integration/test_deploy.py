"""Deployment files: the systemd unit verifies, the Kubernetes manifest's server arguments and
probes work against the real binary."""
import os
import re
import shutil
import subprocess

import pytest
import yaml

from conftest import BIN, ROOT

DEPLOY = os.path.join(ROOT, "scripts", "deploy")


def test_systemd_unit_verifies(tmp_path):
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze is not installed")
    unit = open(os.path.join(DEPLOY, "lmcache.service")).read()
    assert "Type=notify" in unit and "Restart=on-failure" in unit
    unit = unit.replace("/usr/local/bin/lmcache", os.path.abspath(BIN))
    path = tmp_path / "lmcache.service"
    path.write_text(unit)
    p = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_systemd_unit_arguments_start_a_server(make_server):
    unit = open(os.path.join(DEPLOY, "lmcache.service")).read()
    args = re.search(r"^ExecStart=\S+ server (.*)$", unit, re.M).group(1).split()
    # The unit's options, with the ports replaced by free ones.
    keep = []
    it = iter(args)
    for a in it:
        if a in ("--port", "--http-port", "--host", "--http-host"):
            next(it)
        else:
            keep.append(a)
    # The unit's 8 GiB L1 is not faulted in here: the test machine runs several servers.
    s = make_server(args=keep + ["--l1-prefault=false"], l1_size_gb=None, policy=None)
    assert s.get("/healthcheck").status_code == 200


def _manifest():
    return list(yaml.safe_load_all(open(os.path.join(DEPLOY, "kubernetes.yaml"))))


def test_kubernetes_manifest_probes_and_args(make_server):
    docs = _manifest()
    kinds = {d["kind"] for d in docs}
    assert kinds == {"Deployment", "Service"}
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthcheck", "port": 8080}
    args = [a for a in c["args"] if a != "server"]
    assert args[0].startswith("--")
    # The manifest's arguments parse and run (ports and identity replaced for the test).
    keep = [a for a in args if not a.startswith(("--port=", "--http-port=", "--host=",
                                                 "--http-host=", "--instance-id="))]
    s = make_server(args=keep + ["--instance-id=pod-0", "--l1-prefault=false"], l1_size_gb=None,
                    policy=None)
    assert s.get("/healthcheck").status_code == 200
    assert s.get("/status").json()["instance_id"] == "pod-0"
