"""Every curl example in docs/http-api.md runs against a live server and answers the status
code written beside it (`# NNN`)."""
import os
import re
import subprocess

import pytest

from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "http-api.md")


def examples():
    text = open(DOC).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            m = re.match(r"^(curl .*?)\s+#\s*(\d{3})\s*$", line.strip())
            if m:
                out.append((m.group(1), int(m.group(2))))
    return out


def test_doc_has_examples():
    assert len(examples()) >= 15


@pytest.fixture(scope="module")
def doc_server():
    from conftest import Server
    s = Server()
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("cmd,status", examples())
def test_example(doc_server, cmd, status):
    cmd = cmd.replace("http://localhost:8080", doc_server.url)
    p = subprocess.run(["bash", "-c", cmd + " -o /dev/null -w '%{http_code}'"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.strip()[-3:]) == status, (cmd, p.stdout)
