//! The configured connectors, by name, each with its retry policy and retry budget.

use crate::budget::RetryBudget;
use crate::config::{Config, ConfigError, ConnectorConfig};
use crate::connector::Connector;
use crate::http::HttpConnector;
use crate::nats::NatsConnector;
use crate::smtp::SmtpConnector;
use idem_core::RetryPolicy;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One configured connector.
#[derive(Debug)]
pub struct Entry {
    /// Its name in the config.
    pub name: String,
    /// The connector.
    pub connector: Arc<dyn Connector>,
    /// Durable retry schedule of its operations.
    pub policy: RetryPolicy,
    /// Its retry budget.
    pub budget: RetryBudget,
    /// Inconclusive lookups before review.
    pub max_lookups: i64,
    /// False for lookup-only entries (e.g. the proxy's): the executor never runs their
    /// operations and triggers cannot name them; the caller performs the effect and the
    /// reconciler may still ask.
    pub executes: bool,
    /// The tenants whose operations it may perform (`tenants = [...]`; lookup-only
    /// entries serve every tenant of the proxy that made them).
    pub tenants: crate::tenants::TenantScope,
}

impl Entry {
    /// Whether operations of `tenant` may run on it.
    pub fn allows(&self, tenant: &str) -> bool {
        self.tenants.allows(tenant)
    }
}

/// All connectors and the action → connector defaults.
#[derive(Debug, Default)]
pub struct Registry {
    entries: BTreeMap<String, Arc<Entry>>,
    actions: BTreeMap<String, String>,
}

impl Registry {
    /// Builds every connector of `config`, resolving secrets and checking templates now,
    /// so a bad config fails at start-up.
    ///
    /// # Errors
    /// The first [`ConfigError`], naming its field.
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let mut entries = BTreeMap::new();
        for (name, c) in &config.connectors {
            let connector: Arc<dyn Connector> = match c {
                ConnectorConfig::Http(h) => Arc::new(HttpConnector::new(name, h)?),
                ConnectorConfig::Smtp(s) => Arc::new(SmtpConnector::new(name, s)?),
                ConnectorConfig::Nats(n) => Arc::new(NatsConnector::new(name, n)?),
            };
            let r = c.retry();
            entries.insert(
                name.clone(),
                Arc::new(Entry {
                    name: name.clone(),
                    connector,
                    policy: r.policy(),
                    budget: RetryBudget::new(r.budget_per_s, r.budget_burst),
                    max_lookups: r.max_lookups,
                    executes: true,
                    tenants: c.tenants().clone(),
                }),
            );
        }
        let actions = config.actions.iter().filter_map(|(a, c)| c.connector.clone().map(|c| (a.clone(), c))).collect();
        Ok(Registry { entries, actions })
    }

    /// Adds a lookup-only entry (see [`Entry::executes`]). Its name must start with
    /// `lookup:` (the store never lists such operations as due for execution; configured
    /// connector names cannot contain `:`).
    pub fn add_lookup_only(
        &mut self,
        name: &str,
        connector: Arc<dyn Connector>,
        policy: RetryPolicy,
        max_lookups: i64,
    ) {
        debug_assert!(name.starts_with("lookup:"));
        let entry = Entry {
            name: name.to_owned(),
            connector,
            policy,
            budget: RetryBudget::new(1.0, 1.0),
            max_lookups,
            executes: false,
            tenants: crate::tenants::TenantScope::All,
        };
        self.entries.insert(name.to_owned(), Arc::new(entry));
    }

    /// The connector named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Entry>> {
        self.entries.get(name).cloned()
    }

    /// The connector an action runs on when a trigger names none.
    pub fn for_action(&self, action: &str) -> Option<&str> {
        self.actions.get(action).map(String::as_str)
    }

    /// Connector names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }
}
