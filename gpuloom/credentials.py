"""The credentials directory of a deployment: what it needs to run secured, made on its first
start (`gpuloom up`) or by a one-shot step (`gpuloom credentials init`: compose's job, the
Kubernetes Secret's source), every file 0600 in a 0700 directory:

- `ca.crt`, `ca.key`: the deployment's own CA (EC P-256);
- `SERVICE.crt`, `SERVICE.key`: one certificate per service (placement, profile-store,
  profiler, dispatcher), for serving and for its calls to the others; each names its service,
  `localhost`, `127.0.0.1`, the names given to `init`, and `gpuloom`, the name clients check;
- `admin.crt`, `admin.key`: the admin's client certificate (no server name);
- `tokens`: the table of bearer tokens (`ROLE NAME TOKEN`): the services', the admin's, and
  any added with `gpuloom credentials add NAME` (whose token is also in `NAME.token`);
- `service.token`, `admin.token`: the services' token and the admin's, one line each;
- `client.env`: the settings a client of this deployment uses (`GPULOOM_AUTH_TOKEN_FILE`,
  `GPULOOM_TLS_*`, paths relative to the directory): every gpuloom command and client reads it
  when the environment sets none, as kubectl reads its kubeconfig;
- with `init --kubernetes` (`ensure_kubernetes`), for gpuloom's Kubernetes components:
  `k8s.crt/.key/.token` and `device-plugin.crt/.key/.token`, whose tokens are the submitter
  `kubernetes`'s (not the services'), and `scheduler.crt/.key` for gpuloom's kube-scheduler.

The directory is `GPULOOM_CREDENTIALS_DIR`, else `$XDG_CONFIG_HOME/gpuloom`, else
`~/.config/gpuloom`. Files are made once and never overwritten: a second start, or a second
`init`, keeps them (a file removed is made again; a certificate removed is signed again by the
same CA). Several processes making the same directory at once take turns on a lock file.
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpuloom.private_files import DIRECTORY_MODE, private_directory, write_private

if TYPE_CHECKING:  # loaded only to make certificates: every client reads client_defaults
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

SERVICES = ("placement", "profile-store", "profiler", "dispatcher")
SERVER_NAME = "gpuloom"  # in every service certificate; what clients of the directory check
ADMIN = "admin"
SERVICE_TOKEN_NAME = "services"  # the name of the services' token in the tokens file
CLIENT_ENV = "client.env"
TOKENS = "tokens"
ROLES = ("submitter", "admin")  # what `add` makes; the services' token is made with the rest
# Kubernetes (`init --kubernetes`): the k8s process (webhook, extender, controller) and the
# device plugins submit and read their Pods' jobs as one submitter, each with a token, a
# certificate and a key of its own (COMPONENT.token, .crt, .key).
KUBERNETES_SUBMITTER = "kubernetes"
KUBERNETES_COMPONENTS = ("k8s", "device-plugin")
# gpuloom's kube-scheduler: a client certificate only (scheduler.crt, .key), which the k8s
# process's extender routes require.
KUBERNETES_SCHEDULER = "scheduler"
KUBERNETES_SERVICE = "gpuloom-k8s"  # the Service the API server and kube-scheduler call
# Names `add` refuses: tokens the directory makes itself, or whose NAME.token it writes.
RESERVED_NAMES = frozenset(
    {ADMIN, SERVICE_TOKEN_NAME, "service", KUBERNETES_SUBMITTER, *KUBERNETES_COMPONENTS}
)
TOKEN_NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")
HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
CA_DAYS = 3650
CERT_DAYS = 825


class CredentialsError(Exception):
    """The directory cannot be made or used; the message says why and what to do."""


def default_directory() -> Path:
    """GPULOOM_CREDENTIALS_DIR, else $XDG_CONFIG_HOME/gpuloom, else ~/.config/gpuloom."""
    explicit = os.environ.get("GPULOOM_CREDENTIALS_DIR", "")
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME", "") or os.path.join(
        os.path.expanduser("~"), ".config"
    )
    return Path(config) / "gpuloom"


@dataclass(frozen=True)
class Credentials:
    directory: Path

    def file(self, name: str) -> Path:
        return self.directory / name

    @property
    def ca(self) -> Path:
        return self.file("ca.crt")

    @property
    def tokens(self) -> Path:
        return self.file(TOKENS)

    @property
    def service_token(self) -> Path:
        return self.file("service.token")

    @property
    def admin_token(self) -> Path:
        return self.file(f"{ADMIN}.token")

    def certificate(self, who: str) -> tuple[Path, Path]:
        """(certificate, key) of a service or of the admin."""
        return self.file(f"{who}.crt"), self.file(f"{who}.key")

    def complete(self) -> bool:
        """Whether every file a service needs is there."""
        needed = [self.ca, self.tokens, self.service_token]
        needed += [path for service in SERVICES for path in self.certificate(service)]
        return all(path.is_file() for path in needed)


def check_host_names(names: Sequence[str]) -> list[str]:
    """The extra names a service certificate should carry: host names or IP addresses;
    CredentialsError naming the first that is neither."""
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if not HOST_NAME.fullmatch(name):
                raise CredentialsError(
                    f"{name[:80]!r} is not a host name or an IP address"
                ) from None
    return list(names)


def ensure(directory: Path, names: Sequence[str] = (), client_tls: bool = True) -> Credentials:
    """Make whatever of the directory is missing (nothing that exists is changed, but for
    narrowing modes). `names`: further host names or IPs for the service certificates made now.
    `client_tls`: whether the client settings made now use TLS (a plane served in plaintext on
    127.0.0.1 is called without)."""
    check_host_names(names)
    credentials = Credentials(directory)
    try:
        private_directory(directory)
        _check_owner(directory)
        with _locked(directory):
            _make(credentials, names, client_tls)
    except OSError as error:
        raise CredentialsError(f"{directory}: {error.strerror or error}") from None
    return credentials


def existing(directory: Path) -> Credentials | None:
    """The directory's credentials if a service could run with them, else None."""
    credentials = Credentials(directory)
    return credentials if credentials.complete() else None


def add_token(directory: Path, name: str, role: str) -> Path:
    """A new bearer token for `name` in the tokens file (the services read it again within a
    second) and in NAME.token; the path of that file. CredentialsError if the name is taken or
    not a valid name."""
    if not TOKEN_NAME.fullmatch(name) or name in RESERVED_NAMES:
        raise CredentialsError(
            f"{name[:80]!r}: a name is [A-Za-z0-9._@-]{{1,128}}, and not "
            f"{', '.join(sorted(RESERVED_NAMES))}"
        )
    if role not in ROLES:
        raise CredentialsError(f"role {role!r}: one of {', '.join(ROLES)}")
    credentials = Credentials(directory)
    if not credentials.tokens.is_file():
        raise CredentialsError(f"{directory} holds no tokens file: run `gpuloom credentials init`")
    with _locked(directory):
        table = credentials.tokens.read_text()
        if any(line.split()[1:2] == [name] for line in table.splitlines() if line.strip()):
            raise CredentialsError(f"{name!r} already has a token in {credentials.tokens}")
        token = secrets.token_urlsafe(32)
        write_private(credentials.file(f"{name}.token"), token + "\n")
        write_private(credentials.tokens, table.rstrip("\n") + f"\n{role} {name} {token}\n")
    return credentials.file(f"{name}.token")


def client_defaults(directory: Path | None = None) -> dict[str, str]:
    """The directory's client settings (client.env), paths made absolute; {} without one.
    Lines are `GPULOOM_NAME=VALUE`; `#` starts a comment."""
    directory = directory or default_directory()
    try:
        text = (directory / CLIENT_ENV).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    found = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not key.startswith("GPULOOM_"):
            continue
        if key.endswith("_FILE") and value and not os.path.isabs(value):
            value = str(directory / value)
        found[key] = value
    return found


# ---- Kubernetes (`gpuloom credentials init --kubernetes`) ----

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def kubernetes_hosts(namespace: str) -> list[str]:
    """The names the API server and kube-scheduler call the k8s process by (its Service)."""
    service = f"{KUBERNETES_SERVICE}.{namespace}"
    return [KUBERNETES_SERVICE, service, f"{service}.svc", f"{service}.svc.cluster.local"]


def ensure_kubernetes(
    directory: Path, namespace: str = "gpuloom", names: Sequence[str] = ()
) -> Credentials:
    """The directory as `ensure` makes it, and what gpuloom's Kubernetes components need
    besides (nothing that exists is changed):

    - `k8s.crt`, `k8s.key`: the k8s process's certificate, for its calls to placement and for
      serving the admission webhook and the scheduler extender over HTTPS: it names the
      Service `gpuloom-k8s` in `namespace` (`gpuloom-k8s.NAMESPACE.svc`, ...), which the
      MutatingWebhookConfiguration and kube-scheduler's extender call, checking it with
      `ca.crt`;
    - `device-plugin.crt`, `device-plugin.key`: the device plugins' client certificate;
    - `scheduler.crt`, `scheduler.key`: gpuloom's kube-scheduler's client certificate, which
      it presents to the extender (the extender's routes take no caller without one);
    - `k8s.token`, `device-plugin.token`: their bearer tokens, two lines
      `submitter kubernetes TOKEN` of the tokens file: one submitter, so that the device plugin
      is given the assignment token of every job the k8s process submitted (placement tells it
      to a job's submitter only), yet neither holds the services' token, and either can be
      revoked (its line deleted) without the other.

    CredentialsError when `namespace` is no DNS label, when `kubernetes` holds another role in
    the tokens file, or when k8s.crt names another namespace (delete k8s.crt and k8s.key to
    make it again)."""
    if not DNS_LABEL.fullmatch(namespace):
        raise CredentialsError(f"namespace {namespace[:80]!r} is not a DNS label")
    credentials = ensure(directory, names)
    try:
        with _locked(directory):
            ca_key, ca_cert = _authority(credentials)
            hosts = [*kubernetes_hosts(namespace), "localhost", "127.0.0.1", *names]
            _leaf(credentials, "k8s", ca_key, ca_cert, hosts)
            _check_names(credentials.certificate("k8s")[0], kubernetes_hosts(namespace))
            _leaf(credentials, "device-plugin", ca_key, ca_cert, [])
            _leaf(credentials, KUBERNETES_SCHEDULER, ca_key, ca_cert, [])
            _kubernetes_tokens(credentials)
    except OSError as error:
        raise CredentialsError(f"{directory}: {error.strerror or error}") from None
    return credentials


def kubernetes_complete(credentials: Credentials) -> bool:
    """Whether the files of `ensure_kubernetes` are there too."""
    needed = [credentials.file(f"{c}.token") for c in KUBERNETES_COMPONENTS]
    needed += [path for c in KUBERNETES_COMPONENTS for path in credentials.certificate(c)]
    needed += credentials.certificate(KUBERNETES_SCHEDULER)
    return credentials.complete() and all(path.is_file() for path in needed)


def _check_names(path: Path, hosts: Sequence[str]) -> None:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    missing = [h for h in hosts if h not in names.get_values_for_type(x509.DNSName)]
    if missing:
        raise CredentialsError(
            f"{path} does not name {missing[0]} (made for another namespace?): delete it and "
            f"{path.with_suffix('.key').name}, and run `gpuloom credentials init --kubernetes` "
            "again"
        )


def _kubernetes_tokens(credentials: Credentials) -> None:
    """A token file per component, and a `submitter kubernetes TOKEN` line for each."""
    tokens = []
    for component in KUBERNETES_COMPONENTS:
        path = credentials.file(f"{component}.token")
        if not path.is_file():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        tokens.append(path.read_text().strip())
    table = credentials.tokens.read_text().splitlines()
    present = set()
    for line in table:
        fields = line.split()
        if len(fields) != 3 or line.lstrip().startswith("#"):
            continue
        role, name, token = fields
        if name == KUBERNETES_SUBMITTER and role != "submitter":
            raise CredentialsError(
                f"{credentials.tokens}: {KUBERNETES_SUBMITTER!r} has role {role}; gpuloom's "
                "Kubernetes components submit as a submitter: delete that line"
            )
        if token in tokens:
            if name != KUBERNETES_SUBMITTER:
                raise CredentialsError(
                    f"{credentials.tokens}: a Kubernetes component's token is {name!r}'s: "
                    "delete that line"
                )
            present.add(token)
    missing = [t for t in tokens if t not in present]
    if missing:
        lines = [f"submitter {KUBERNETES_SUBMITTER} {t}" for t in missing]
        write_private(credentials.tokens, "\n".join([*table, *lines]) + "\n")


# ---- making the files ----


def _make(credentials: Credentials, names: Sequence[str], client_tls: bool) -> None:
    ca_key, ca_cert = _authority(credentials)
    for service in SERVICES:
        hosts = [service, "localhost", "127.0.0.1", "::1", SERVER_NAME, *names]
        _leaf(credentials, service, ca_key, ca_cert, hosts)
    _leaf(credentials, ADMIN, ca_key, ca_cert, [])
    _tokens(credentials)
    if not credentials.file(CLIENT_ENV).exists():
        lines = [
            "# The client settings of this gpuloom deployment: every gpuloom command and client",
            "# reads them when the environment sets none (as kubectl reads its kubeconfig).",
            "# Paths are relative to this directory.",
            f"GPULOOM_AUTH_TOKEN_FILE={ADMIN}.token",
        ]
        if client_tls:
            lines += [
                "GPULOOM_TLS_CA_FILE=ca.crt",
                f"GPULOOM_TLS_CERT_FILE={ADMIN}.crt",
                f"GPULOOM_TLS_KEY_FILE={ADMIN}.key",
                f"GPULOOM_TLS_SERVER_NAME={SERVER_NAME}",
            ]
        write_private(credentials.file(CLIENT_ENV), "\n".join(lines) + "\n")
    for path in credentials.directory.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o600)  # a file copied in (or left by an older version) narrowed


def _authority(credentials: Credentials) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = credentials.ca, credentials.file("ca.key")
    if cert_path.is_file() and key_path.is_file():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    for path in credentials.directory.glob("*.crt"):
        path.unlink()  # certificates of a CA that is gone would not verify: sign them again
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpuloom CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
        .sign(key, hashes.SHA256())
    )
    write_private(key_path, _key_pem(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
    return key, cert


def _leaf(
    credentials: Credentials,
    who: str,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    hosts: Sequence[str],
) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    cert_path, key_path = credentials.certificate(who)
    if cert_path.is_file() and key_path.is_file():
        return
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpuloom {who}")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if hosts:  # a service: it serves too
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        entries: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                entries.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                entries.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(entries), critical=False)
    cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
        ca_key, hashes.SHA256()
    )
    write_private(key_path, _key_pem(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())


def _tokens(credentials: Credentials) -> None:
    made = {}
    for path, name in ((credentials.service_token, "service"), (credentials.admin_token, ADMIN)):
        if not path.is_file():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        made[name] = path.read_text().strip()
    lines = credentials.tokens.read_text().splitlines() if credentials.tokens.is_file() else []
    # The services' and the admin's lines follow their token files; other lines are kept.
    kept = [line for line in lines if line.split()[1:2] not in ([SERVICE_TOKEN_NAME], [ADMIN])]
    table = [
        "# role name token: read by every service (docs/security.md); add with",
        "# `gpuloom credentials add NAME`",
        f"service {SERVICE_TOKEN_NAME} {made['service']}",
        f"admin {ADMIN} {made[ADMIN]}",
        *(line for line in kept if not line.startswith("#")),
    ]
    text = "\n".join(table) + "\n"
    if not credentials.tokens.is_file() or credentials.tokens.read_text() != text:
        write_private(credentials.tokens, text)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _check_owner(directory: Path) -> None:
    info = directory.stat()
    if info.st_uid != os.geteuid():
        raise CredentialsError(
            f"{directory} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
        )
    if stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
        os.chmod(directory, DIRECTORY_MODE)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    descriptor = os.open(directory / ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)
