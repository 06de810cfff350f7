"""SSRF guard: refused addresses, the allow-list, and connections pinned to the checked address."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kiln.tasks.webhooks.ssrf import CheckedUrl, UnsafeUrl, UrlPolicy, check_url, pinned_client
from tests.tasks.helpers import Receiver, fake_dns

STRICT = UrlPolicy()
DNS = fake_dns(
    {
        "internal.example": ["10.1.2.3"],
        "mixed.example": ["93.184.216.34", "192.168.0.7"],
        "public.example": ["93.184.216.34", "2606:2800:220:1::1"],
        "hooks.example": ["127.0.0.1"],
    }
)


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/hook",
        "https://localhost/hook",
        "https://[::1]/hook",
        "https://10.0.0.1/hook",
        "https://172.16.5.4/hook",
        "https://192.168.1.1/hook",
        "https://169.254.169.254/latest/meta-data",
        "https://[fe80::1]/hook",
        "https://[::ffff:127.0.0.1]/hook",
        "https://[::ffff:a9fe:a9fe]/hook",  # mapped 169.254.169.254
        "https://2130706433/hook",  # decimal 127.0.0.1
        "https://0x7f000001/hook",  # hex
        "https://0x7f.1/hook",  # short hex form
        "https://017700000001/hook",  # octal
        "https://127.1/hook",
        "https://100.64.0.1/hook",  # CGNAT
        "https://224.0.0.1/hook",  # multicast
        "https://240.0.0.1/hook",  # reserved
        "https://0.0.0.0/hook",
        "https://[::]/hook",
        "https://[2002:7f00:1::]/hook",  # 6to4 of 127.0.0.1
        "https://[64:ff9b::a00:1]/hook",  # NAT64 of 10.0.0.1
        "https://[fc00::1]/hook",  # unique local
        "https://internal.example/hook",  # a name that resolves to a private address
        "https://mixed.example/hook",  # one bad address among good ones
        "http://93.184.216.34/hook",  # plain http not allowed by default
        "ftp://93.184.216.34/hook",
        "https:///nohost",
        "https://no-such-host.invalid/hook",
    ],
)
def test_refused(url: str) -> None:
    with pytest.raises(UnsafeUrl):
        check_url(url, STRICT, DNS)


def test_public_addresses_pass_and_every_address_is_kept() -> None:
    checked = check_url("https://public.example:8443/h", STRICT, DNS)
    assert checked.addresses == ("93.184.216.34", "2606:2800:220:1::1")
    assert checked.port == 8443
    assert checked.host == "public.example"
    assert check_url("https://1.1.1.1/h", STRICT, DNS).addresses == ("1.1.1.1",)


def test_allow_list_and_http_switch() -> None:
    local = UrlPolicy(allow_http=True, allow_hosts=("127.0.0.1",))
    assert check_url("http://127.0.0.1:9000/h", local, DNS).addresses == ("127.0.0.1",)
    with pytest.raises(UnsafeUrl):
        check_url("http://10.0.0.1/h", local, DNS)
    by_cidr = UrlPolicy(allow_hosts=("10.0.0.0/8",))
    assert check_url("https://internal.example/h", by_cidr, DNS).addresses == ("10.1.2.3",)
    by_name = UrlPolicy(allow_hosts=("internal.example",))
    assert check_url("https://internal.example/h", by_name, DNS).host == "internal.example"


def test_connection_goes_to_the_checked_address_with_the_original_host(
    receiver: Receiver,
) -> None:
    # "hooks.example" exists only in the test resolver: reaching the receiver proves the
    # connection used the checked address, and the Host header keeps the name.
    policy = UrlPolicy(allow_http=True, allow_hosts=("hooks.example",))
    url = f"http://hooks.example:{receiver.port}/hook"
    target = check_url(url, policy, DNS)
    with pinned_client(target, timeout=10) as client:
        assert client.post(url, content=b"{}").status_code == 200
    assert receiver.hits[0].headers["Host"] == f"hooks.example:{receiver.port}"


def test_pinned_client_refuses_other_hosts_and_redirects(receiver: Receiver) -> None:
    target = CheckedUrl(
        url=receiver.url, host="127.0.0.1", port=receiver.port, addresses=("127.0.0.1",)
    )
    with pinned_client(target, timeout=10) as client, pytest.raises(httpx.ConnectError):
        client.post(f"http://localhost:{receiver.port}/hook")
    receiver.script = [(302, {"Location": "http://127.0.0.1:1/elsewhere"})]
    with pinned_client(target, timeout=10) as client:
        assert client.post(receiver.url).status_code == 302
    assert len(receiver.hits) == 1


def _certificate(tmp: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / f"{name}.pem", tmp / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_receiver(tmp_path: Path) -> Iterator[tuple[Receiver, Path]]:
    """A receiver serving TLS with a certificate for `hooks.example` only."""
    cert, key = _certificate(tmp_path, "hooks.example")
    receiver = Receiver()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    receiver.httpd.socket = context.wrap_socket(receiver.httpd.socket, server_side=True)
    yield receiver, cert
    receiver.close()


def test_tls_uses_the_url_host_for_sni_and_certificate(
    tls_receiver: tuple[Receiver, Path],
) -> None:
    receiver, cert = tls_receiver
    trust = ssl.create_default_context(cafile=str(cert))
    policy = UrlPolicy(allow_hosts=("hooks.example",))
    url = f"https://hooks.example:{receiver.port}/hook"
    with pinned_client(check_url(url, policy, DNS), timeout=10, verify=trust) as client:
        assert client.post(url, content=b"{}").status_code == 200
    # The same pinned address under a name the certificate does not carry fails verification.
    other = fake_dns({"other.example": ["127.0.0.1"]})
    bad_url = f"https://other.example:{receiver.port}/hook"
    target = check_url(bad_url, UrlPolicy(allow_hosts=("other.example",)), other)
    with (
        pinned_client(target, timeout=10, verify=trust) as client,
        pytest.raises(httpx.ConnectError),
    ):
        client.post(bad_url, content=b"{}")
    assert ipaddress.ip_address(target.addresses[0]).is_loopback


def test_threads_do_not_share_state() -> None:
    # check_url is pure apart from the resolver: concurrent checks give the same answers.
    results: list[tuple[str, ...]] = []

    def check() -> None:
        results.append(check_url("https://public.example/", STRICT, DNS).addresses)

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
