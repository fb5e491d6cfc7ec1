#!/usr/bin/env python3
"""A worker that performs a workflow's steps in its own code, through idem's step API.

It needs nothing but the Python standard library. Run it again after any crash: it starts
from the top, the steps that finished replay (200), the first unfinished one is granted
(201), and it never performs a finished step again. A step whose outcome is UNKNOWN (202)
waits for a person: the worker stops, an operator resolves the step
(`idem ops resolve KEY …`), and the next run goes on.

    export IDEM_URL=http://127.0.0.1:8080 IDEM_API_KEY=idem_…
    PROVIDER_URL=http://127.0.0.1:8090 INSTANCE_ID=ORD-40:manual python3 examples/workflow_worker.py

Each step's "side effect" here is an order at idem's provider double
(`idem scenarios provider`); put your own call in `perform`. Exit status: 0 done,
3 a step is UNKNOWN (an operator decides), 4 refused (409), 1 error.
"""
import json
import os
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request

IDEM = os.environ.get("IDEM_URL", "http://127.0.0.1:8080").rstrip("/")
API_KEY = os.environ["IDEM_API_KEY"]
PROVIDER = os.environ.get("PROVIDER_URL", "http://127.0.0.1:8090").rstrip("/")
INSTANCE = os.environ.get("INSTANCE_ID", "ORD-40:manual")
STEPS = ["create_ticket", "reserve_stock", "notify"]


def call(method, url, body=None, headers=None):
    """One HTTP call; returns (status, parsed JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def idem(method, path, body=None):
    return call(method, IDEM + path, body, {"Authorization": "Bearer " + API_KEY})


def perform(step, payload):
    """The step's side effect. The step's key goes along as Idempotency-Key."""
    key = "default:%s:%s" % (INSTANCE, step)
    status, body = call("POST", PROVIDER + "/orders", payload, {"Idempotency-Key": key})
    if status != 201:
        raise RuntimeError("%s: the provider answered %s" % (step, status))
    return body["id"]


def main():
    inst = urllib.parse.quote(INSTANCE, safe="")
    status, body = idem("POST", "/v1/workflows", {
        "workflow": "stock-reservation",
        "instance_id": INSTANCE,
        "input": {"ticket": "T-40"},
        "steps": [{"name": s} for s in STEPS],
    })
    if status not in (200, 201):
        print("start refused: %s %s" % (status, body), file=sys.stderr)
        return 1
    for step in STEPS:
        payload = {"instance": INSTANCE, "step": step}
        status, op = idem("POST", "/v1/workflows/%s/steps/%s" % (inst, step), {"payload": payload, "lease_ms": 2000})
        if status == 200:
            print("%s: replayed (%s)" % (step, op["state"]), flush=True)
            if op["state"] != "SUCCEEDED":
                return 1
            continue
        if status == 202:
            print("%s: outcome UNKNOWN: an operator decides; nothing is redone" % step, flush=True)
            return 3
        if status == 409:
            print("%s: %s: %s" % (step, op["type"], op["detail"]), flush=True)
            return 4
        if status != 201:
            print("%s: %s %s" % (step, status, op), file=sys.stderr)
            return 1
        ref = perform(step, payload)
        if os.environ.get("CRASH_AFTER_EFFECT") == step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash before the outcome is reported
        done = {"fencing_token": op["fencing_token"], "outcome": "succeeded", "provider_ref": ref}
        status, op = idem("POST", "/v1/workflows/%s/steps/%s/complete" % (inst, step), done)
        if status != 200:
            print("%s: completion refused: %s %s" % (step, status, op), file=sys.stderr)
            return 1
        print("%s: done (%s)" % (step, ref), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
