"""SSRF guard for webhook URLs: resolve once, check every address, pin the connection to it.

A URL is refused unless its scheme is allowed, every address its host resolves to is public
unicast, and it carries no tricks (encoded IPs, zone ids). The checked addresses are then the
only ones a delivery connects to (`PinnedBackend`), so DNS cannot change between check and use.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

# Legacy inet_aton forms a resolver would accept: 2130706433, 0177.0.0.1, 0x7f.1, 127.1.
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$", re.I)
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


class UnsafeUrl(ValueError):
    """A webhook URL the guard refuses; the message says why."""


class UnresolvableHost(UnsafeUrl):
    """The host did not resolve now; unlike other refusals this may pass on a later try."""


@dataclass(frozen=True)
class UrlPolicy:
    """What the guard lets through: schemes and an allow-list for local testing."""

    allow_http: bool = False
    allow_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckedUrl:
    """A URL that passed the guard, with the addresses a connection may use."""

    url: str
    host: str
    port: int
    addresses: tuple[str, ...]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `getaddrinfo` gives for a host (one lookup)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_problem(address: IPAddress) -> str | None:
    """Why an address is not a public unicast one, or None when it is."""
    inner = embedded_ipv4(address)
    if inner is not None:
        problem = address_problem(inner)
        return f"embeds {inner}, which {problem}" if problem else None
    checks: list[tuple[bool, str]] = [
        (address.is_loopback, "is loopback"),
        (address.is_unspecified, "is unspecified"),
        (address.is_link_local, "is link-local (cloud metadata lives here)"),
        (address.is_multicast, "is multicast"),
        (isinstance(address, ipaddress.IPv4Address) and address in _CGNAT, "is CGNAT (100.64/10)"),
        (isinstance(address, ipaddress.IPv6Address) and address in _NAT64_LOCAL, "is local NAT64"),
        (address.is_private, "is private"),
        (address.is_reserved, "is reserved"),
        (not address.is_global, "is not globally routable"),
    ]
    return next((reason for refused, reason in checks if refused), None)


def literal_address(host: str) -> IPAddress | None:
    """The IP a host names literally, decoding the legacy numeric forms; None for a name."""
    if "%" in host:
        raise UnsafeUrl("IPv6 zone ids are not allowed")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_HOST.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host.rstrip(".")))
        except OSError as exc:
            raise UnsafeUrl(f"malformed numeric host {host!r}") from exc
    return None


def _allowed(host: str, address: IPAddress | None, allow: Iterable[str]) -> bool:
    for entry in allow:
        entry = entry.strip().lower().strip("[]")
        if entry == host:
            return True
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


def _split(url: str, policy: UrlPolicy) -> tuple[str, int]:
    # Parse as httpx will when it sends: the pinned backend compares against this very host.
    try:
        parsed = httpx.URL(url)
        host = parsed.raw_host.decode("ascii").lower()
    except (httpx.InvalidURL, UnicodeError, TypeError) as exc:
        raise UnsafeUrl(f"not a valid URL: {exc}") from exc
    scheme = parsed.scheme.lower()
    if scheme != "https" and not (scheme == "http" and policy.allow_http):
        raise UnsafeUrl("only https URLs are allowed" if scheme else "the URL has no scheme")
    if not host:
        raise UnsafeUrl("the URL has no host")
    return host, parsed.port or (443 if scheme == "https" else 80)


def check_url(url: str, policy: UrlPolicy, resolve: Resolver = system_resolver) -> CheckedUrl:
    """Resolve a URL's host once and check every address; raises `UnsafeUrl`."""
    host, port = _split(url, policy)
    literal = literal_address(host)
    if literal is not None:
        names = [str(literal)]
    else:
        try:
            names = resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise UnresolvableHost(f"cannot resolve {host!r}: {exc}") from exc
        if not names:
            raise UnresolvableHost(f"{host!r} resolves to no address")
    addresses: list[str] = []
    for name in names:
        address = ipaddress.ip_address(name.split("%", 1)[0])
        problem = address_problem(address)
        if problem and not _allowed(host, address, policy.allow_hosts):
            raise UnsafeUrl(f"{host!r} resolves to {address}, which {problem}")
        addresses.append(str(address))
    return CheckedUrl(url=url, host=host, port=port, addresses=tuple(addresses))


class PinnedBackend(httpcore.NetworkBackend):
    """Connects only to the checked addresses of the checked host, whatever DNS says now."""

    def __init__(self, target: CheckedUrl) -> None:
        self.target = target
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        """Open a TCP connection to the first checked address that answers."""
        if host.lower().strip("[]") != self.target.host or port != self.target.port:
            raise httpcore.ConnectError(f"connection to {host}:{port} is not the checked target")
        error: Exception | None = None
        for address in self.target.addresses:
            try:
                return self._backend.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise httpcore.ConnectError(f"no checked address of {host} answered: {error}")

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        """Refused: a webhook never goes to a local socket."""
        del path, timeout, socket_options  # httpcore's NetworkBackend signature
        raise httpcore.ConnectError("unix sockets are not allowed")


class PinnedTransport(httpx.HTTPTransport):
    """An httpx transport whose every connection goes through a `PinnedBackend`."""

    def __init__(self, target: CheckedUrl, verify: bool | ssl.SSLContext = True) -> None:
        super().__init__(verify=verify, retries=0)
        # Same pool httpx builds, with the network backend swapped: TLS SNI and certificate
        # checks still use the URL's host name, only the TCP connect goes to the pinned address.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify),
            max_connections=1,
            network_backend=PinnedBackend(target),
        )


def pinned_client(
    target: CheckedUrl, timeout: float, verify: bool | ssl.SSLContext = True
) -> httpx.Client:
    """An httpx client for one checked URL: pinned, no redirects, no proxies from the env."""
    return httpx.Client(
        transport=PinnedTransport(target, verify=verify),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )


def policy_from(allow_http: bool, allow_hosts: Sequence[str]) -> UrlPolicy:
    """A policy from the webhook settings."""
    return UrlPolicy(allow_http=allow_http, allow_hosts=tuple(h.lower() for h in allow_hosts))
