//! Acceptance runs: a scenario file executed against a running idem and a provider.

pub mod provider;
pub mod runner;
