"""Whatever JSON arrives, the pure edges answer or refuse it cleanly (hypothesis): a Pod read by
`pod_ask` is a PodAsk or an InvalidArgument naming a field; an AdmissionReview gets an answer
(allowed, or refused with a message) or a ValueError (the server's 400); extender messages
parse or raise ValueError. No other exception, so the servers never answer 500 for input."""

from __future__ import annotations

import base64
import contextlib
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuloom.domain.errors import InvalidArgument
from gpuloom.kube import extender as wire
from gpuloom.kube.admission import AdmissionPolicy, FleetLimits, answer
from gpuloom.kube.asks import pod_ask
from gpuloom.policies.placement import POLICIES
from tests.k8s.standins import apply_patch

KEYS = st.sampled_from(
    [
        "metadata", "spec", "annotations", "name", "namespace", "uid", "containers",
        "initContainers", "resources", "limits", "requests", "restartPolicy",
        "priorityClassName", "gpuloom.io/gpu", "gpuloom.io/sm", "gpuloom.io/quota",
        "gpuloom.io/quota-limit", "gpuloom.io/memory", "gpuloom.io/mig", "gpuloom.io/priority",
        "gpuloom.io/kind", "gpuloom.io/function", "gpuloom.io/checkpoint-command",
        "gpuloom.io/checkpoint-timeout-s", "gpuloom.io/job", "Pod", "NodeNames", "Nodes",
        "items", "PodUID", "x",
    ]
)  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.sampled_from(["", "1", "24", "4Gi", "1e400", "-1", "0.5", "training", "[1]", "\x00"]),
    st.text(max_size=12),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(KEYS | st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=30,
)


def pod_like(draw_json: Any) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": draw_json}


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POLICY = AdmissionPolicy(
    POLICIES, "gpuloom", (), fleet=FleetLimits.of([("n", "A100-80GB", 80 << 30)])
)


@FAST
@given(document=JSON, spec=JSON)
def test_pod_ask_answers_or_names_a_field(document: Any, spec: Any) -> None:
    for pod in (document, pod_like(spec)):
        try:
            pod_ask(pod if isinstance(pod, dict) else {"spec": pod}, POLICIES)
        except InvalidArgument as error:
            assert error.field and error.message


@FAST
@given(obj=JSON, operation=st.sampled_from(["CREATE", "UPDATE", "DELETE", 7]), spec=JSON)
def test_an_admission_review_is_answered_or_refused_as_bad(
    obj: Any, operation: Any, spec: Any
) -> None:
    for candidate in (obj, pod_like(spec)):
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "r",
                "kind": {"group": "", "kind": "Pod"},
                "operation": operation,
                "object": candidate,
                "oldObject": obj,
                "userInfo": {"username": "alice"},
            },
        }
        try:
            verdict = answer(review, POLICY)["response"]
        except ValueError:
            continue
        assert verdict["uid"] == "r"
        assert verdict["allowed"] or verdict["status"]["message"].startswith("gpuloom: ")
        if "patch" in verdict:  # a patch that applies to the Pod as it came
            apply_patch(candidate, json.loads(base64.b64decode(verdict["patch"])))


@FAST
@given(document=JSON)
def test_extender_messages_parse_or_are_refused(document: Any) -> None:
    for parse in (wire.parse_args, wire.parse_binding):
        with contextlib.suppress(ValueError):
            parse(document)
