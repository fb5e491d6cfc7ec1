#!/usr/bin/env python3
"""A worker that performs a workflow's steps in its own code, through idem's step API.

It uses idem's Python client (`pip install ./clients/python`, import `idem_client`). Run it
again after any crash: it starts from the top, the steps that finished replay, the first
unfinished one is granted, and it never performs a finished step again. A step whose outcome
is UNKNOWN waits for a person: the worker stops, an operator resolves the step
(`idem ops resolve KEY …`), and the next run goes on.

    export IDEM_URL=http://127.0.0.1:8080 IDEM_API_KEY=idem_…
    PROVIDER_URL=http://127.0.0.1:8090 INSTANCE_ID=ORD-40:manual python3 examples/workflow_worker.py

Each step's "side effect" here is an order at idem's provider double
(`idem scenarios provider`); put your own call in `perform`. Exit status: 0 done,
3 a step is UNKNOWN (an operator decides), 4 refused (409), 1 error.
"""

import os
import signal
import sys

import httpx

import idem_client

PROVIDER = os.environ.get("PROVIDER_URL", "http://127.0.0.1:8090").rstrip("/")
INSTANCE = os.environ.get("INSTANCE_ID", "ORD-40:manual")
STEPS = ["create_ticket", "reserve_stock", "notify"]


def perform(step, payload):
    """The step's side effect. The step's key goes along as Idempotency-Key."""
    key = "default:%s:%s" % (INSTANCE, step)
    r = httpx.post(PROVIDER + "/orders", json=payload, headers={"Idempotency-Key": key}, timeout=30)
    if r.status_code != 201:
        raise RuntimeError("%s: the provider answered %s" % (step, r.status_code))
    return r.json()["id"]


def main():
    idem = idem_client.Client()  # IDEM_URL, IDEM_API_KEY
    idem.start_workflow("stock-reservation", INSTANCE, input={"ticket": "T-40"}, steps=STEPS)
    for step in STEPS:
        payload = {"instance": INSTANCE, "step": step}
        try:
            with idem.step(INSTANCE, step, payload=payload, lease_ms=2000) as claim:
                if claim.replayed:
                    print("%s: replayed (%s)" % (step, claim.state), flush=True)
                    if claim.state != "SUCCEEDED":
                        return 1
                    continue
                ref = perform(step, payload)
                if os.environ.get("CRASH_AFTER_EFFECT") == step:
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash before the outcome is reported
                claim.succeeded(provider_ref=ref)
                print("%s: done (%s)" % (step, ref), flush=True)
        except idem_client.OutcomeUnknownError:
            print("%s: outcome UNKNOWN: an operator decides; nothing is redone" % step, flush=True)
            return 3
        except idem_client.ConflictError as e:
            print("%s: %s: %s" % (step, e.type, e.detail), flush=True)
            return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
