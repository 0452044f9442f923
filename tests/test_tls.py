"""TLS (issue 11 item 14): `router serve --ssl-certfile F --ssl-keyfile F` serves HTTPS on every
listener, the dedicated Ollama and LM Studio ports included, to the official clients verifying
a self-signed certificate made here. HTTP/1.1 only: a client offering h2 over ALPN gets
http/1.1 (HTTP/2 works with Granian 2.8 but is left off: see router/serve/server.py)."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import socket
import ssl
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import ollama
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import ROOT, RouterProcess, wait_for, write_boxes
from router.sim import SimBox, SimFleet, SimLMStudio, SimOllama


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, valid for a day."""
    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def trusting(cert_path: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert_path))


def test_every_listener_serves_https_to_the_official_clients(start_fleet_in_process, cert):
    cert_path, key_path = cert
    hugpy = SimBox("h", catalog=["tiny"], residents=["tiny"])
    ollama_box = SimOllama("o", tags=["llama3:latest"], loaded=["llama3:latest"])
    lmstudio_box = SimLMStudio("l", models=["qwen2.5-7b-instruct"])
    router = start_fleet_in_process(
        hugpy, ollama_box, lmstudio_box,
        extra_args=("--ollama-port", "auto", "--lmstudio-port", "auto",
                    "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path)),
    )
    assert all(url.startswith("https://") for url in router.urls.values())
    context = trusting(cert_path)

    client = openai.OpenAI(base_url=router.urls["router"] + "/v1", api_key="unused", max_retries=0,
                           http_client=httpx.Client(verify=context, timeout=10))
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert len(chunks) > 2

    ollama_client = ollama.Client(host=router.urls["ollama"], verify=context, timeout=10)
    assert [m.model for m in ollama_client.list().models] == ["llama3:latest"]
    assert ollama_client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}]).message.content

    lms = openai.OpenAI(base_url=router.urls["lmstudio"] + "/v1", api_key="lm-studio", max_retries=0,
                        http_client=httpx.Client(verify=context, timeout=10))
    assert [m.id for m in lms.models.list().data] == ["qwen2.5-7b-instruct"]

    # The router's own answers on each listener: HTTP/1.1, and no `server: granian`.
    own = {"router": "/health", "ollama": "/api/version", "lmstudio": "/v1/models"}
    for name, url in router.urls.items():
        with httpx.Client(verify=context, timeout=10) as plain:
            answer = plain.get(url + own[name])
        assert answer.status_code == 200
        assert answer.http_version == "HTTP/1.1"
        assert answer.headers["server"] == "router"
        # No cleartext on a TLS listener.
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + own[name], timeout=5)


def test_alpn_offering_h2_gets_http_1_1_and_an_untrusted_certificate_is_refused(start_fleet_in_process, cert):
    cert_path, key_path = cert
    router = start_fleet_in_process(extra_args=("--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path)))
    url = urlsplit(router.url)
    context = trusting(cert_path)
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((url.hostname, url.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=url.hostname) as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with pytest.raises(httpx.ConnectError):  # the system's trust store does not know this cert
        httpx.get(router.url + "/health", timeout=5)


def test_an_unusable_certificate_is_one_line_at_start(tmp_path, cert):
    cert_path, _ = cert
    boxes = write_boxes(tmp_path / "boxes.json", [])
    result = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--port", "auto", "--boxes-file", str(boxes),
         "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(tmp_path / "missing.pem")],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
        env={**os.environ, "HUGPY_ROUTER_HOME": str(tmp_path / "home")},
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"router: cannot use TLS certificate {cert_path} with key {tmp_path / 'missing.pem'}: "
        "No such file or directory"
    ]


def test_an_https_box_is_reached_over_tls_and_an_untrusted_one_says_why(tmp_path, cert):
    """A box at an https:// URL (issue 20.3): the router verifies its certificate against the
    trusted CAs (SSL_CERT_FILE names this one), and one it cannot trust is down with the reason."""
    cert_path, key_path = cert
    box = SimBox("s", catalog=["tiny"], residents=["tiny"])
    box.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    box.tls.load_cert_chain(cert_path, key_path)
    fleet = SimFleet([box])
    fleet.start()
    routers = []
    try:
        assert box.url.startswith("https://")
        for name, env in (("trusting", {"SSL_CERT_FILE": str(cert_path)}), ("untrusting", {})):
            (tmp_path / name).mkdir()
            routers.append(RouterProcess(write_boxes(tmp_path / name / "boxes.json", [box]), env=env))
        trusting_router, untrusting_router = routers
        client = openai.OpenAI(base_url=trusting_router.url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert answer.headers["x-hugpy-box"] == "s"

        def down() -> str:
            host, port = untrusting_router.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/v1/router/state")
            doc = json.loads(conn.getresponse().read())
            conn.close()
            return doc["boxes"][0]["down"] or ""

        assert wait_for(lambda: down().startswith("TLS: certificate not trusted"), 10, 0.2), down()
    finally:
        for router in routers:
            router.stop()
        fleet.stop()
