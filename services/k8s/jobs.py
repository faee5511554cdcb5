"""gpuloom's Kubernetes components talk to placement as any submitter does, over gRPC (with
the settings of gpuloom/transport.py: TLS and a bearer token): submit a Pod's job, read it,
follow it (WatchJob), end it, list the live jobs, list the fleet. Every call is one of a
submitter's RPCs (services/common/auth.py SUBMITTER_RPCS), so the components run with a
submitter's token (`kubernetes`, docs/security.md): they see and end the jobs they
submitted, and the replicas placement's auto-scaling gives them
(GPULOOM_PLACEMENT_FUNCTION_OWNER), nothing else. Answers in the domain's terms (JobView,
GpuEntry); gRPC errors become the domain's errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import grpc

from gpuloom.convert.placement import (
    STATE_TO_PB,
    gpu_entry_from_pb,
    job_from_pb,
    spec_to_pb,
)
from gpuloom.convert.status import error_from_rpc
from gpuloom.domain.placement import GpuEntry, JobSpec, JobState, JobView
from gpuloom.transport import TransportSettings, open_aio_channel
from gpuloom.v1 import placement_pb2 as pb
from gpuloom.v1 import placement_pb2_grpc

LIVE = (JobState.PENDING, JobState.BINDING, JobState.ASSIGNED)
PAGE = 1000


class PlacementJobs:
    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        transport: TransportSettings | None = None,
    ) -> None:
        """`transport`: the TLS and token settings of the calls; None: this process's
        (GPULOOM_TLS_*, GPULOOM_AUTH_TOKEN_FILE: the k8s components' own token, a submitter's,
        on a deployment made by `gpuloom credentials init --kubernetes`)."""
        self.address = address
        self._timeout_s = timeout_s
        self._channel = open_aio_channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
            settings=transport,
        )
        self._stub = placement_pb2_grpc.PlacementStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def submit(self, request_id: str, spec: JobSpec) -> JobView:
        request = pb.SubmitJobRequest(request_id=request_id, spec=spec_to_pb(spec))
        return job_from_pb(await self._call(self._stub.SubmitJob, request))

    async def get(self, job_id: str) -> JobView:
        return job_from_pb(await self._call(self._stub.GetJob, pb.GetJobRequest(job_id=job_id)))

    async def cancel(self, job_id: str, reason: str) -> JobView:
        request = pb.CancelJobRequest(job_id=job_id, reason=reason)
        return job_from_pb(await self._call(self._stub.CancelJob, request))

    async def report_done(
        self, job_id: str, succeeded: bool, exit_code: int, message: str
    ) -> JobView:
        request = pb.ReportJobDoneRequest(
            job_id=job_id, succeeded=succeeded, exit_code=exit_code, message=message
        )
        return job_from_pb(await self._call(self._stub.ReportJobDone, request))

    async def report_checkpoint(
        self, job_id: str, migration_id: str, succeeded: bool, message: str
    ) -> JobView:
        request = pb.ReportCheckpointRequest(
            job_id=job_id, migration_id=migration_id, succeeded=succeeded, message=message
        )
        return job_from_pb(await self._call(self._stub.ReportCheckpoint, request))

    async def watch(self, job_id: str) -> AsyncIterator[JobView]:
        """The job's revisions as placement publishes them (WatchJob), the current one first,
        until it ends or the stream breaks (a DomainError). While the stream is open placement
        counts the job followed: a MIG batch task is handed its instance only then."""
        call = self._stub.WatchJob(pb.WatchJobRequest(job_id=job_id))
        try:
            async for message in call:
                yield job_from_pb(message)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        finally:
            call.cancel()

    async def jobs(self, states: Iterable[JobState] = LIVE, function: str = "") -> list[JobView]:
        """Every job in these states (of this auto-scaled function, if named): placement's
        ListJobs, page after page."""
        codes = [STATE_TO_PB[s] for s in states]
        found: list[JobView] = []
        token = ""
        while True:
            request = pb.ListJobsRequest(
                states=codes, function=function, page_size=PAGE, page_token=token
            )
            answer = await self._call(self._stub.ListJobs, request)
            found += [job_from_pb(j) for j in answer.jobs]
            token = answer.next_page_token
            if not token:
                return found

    async def gpus(self, node: str = "") -> list[GpuEntry]:
        found: list[GpuEntry] = []
        token = ""
        while True:
            request = pb.ListGpusRequest(node=node, page_token=token)
            answer = await self._call(self._stub.ListGpus, request)
            found += [gpu_entry_from_pb(g) for g in answer.gpus]
            token = answer.next_page_token
            if not token:
                return found

    async def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=self._timeout_s)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
