"""A worker process of the multi-process tests: calls one guarded function once and prints
what happened (``effect`` when the function body starts, then ``returned REF`` or ``raised
KIND``). Arguments: URL KEY EFFECTS_FILE SLEEP_S LEASE_MS WAIT_MS."""

from __future__ import annotations

import os
import sys
import time

import idem_client

from casefile import kind_of
from conftest import ADMIN_KEY


def main() -> int:
    url, key, effects, sleep_s, lease_ms, wait_ms = sys.argv[1:]
    client = idem_client.Client(url, ADMIN_KEY)

    @client.idempotent(
        key="{order}",
        action="send_confirmation",
        payload=["order"],
        provider_ref="ref",
        lease_ms=int(lease_ms),
        wait_ms=int(wait_ms),
    )
    def send_confirmation(order: str) -> dict[str, str]:
        with open(effects, "a") as f:  # the side effect, counted once per line
            f.write(f"{os.getpid()}\n")
        print("effect", flush=True)
        time.sleep(float(sleep_s))
        return {"ref": f"msg-{os.getpid()}"}

    try:
        print("returned", send_confirmation(key)["ref"], flush=True)
    except Exception as e:
        print("raised", kind_of(e), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
