//! idem-connect: idem performs side effects itself.
//!
//! - [`config`]: the TOML connector configuration, secrets and `${VAR}` overrides.
//! - [`connector`]: the `Connector` contract (execute, lookup) and outcome helpers.
//! - [`http`], [`smtp`], [`nats`]: the HTTP/webhook, SMTP (+ IMAP lookup) and NATS
//!   JetStream connectors; [`nats::publish`] is also the relay's NATS sink.
//! - [`http_status`]: what an HTTP status proves about a side effect (connector and proxy).
//! - [`budget`]: per-connector retry budgets (token buckets).
//! - [`registry`]: the configured connectors by name; [`tenants`]: which tenants each serves.
//! - [`executor`]: runs attempts and the durable retry loop.
//! - [`reconciler`]: settles UNKNOWN operations by lookup.
//! - [`labels`]: bounded metric label values chosen by clients.
//! - [`crash`]: named crash points for the kill -9 tests (`IDEM_TEST_CRASH_AT`).
//!
//! This crate owns talking to providers and the loops; it must not decide protocol
//! questions (idem-core does) or write SQL (idem-store does).

pub mod budget;
pub mod config;
pub mod connector;
pub mod crash;
pub mod executor;
pub mod http;
pub mod http_status;
pub mod labels;
pub mod nats;
pub mod reconciler;
pub mod registry;
pub mod smtp;
pub mod tenants;

pub use config::{Config, ConfigError};
pub use connector::{Connector, OperationCtx};
pub use executor::Executor;
pub use reconciler::Reconciler;
pub use registry::Registry;
