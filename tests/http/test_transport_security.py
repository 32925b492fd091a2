"""TLS on the HTTP API, CURVE on the ZeroMQ socket, and admin frames behind a token of their own."""

from __future__ import annotations

import datetime
import ssl

import httpx
import pytest
import zmq

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.server.config import ServerConfig
from tests.support import running_server, serving_http

TOKEN = "client-token-for-tests-0123456789"
ADMIN = "admin-token-for-tests-9876543210"
RC = dict(max_batch=4, block_size=16, num_blocks=64, dtype="float32", max_model_len=256)


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made here (PEM files)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusedserve-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def server(ray_session):
    """A client token, an admin token, and a CURVE-encrypted socket."""
    public, secret = zmq.curve_keypair()
    with running_server(**RC, auth_token=TOKEN, admin_token=ADMIN, curve_secret_key=secret.decode()) as coord:
        coord.public = public.decode()
        yield coord


def test_the_http_api_over_tls(server, tmp_path):
    cert, key = _self_signed(tmp_path)
    with serving_http(server, ssl_keyfile=key, ssl_certfile=cert, token=TOKEN) as http:
        assert http.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=cert)
        r = httpx.post(f"{http.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                       verify=trusted, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(f"http://127.0.0.1:{http.port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{http.url}/health", timeout=10)


def test_curve_clients_are_served_and_others_cannot_talk(server):
    with Client(server.address, token=TOKEN, curve_server_key=server.public) as c:
        assert len(c.generate("hello", max_tokens=3)["token_ids"]) == 3
    with Client(server.address, token=TOKEN, timeout_s=2) as plain, pytest.raises(TimeoutError):
        plain.stats()  # no CURVE handshake: the frame never reaches the server
    wrong, _ = zmq.curve_keypair()
    with Client(server.address, token=TOKEN, timeout_s=2, curve_server_key=wrong) as c, \
            pytest.raises(TimeoutError):
        c.stats()


def test_admin_frames_need_the_admin_token(server):
    with Client(server.address, token=TOKEN, curve_server_key=server.public) as c:
        for call in (lambda: c.scale(1), c.workers):
            with pytest.raises(ServerError) as err:
                call()
            assert err.value.code == "unauthorized" and "admin" in str(err.value)
        assert c.stats()["workers"], "the client token still reads stats"
    with Client(server.address, token=TOKEN, admin_token=TOKEN, curve_server_key=server.public) as c:
        with pytest.raises(ServerError):  # the client token is not the admin token
            c.workers()
    with Client(server.address, token=TOKEN, admin_token=ADMIN, curve_server_key=server.public) as c:
        assert len(c.workers()) == 1 and c.scale(1)["active"] == 1


def test_without_an_admin_token_a_server_with_auth_takes_no_admin_frame(ray_session):
    with running_server(**RC, auth_token=TOKEN) as coord, Client(coord.address, token=TOKEN) as c:
        with pytest.raises(ServerError) as err:
            c.scale(2)
        assert err.value.code == "unauthorized" and "--admin-token-file" in str(err.value)
    with pytest.raises(ValueError, match="differ"):
        ServerConfig.build(auth_token=TOKEN, admin_token=TOKEN).check()
