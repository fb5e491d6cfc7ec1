//! Issue 28 §5 with a real Stripe SDK: stripe-python (pinned in
//! `scripts/requirements-stripe.txt`, installed by `scripts/test.sh` into a venv it names
//! in `IDEM_STRIPE_VENV`) creates PaymentIntents through `idem proxy` in front of a
//! Stripe-like upstream that deduplicates by Idempotency-Key. The cases and the upstream
//! are in `scripts/stripe_through_proxy.py` (Python's unittest): a 500 without effect and
//! timeouts before, after and during the upstream's work each end in one charge through
//! the SDK's own retries; a route not declared deduplicating keeps outcome-unknown and the
//! SDK raises a typed error without retrying; a reused key raises `IdempotencyError`.

mod common;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn stripe_python_through_the_proxy() {
    let venv = std::env::var("IDEM_STRIPE_VENV").expect(
        "IDEM_STRIPE_VENV (the venv of scripts/requirements-stripe.txt): run ./scripts/test.sh, which makes it",
    );
    let python = PathBuf::from(venv).join("bin").join("python");
    assert!(python.exists(), "{} is missing: run ./scripts/test.sh", python.display());
    let script = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/stripe_through_proxy.py"));
    let out = Command::new(&python).arg(&script).env("IDEM_BIN", common::idem_bin()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script:?} failed:\n{text}");
    assert!(text.contains("\nOK") && text.contains("Ran 6 tests"), "{text}");
}
