//! idem-outbox: effects that leave a transaction, and messages applied once — in the
//! application's own database (DESIGN.md §8, "one atomic boundary").
//!
//! **The guarantee, stated plainly.** The relay delivers every committed event **at least
//! once**: a crash, a lost acknowledgement or an operator's redrive can deliver an event
//! again. An *exactly-once effect* needs a receiver that dedupes by the event id — an
//! inbox ([`inbox`], or a receiver using [`receive`]), or a broker that deduplicates
//! (NATS JetStream's `Nats-Msg-Id` within the stream's duplicate window). Nothing here
//! promises exactly-once *delivery*.
//!
//! The transaction half (always built; what an application links):
//! - [`tx`]: claim an idempotency key, write business rows, store the result — all in the
//!   caller's sqlx transaction: a retry gets the stored result, another payload a
//!   conflict, a crash leaves everything or nothing.
//! - [`append`]: append an outbox event in the caller's transaction.
//! - [`inbox`]: claim a message id for a consumer in the caller's transaction, then finish
//!   with an outcome; a redelivery is a no-op, other content under the id a conflict.
//! - [`signature`], [`receive`]: Standard Webhooks signatures, and a received webhook
//!   verified then claimed in the inbox in one step.
//! - [`schema`]: `idem schema install`: the `idem` schema (PostgreSQL: tables and the SQL
//!   functions `idem.outbox_append`, `idem.inbox_claim`, `idem.inbox_finish`,
//!   `idem.key_claim`, `idem.key_finish`, for any language) or the `idem_*` tables
//!   (SQLite), versioned.
//! - [`Conn`]: the connection (of an open transaction) these functions write on.
//!
//! The relay half (feature `relay`):
//! - [`relay`]: `Relay::tick` / `run` — claim (lease + fencing, head of each aggregate),
//!   deliver, record; [`relay::config`] (`[outbox]`), [`relay::wake`] (LISTEN/NOTIFY).
//! - [`sink`]: the webhook (Standard Webhooks) and NATS JetStream sinks.
//! - [`store`]: `OutboxStore`, the relay's reads and fenced writes, and the operators'
//!   redrive and skip of dead letters.
//!
//! Decisions are idem-core's ([`idem_core::outbox`], [`idem_core::inbox`]); this crate
//! reads, calls them, and writes.

pub mod append;
mod claims;
mod conn;
pub mod error;
pub mod inbox;
pub mod receive;
#[cfg(feature = "relay")]
pub mod relay;
pub mod schema;
pub mod signature;
#[cfg(feature = "relay")]
pub mod sink;
#[cfg(feature = "relay")]
pub mod store;
pub mod tx;

pub use append::append;
pub use conn::Conn;
pub use error::OutboxError;
pub use idem_core::inbox::InboxDecision;
pub use idem_core::outbox::NewEvent;
