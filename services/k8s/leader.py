"""Leader election among the replicas of the k8s process, on a coordination.k8s.io/v1 Lease
(as client-go's leaderelection does, with the API server's optimistic concurrency): one
replica holds the Lease and works (the controller's reconcile, the extender's memory of each
Pod's job, the webhooks); the others wait, unready, and take the Lease over when its holder
has not renewed it for its `leaseDurationSeconds`.

Whether a holder's lease has run out is judged by this process's own clock since it last saw
the Lease change (its resourceVersion), never by the holder's `renewTime`, so clock skew
between nodes does not matter. A leader that cannot renew within `renew_deadline_s` stops
leading (its work stops, it turns unready) before another replica can take the Lease. A
leader that stops hands the Lease back (an empty holder), so a replica waiting takes it at
once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import structlog

from gpuloom.services.k8s.kubeapi import KubeApi, KubeApiError
from gpuloom.tasks import cancel_and_wait

log = structlog.get_logger("gpuloom.k8s")


def micro_time(seconds: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float,
        renew_deadline_s: float,
        retry_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < retry_s < renew_deadline_s < lease_duration_s:
            raise ValueError("leader election needs 0 < retry < renew deadline < lease duration")
        self._api = api
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._duration_s = lease_duration_s
        self._renew_deadline_s = renew_deadline_s
        self._retry_s = retry_s
        self._clock = clock
        self._wall = wall
        self._seen_version = ""
        self._seen_at = 0.0
        self._renewed_at = -float("inf")
        self.leading = False
        self.holder = ""  # the holder last seen
        self._task: asyncio.Task[None] | None = None

    # ---- one round ----

    async def try_lead(self) -> bool:
        """Take the Lease (none, or its holder's time ran out, or it was handed back) or renew
        it; whether this process holds it afterwards. API errors count as not holding."""
        try:
            lease = await self._api.get_lease(self._namespace, self._name)
        except KubeApiError as error:
            if error.status != 404:
                log.warning("lease not read", lease=self._name, error=str(error))
                return False
            return await self._write(None)
        meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
        version = str(meta.get("resourceVersion") or "")
        if version != self._seen_version:
            self._seen_version, self._seen_at = version, self._clock()
        holder = self.holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or self._duration_s)
        if holder and holder != self.identity and self._clock() - self._seen_at < duration:
            return False
        return await self._write(lease)

    async def _write(self, lease: dict[str, Any] | None) -> bool:
        now = micro_time(self._wall())
        spec = dict((lease or {}).get("spec") or {})
        taking = spec.get("holderIdentity") != self.identity
        if taking:
            spec["acquireTime"] = now
            if lease is not None:
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=round(self._duration_s),
            renewTime=now,
        )
        try:
            if lease is None:
                spec["leaseTransitions"] = 0
                written = await self._api.create_lease(
                    self._namespace, self._lease(spec, resource_version="")
                )
            else:
                version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
                written = await self._api.update_lease(
                    self._namespace, self._name, self._lease(spec, version)
                )
        except KubeApiError as error:
            # 409: another replica wrote it first (or created it); it holds it.
            log.info("lease not written", lease=self._name, error=str(error))
            return False
        self._seen_version = str((written.get("metadata") or {}).get("resourceVersion") or "")
        self._seen_at = self._clock()
        self.holder = self.identity
        if taking:
            log.info("leading", lease=self._name, identity=self.identity)
        return True

    def _lease(self, spec: dict[str, Any], resource_version: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self._name, "namespace": self._namespace}
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    async def release(self) -> None:
        """Hand the Lease back (an empty holder) if this process holds it."""
        if not self.leading:
            return
        self.leading = False
        with contextlib.suppress(KubeApiError):
            lease = await self._api.get_lease(self._namespace, self._name)
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            spec.update(holderIdentity="", renewTime=micro_time(self._wall()))
            version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
            await self._api.update_lease(self._namespace, self._name, self._lease(spec, version))
            log.info("lease handed back", lease=self._name, identity=self.identity)

    # ---- the loop ----

    async def start(
        self,
        on_leading: Callable[[], Awaitable[None]],
        on_stopped: Callable[[], Awaitable[None]],
    ) -> None:
        """Contend for the Lease in the background: `on_leading` once it is held,
        `on_stopped` when it could not be renewed in time (then contend again)."""
        self._task = asyncio.create_task(self._run(on_leading, on_stopped), name="k8s-leader")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self.release()

    async def _run(
        self,
        on_leading: Callable[[], Awaitable[None]],
        on_stopped: Callable[[], Awaitable[None]],
    ) -> None:
        while True:
            held = await self.try_lead()
            if held:
                self._renewed_at = self._clock()
                if not self.leading:
                    await on_leading()  # its first reconcile done before it serves
                    self.leading = True
            elif self.leading and (
                self.holder not in ("", self.identity)
                or self._clock() - self._renewed_at >= self._renew_deadline_s
            ):
                self.leading = False
                log.warning(
                    "leadership lost", lease=self._name, holder=self.holder or "none (not renewed)"
                )
                await on_stopped()
            await asyncio.sleep(self._retry_s)
