"""A test certificate authority and a server certificate for loopback names, made with `cryptography`.

Generated into a temporary directory per test session, so no private key is
ever committed. EC P-256 keys keep generation in the milliseconds.
"""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# A name only the tests' fake resolver knows: it proves the connection goes to the pinned
# address while TLS (SNI, certificate check) and the Host header keep the name.
EXECUTOR_NAME = "executor.relay.test"


@dataclass(frozen=True)
class TestPKI:
    __test__ = False  # a data holder, not a test class

    ca_cert: Path  # the CA bundle the relay is told to trust (TEST-ONLY setting)
    server_cert: Path  # leaf for localhost and 127.0.0.1, signed by the CA
    server_key: Path
    other_ca_cert: Path  # a second, unrelated CA: trusting it must make verification fail


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _ca(common_name: str, now: datetime.datetime):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_pki(directory: Path) -> TestPKI:
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = _ca("relay test CA (throwaway)", now)
    _, other_cert = _ca("some other CA (throwaway)", now)

    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.DNSName(EXECUTOR_NAME),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    directory.mkdir(parents=True, exist_ok=True)
    pki = TestPKI(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        other_ca_cert=directory / "other-ca.pem",
    )
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.other_ca_cert.write_bytes(other_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.server_key, key)
    return pki
