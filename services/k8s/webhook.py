"""The admission webhooks (admission.k8s.io/v1): gpuloom Pods validated, routed to gpuloom's
scheduler profile and labelled (the mutating webhook, /admission), and checked again as every
mutating webhook left them (the validating webhook, /validate; gpuloom/kube/admission.py
decides both); the fleet's
limits (GPU models, memory, GPUs per node) read from placement at most every `ttl_s`. When
placement cannot be reached the last limits read are used (none before the first read:
placement then refuses the same asks at submission, naming the field), and the other checks
apply all the same."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import structlog

from gpuloom.domain.errors import DomainError
from gpuloom.kube.admission import AdmissionPolicy, FleetLimits, answer
from gpuloom.services.k8s import metrics
from gpuloom.services.k8s.jobs import PlacementJobs

log = structlog.get_logger("gpuloom.k8s")

FLEET_READ_TIMEOUT_S = 2.0  # of the API server's 10 s for a webhook's answer


class AdmissionWebhook:
    def __init__(
        self,
        policy: AdmissionPolicy,
        jobs: PlacementJobs,
        ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._policy = policy
        self._jobs = jobs
        self._ttl_s = ttl_s
        self._clock = clock
        self._read_at = -float("inf")

    async def review(self, document: object) -> tuple[int, object]:
        """The mutating webhook (/admission)."""
        return await self._review(document, validating=False)

    async def validate(self, document: object) -> tuple[int, object]:
        """The validating webhook (/validate): the Pod as every mutating webhook left it."""
        return await self._review(document, validating=True)

    async def _review(self, document: object, validating: bool) -> tuple[int, object]:
        await self._refresh()
        try:
            response = answer(document, self._policy, validating)  # type: ignore[arg-type]
        except ValueError as error:
            return 400, {"error": str(error)}
        verdict = response["response"]
        outcome = (
            "refused" if not verdict["allowed"] else "patched" if "patch" in verdict else "allowed"
        )
        metrics.ADMISSIONS.labels(outcome).inc()
        if outcome == "refused":
            log.info("pod refused", message=verdict["status"]["message"])
        return 200, response

    async def _refresh(self) -> None:
        if self._clock() - self._read_at < self._ttl_s:
            return
        try:
            gpus = await asyncio.wait_for(self._jobs.gpus(), FLEET_READ_TIMEOUT_S)
        except (DomainError, TimeoutError) as error:
            # The API server waits on this answer: keep what was known until the next try.
            self._read_at = self._clock()
            log.warning("fleet limits not read; the last ones kept", error=str(error))
            return
        fleet = FleetLimits.of([(g.gpu.node, g.gpu.model, g.gpu.memory_bytes) for g in gpus])
        self._policy = replace(self._policy, fleet=fleet)
        self._read_at = self._clock()
