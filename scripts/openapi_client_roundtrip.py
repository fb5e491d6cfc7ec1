"""acquire -> complete -> replay through a client generated from idem's served OpenAPI
document (openapi-python-client). Run by crates/idem/tests/openapi.rs:

    python openapi_client_roundtrip.py GENERATED_PACKAGE_DIR BASE_URL API_KEY

The package is imported under the name `idem_client`. Exits non-zero on any mismatch.
"""

import importlib.util
import sys
import uuid
from pathlib import Path

package_dir, base_url, api_key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = importlib.util.spec_from_file_location("idem_client", package_dir / "__init__.py", submodule_search_locations=[str(package_dir)])
idem_client = importlib.util.module_from_spec(spec)
sys.modules["idem_client"] = idem_client
spec.loader.exec_module(idem_client)

from idem_client import AuthenticatedClient  # noqa: E402
from idem_client.api.operations import acquire_operation, complete_operation, get_operation  # noqa: E402
from idem_client.models import AcquireBody, CompleteBody, CompleteBodyOutcome, OperationView  # noqa: E402

client = AuthenticatedClient(base_url=base_url, token=api_key)
key = f"client-roundtrip:{uuid.uuid4()}"


def acquire():
    return acquire_operation.sync_detailed(
        client=client,
        body=AcquireBody(action="send_confirmation", key=key, payload={"to": "customer-42", "template": "confirmation"}),
    )


first = acquire()
assert first.status_code == 201, (first.status_code, first.content)
assert isinstance(first.parsed, OperationView), first.parsed
assert first.parsed.state == "EXECUTING" and first.parsed.fencing_token > 0, first.parsed

done = complete_operation.sync_detailed(
    key,
    client=client,
    body=CompleteBody(
        fencing_token=first.parsed.fencing_token,
        outcome=CompleteBodyOutcome.SUCCEEDED,
        provider_ref="msg-001",
        result={"message_id": "msg-001"},
    ),
)
assert done.status_code == 200, (done.status_code, done.content)
assert done.parsed.state == "SUCCEEDED" and done.parsed.provider_ref == "msg-001", done.parsed

replay = acquire()
assert replay.status_code == 200, (replay.status_code, replay.content)
assert replay.headers.get("idempotent-replayed") == "true", replay.headers
assert replay.parsed.state == "SUCCEEDED" and replay.parsed.provider_ref == "msg-001", replay.parsed

record = get_operation.sync_detailed(key, client=client)
assert record.status_code == 200 and len(record.parsed.events) == 3, record.content
print(f"round trip ok: {key} 201 -> complete 200 -> replay 200, {len(record.parsed.events)} events")
