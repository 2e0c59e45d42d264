"""Remote image URLs cannot reach the server's own network (server-side request forgery).

A loopback HTTP server (threads, bounded in time) serves an image, redirects, an
oversize body, a 404 with text that must not leak and slow answers. Every form of a
non-public address is refused before any connection; an allow-list of networks lets
the loopback server through; an injected resolver shows that a name with any private
address is refused and that the connection goes to the address that was checked.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from api.app import ServerSettings, create_app
from api.cli import build_parser, settings_from_args
from api.remote_fetch import (
    RemoteFetcher,
    RemoteFetchError,
    address_allowed,
    embedded_ipv4,
    literal_address,
    parse_networks,
)
from mmserve.cancel import Cancelled, CancelToken, using
from tests.helpers import MODEL, SAMPLES, chat, image_part

CAT = (SAMPLES / "cat.png").read_bytes()
SECRET = "Secret-Internal-Banner"
LOOPBACK = parse_networks("127.0.0.1/32")


class _Handler(http.server.BaseHTTPRequestHandler):
    """Routes of the test server; every request is recorded as ``(path, Host)``."""

    server_version = SECRET
    timeout = 10  # a stuck client never holds a server thread for long

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        srv = self.server
        path = urllib.parse.unquote(self.path)
        srv.seen.append((path, self.headers.get("Host")))
        if path == "/cat.png":
            self._send(200, CAT, "image/png")
        elif path.startswith("/to/"):  # /to/<url>: redirect there
            self._redirect(path[len("/to/") :])
        elif path.startswith("/loop/"):  # /loop/N redirects to /loop/N+1, forever
            self._redirect(f"/loop/{int(path.rsplit('/', 1)[1]) + 1}")
        elif path == "/redirect-once":
            self._redirect("/cat.png")
        elif path == "/big":
            self._send(200, b"\0" * (srv.big + 1), "image/png")
        elif path == "/big-chunked":  # no Content-Length: counted while reading
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(srv.big // 1000 + 2):
                if not self._write(b"3e8\r\n" + b"\0" * 1000 + b"\r\n"):
                    return
            self._write(b"0\r\n\r\n")
        elif path == "/slow-body":  # headers at once, then a byte every 20 ms
            self.send_response(200)
            self.send_header("Content-Length", "500")
            self.end_headers()
            self._trickle(b"\0" * 500)
        elif path == "/slow-headers":  # the status line and headers a byte at a time
            self._trickle(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 480 + b"\r\n\r\n")
        else:
            self._send(404, f"{SECRET}: nothing at {path}".encode(), "text/plain", SECRET)

    def _send(self, status: int, body: bytes, ctype: str, reason: str | None = None) -> None:
        self.send_response(status, reason)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _write(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
            return True
        except OSError:
            return False

    def _trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            if not self._write(data[i : i + 1]):
                self.server.cut.append(i)  # the client hung up before the end
                return
            time.sleep(0.02)
        self.server.cut.append(None)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    big = 10_000

    def __init__(self, addr: tuple[str, int], tls: ssl.SSLContext | None = None) -> None:
        super().__init__(addr, _Handler)
        self.seen: list[tuple[str, str | None]] = []
        self.cut: list[int | None] = []
        self.tls = tls

    def get_request(self):
        conn, addr = super().get_request()
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, addr

    def handle_error(self, request, client_address) -> None:
        pass  # failed TLS handshakes are expected in the certificate test


def _start(tls: ssl.SSLContext | None = None) -> _Server:
    srv = _Server(("127.0.0.1", 0), tls)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def server():
    srv = _start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture()
def srv(server):
    server.seen.clear()
    server.cut.clear()
    return server


def base(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def fetcher(**kw) -> RemoteFetcher:
    kw.setdefault("max_bytes", 10_000 if "big" in kw else 1 << 20)
    kw.pop("big", None)
    kw.setdefault("timeout", 5.0)
    return RemoteFetcher(**kw)


def never_resolve(host: str, port: int) -> list:
    """A resolver for URLs that must be refused (or are literal addresses) before any
    name is looked up."""
    raise AssertionError(f"{host}: looked up, but the URL should be judged without DNS")


def refused(f: RemoteFetcher, url: str) -> RemoteFetchError:
    with pytest.raises(RemoteFetchError) as e:
        f.fetch(url)
    assert e.value.refused, (url, e.value.message)
    return e.value


def failed(f: RemoteFetcher, url: str) -> RemoteFetchError:
    with pytest.raises(RemoteFetchError) as e:
        f.fetch(url)
    assert not e.value.refused, (url, e.value.message)
    return e.value


def assert_says_nothing_inside(err: RemoteFetchError) -> None:
    for leak in (SECRET, "404", "Errno", "Connection refused", "etc/", "127.0.0", "Traceback"):
        assert leak not in err.message, err.message


# ---- refusals before any connection ---------------------------------------------------

LOOPBACK_FORMS = [
    "127.0.0.1",
    "localhost",
    "0.0.0.0",
    "2130706433",
    "0x7f000001",
    "0x7f.1",
    "127.1",
    "0177.0.0.1",
    "127.000.000.001",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::ffff:0:127.0.0.1]",
    "[::127.0.0.1]",
    "[64:ff9b::127.0.0.1]",
    "[2002:7f00:1::]",
    "[0:0:0:0:0:0:0:1]",
    "[::]",
]


@pytest.mark.parametrize("host", LOOPBACK_FORMS)
def test_every_form_of_a_loopback_address_is_refused(srv, host) -> None:
    port = srv.server_address[1]
    err = refused(fetcher(), f"http://{host}:{port}/cat.png")
    assert "address" in err.message
    assert_says_nothing_inside(err)
    assert srv.seen == []  # nothing was sent


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/latest/meta-data/",
        "http://10.0.0.1/a.png",
        "http://10.255.255.255/a.png",
        "http://172.16.0.1/a.png",
        "http://192.168.1.1/a.png",
        "http://100.64.0.1/a.png",
        "http://192.0.2.1/a.png",
        "http://198.18.0.1/a.png",
        "http://224.0.0.1/a.png",
        "http://240.0.0.1/a.png",
        "http://255.255.255.255/a.png",
        "http://0.1.2.3/a.png",
        "http://[fe80::1]/a.png",
        "http://[fe80::1%25eth0]/a.png",
        "http://[fc00::1]/a.png",
        "http://[fec0::1]/a.png",
        "http://[ff02::1]/a.png",
        "http://[2001:db8::1]/a.png",
        "http://[2001::1]/a.png",
        "http://[64:ff9b:1::a00:1]/a.png",
        "http://[::ffff:10.0.0.1]/a.png",
        "http://[::ffff:169.254.169.254]/a.png",
        "http://[2002:a9fe:a9fe::]/a.png",
        "http://[64:ff9b::a9fe:a9fe]/a.png",
        "http://167772161/a.png",
        "https://10.0.0.1/a.png",
    ],
)
def test_private_and_special_addresses_are_refused(url) -> None:
    err = refused(fetcher(resolver=never_resolve), url)
    assert "address" in err.message


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("file:///etc/passwd", "only http and https"),
        ("ftp://example.com/a.png", "only http and https"),
        ("gopher://example.com/_x", "only http and https"),
        ("dict://example.com:11211/stat", "only http and https"),
        ("http://user:pw@example.com/a.png", "user name or password"),
        ("http://example.com/a b.png", "spaces or control characters"),
        ("http://example.com/a\r\nX-Injected: 1", "spaces or control characters"),
        ("http:///a.png", "has no host"),
        ("http://example.com:99999/a.png", "not a valid URL"),
        ("http://1.2.3.4.5.6/a.png", "not a valid address"),
    ],
)
def test_urls_that_are_not_plain_http_are_refused(url: str, words: str) -> None:
    assert words in refused(fetcher(resolver=never_resolve), url).message


# ---- what the allow-list lets through, and what it still stops ------------------------


def test_allowed_network_lets_the_loopback_server_through(srv) -> None:
    port = srv.server_address[1]
    assert fetcher(allowed_networks=LOOPBACK).fetch(f"{base(srv)}/cat.png") == CAT
    # IPv4 embedded in IPv6 is judged as that IPv4 address, for the allow-list too
    assert address_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), LOOPBACK)
    assert not address_allowed(ipaddress.ip_address("127.0.0.2"), LOOPBACK)
    f = fetcher(allowed_networks=LOOPBACK)
    assert f.fetch(f"http://2130706433:{port}/redirect-once") == CAT
    assert srv.seen == [("/cat.png", f"127.0.0.1:{port}")] + [
        ("/redirect-once", f"2130706433:{port}"),
        ("/cat.png", f"2130706433:{port}"),
    ]


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.2:{port}/cat.png",
        "http://[::1]:{port}/cat.png",
        "http://2130706434:{port}/cat.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/x",
        "file:///etc/passwd",
        "ftp://127.0.0.1/x",
        "gopher://127.0.0.1:6379/_x",
    ],
)
def test_each_redirect_is_checked_again(srv, target) -> None:
    """The first hop is allowed (127.0.0.1 only); where it redirects is not."""
    target = target.format(port=srv.server_address[1])
    err = refused(fetcher(allowed_networks=LOOPBACK), f"{base(srv)}/to/{target}")
    assert_says_nothing_inside(err)
    assert target not in err.message
    assert [p for p, _ in srv.seen] == [f"/to/{target}"]


def test_redirects_are_bounded(srv) -> None:
    f = fetcher(allowed_networks=LOOPBACK, max_redirects=2)
    err = failed(f, f"{base(srv)}/loop/0")
    assert "more than 2" in err.message
    assert [p for p, _ in srv.seen] == ["/loop/0", "/loop/1", "/loop/2"]
    srv.seen.clear()
    assert (
        fetcher(allowed_networks=LOOPBACK, max_redirects=1).fetch(f"{base(srv)}/redirect-once")
        == CAT
    )
    failed(fetcher(allowed_networks=LOOPBACK, max_redirects=0), f"{base(srv)}/redirect-once")


@pytest.mark.parametrize("path", ["/big", "/big-chunked"])
def test_body_over_the_limit(srv, path) -> None:
    f = fetcher(allowed_networks=LOOPBACK, max_bytes=srv.big)
    err = failed(f, base(srv) + path)
    assert err.too_large and f"over {srv.big} bytes" in err.message


@pytest.mark.parametrize("path", ["/slow-body", "/slow-headers"])
def test_a_slow_server_is_cut_at_the_deadline(srv, path) -> None:
    """The server sends a byte every 20 ms (10 s in all); each read is quick, so only a
    deadline over the whole fetch stops it."""
    err = failed(fetcher(allowed_networks=LOOPBACK, timeout=0.5), base(srv) + path)
    assert "longer than 0.5 s" in err.message
    for _ in range(200):  # the server notices the hang-up at its next write
        if srv.cut:
            break
        time.sleep(0.05)
    assert srv.cut and srv.cut[0] is not None  # it never got to send everything


@pytest.mark.parametrize("path", ["/slow-body", "/slow-headers"])
def test_a_client_that_hangs_up_stops_the_download_at_once(srv, path) -> None:
    """The request's token cancelled 0.2 s into a 10 s download (issue 45): the blocked
    read wakes at once and the fetch raises ``Cancelled`` (the route's 499), not a 400."""
    token = CancelToken()
    threading.Timer(0.2, token.cancel).start()
    t0 = time.monotonic()
    with using(token), pytest.raises(Cancelled):
        fetcher(allowed_networks=LOOPBACK, timeout=20).fetch(base(srv) + path)
    assert time.monotonic() - t0 < 2
    for _ in range(200):  # the server notices the hang-up at its next write
        if srv.cut:
            break
        time.sleep(0.05)
    assert srv.cut and srv.cut[0] is not None


def test_failures_say_nothing_about_the_inside(srv) -> None:
    f = fetcher(allowed_networks=LOOPBACK)
    err = failed(f, f"{base(srv)}/missing.png")
    assert_says_nothing_inside(err)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    err = failed(f, f"http://127.0.0.1:{port}/a.png")
    assert_says_nothing_inside(err)
    assert "unreachable" in err.message


# ---- names: every address checked, the checked one used -----------------------------


def test_a_name_with_any_private_address_is_refused(srv) -> None:
    calls = []

    def resolver(host: str, port: int) -> list:
        calls.append(host)
        return [ipaddress.ip_address(a) for a in ("93.184.215.14", "2606:4700::1111", "10.0.0.7")]

    err = refused(fetcher(resolver=resolver), "http://mixed.example/a.png")
    assert calls == ["mixed.example"]
    assert "10.0.0.7" not in err.message
    for bad in ("::1", "::ffff:127.0.0.1", "fe80::1", "169.254.169.254"):

        def one_bad(host: str, port: int, bad: str = bad) -> list:
            return [ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address(bad)]

        refused(fetcher(resolver=one_bad), "http://mixed.example/a.png")


def test_the_connection_goes_to_the_checked_address(srv, monkeypatch) -> None:
    """One lookup per hop; the socket dials the checked address (a second lookup would
    get a private one and fail), and the request names the original host."""
    port = srv.server_address[1]
    calls = []

    def rebinding(host: str, port: int) -> list:
        calls.append(host)
        first = len(calls) == 1
        return [ipaddress.ip_address("127.0.0.1" if first else "10.0.0.1")]

    real = socket.getaddrinfo

    def numeric_only(host, *a, **kw):
        if literal_address(str(host)) is None:
            raise AssertionError(f"second lookup of {host!r}")
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    f = fetcher(allowed_networks=LOOPBACK, resolver=rebinding)
    assert f.fetch(f"http://images.example:{port}/cat.png") == CAT
    assert calls == ["images.example"]
    assert srv.seen == [("/cat.png", f"images.example:{port}")]
    # a redirect is a new hop: looked up again, and this time the answer is private
    srv.seen.clear()
    calls.clear()
    calls.append("(first call used)")
    refused(f, f"http://127.0.0.1:{port}/to/http://images.example:{port}/cat.png")
    assert calls[1:] == ["images.example"]


def test_https_checks_the_certificate_against_the_host_name(tmp_path) -> None:
    """SNI and the certificate check use the URL's host name, not the dialled address."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "images.example")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("images.example")]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(pem)
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: sni.append(name)
    srv = _start(server_ctx)
    try:
        port = srv.server_address[1]
        client_ctx = ssl.create_default_context(cadata=pem.decode())
        to_loopback = lambda host, port: [ipaddress.ip_address("127.0.0.1")]  # noqa: E731
        f = fetcher(allowed_networks=LOOPBACK, resolver=to_loopback, ssl_context=client_ctx)
        assert f.fetch(f"https://images.example:{port}/cat.png") == CAT
        assert sni == ["images.example"]
        assert srv.seen == [("/cat.png", f"images.example:{port}")]
        # same address, other name: the certificate does not match
        err = failed(f, f"https://other.example:{port}/cat.png")
        assert_says_nothing_inside(err)
        # and without the test CA the certificate is not trusted
        failed(
            fetcher(allowed_networks=LOOPBACK, resolver=to_loopback),
            f"https://images.example:{port}/cat.png",
        )
    finally:
        srv.shutdown()
        srv.server_close()


# ---- the address rules ------------------------------------------------------------------


@pytest.mark.parametrize(
    "addr", ["8.8.8.8", "93.184.215.14", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_public_addresses_are_allowed(addr) -> None:
    assert address_allowed(ipaddress.ip_address(addr))


@given(st.integers(0, 2**32 - 1))
def test_ipv4_inside_ipv6_is_judged_as_the_ipv4(n) -> None:
    v4 = ipaddress.IPv4Address(n)
    want = address_allowed(v4)
    for v6 in (
        ipaddress.IPv6Address(0xFFFF << 32 | n),  # mapped
        ipaddress.IPv6Address(0xFFFF << 48 | n),  # translated
        ipaddress.IPv6Address(0x64FF9B << 96 | n),  # NAT64
        ipaddress.IPv6Address(0x2002 << 112 | n << 80 | 0x1234),  # 6to4
    ):
        assert embedded_ipv4(v6) == v4
        assert address_allowed(v6) == want, v6
    compatible = ipaddress.IPv6Address(n)  # deprecated: refused unless allowed
    assert not address_allowed(compatible)
    assert address_allowed(compatible, [ipaddress.ip_network(f"{v4}/32")])


# written out from the IANA special-purpose registries, not read from api.remote_fetch:
# the test checks the server's list against them
NON_PUBLIC = """
0.0.0.0/8 10.0.0.0/8 100.64.0.0/10 127.0.0.0/8 169.254.0.0/16 172.16.0.0/12 192.0.0.0/24
192.168.0.0/16 198.18.0.0/15 224.0.0.0/4 240.0.0.0/4 fc00::/7 fe80::/10 ff00::/8 ::/96
2001:db8::/32 203.0.113.0/24 198.51.100.0/24 64:ff9b:1::/48 2001::/32 fec0::/10 100::/64
3fff::/20 ::ffff:0:0/112
""".split()


@given(
    st.sampled_from(NON_PUBLIC),
    st.integers(0, 2**128 - 1),
)
def test_non_public_ranges_are_refused(net, n) -> None:
    net = ipaddress.ip_network(net)
    ip = net[n % net.num_addresses]
    assert not address_allowed(ip)
    assert address_allowed(ip, [net])


def test_allowed_networks_setting_and_flags() -> None:
    assert parse_networks(" 10.1.0.0/16, ::1 ,") == (
        ipaddress.ip_network("10.1.0.0/16"),
        ipaddress.ip_network("::1/128"),
    )
    for bad in ("10.0.0.1/8", "localhost", "10.0.0.0/33"):
        with pytest.raises(ValueError, match="CIDR"):
            parse_networks(bad)
    args = build_parser().parse_args(
        [
            "serve",
            "--allow-remote-images",
            "--remote-image-allowed-networks",
            "127.0.0.0/8,::1/128",
            "--remote-image-max-redirects",
            "1",
            "--remote-image-timeout",
            "2.5",
        ]
    )
    _, _, server = settings_from_args(args)
    assert server.allowed_networks() == parse_networks("127.0.0.0/8,::1/128")
    assert (server.remote_image_max_redirects, server.remote_image_timeout) == (1, 2.5)
    bad = build_parser().parse_args(["serve", "--remote-image-allowed-networks", "nope"])
    with pytest.raises(ValueError, match="remote_image_allowed_networks"):
        settings_from_args(bad)
    with pytest.raises(ValueError, match="remote_image_max_redirects"):
        ServerSettings(remote_image_max_redirects=-1).validate()


# ---- through the chat route -------------------------------------------------------------


def _ask(client, url: str):
    return chat(client, [{"type": "text", "text": "?"}, image_part(url)], max_tokens=2)


def test_chat_route_answers_400_naming_the_field(make_engine, srv) -> None:
    engine = make_engine(max_total_tokens=4096)
    port = srv.server_address[1]
    param = "messages[0].content[1].image_url.url"
    settings = ServerSettings(
        served_model_name=MODEL, allow_remote_images=True, remote_image_timeout=2.0
    )
    with TestClient(create_app(engine, settings)) as c:
        for url in (
            f"{base(srv)}/cat.png",
            f"http://localhost:{port}/cat.png",
            f"http://2130706433:{port}/cat.png",
            f"http://[::ffff:127.0.0.1]:{port}/cat.png",
            "http://169.254.169.254/latest/meta-data/",
        ):
            r = _ask(c, url)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, "image_url_not_allowed"), err
            assert err["message"].startswith(f"{param}: image URL refused")
        assert srv.seen == []
    allowed = ServerSettings(
        served_model_name=MODEL,
        allow_remote_images=True,
        remote_image_allowed_networks="127.0.0.1/32",
        remote_image_timeout=2.0,
    )
    with TestClient(create_app(engine, allowed)) as c:
        assert _ask(c, f"{base(srv)}/redirect-once").status_code == 200
        r = _ask(c, f"{base(srv)}/to/file:///etc/passwd")
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "image_url_not_allowed", err
        assert err["param"] == param and "/etc/passwd" not in err["message"]
        r = _ask(c, f"{base(srv)}/missing.png")
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "image_fetch_failed", err
        assert (
            err["param"] == param and SECRET not in err["message"] and "404" not in err["message"]
        )
        r = _ask(c, f"{base(srv)}/slow-body")
        err = r.json()["error"]
        assert r.status_code == 400 and "longer than 2 s" in err["message"], err
        assert c.get("/health").status_code == 200
