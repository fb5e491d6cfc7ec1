//! Named crash points for the kill -9 tests (the "before and after every external call"
//! checks of DESIGN.md §8; the shape of DBOS's debug triggers).
//!
//! With `IDEM_TEST_CRASH_AT=<point>@<operation key>` in its environment, the process aborts
//! — no cleanup, no flush, like `kill -9` — the first time it reaches `<point>` for that
//! operation. Points:
//! - `executor.before_call`: the attempt holds its lease; nothing was sent yet;
//! - `executor.after_call`: the provider answered; the outcome is not recorded yet;
//! - `flow.after_step`: a workflow step's outcome is recorded; its instance is not advanced.
//!
//! Read once at the first check; unset (always, in production) it costs one load.

use std::sync::OnceLock;

static ARMED: OnceLock<Option<(String, String)>> = OnceLock::new();

/// Aborts the process if `IDEM_TEST_CRASH_AT` names `point` for operation `key`.
pub fn crash_point(point: &str, key: &str) {
    let armed = ARMED.get_or_init(|| {
        let spec = std::env::var("IDEM_TEST_CRASH_AT").ok()?;
        let (p, k) = spec.split_once('@')?;
        Some((p.to_owned(), k.to_owned()))
    });
    if let Some((p, k)) = armed
        && p == point
        && k == key
    {
        eprintln!("idem: IDEM_TEST_CRASH_AT: aborting at {point} for {key}");
        std::process::abort();
    }
}
