//! The `idem` crate's library part: what the binary and the integration tests share.
//!
//! - [`acceptance`]: the acceptance matrix runner (`idem scenarios run`) and the
//!   scriptable provider double it runs against (`idem scenarios provider`).

pub mod acceptance;
