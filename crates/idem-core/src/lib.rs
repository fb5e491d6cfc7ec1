//! idem-core: the pure domain of idem. No I/O, no async.
//!
//! - [`key`]: idempotency key rules (length, charset, no personal data).
//! - [`fingerprint`]: SHA-256 over RFC 8785 canonical JSON of NFC text.
//! - [`payload`]: parsing a client's JSON value (I-JSON: no duplicate members, exact numbers).
//! - [`json_number`]: which number literals an IEEE 754 double carries exactly.
//! - [`state`]: the states and their legal transitions (DESIGN.md §2).
//! - [`decision`]: the decision table of DESIGN.md §3 ([`decide`]) and acquire plans.
//! - [`completion`]: fenced completions and their plans.
//! - [`lease`]: lease holder identities and lease renewal (heartbeats); [`holder`]: what a
//!   holder identity may be (one attempt's UUID).
//! - [`ident`]: the one rule every stored identifier follows (not empty, not blank, not
//!   padded, no control characters).
//! - [`reconcile`]: settling UNKNOWN by lookup evidence or operator resolution.
//! - [`retention`]: retention windows, tombstones, late arrivals.
//! - [`retry`]: the durable backoff schedule (full jitter).
//! - [`record`]: the operation record and event log entries.
//! - [`clock`]: epoch-millisecond time behind a trait.
//! - [`flow`]: workflows — instances, steps, checkpoints, recovery policies, and their plans.
//! - [`outbox`]: outbox events — their limits, the plan after a delivery attempt, dead letters.
//! - [`inbox`]: a consumer's claim of a message id — apply, duplicate or conflict.
//! - [`text`]: what a provider or receiver sent, as text every store accepts (error snippets).
//!
//! Stores persist the plans these functions return; they do not decide anything.

pub mod clock;
pub mod completion;
pub mod decision;
pub mod fingerprint;
pub mod flow;
pub mod holder;
pub mod ident;
pub mod inbox;
pub mod json_number;
pub mod key;
pub mod lease;
pub mod outbox;
pub mod payload;
pub mod reconcile;
pub mod record;
pub mod retention;
pub mod retry;
pub mod state;
pub mod text;

pub use clock::{Clock, ManualClock, SystemClock};
pub use completion::{CompleteError, CompletionPlan, Outcome, plan_completion};
pub use decision::{AcquireInput, AcquirePlan, Decision, decide, plan_acquire, plan_lease_expiry};
pub use fingerprint::{Fingerprint, FingerprintError, fingerprint};
pub use key::{IdempotencyKey, KeyError};
pub use lease::{HolderId, RenewError, plan_renewal};
pub use payload::{MAX_JSON_DEPTH, Payload, check_depth, json_depth};
pub use reconcile::{Lookup, ResolveError, plan_reconciliation, plan_resolution};
pub use record::{Actor, EventKind, OperationEvent, OperationRecord};
pub use retention::{Retention, Tombstone, is_expired, plan_late_arrival};
pub use retry::RetryPolicy;
pub use state::State;
