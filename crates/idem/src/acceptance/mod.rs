//! Acceptance runs: a scenario file executed against a running idem and a provider; the
//! webhook receiver the relay is tested and benchmarked against.

pub mod provider;
pub mod receiver;
pub mod runner;
