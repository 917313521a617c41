"""Schemathesis over both OpenAPI schemas against the live services: no 5xx, and every response
(status code, content type, headers, body) is one the schema documents. Every operation gets a few
schema-conforming and a few schema-violating requests (bounded: no deadline, fixed seed).

(The schemathesis pytest plugin's lazy fixture loader does not run under pytest 9, so each
operation's Hypothesis strategy is driven directly.)"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import TOKEN, Proc  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 10}


def requests_served(service: Proc) -> float:
    import httpx

    text = httpx.get(f"{service.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("planekv_") and "_http_requests_total{" in line)


def fuzz(service: Proc) -> tuple[int, list[str]]:
    """Run every operation of the live schema; (operations run, failures)."""
    before = requests_served(service)
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    failures: list[str] = []
    ops = 0
    for result in schema.get_all_operations():
        op = result.ok()
        ops += 1
        for mode, n in EXAMPLES.items():
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                case.call_and_validate(base_url=service.url, headers=AUTH, checks=CHECKS, timeout=30)

            try:
                run()
            except Unsatisfiable:  # nothing to violate: the operation takes no input
                assert mode is GenerationMode.NEGATIVE, f"{op.method.upper()} {op.path}: no positive case"
            except Exception as exc:
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {exc}")
    assert requests_served(service) - before >= 8 * ops  # the cases really reached the service
    return ops, failures


def test_control_plane_conforms_to_its_schema(control):
    ops, failures = fuzz(control)
    assert ops >= 20
    assert not failures, "\n\n".join(failures)


def test_store_service_conforms_to_its_schema(store):
    ops, failures = fuzz(store)
    assert ops >= 7
    assert not failures, "\n\n".join(failures)
