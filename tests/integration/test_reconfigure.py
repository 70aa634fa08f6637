"""Runtime L2 reconfiguration over HTTP: GET /reconfigure/{backend}/status and
POST /reconfigure/{backend}/{operation}, against servers without L2 adapters and with a dax
adapter on file-backed devices in a temp dir."""
import json
import os
import tempfile

import pytest
import requests

from conftest import Server


# ---- a server without L2 adapters ------------------------------------------------------------

def test_status_unknown_backend_is_disabled(server):
    for backend in ("dax", "DAX", "s3", "nosuch", "%20Dax%20"):
        r = server.get(f"/reconfigure/{backend}/status")
        assert r.status_code == 200, backend
        body = r.json()
        assert body == {"enabled": False, "backend": body["backend"], "num_adapters": 0,
                        "adapters": []}
    assert server.get("/reconfigure/%20DaX%20/status").json()["backend"] == "dax"


def test_status_empty_backend_is_400(server):
    r = server.get("/reconfigure/%20/status")
    assert r.status_code == 400
    assert "detail" in r.json()


def test_operation_without_adapter_is_404(server):
    r = server.post("/reconfigure/dax/add", json={"device_path": "/dev/dax0.0", "size": "1GiB"})
    assert r.status_code == 404
    assert "adapter_index" in r.json()["detail"]
    r = server.post("/reconfigure/dax/add", json={"device_path": "/x", "size": 1,
                                                  "adapter_index": 3})
    assert r.status_code == 404


def test_operation_empty_segments_are_400(server):
    assert server.post("/reconfigure/%20/add", json={}).status_code == 400
    assert server.post("/reconfigure/dax/%20%20", json={}).status_code == 400


def test_operation_body_shape_is_422(server):
    r = server.post("/reconfigure/dax/add", data="{not json",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    r = server.post("/reconfigure/dax/add", json=[1, 2])
    assert r.status_code == 422
    r = server.post("/reconfigure/dax/add", json={"adapter_index": "zero"})
    assert r.status_code == 422


def test_wrong_method_is_405(server):
    r = server.get("/reconfigure/dax/add")
    assert r.status_code == 405


def test_unready_is_503(make_server):
    s = make_server(env={"LMCACHE_TEST_INIT_DELAY_MS": "4000"}, wait_ready=False)
    r = s.get("/reconfigure/dax/status")
    assert r.status_code == 503
    assert r.json() == {"error": "engine not initialized"}
    r = s.post("/reconfigure/dax/add", json={"device_path": "/dev/dax0.0", "size": "1GiB"})
    assert r.status_code == 503
    assert r.json() == {"error": "engine not initialized"}
    s.wait_ready()


# ---- a server with a dax adapter ---------------------------------------------------------------

@pytest.fixture
def daxdir():
    with tempfile.TemporaryDirectory(prefix="lmcache-dax-") as d:
        yield d


def dax_server(make_server, daxdir, devices, slot="64KiB", extra=()):
    cfg = {"type": "dax", "slot_size": slot,
           "devices": [{"device_path": os.path.join(daxdir, n), "size": s} for n, s in devices]}
    args = ["--l2-adapter", json.dumps(cfg)] + list(extra)
    s = make_server(args)
    # a server that did not load the dax adapter is a failure, never a reason to skip
    adapters = s.get("/config/adapters").json().get("adapters", [])
    assert [a.get("type_name") for a in adapters] == ["dax"], adapters
    status = s.get("/reconfigure/dax/status").json()
    assert status["enabled"] is True, status
    return s


def test_status_lists_devices(make_server, daxdir):
    s = dax_server(make_server, daxdir, [("d0", "1MiB"), ("d1", "2MiB")])
    body = s.get("/reconfigure/dax/status").json()
    assert body["enabled"] is True and body["backend"] == "dax" and body["num_adapters"] == 1
    a = body["adapters"][0]
    assert a["adapter_index"] == 0
    assert a["slot_size"] == 65536
    assert [d["state"] for d in a["devices"]] == ["active", "active"]
    assert [d["size_bytes"] for d in a["devices"]] == [1 << 20, 2 << 20]
    assert s.get("/reconfigure/DAX/status").json()["num_adapters"] == 1
    listing = s.get("/config/adapters").json()["adapters"]
    dax = [x for x in listing if x["type_name"] == "dax"][0]
    assert dax.get("reconfigurable") is True


def test_seed_examples(make_server, daxdir):
    s = dax_server(make_server, daxdir, [("d0", "1MiB")])
    p1 = os.path.join(daxdir, "d1")
    r = s.post("/reconfigure/dax/add", json={"device_path": p1, "size": "2MiB"})
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "operation": "add", "adapter_index": 0,
                        "device": r.json()["device"]}
    dev = r.json()["device"]
    assert dev["device_path"] == p1 and dev["state"] == "active" and dev["size_bytes"] == 2 << 20
    # idempotent add, then a conflicting size
    assert s.post("/reconfigure/dax/add", json={"device_path": p1, "size": 2 << 20}
                  ).status_code == 200
    assert s.post("/reconfigure/dax/add", json={"device_path": p1, "size": "3MiB"}
                  ).status_code == 409
    # normalised segments
    r = s.post("/reconfigure/%20DAX%20/%20Resize%20",
               json={"device_path": p1, "size": "4mib", "mode": "migrate"})
    assert r.status_code == 200, r.text
    assert r.json()["new_size_bytes"] == 4 << 20 and r.json()["old_size_bytes"] == 2 << 20
    r = s.post("/reconfigure/dax/remove", json={"device_path": p1, "mode": "drain"})
    assert r.status_code == 200 and r.json()["device"]["state"] == "draining"
    r = s.post("/reconfigure/dax/remove", json={"device_path": p1, "mode": "evict",
                                                 "force": False})
    assert r.status_code == 200 and r.json()["device"]["state"] == "removed"
    # errors
    p0 = os.path.join(daxdir, "d0")
    cases = [
        ("add", {"device_path": p1}, 422),                                 # missing size
        ("add", {"size": "1GiB"}, 422),                                    # missing path
        ("add", {"device_path": p1, "size": "1GiB", "color": "red"}, 422),  # extra field
        ("remove", {"device_path": p0, "size": "1MiB"}, 422),              # size not accepted
        ("remove", {"device_path": p0, "mode": "shred"}, 422),
        ("resize", {"device_path": p0, "size": "1MiB", "mode": "drain"}, 422),
        ("add", {"device_path": p1, "size": "-5GiB"}, 400),
        ("add", {"device_path": p1, "size": 0}, 400),
        ("add", {"device_path": p1, "size": "12 parsecs"}, 400),
        ("resize", {"device_path": p0, "size": "0b"}, 400),
        ("explode", {"device_path": p0}, 400),                              # unsupported op
        ("add", {"device_path": p1, "size": "1MiB", "adapter_index": 1}, 404),
        ("add", {"device_path": p1, "size": "1MiB", "adapter_index": -1}, 404),
        ("remove", {"device_path": p1}, 404),  # no longer attached
    ]
    for op, body, want in cases:
        r = s.post(f"/reconfigure/dax/{op}", json=body)
        assert r.status_code == want, (op, body, r.status_code, r.text)
        assert "detail" in r.json()
