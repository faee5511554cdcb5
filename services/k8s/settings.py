"""Settings of gpuloom's Kubernetes components: the webhook, extender and controller process
(GPULOOM_K8S_*) and the device plugin of each GPU node (GPULOOM_DEVICE_PLUGIN_*)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gpuloom.kube.asks import priority_classes_from_text

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class K8sSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_K8S_", extra="ignore")

    # The HTTPS port of the admission webhook (/admission) and the scheduler extender
    # (/filter, /prioritize, /bind); /healthz for probes.
    port: int = Field(default=8443, ge=0, le=65535)
    # Its certificate and key (PEM). Without them it serves plain HTTP: fine for the extender
    # on a trusted network, but the API server calls webhooks over HTTPS only.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # The CA whose client certificates the extender's routes (/filter, /prioritize, /bind)
    # require (kube-scheduler presents one: its extender tlsConfig's certFile); the webhooks'
    # stay open to callers without one (the API server presents none). Empty: any caller.
    extender_client_ca_file: str = ""
    placement_address: str = "placement:50051"
    # The scheduler profile gpuloom Pods are sent to (its extender is this process).
    scheduler_name: str = Field(default="gpuloom", pattern=DNS_LABEL)
    # Who may write the annotations only gpuloom writes (gpuloom.io/job, ...): the user of
    # this process's service account.
    service_accounts: str = "system:serviceaccount:gpuloom:gpuloom-k8s"
    # The device plugins' users: they may change one thing of a Pod, the annotation
    # gpuloom.io/allocated (the validating webhook refuses any other change they make).
    device_plugin_accounts: str = "system:serviceaccount:gpuloom:gpuloom-device-plugin"
    # Further PriorityClass names and their gpuloom levels: "high=1,batch=8"
    # (gpuloom-priority-N is always level N).
    priority_classes: str = ""
    resync_s: float = Field(default=2.0, gt=0, le=3600)
    # How long the fleet's limits (webhook) and GPU nodes (extender) read from placement last.
    fleet_ttl_s: float = Field(default=10.0, ge=0, le=3600)
    # The Kubernetes API server; empty: the cluster's (the Pod's service account).
    api_server: str = ""
    api_token_file: str = ""
    api_ca_file: str = ""
    # Leader election among replicas (services/k8s/leader.py): on a Lease of this name in this
    # namespace; this replica's identity (empty: the host name, the Pod's name). Off: this
    # process leads alone (run one replica).
    leader_election: bool = False
    lease_namespace: str = Field(default="gpuloom", pattern=DNS_LABEL)
    lease_name: str = Field(default="gpuloom-k8s", pattern=DNS_LABEL)
    leader_identity: str = Field(default="", max_length=253)
    lease_duration_s: float = Field(default=15.0, gt=0, le=3600)
    lease_renew_deadline_s: float = Field(default=10.0, gt=0, le=3600)
    lease_retry_s: float = Field(default=2.0, gt=0, le=3600)

    @field_validator("priority_classes")
    @classmethod
    def _classes(cls, text: str) -> str:
        priority_classes_from_text(text)
        return text

    @model_validator(mode="after")
    def _tls_pair(self) -> K8sSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("GPULOOM_K8S_TLS_CERT_FILE and GPULOOM_K8S_TLS_KEY_FILE go together")
        if not self.lease_retry_s < self.lease_renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "GPULOOM_K8S_LEASE_RETRY_S < GPULOOM_K8S_LEASE_RENEW_DEADLINE_S < "
                "GPULOOM_K8S_LEASE_DURATION_S, got "
                f"{self.lease_retry_s} / {self.lease_renew_deadline_s} / {self.lease_duration_s}"
            )
        if self.extender_client_ca_file and not self.tls_cert_file:
            raise ValueError(
                "GPULOOM_K8S_EXTENDER_CLIENT_CA_FILE needs TLS: set GPULOOM_K8S_TLS_CERT_FILE "
                "and GPULOOM_K8S_TLS_KEY_FILE"
            )
        return self

    @property
    def users(self) -> tuple[str, ...]:
        return _names(self.service_accounts)

    @property
    def plugin_users(self) -> tuple[str, ...]:
        return _names(self.device_plugin_accounts)


def _names(text: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in text.split(",") if u.strip())


class DevicePluginSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GPULOOM_DEVICE_PLUGIN_", extra="ignore")

    # This node's name as Kubernetes and the dispatchers know it (spec.nodeName).
    node: str = Field(min_length=1, max_length=253)
    placement_address: str = "placement:50051"
    # The kubelet's device plugin directory (its socket kubelet.sock is there).
    kubelet_dir: str = "/var/lib/kubelet/device-plugins"
    socket_name: str = Field(default="gpuloom.sock", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    # Devices per GPU: how many containers kube-scheduler lets share one GPU at most.
    slots_per_gpu: int = Field(default=16, ge=1, le=1024)
    # The shim on the node (the DaemonSet copies it there) and where containers see it.
    shim_host_path: str = "/var/lib/gpuloom/shim/libgpuloom.so"
    shim_container_path: str = "/opt/gpuloom/shim/libgpuloom.so"
    scheduler_name: str = Field(default="gpuloom", pattern=DNS_LABEL)
    refresh_s: float = Field(default=5.0, gt=0, le=3600)
    api_server: str = ""
    api_token_file: str = ""
    api_ca_file: str = ""

    @field_validator("shim_host_path", "shim_container_path", "kubelet_dir")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError(f"must be an absolute path, got {path!r}")
        return path
