//! Which tenants may use a connector or a declared workflow (`tenants = [...]`).
//!
//! A connector carries the operator's credentials (an SMTP account, an API token): a
//! trigger of any tenant that names it — or names an action whose default it is — makes
//! idem act with them. So a connector serves only the tenants its configuration lists,
//! and the default is the tenant the first start creates, `default`, alone: a client key
//! of tenant `acme` cannot send mail through the default tenant's mailbox unless the
//! operator wrote `tenants = ["default", "acme"]` (or `["*"]`, every tenant). The same
//! holds for a workflow declared in the configuration, whose steps run on connectors.

use crate::config::ConfigError;
use serde::Deserialize;
use std::collections::BTreeSet;

/// The tenant the first start of `idem serve` creates its admin key in.
pub const DEFAULT_TENANT: &str = "default";

/// The tenants a connector or a declared workflow serves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "Vec<String>")]
pub enum TenantScope {
    /// `["*"]`: every tenant.
    All,
    /// These tenants only (as written; checked by [`TenantScope::check`]).
    Only(BTreeSet<String>),
}

impl Default for TenantScope {
    /// `["default"]`: the tenant of the first start's admin key.
    fn default() -> Self {
        TenantScope::Only(BTreeSet::from([DEFAULT_TENANT.to_owned()]))
    }
}

impl From<Vec<String>> for TenantScope {
    fn from(v: Vec<String>) -> Self {
        if v.iter().any(|t| t == "*") && v.len() == 1 {
            TenantScope::All
        } else {
            TenantScope::Only(v.into_iter().collect())
        }
    }
}

impl TenantScope {
    /// Whether `tenant` may use it.
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            TenantScope::All => true,
            TenantScope::Only(set) => set.contains(tenant),
        }
    }

    /// Whether every tenant `self` allows is allowed by `other` too (a workflow's tenants
    /// against its steps' connectors).
    pub fn within(&self, other: &TenantScope) -> bool {
        match (self, other) {
            (_, TenantScope::All) => true,
            (TenantScope::All, TenantScope::Only(_)) => false,
            (TenantScope::Only(a), TenantScope::Only(b)) => a.is_subset(b),
        }
    }

    /// The tenants as written, for messages: `["default", "acme"]` or `["*"]`.
    pub fn describe(&self) -> String {
        match self {
            TenantScope::All => "[\"*\"]".to_owned(),
            TenantScope::Only(set) => format!("{:?}", set.iter().collect::<Vec<_>>()),
        }
    }

    /// Checks the list of `field` (`connectors.mail.tenants`): not empty, each a tenant
    /// name (1–64 characters of `[A-Za-z0-9._-]`, the rule of `idem keys create
    /// --tenant`), or `*` alone.
    ///
    /// # Errors
    /// A [`ConfigError`] naming `field`.
    pub fn check(&self, field: &str) -> Result<(), ConfigError> {
        let TenantScope::Only(set) = self else { return Ok(()) };
        let bad = |m: String| Err(ConfigError { field: field.to_owned(), message: m });
        if set.is_empty() {
            return bad("lists no tenant: name the tenants that may use it, or [\"*\"] for every tenant".into());
        }
        for t in set {
            if t == "*" {
                return bad("\"*\" (every tenant) must be the only entry".into());
            }
            if t.is_empty() || t.len() > 64 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
                return bad(format!("{t:?} is not a tenant name (1-64 characters of [A-Za-z0-9._-])"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_the_default_tenant_alone() {
        let d = TenantScope::default();
        assert!(d.allows("default") && !d.allows("acme") && !d.allows("default.proxy"));
        assert!(TenantScope::from(vec!["*".to_owned()]).allows("acme"));
    }

    #[test]
    fn lists_are_checked_and_scopes_compare() {
        let of = |v: &[&str]| TenantScope::from(v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>());
        assert!(of(&["default", "acme"]).check("f").is_ok());
        for bad in [&[][..], &["*", "acme"], &[" acme"], &["a/b"], &[""]] {
            let e = of(bad).check("connectors.mail.tenants").unwrap_err();
            assert_eq!(e.field, "connectors.mail.tenants", "{bad:?}");
        }
        assert!(of(&["acme"]).within(&of(&["acme", "default"])));
        assert!(!of(&["acme", "beta"]).within(&of(&["acme"])));
        assert!(of(&["*"]).within(&of(&["*"])) && !of(&["*"]).within(&of(&["acme"])));
    }
}
