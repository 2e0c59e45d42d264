"""Fetching a remote image URL without becoming a proxy into the server's own network.

:class:`RemoteFetcher` fetches one ``http(s)://`` URL under these rules (a defence
against server-side request forgery; the checks follow the OWASP SSRF prevention
cheat sheet):

- only ``http`` and ``https``, no user name or password in the URL;
- the host name is resolved once per hop and **every** address it resolves to must be
  public (:func:`address_allowed`: not loopback, private, link-local, multicast,
  unspecified, reserved, shared or documentation space, in IPv4 and IPv6, with IPv4
  embedded in IPv6 judged as the IPv4 it stands for), unless it lies in an
  operator-given allowed network;
- numeric host forms (``2130706433``, ``0x7f000001``, ``127.1``, ``0177.0.0.1``) are
  read as the IPv4 address the C library would make of them, never sent to DNS;
- the TCP connection goes to an address that was checked (no second lookup, so a DNS
  answer that changes between check and use cannot redirect it); the request carries
  the original ``Host`` header, and for ``https`` the TLS handshake sends the host
  name (SNI) and verifies the certificate against it;
- redirects (301, 302, 303, 307, 308) are followed at most ``max_redirects`` times,
  each hop checked the same way; a redirect to another scheme is refused;
- one deadline covers DNS, connecting, TLS, headers, body and every redirect: a
  watchdog closes the socket when it passes, so a server trickling bytes cannot
  hold the fetch; the body is read up to ``max_bytes`` (more is an error);
- proxies from the environment are never used.

Errors carry a message safe to show a client: whether the URL was refused (address or
scheme not allowed) or the fetch failed, never what the remote side answered (status,
connection error text, redirect target); the details go to the server log.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import ipaddress
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mmserve.cancel import Cancelled, check_cancelled, current

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: ``resolver(host, port)`` -> the addresses ``host`` resolves to.
Resolver = Callable[[str, int], Sequence[IPAddress]]

_REDIRECTS = {301, 302, 303, 307, 308}
_CHUNK = 64 << 10
# IPv6 forms that stand for an IPv4 address (RFC 4291 2.5.5, RFC 2765, RFC 3056, RFC 6052)
_V4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_V4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_V4_COMPATIBLE = ipaddress.ip_network("::/96")
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# IANA IPv4 special-purpose address registry (RFC 6890 and updates), multicast and the
# reserved 240/4 (with 255.255.255.255): none of it is an image host
_SPECIAL_V4 = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.31.196.0/24",
        "192.52.193.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "192.175.48.0/24",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)
# IPv6: only global unicast (2000::/3), less its special-purpose blocks (IETF protocol
# assignments with Teredo, documentation, 6to4 and AS112); embedded IPv4 is judged before
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
_SPECIAL_V6 = tuple(
    ipaddress.ip_network(n)
    for n in ("2001::/23", "2001:db8::/32", "2002::/16", "2620:4f:8000::/48", "3fff::/20")
)
# what inet_aton accepts besides dotted quads: 1 to 4 parts, decimal, octal or hex
_NUMERIC_LABEL = re.compile(r"^(?:0[xX][0-9a-fA-F]*|[0-9]+)$")
_LEGACY_IPV4 = re.compile(r"^(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}$")


class RemoteFetchError(Exception):
    """A remote image that cannot be had.

    Args:
        message: text safe to show the client (nothing the remote side answered).
        refused: True when the URL itself is not allowed (scheme, address, redirect
            target), False when the fetch was tried and failed.
        too_large: True when the body is over the byte limit.
        detail: what really happened, for the server log only.
    """

    def __init__(
        self, message: str, *, refused: bool = False, too_large: bool = False, detail: str = ""
    ) -> None:
        super().__init__(message)
        self.message, self.refused, self.too_large, self.detail = (
            message,
            refused,
            too_large,
            detail,
        )


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """Networks from a comma-separated list of CIDRs or single addresses.

    ``"127.0.0.0/8, ::1, 10.1.2.0/24"`` gives three networks (``::1`` is ``::1/128``).

    Raises:
        ValueError: naming an entry that is not an address or network (host bits set
            counts as an error, so ``10.0.0.1/8`` is refused rather than widened).
    """
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=True))
        except ValueError as e:
            raise ValueError(f"{item!r} is not an IP network in CIDR form ({e})") from None
    return tuple(out)


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for, or None.

    IPv4-mapped (``::ffff:a.b.c.d``), IPv4-translated (``::ffff:0:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``), 6to4 (``2002:AABB:CCDD::/48``) and the NAT64
    well-known prefix (``64:ff9b::a.b.c.d``).
    """
    if ip.version == 4:
        return None
    if ip in _SIX_TO_FOUR:
        return ip.sixtofour
    if ip in _V4_MAPPED or ip in _V4_TRANSLATED or ip in _V4_COMPATIBLE or ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _public(ip: IPAddress) -> bool:
    """Globally routable unicast: outside every special-purpose range, by our own table
    (the standard library's ``is_global`` differs between Python versions) and by
    ``is_global``."""
    if ip.version == 4:
        special = any(ip in n for n in _SPECIAL_V4)
    else:
        special = ip not in _GLOBAL_UNICAST_V6 or any(ip in n for n in _SPECIAL_V6)
    return not special and ip.is_global and not ip.is_multicast


def address_allowed(ip: IPAddress, allowed: Iterable[IPNetwork] = ()) -> bool:
    """Whether a fetch may connect to ``ip``.

    Allowed: an address in ``allowed`` (or whose embedded IPv4, see
    :func:`embedded_ipv4`, is), else a globally routable unicast address. An IPv6
    address standing for an IPv4 one is judged as that IPv4 address, so
    ``::ffff:127.0.0.1`` is loopback; the deprecated IPv4-compatible form
    (``::a.b.c.d``) is refused whatever it embeds. Refused: loopback, private (RFC 1918, ULA),
    link-local (169.254/16 with cloud metadata services, fe80::/10), multicast,
    unspecified, reserved, shared (100.64/10), documentation and benchmark ranges,
    site-local, Teredo and local-use NAT64.
    """
    # an IPv6 literal may carry a zone (fe80::1%eth0): judge the address
    if ip.version == 6 and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    v4 = embedded_ipv4(ip)
    nets = list(allowed)
    if any(ip in n for n in nets) or (v4 is not None and any(v4 in n for n in nets)):
        return True
    if ip in _V4_COMPATIBLE:  # deprecated (RFC 4291 2.5.5.1): no public use
        return False
    return _public(v4) if v4 is not None else _public(ip)


def literal_address(host: str) -> IPAddress | None:
    """The address ``host`` names without DNS: an IP literal, or a numeric IPv4 form
    that ``inet_aton`` accepts (``2130706433``, ``0x7f000001``, ``127.1``, ``0177.0.0.1``);
    None for a name.

    Raises:
        RemoteFetchError: (refused) for a host whose last label is numeric but that is not
            such a form (``1.2.3.4.5``, ``999.1.1.1``).
    """
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    # a name ending in a numeric label is an IPv4 form (no top-level domain is numeric,
    # as in the WHATWG URL standard): read it here or refuse it, never ask DNS
    if _NUMERIC_LABEL.match(host.rsplit(".", 1)[-1]):
        try:
            if _LEGACY_IPV4.match(host):
                return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            pass
        raise RemoteFetchError("the image URL's host is not a valid address", refused=True)
    return None


def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address ``getaddrinfo`` gives for ``host`` (TCP), in its order, without
    duplicates.

    Raises:
        OSError: when the name does not resolve.
    """
    out: list[IPAddress] = []
    for _, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if ip not in out:
            out.append(ip)
    return out


# lookups run here so that the deadline bounds them (getaddrinfo has no timeout); a
# lookup that hangs holds one worker until the C library gives up
_LOOKUPS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="mmserve-dns")


@dataclass
class RemoteFetcher:
    """Fetches remote images under the rules of the module docstring.

    Attributes:
        max_bytes: largest body accepted (bytes).
        timeout: seconds for the whole fetch: every lookup, connection, TLS handshake,
            read and redirect together.
        max_redirects: most redirects followed (0: none).
        allowed_networks: networks fetched from even though they are not public.
        resolver: host name -> addresses (:func:`system_resolver`); tests inject one.
        ssl_context: TLS settings for ``https`` (default: system CAs, certificate and
            host name checked).
    """

    max_bytes: int
    timeout: float = 10.0
    max_redirects: int = 3
    allowed_networks: tuple[IPNetwork, ...] = ()
    resolver: Resolver = system_resolver
    ssl_context: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    def fetch(self, url: str) -> bytes:
        """The body of ``url`` (a 2xx answer, after redirects).

        Raises:
            RemoteFetchError: ``refused`` for a URL, address or redirect that is not
                allowed; ``too_large`` for a body over ``max_bytes``; otherwise a failed
                fetch (unreachable, timed out, no image in the answer, too many redirects).
            Cancelled: the current :class:`~mmserve.cancel.CancelToken` was cancelled
                (checked before each hop and between body chunks).
        """
        deadline = time.monotonic() + self.timeout
        for hop in range(self.max_redirects + 1):
            check_cancelled()
            location = self._hop(url, deadline)
            if isinstance(location, bytes):
                return location
            url = location
            log.info("remote image: redirect %d", hop + 1)
        raise RemoteFetchError(f"the image URL redirected more than {self.max_redirects} times")

    def _target(self, url: str) -> tuple[str, str, int, str]:
        """``(scheme, host, port, path?query)`` of an allowed URL."""
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError:
            raise RemoteFetchError("the image URL is not a valid URL", refused=True) from None
        if any(c <= " " or c == "\x7f" for c in url):
            raise RemoteFetchError(
                "the image URL contains spaces or control characters", refused=True
            )
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise RemoteFetchError("only http and https image URLs are allowed", refused=True)
        if parts.username is not None or parts.password is not None:
            raise RemoteFetchError(
                "image URLs with a user name or password are not allowed", refused=True
            )
        host = (parts.hostname or "").rstrip(".")
        if not host:
            raise RemoteFetchError("the image URL has no host", refused=True)
        try:  # a non-ASCII name as DNS sees it
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise RemoteFetchError(
                "the image URL's host is not a valid name", refused=True
            ) from None
        port = port or (443 if scheme == "https" else 80)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        # non-ASCII as UTF-8 percent-escapes; escapes already present are kept
        path = urllib.parse.quote(path, safe="/%:@!$&'()*+,;=?~")
        return scheme, host, port, path

    def _addresses(self, host: str, port: int, deadline: float) -> list[IPAddress]:
        """The checked addresses of ``host``: all must be allowed."""
        literal = literal_address(host)
        if literal is not None:
            addrs: Sequence[IPAddress] = [literal]
        else:
            job = _LOOKUPS.submit(self.resolver, host, port)
            try:
                addrs = job.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise RemoteFetchError(self._timed_out(), detail=f"lookup of {host}") from None
            except (OSError, UnicodeError, ValueError) as e:
                raise RemoteFetchError(
                    "could not fetch the image URL: its host name does not resolve",
                    detail=f"lookup of {host}: {e}",
                ) from None
        if not addrs:
            raise RemoteFetchError("could not fetch the image URL: its host name does not resolve")
        for ip in addrs:
            if not address_allowed(ip, self.allowed_networks):
                raise RemoteFetchError(
                    "the image URL points to an address this server does not fetch from "
                    "(loopback, private, link-local or other non-public addresses are refused)",
                    refused=True,
                    detail=f"{host} -> {ip}",
                )
        return list(addrs)

    def _timed_out(self) -> str:
        return f"fetching the image URL took longer than {self.timeout:g} s"

    def _hop(self, url: str, deadline: float) -> bytes | str:
        """One request: the body, or the next URL of a redirect."""
        scheme, host, port, path = self._target(url)
        addrs = self._addresses(host, port, deadline)
        raw = self._connect(addrs, port, deadline)
        killed = threading.Event()
        live = [raw]  # the socket in use (TLS takes the descriptor over)

        def kill() -> None:  # the deadline passed: wake any blocked read
            killed.set()
            try:  # the plain socket's shutdown, so a TLS read sees EOF, not a torn object
                socket.socket.shutdown(live[-1], socket.SHUT_RDWR)
            except OSError:
                pass

        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), kill)
        watchdog.daemon = True
        watchdog.start()
        token = current()  # the client hanging up wakes a blocked read the same way
        unhook = token.on_cancel(kill) if token is not None else None
        conn = None
        try:
            sock: socket.socket = raw
            if scheme == "https":
                sock = self.ssl_context.wrap_socket(
                    raw, server_hostname=host, do_handshake_on_connect=False
                )
                live.append(sock)
                sock.do_handshake()
            conn = _PinnedConnection(host, port, sock, deadline)
            conn.request(
                "GET",
                path,
                headers={
                    "User-Agent": "mmserve",
                    "Accept": "image/*",
                    "Accept-Encoding": "identity",
                },
            )
            resp = conn.getresponse()
            if resp.status in _REDIRECTS:
                location = resp.getheader("Location")
                if not location:
                    raise RemoteFetchError(
                        "could not fetch the image URL: it redirects nowhere",
                        detail=f"{resp.status} without Location",
                    )
                return urllib.parse.urljoin(url, location.strip())
            if not 200 <= resp.status < 300:
                raise RemoteFetchError(
                    "could not fetch the image URL: the server did not answer with the image",
                    detail=f"HTTP {resp.status}",
                )
            body = self._read_body(resp, sock, deadline)
            if killed.is_set():  # the watchdog's shutdown reads as an early end
                raise RemoteFetchError(self._timed_out())
            if resp.length:  # http.client counts down a Content-Length it was given
                raise RemoteFetchError(
                    "could not fetch the image URL: the answer ended early",
                    detail=f"{resp.length} bytes missing",
                )
            return body
        except Cancelled:  # the client left mid-download: no 400, the route answers 499
            raise
        except RemoteFetchError:
            check_cancelled()
            if killed.is_set():
                raise RemoteFetchError(self._timed_out()) from None
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            check_cancelled()
            if killed.is_set() or time.monotonic() >= deadline or isinstance(e, TimeoutError):
                raise RemoteFetchError(self._timed_out(), detail=repr(e)) from None
            raise RemoteFetchError(
                "could not fetch the image URL: the connection failed", detail=repr(e)
            ) from None
        except Exception as e:  # whatever broke, the client gets a 400
            check_cancelled()
            log.warning("remote image fetch broke", exc_info=True)
            raise RemoteFetchError(
                "could not fetch the image URL: the connection failed", detail=repr(e)
            ) from None
        finally:
            watchdog.cancel()
            if unhook is not None:
                unhook()
            if conn is not None:
                conn.close()
            live[-1].close()

    def _read_body(
        self, resp: http.client.HTTPResponse, sock: socket.socket, deadline: float
    ) -> bytes:
        length = resp.getheader("Content-Length")
        if length and length.strip().isdigit() and int(length) > self.max_bytes:
            raise self._too_large()
        chunks, got = [], 0
        while True:
            check_cancelled()  # between chunks: the requester may have left
            if sock.fileno() >= 0:
                _set_timeout(sock, deadline)
            chunk = resp.read(min(_CHUNK, self.max_bytes + 1 - got))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            got += len(chunk)
            if got > self.max_bytes:
                raise self._too_large()

    def _too_large(self) -> RemoteFetchError:
        return RemoteFetchError(f"the remote image is over {self.max_bytes} bytes", too_large=True)

    def _connect(self, addrs: Sequence[IPAddress], port: int, deadline: float) -> socket.socket:
        """A TCP connection to the first checked address that answers."""
        last: Exception | None = None
        for ip in addrs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                return socket.create_connection((str(ip), port), timeout=left)
            except OSError as e:
                last = e
        if time.monotonic() >= deadline:
            raise RemoteFetchError(self._timed_out(), detail=repr(last))
        raise RemoteFetchError(
            "could not fetch the image URL: the host is unreachable", detail=repr(last)
        )


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP connection over an already connected (and checked) socket; ``Host`` is
    the URL's host."""

    def __init__(self, host: str, port: int, sock: socket.socket, deadline: float) -> None:
        super().__init__(host, port, timeout=max(0.001, deadline - time.monotonic()))
        self.sock = sock
        _set_timeout(sock, deadline)

    def connect(self) -> None:
        # never dial: a closed pinned connection stays closed
        raise http.client.NotConnected("pinned connection is closed")

    def close(self) -> None:
        # the fetcher owns the socket (its watchdog may still need it): only let go
        self.sock = None
        super().close()


def _set_timeout(sock: socket.socket, deadline: float) -> None:
    """Bound the next blocking socket call by what is left of the deadline (the
    watchdog bounds the sum of them)."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
