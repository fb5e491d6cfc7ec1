//! API keys: Bearer secrets bound to a tenant, a principal and a role.
//!
//! A secret is `idem_` followed by 64 hex digits (256 random bits). Only its SHA-256 digest
//! is stored (`api_keys.key_hash`, unique index), so authentication is a single indexed
//! lookup and a database dump does not reveal usable keys. A fast hash is enough here: the
//! secrets are server-generated with 256 bits of entropy, not passwords (CRATES.md §2).

use idem_core::fingerprint::sha256_hex;
use rand::RngExt;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Prefix of every generated secret (helps secret scanners and humans).
pub const SECRET_PREFIX: &str = "idem_";

/// What [`crate::Store::revoke_api_key_keeping_an_admin`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    /// The key is revoked.
    Revoked,
    /// No live key with that id in the tenant.
    NotFound,
    /// It is the tenant's last active admin key: nothing changed.
    LastAdmin,
}

/// What a key may do. Each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Acquire, complete, read operations of its tenant.
    Client,
    /// Client, plus operator actions (resolve, reconcile) when those exist.
    Operator,
    /// Operator, plus key management.
    Admin,
}

impl Role {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "client" => Ok(Role::Client),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!("unknown role {other:?}: expected client, operator or admin")),
        }
    }
}

/// A stored API key, without its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKeyInfo {
    /// Public identifier (UUID v7), used to list and revoke.
    pub id: String,
    /// Tenant the key acts for.
    pub tenant: String,
    /// Principal recorded on every transition made with this key.
    pub principal: String,
    /// What the key may do.
    pub role: Role,
    /// Creation instant (epoch ms).
    pub created_at: i64,
    /// Revocation instant (epoch ms); a revoked key authenticates nothing.
    pub revoked_at: Option<i64>,
}

/// 256 random bits as 64 lowercase hex digits (API key secrets, session ids, CSRF tokens).
pub fn random_hex_256() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    idem_core::fingerprint::hex(&bytes)
}

/// A new random secret (`idem_` + 64 hex digits).
pub fn generate_secret() -> String {
    format!("{SECRET_PREFIX}{}", random_hex_256())
}

/// The stored digest of `secret`: SHA-256, lowercase hex.
pub fn hash_secret(secret: &str) -> String {
    sha256_hex(secret.as_bytes())
}

/// Checks a tenant or principal name: 1–64 characters of `[A-Za-z0-9._-]`; the principals
/// `system` and `executor` are reserved for idem's own changes.
///
/// # Errors
/// A one-line message naming the rule.
pub fn validate_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(format!("{what} {name:?} must be 1-64 characters of [A-Za-z0-9._-]"));
    }
    let reserved = [idem_core::record::SYSTEM_PRINCIPAL, idem_core::record::EXECUTOR_PRINCIPAL];
    if what == "principal" && reserved.contains(&name) {
        return Err(format!("principal {name:?} is reserved for idem itself"));
    }
    Ok(())
}

/// Checks a secret supplied from outside (`IDEM_BOOTSTRAP_KEY`): 32–256 printable ASCII
/// characters without spaces, so it carries enough entropy and fits a Bearer header.
///
/// # Errors
/// A one-line message naming the rule.
pub fn validate_supplied_secret(secret: &str) -> Result<(), String> {
    if !(32..=256).contains(&secret.len()) || !secret.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err("the supplied API key must be 32-256 printable ASCII characters without spaces".into());
    }
    Ok(())
}
