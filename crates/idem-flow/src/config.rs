//! `[workflows.NAME]` in the configuration file → validated [`Definition`]s.
//!
//! ```toml
//! [workflows.order-intake]
//! steps = [
//!   # idem performs this step with connector "orders"; its input is built from the
//!   # instance input (JSON pointers, types kept; a missing value is an error, never null).
//!   { name = "create_order", connector = "orders",
//!     input = { customer = { from = "/input/customer" }, amount = { from = "/input/amount" } } },
//!   # policy defaults to lookup_before_redo when the connector has a lookup, else manual.
//!   { name = "send_confirmation", connector = "mail", policy = "lookup_before_redo",
//!     input = { to = { from = "/input/email" }, order = { from = "/steps/create_order/result/id" } } },
//!   # no connector (and none for the action under [actions]): your code performs it
//!   # through the step API.
//!   { name = "write_back", action = "crm_write_back", policy = "manual" },
//! ]
//! ```
//! Parallel branches: consecutive steps with the same `group = "NAME"` run at once, and the
//! step after them waits for all of them; each branch is its own operation, keyed
//! `{instance}:{group}:{step}` (`idem_core::flow::group`). A group's settings, optional:
//!
//! ```toml
//! [[workflows.order-intake.groups]]
//! name = "notify"
//! on_failure = "compensate"   # or "pause" (the default): what a failed branch does
//! max_concurrency = 2         # branches in flight at once (default: all)
//! ```
//! Step fields: `name` (required, `[A-Za-z0-9_.-]`, unique), `action` (default: the name),
//! `connector` (default: the action's `[actions.X] connector`, else none), `policy`
//! (`redo_safe`, `lookup_before_redo`, `compensate`, `manual`), `input` (template, see
//! `idem_core::flow::input`; default: the whole instance input), `compensation`
//! (`{ action, connector, input }`), `group` (the parallel group it is a branch of).
//! Every error names its field, e.g.
//! `workflows.order-intake.steps[1].policy: …`.

use idem_connect::tenants::TenantScope;
use idem_connect::{Config, ConfigError, Registry};
use idem_core::flow::definition::ConnectorCaps;
use idem_core::flow::{CompensationDef, Definition, RecoveryPolicy, StepDef};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkflowConfig {
    steps: Vec<toml::Value>,
    #[serde(default)]
    groups: Vec<toml::Value>,
    #[serde(default)]
    tenants: TenantScope,
}

/// A workflow declared in the configuration: its definition, and the tenants that may
/// start it (`tenants = [...]`, default `["default"]`, `idem_connect::tenants`).
#[derive(Debug, Clone)]
pub struct Declared {
    /// The validated definition.
    pub definition: Definition,
    /// Who may start it.
    pub tenants: TenantScope,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepConfig {
    name: String,
    action: Option<String>,
    connector: Option<String>,
    policy: Option<RecoveryPolicy>,
    input: Option<Value>,
    compensation: Option<CompensationConfig>,
    group: Option<String>,
    for_each: Option<idem_core::flow::definition::ForEachDef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CompensationConfig {
    action: String,
    connector: Option<String>,
    input: Option<Value>,
}

/// What the validation needs to know of a connector: configured and performing effects
/// (not a lookup-only entry), and whether it has a lookup.
pub fn caps(registry: &Registry, name: &str) -> Option<ConnectorCaps> {
    registry.get(name).filter(|e| e.executes).map(|e| ConnectorCaps { has_lookup: e.connector.can_look_up() })
}

/// Every `[workflows.NAME]` of `config` as a validated definition with its tenants, by
/// name. A workflow may serve only tenants that every connector of its steps (and their
/// compensations) serves, so that a start it accepts never runs a step for a tenant the
/// connector refuses.
///
/// # Errors
/// The first [`ConfigError`], naming its field (`workflows.NAME.steps[i].policy`,
/// `workflows.NAME.tenants`).
pub fn definitions(config: &Config, registry: &Registry) -> Result<BTreeMap<String, Declared>, ConfigError> {
    let mut out = BTreeMap::new();
    for (name, raw) in &config.workflows {
        let prefix = format!("workflows.{name}");
        let bad = |field: String, message: String| ConfigError { field, message };
        let wf: WorkflowConfig =
            raw.clone().try_into().map_err(|e: toml::de::Error| bad(prefix.clone(), one_line(&e.to_string())))?;
        let mut steps = Vec::with_capacity(wf.steps.len());
        for (i, raw) in wf.steps.into_iter().enumerate() {
            let field = format!("{prefix}.steps[{i}]");
            let s: StepConfig =
                raw.try_into().map_err(|e: toml::de::Error| bad(field.clone(), one_line(&e.to_string())))?;
            let action = s.action.unwrap_or_else(|| s.name.clone());
            let connector = s.connector.or_else(|| registry.for_action(&action).map(str::to_owned));
            let has_lookup = connector.as_deref().and_then(|c| caps(registry, c)).is_some_and(|c| c.has_lookup);
            steps.push(StepDef {
                name: s.name,
                action,
                policy: s.policy.unwrap_or(RecoveryPolicy::default_for(has_lookup)),
                input: s.input.unwrap_or(Value::Null),
                compensation: s.compensation.map(|c| CompensationDef {
                    action: c.action,
                    connector: c.connector,
                    input: c.input.unwrap_or(Value::Null),
                }),
                connector,
                group: s.group,
                for_each: s.for_each,
            });
        }
        let mut groups = Vec::with_capacity(wf.groups.len());
        for (i, raw) in wf.groups.into_iter().enumerate() {
            let field = format!("{prefix}.groups[{i}]");
            groups.push(raw.try_into().map_err(|e: toml::de::Error| bad(field.clone(), one_line(&e.to_string())))?);
        }
        let def = Definition { name: name.clone(), steps, groups };
        def.validate(&prefix, &|c| caps(registry, c)).map_err(|e| bad(e.field, e.message))?;
        let field = format!("{prefix}.tenants");
        wf.tenants.check(&field)?;
        let connectors = def
            .steps
            .iter()
            .flat_map(|s| s.connector.iter().chain(s.compensation.as_ref().and_then(|c| c.connector.as_ref())));
        for c in connectors {
            if let Some(e) = registry.get(c)
                && !wf.tenants.within(&e.tenants)
            {
                return Err(bad(
                    field,
                    format!(
                        "the workflow serves {} but its connector {c:?} serves only {} (connectors.{c}.tenants)",
                        wf.tenants.describe(),
                        e.tenants.describe()
                    ),
                ));
            }
        }
        out.insert(name.clone(), Declared { definition: def, tenants: wf.tenants });
    }
    Ok(out)
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(workflows: &str) -> Result<BTreeMap<String, Declared>, ConfigError> {
        let text = format!(
            r#"
[actions.notify]
connector = "hook"

[connectors.orders]
kind = "http"
url = "http://127.0.0.1:9/orders"
lookup = {{ url = "http://127.0.0.1:9/orders?ref={{idempotency_key}}", found_pointer = "/0/id" }}

[connectors.hook]
kind = "http"
url = "http://127.0.0.1:9/hook"

{workflows}"#
        );
        let config = Config::parse(&text).unwrap();
        let registry = Registry::from_config(&config).unwrap();
        definitions(&config, &registry)
    }

    #[test]
    fn defaults_follow_the_connector() {
        let defs = load(
            r#"[workflows.intake]
steps = [
  { name = "create_order", connector = "orders", input = { c = { from = "/input/c" } } },
  { name = "notify" },
  { name = "write_back", action = "crm" },
]"#,
        )
        .unwrap();
        assert_eq!(defs["intake"].tenants, TenantScope::default(), "the default tenant alone");
        let d = &defs["intake"].definition;
        assert_eq!(d.steps[0].policy, RecoveryPolicy::LookupBeforeRedo, "the connector has a lookup");
        assert_eq!((d.steps[1].connector.as_deref(), d.steps[1].policy), (Some("hook"), RecoveryPolicy::Manual));
        assert_eq!(d.steps[1].action, "notify");
        assert_eq!((d.steps[2].connector.as_deref(), d.steps[2].action.as_str()), (None, "crm"));
    }

    #[test]
    fn each_error_is_one_line_naming_its_field() {
        let cases = [
            (
                r#"[workflows.w]
steps = [{ name = "a", connector = "nope" }]"#,
                "workflows.w.steps[0].connector",
            ),
            (
                r#"[workflows.w]
steps = [{ name = "a", connector = "hook", policy = "lookup_before_redo" }]"#,
                "workflows.w.steps[0].policy",
            ),
            (
                r#"[workflows.w]
steps = [{ name = "a", polcy = "manual" }]"#,
                "workflows.w.steps[0]",
            ),
            (
                r#"[workflows.w]
steps = [{ name = "a", connector = "hook", input = { x = { from = "/steps/b/result" } } }]"#,
                "workflows.w.steps[0].input/x",
            ),
            (
                r#"[workflows.w]
steps = []"#,
                "workflows.w.steps",
            ),
            (
                r#"[workflows."bad name"]
steps = [{ name = "a" }]"#,
                "workflows.bad name.name",
            ),
            (
                r#"[workflows.w]
tenants = ["default", "acme"]
steps = [{ name = "a", connector = "hook" }]"#,
                "workflows.w.tenants",
            ),
            (
                r#"[workflows.w]
tenants = []
steps = [{ name = "a" }]"#,
                "workflows.w.tenants",
            ),
        ];
        for (toml, field) in cases {
            let e = load(toml).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
    }
}
