"""A job submitter's first steps with the real grpcurl: list the service, submit, read back."""

from __future__ import annotations

import json

from gpuloom.services.dispatcher.app import DispatcherApp
from tests.placement.conftest import Live, register_all
from tests.profile_store.test_grpcurl import grpcurl


async def test_grpcurl_submits_and_reads_jobs(placement: Live, dispatchers: DispatcherApp) -> None:
    await register_all(placement.stub, dispatchers)
    app = placement.app
    assert "gpuloom.v1.Placement" in (await grpcurl(app, "list")).split()
    submitted = json.loads(
        await grpcurl(
            app,
            "gpuloom.v1.Placement/SubmitJob",
            data=json.dumps(
                {
                    "requestId": "grpcurl-1",
                    "spec": {
                        "name": "from-grpcurl",
                        "kind": "JOB_KIND_BATCH",
                        "priority": {"level": 3},
                        "resources": {"memoryBytes": "4294967296", "wholeGpus": 1},
                    },
                }
            ),
        )
    )
    assert submitted["state"] == "JOB_STATE_ASSIGNED"
    assert submitted["assignment"]["environment"]["GPULOOM_ASSIGNMENT_ID"] == submitted["job_id"]
    got = json.loads(
        await grpcurl(
            app, "gpuloom.v1.Placement/GetJob", data=f'{{"job_id": "{submitted["job_id"]}"}}'
        )
    )
    assert got["spec"]["name"] == "from-grpcurl"
    gpus = json.loads(await grpcurl(app, "gpuloom.v1.Placement/ListGpus"))
    assert len(gpus["gpus"]) == 4 and sum(g.get("jobs", 0) for g in gpus["gpus"]) == 1
