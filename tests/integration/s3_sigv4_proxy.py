#!/usr/bin/python3
"""A strict SigV4-verifying HTTP proxy in front of an S3-protocol server (s3rver does not check
signatures). It recomputes every request's AWS Signature Version 4 the way S3 does and answers
403 SignatureDoesNotMatch (S3's XML error body) on a mismatch; matching requests are forwarded.

    s3_sigv4_proxy.py --listen PORT --admin PORT --upstream HOST:PORT --cred AKID:SECRET

Admin port (plain HTTP, unsigned): GET /stats -> {"forwarded", "rejected", "last_reject"};
POST /delay?ms=N delays every forwarded answer; POST /down closes the listening socket and every
open connection (clients get "connection refused"); POST /up listens again on the same port.
Standard library only."""
import argparse
import datetime
import hashlib
import hmac
import http.client
import http.server
import json
import socket
import socketserver
import sys
import threading
import time
import urllib.parse

HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te",
       "upgrade"}
STATE = {"forwarded": 0, "rejected": 0, "last_reject": "", "delay_ms": 0}
LOCK = threading.Lock()
CREDS = {}
UPSTREAM = ("127.0.0.1", 0)


def uri_encode(s, keep_slash):
    return urllib.parse.quote(s, safe="-_.~" + ("/" if keep_slash else ""))


def canonical_query(raw):
    if not raw:
        return ""
    pairs = []
    for part in raw.split("&"):
        k, _, v = part.partition("=")
        pairs.append((uri_encode(urllib.parse.unquote(k), False),
                      uri_encode(urllib.parse.unquote(v), False)))
    pairs.sort()
    return "&".join(f"{k}={v}" for k, v in pairs)


def verify(method, raw_path, headers, body):
    """Returns None when the signature is right, else the reason."""
    auth = headers.get("authorization")
    if not auth:
        return "no Authorization header"
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "not AWS4-HMAC-SHA256"
    fields = {}
    for item in auth[len("AWS4-HMAC-SHA256 "):].split(","):
        k, _, v = item.strip().partition("=")
        fields[k] = v
    try:
        akid, date, region, service, term = fields["Credential"].split("/")
        signed = fields["SignedHeaders"].split(";")
        sig = fields["Signature"]
    except (KeyError, ValueError):
        return "malformed Authorization header"
    if akid not in CREDS:
        return "unknown access key"
    if term != "aws4_request" or service != "s3":
        return "bad credential scope"
    for need in ("host", "x-amz-date", "x-amz-content-sha256"):
        if need not in signed:
            return f"{need} is not signed"
    if "x-amz-security-token" in headers and "x-amz-security-token" not in signed:
        return "x-amz-security-token is not signed"
    amz_date = headers.get("x-amz-date", "")
    try:
        t = datetime.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(
            tzinfo=datetime.timezone.utc)
    except ValueError:
        return "bad x-amz-date"
    if abs((datetime.datetime.now(datetime.timezone.utc) - t).total_seconds()) > 900:
        return "request time too skewed"
    if not amz_date.startswith(date):
        return "credential date differs from x-amz-date"
    payload = headers.get("x-amz-content-sha256", "")
    if payload != "UNSIGNED-PAYLOAD" and payload != hashlib.sha256(body).hexdigest():
        return "x-amz-content-sha256 does not match the body"
    path, _, query = raw_path.partition("?")
    curi = "/".join(uri_encode(urllib.parse.unquote(seg), False) for seg in path.split("/"))
    chdrs = ""
    for h in signed:
        if h not in headers:
            return f"signed header {h} is missing"
        chdrs += h + ":" + " ".join(headers[h].split()) + "\n"
    creq = "\n".join([method, curi or "/", canonical_query(query), chdrs, ";".join(signed),
                      payload])
    scope = f"{date}/{region}/{service}/{term}"
    sts = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                     hashlib.sha256(creq.encode()).hexdigest()])
    key = ("AWS4" + CREDS[akid]).encode()
    for part in (date, region, service, term):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    want = hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, sig):
        return "signature mismatch; canonical request was:\n" + creq
    return None


def s3_error(code, msg):
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{msg}</Message></Error>").encode()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def _headers(self):
        h = {}
        for k, v in self.headers.items():
            k = k.lower()
            h[k] = h[k] + "," + v.strip() if k in h else v.strip()
        return h

    def _reply(self, status, hdrs, body, head=False):
        self.send_response(status)
        for k, v in hdrs:
            self.send_header(k, v)
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _handle(self):
        hdrs = self._headers()
        if "chunked" in hdrs.get("transfer-encoding", ""):
            body = s3_error("MissingContentLength", "You must provide the Content-Length HTTP "
                            "header.")
            self._reply(411, [("Content-Length", str(len(body))), ("Connection", "close")], body)
            self.close_connection = True
            return
        n = int(hdrs.get("content-length", "0") or 0)
        body = self.rfile.read(n) if n else b""
        why = verify(self.command, self.path, hdrs, body)
        if why:
            with LOCK:
                STATE["rejected"] += 1
                STATE["last_reject"] = f"{self.command} {self.path}: {why}"
            sys.stderr.write(f"s3_sigv4_proxy: REJECT {self.command} {self.path}: {why}\n")
            err = s3_error("SignatureDoesNotMatch", "The request signature we calculated does "
                           "not match the signature you provided.")
            self._reply(403, [("Content-Type", "application/xml"),
                              ("Content-Length", str(len(err)))], err, self.command == "HEAD")
            return
        fwd = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        fwd["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*UPSTREAM, timeout=120)
        try:
            conn.request(self.command, self.path, body=body, headers=fwd)
            resp = conn.getresponse()
            rbody = resp.read()
            rh = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP]
            status = resp.status
        finally:
            conn.close()
        with LOCK:
            STATE["forwarded"] += 1
            delay = STATE["delay_ms"]
        if delay:
            time.sleep(delay / 1000.0)
        if self.command != "HEAD" and not any(k.lower() == "content-length" for k, _ in rh):
            rh.append(("Content-Length", str(len(rbody))))
        self._reply(status, rh, rbody, self.command == "HEAD")

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr):
        super().__init__(addr, Handler)
        self.conns = set()

    def process_request(self, request, client_address):
        with LOCK:
            self.conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with LOCK:
            self.conns.discard(request)
        super().shutdown_request(request)

    def kill_all(self):
        with LOCK:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Data:
    def __init__(self, port):
        self.port = port
        self.srv = None
        self.thread = None

    def up(self):
        if self.srv:
            return
        self.srv = Server(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def down(self):
        if not self.srv:
            return
        self.srv.shutdown()
        self.srv.server_close()
        self.srv.kill_all()
        self.srv = None


def admin_handler(data):
    class Admin(http.server.BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):
            pass

        def _send(self, obj):
            b = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            with LOCK:
                self._send(dict(STATE, up=data.srv is not None))

        def do_POST(self):
            u = urllib.parse.urlparse(self.path)
            q = urllib.parse.parse_qs(u.query)
            if u.path == "/delay":
                with LOCK:
                    STATE["delay_ms"] = int(q.get("ms", ["0"])[0])
            elif u.path == "/down":
                data.down()
            elif u.path == "/up":
                data.up()
            elif u.path == "/reset":
                with LOCK:
                    STATE.update(forwarded=0, rejected=0, last_reject="")
            self.do_GET()

    return Admin


def main():
    global UPSTREAM
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--admin", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--cred", action="append", default=[])
    a = ap.parse_args()
    host, _, port = a.upstream.rpartition(":")
    UPSTREAM = (host, int(port))
    for c in a.cred:
        k, _, s = c.partition(":")
        CREDS[k] = s
    data = Data(a.listen)
    data.up()
    adm = http.server.ThreadingHTTPServer(("127.0.0.1", a.admin), admin_handler(data))
    adm.allow_reuse_address = True
    try:
        adm.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
