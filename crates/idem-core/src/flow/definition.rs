//! Workflow definitions: ordered steps, each with its connector (or none: the caller
//! performs it), its recovery policy and how its input is built; and the version every
//! instance pins.
//!
//! The **version** of a definition is the SHA-256 (lowercase hex) of its RFC 8785
//! canonical JSON form, so any change — a step added, a policy or an input template
//! changed — is a new version, and an instance started on one version runs it to the end
//! (the store keeps every version an instance uses).

use super::input::references;
use super::record::{validate_step_name, validate_workflow_name};
use crate::fingerprint::{canonical_json, sha256_hex};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt;

/// Most steps one workflow may have.
pub const MAX_STEPS: usize = 64;

/// What to do when a step's outcome is UNKNOWN (a timeout after the request left, a lost
/// reply) or its worker died mid-step (its lease expired). Never "redo blindly".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryPolicy {
    /// Redoing the step cannot duplicate its effect (the provider deduplicates, or the
    /// effect is naturally idempotent): redo it. An expired lease is re-granted at once.
    RedoSafe,
    /// Ask the provider first through the connector's lookup; redo only when the lookup
    /// proves absence; pause for a person when it stays inconclusive. Needs a connector
    /// with a lookup.
    LookupBeforeRedo,
    /// The step has a compensation; an UNKNOWN outcome pauses the instance so the operator
    /// can compensate (the compensation runs when a later step fails finally).
    Compensate,
    /// Pause the instance and put the step in the review queue; nothing is redone or looked
    /// up without a person.
    Manual,
}

impl RecoveryPolicy {
    /// The name used in configuration and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryPolicy::RedoSafe => "redo_safe",
            RecoveryPolicy::LookupBeforeRedo => "lookup_before_redo",
            RecoveryPolicy::Compensate => "compensate",
            RecoveryPolicy::Manual => "manual",
        }
    }

    /// The default where a definition names none: `lookup_before_redo` when the step's
    /// connector can look effects up, else `manual`.
    pub fn default_for(has_lookup: bool) -> Self {
        if has_lookup { RecoveryPolicy::LookupBeforeRedo } else { RecoveryPolicy::Manual }
    }
}

impl fmt::Display for RecoveryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The compensation of a step: a new business action that undoes the step's effect
/// (`cancel_order` for `create_order`), run as its own idempotent operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompensationDef {
    /// Action name of the compensating operation.
    pub action: String,
    /// Connector that performs it; `None`: the caller performs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connector: Option<String>,
    /// Input template (see [`super::input`]); may point at the step's own checkpoint
    /// (`/steps/<this step>/result/...`, `/steps/<this step>/provider_ref`).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub input: Value,
}

/// One step of a definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDef {
    /// Step name, unique in the definition (see [`validate_step_name`]).
    pub name: String,
    /// Action of the step's operation (part of its intent, as for any operation).
    pub action: String,
    /// Connector idem performs the step with; `None`: the caller's code performs it and
    /// reports the outcome (acquire → do → complete, through the step API).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connector: Option<String>,
    /// What to do when the step's outcome is UNKNOWN or its worker died.
    pub policy: RecoveryPolicy,
    /// Input template (see [`super::input`]); `null` = the instance input as it is. Only
    /// for connector steps: a step the caller performs gets its payload from the caller.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub input: Value,
    /// How to undo the step's effect, if it can be undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensation: Option<CompensationDef>,
    /// The parallel group this step is a branch of (see [`super::group`]): consecutive
    /// steps naming the same group run concurrently, and the step after them waits for all
    /// of them. The branch's operation key is `{instance}:{group}:{step}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Perform the step once for each item of a list (see [`super::items`]): each item is
    /// its own operation, keyed `{instance}:{step}:{id}` by the item's identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<ForEachDef>,
}

/// A step for each item of a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForEachDef {
    /// JSON pointer of the list: into the instance input (`/input/recipients`) or an
    /// earlier step's result (`/steps/NAME/result/lines`).
    pub items: String,
    /// JSON pointer, inside one item, of its identity (`/id`): a string of
    /// `[A-Za-z0-9_.-]` or an integer. The item's key ends with it, so a reordered list
    /// redoes nothing; two items with one identity and different contents fail the step.
    pub id: String,
    /// Most items in flight at once (`None`: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// What a failed or UNKNOWN item does: pause the instance (default) or compensate.
    #[serde(default)]
    pub on_failure: GroupFailure,
}

impl StepDef {
    /// The name the step's operation key ends with: `{group}:{step}` for a branch of a
    /// parallel group, else the step name (see [`super::record::step_key`]).
    pub fn key_name(&self) -> String {
        match &self.group {
            Some(g) => format!("{g}:{}", self.name),
            None => self.name.clone(),
        }
    }
}

/// What a parallel group does when one of its branches fails finally, or its outcome is
/// UNKNOWN and its recovery policy leaves it to a person (or to compensation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupFailure {
    /// Pause the instance for a person (the default): the other branches' states are kept,
    /// branches not started yet are not started, running ones finish and are recorded.
    #[default]
    Pause,
    /// Compensate: once the running branches settled, the compensations of every step and
    /// branch whose effect exists run, last first, each once.
    Compensate,
}

impl GroupFailure {
    /// The name used in configuration and the API.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupFailure::Pause => "pause",
            GroupFailure::Compensate => "compensate",
        }
    }
}

/// Settings of a parallel group (optional: a group no entry names pauses on a failure and
/// runs every branch at once).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupDef {
    /// The group's name, as its branches' `group` names it.
    pub name: String,
    /// What a failed or UNKNOWN branch does to the instance.
    #[serde(default)]
    pub on_failure: GroupFailure,
    /// Most branches in flight at once, 1–[`MAX_STEPS`] (`None`: all). For branches your
    /// code performs, an acquire beyond it is refused (see [`super::group::admit_branch`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
}

/// A named, ordered list of steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    /// Workflow name (see [`validate_workflow_name`]).
    pub name: String,
    /// The steps, in the order they run (consecutive branches of one group at once).
    pub steps: Vec<StepDef>,
    /// Settings of the parallel groups its steps name (none: the defaults).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<GroupDef>,
}

/// What a step's connector can do, as the validation needs to know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectorCaps {
    /// The connector can look an effect up (reconciliation).
    pub has_lookup: bool,
}

/// A definition that cannot run. `field` names the place, e.g. `workflows.order.steps[1].policy`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct DefinitionError {
    /// The offending field, as written in the configuration (or the API body).
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

/// Whether `action` is a valid action name: 1–128 characters of `[A-Za-z0-9_.:-]` (the
/// operations API's rule).
pub fn valid_action(action: &str) -> bool {
    !action.is_empty()
        && action.len() <= 128
        && action.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

impl Definition {
    /// The pinned version: SHA-256 hex of the canonical (RFC 8785) JSON of the definition.
    pub fn version(&self) -> String {
        let value = serde_json::to_value(self).expect("a definition serializes");
        sha256_hex(canonical_json(&value).expect("a definition canonicalizes").as_bytes())
    }

    /// The index of step `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.steps.iter().position(|s| s.name == name)
    }

    /// The steps that run together with step `index`: its group's consecutive branches, or
    /// the step alone. Empty for an index past the end.
    pub fn span(&self, index: usize) -> std::ops::Range<usize> {
        let Some(group) = self.steps.get(index).map(|s| s.group.as_deref()) else { return index..index };
        let Some(group) = group else { return index..index + 1 };
        let same = |s: &StepDef| s.group.as_deref() == Some(group);
        let start = self.steps[..index].iter().rposition(|s| !same(s)).map_or(0, |i| i + 1);
        let end = self.steps[index..].iter().position(|s| !same(s)).map_or(self.steps.len(), |n| index + n);
        start..end
    }

    /// The settings of group `name` (the defaults when no entry names it).
    pub fn group_def(&self, name: &str) -> GroupDef {
        self.groups.iter().find(|g| g.name == name).cloned().unwrap_or(GroupDef {
            name: name.to_owned(),
            on_failure: GroupFailure::default(),
            max_concurrency: None,
        })
    }

    /// Checks that the definition can run. `prefix` is prepended to field names (e.g.
    /// `workflows.order`); `connector` answers for a connector name (`None`: not
    /// configured).
    ///
    /// # Errors
    /// The first [`DefinitionError`] found, naming its field.
    pub fn validate(
        &self,
        prefix: &str,
        connector: &dyn Fn(&str) -> Option<ConnectorCaps>,
    ) -> Result<(), DefinitionError> {
        let err = |field: String, message: String| Err(DefinitionError { field, message });
        if let Err(e) = validate_workflow_name(&self.name) {
            return err(format!("{prefix}.name"), e);
        }
        if self.steps.is_empty() {
            return err(format!("{prefix}.steps"), "a workflow needs at least one step".into());
        }
        if self.steps.len() > MAX_STEPS {
            return err(format!("{prefix}.steps"), format!("{} steps; at most {MAX_STEPS}", self.steps.len()));
        }
        for (i, step) in self.steps.iter().enumerate() {
            let f = |name: &str| format!("{prefix}.steps[{i}].{name}");
            if let Err(e) = validate_step_name(&step.name) {
                return err(f("name"), e);
            }
            if self.steps[..i].iter().any(|s| s.name == step.name) {
                return err(f("name"), format!("step {:?} is named twice", step.name));
            }
            if !valid_action(&step.action) {
                return err(f("action"), "an action is 1-128 characters of [A-Za-z0-9_.:-]".into());
            }
            self.check_group(i, &f("group"))?;
            if let Some(fe) = &step.for_each {
                let before = &self.steps[..i];
                check_for_each(step, fe, before, &f("for_each"))?;
            }
            let caps = match &step.connector {
                None => None,
                Some(c) => match connector(c) {
                    Some(caps) => Some(caps),
                    None => return err(f("connector"), format!("no connector named {c:?} is configured")),
                },
            };
            match (step.policy, caps) {
                (RecoveryPolicy::LookupBeforeRedo, None) => {
                    return err(
                        f("policy"),
                        "lookup_before_redo needs a connector: idem cannot look up what your code did (use manual or redo_safe)"
                            .into(),
                    );
                }
                (RecoveryPolicy::LookupBeforeRedo, Some(c)) if !c.has_lookup => {
                    return err(
                        f("policy"),
                        format!(
                            "lookup_before_redo needs a lookup, and connector {:?} has none: configure its lookup, or use manual",
                            step.connector.as_deref().unwrap_or_default()
                        ),
                    );
                }
                (RecoveryPolicy::Compensate, _) if step.compensation.is_none() => {
                    return err(f("policy"), "compensate needs a compensation for the step".into());
                }
                _ => {}
            }
            if step.connector.is_none() && !step.input.is_null() {
                return err(
                    f("input"),
                    "a step your code performs takes its payload from your code: leave out input".into(),
                );
            }
            // A branch reads the steps before its group, never a sibling (it runs meanwhile).
            let before = &self.steps[..self.span(i).start];
            check_references(&step.input, before, None, step.for_each.is_some(), &f("input"))?;
            if let Some(comp) = &step.compensation {
                let cf = |name: &str| format!("{prefix}.steps[{i}].compensation.{name}");
                if !valid_action(&comp.action) {
                    return err(cf("action"), "an action is 1-128 characters of [A-Za-z0-9_.:-]".into());
                }
                if let Some(c) = &comp.connector
                    && connector(c).is_none()
                {
                    return err(cf("connector"), format!("no connector named {c:?} is configured"));
                }
                if comp.connector.is_none() && !comp.input.is_null() {
                    return err(
                        cf("input"),
                        "a compensation your code performs takes its payload from your code".into(),
                    );
                }
                check_references(&comp.input, before, Some(&step.name), step.for_each.is_some(), &cf("input"))?;
            }
        }
        for (g, group) in self.groups.iter().enumerate() {
            let f = |name: &str| format!("{prefix}.groups[{g}].{name}");
            if !self.steps.iter().any(|s| s.group.as_deref() == Some(group.name.as_str())) {
                return err(
                    f("name"),
                    format!("no step names group {:?} (set `group = {:?}` on its branches)", group.name, group.name),
                );
            }
            if self.groups[..g].iter().any(|o| o.name == group.name) {
                return err(f("name"), format!("group {:?} is configured twice", group.name));
            }
            if group.max_concurrency == Some(0) {
                return err(
                    f("max_concurrency"),
                    "at least 1 branch must be able to run (leave it out for all at once)".into(),
                );
            }
            if let Some(m) = group.max_concurrency.filter(|m| *m as usize > MAX_STEPS) {
                return err(
                    f("max_concurrency"),
                    format!("{m}: at most {MAX_STEPS}, the most steps a workflow has (leave it out for all at once)"),
                );
            }
        }
        Ok(())
    }

    /// Checks step `index`'s `group`: a valid name, no step's name, its branches
    /// consecutive, and `{group}:{step}` within a step name's length.
    fn check_group(&self, index: usize, field: &str) -> Result<(), DefinitionError> {
        let step = &self.steps[index];
        let Some(group) = step.group.as_deref() else { return Ok(()) };
        let bad = |message: String| Err(DefinitionError { field: field.to_owned(), message });
        if let Err(e) = validate_step_name(group) {
            return bad(e.replace("a step name", "a group name"));
        }
        if self.steps.iter().any(|s| s.name == group) {
            return bad(format!("group {group:?} has the name of a step: their keys would collide; rename one"));
        }
        let apart = |(j, s): (usize, &StepDef)| s.group.as_deref() == Some(group) && self.span(j).end < index;
        if self.steps[..index].iter().enumerate().any(apart) {
            return bad(format!("the branches of group {group:?} must be consecutive steps"));
        }
        let key_name = step.key_name();
        if key_name.len() > super::record::MAX_STEP_NAME_LEN {
            return bad(format!(
                "{key_name:?} (group:step) has {} characters; at most {} (it ends the branch's key)",
                key_name.len(),
                super::record::MAX_STEP_NAME_LEN
            ));
        }
        Ok(())
    }
}

/// Checks a step's `for_each`: a connector performs it (idem runs each item), it is no
/// branch of a group, its list comes from the input or an earlier step's result, its `id`
/// is a JSON pointer.
fn check_for_each(step: &StepDef, fe: &ForEachDef, before: &[StepDef], field: &str) -> Result<(), DefinitionError> {
    let bad = |name: &str, message: String| Err(DefinitionError { field: format!("{field}.{name}"), message });
    if step.connector.is_none() {
        return bad("items", "a step for each item is performed by idem: give it a connector".into());
    }
    if step.group.is_some() {
        return bad(
            "items",
            "a step for each item cannot also be a branch of a group: make it a step of its own".into(),
        );
    }
    if !(fe.items.starts_with("/input") || fe.items.starts_with("/steps/")) {
        return bad("items", format!("{:?}: the list comes from /input/... or /steps/NAME/result/...", fe.items));
    }
    check_references(&serde_json::json!({"from": fe.items}), before, None, false, &format!("{field}.items"))?;
    if !fe.id.starts_with('/') {
        return bad("id", format!("{:?}: the identity is a JSON pointer into the item, such as \"/id\"", fe.id));
    }
    if fe.max_concurrency == Some(0) {
        return bad("max_concurrency", "at least 1 item must be able to run (leave it out for all at once)".into());
    }
    Ok(())
}

/// Checks that every `from` pointer of `template` names something that will exist when the
/// step runs: the instance input, the instance's own fields, or an earlier step's result or
/// provider reference (or, for a compensation, its own step's).
fn check_references(
    template: &Value,
    earlier: &[StepDef],
    own: Option<&str>,
    item: bool,
    field: &str,
) -> Result<(), DefinitionError> {
    for (at, pointer) in references(template).map_err(|message| DefinitionError { field: field.into(), message })? {
        let bad = |message: String| DefinitionError { field: format!("{field}{at}"), message };
        let mut parts = pointer.split('/').skip(1);
        match parts.next() {
            Some("input") => {}
            Some("item") if item => {}
            Some("instance") => match parts.next() {
                Some("id" | "workflow" | "source_event") if parts.next().is_none() => {}
                _ => return Err(bad(format!("{pointer:?}: /instance has id, workflow and source_event"))),
            },
            Some("steps") => {
                let step = parts.next().unwrap_or_default();
                if !(earlier.iter().any(|s| s.name == step) || own == Some(step)) {
                    return Err(bad(format!("{pointer:?} names step {step:?}, which does not run before this one")));
                }
                match parts.next() {
                    Some("result") => {}
                    Some("provider_ref") if parts.next().is_none() => {}
                    _ => {
                        return Err(bad(format!(
                            "{pointer:?}: a step offers /steps/NAME/result/... and /steps/NAME/provider_ref"
                        )));
                    }
                }
            }
            _ => {
                return Err(bad(format!(
                    "{pointer:?} must start with /input, /instance or /steps (or /item, in a step for each item) (a JSON pointer, RFC 6901)"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(crate) fn three_steps() -> Definition {
        serde_json::from_value(json!({
            "name": "order-intake",
            "steps": [
                {"name": "create_order", "action": "create_order", "connector": "erp", "policy": "lookup_before_redo",
                 "input": {"customer": {"from": "/input/customer"}, "amount": {"from": "/input/amount"}}},
                {"name": "send_confirmation", "action": "send_confirmation", "connector": "mail", "policy": "manual",
                 "input": {"order_id": {"from": "/steps/create_order/result/id"}}},
                {"name": "write_back", "action": "write_back", "connector": "crm", "policy": "redo_safe",
                 "input": {"order": {"from": "/steps/create_order/provider_ref"}, "instance": {"from": "/instance/id"}}}
            ]
        }))
        .unwrap()
    }

    fn caps(name: &str) -> Option<ConnectorCaps> {
        match name {
            "erp" => Some(ConnectorCaps { has_lookup: true }),
            "mail" | "crm" => Some(ConnectorCaps { has_lookup: false }),
            _ => None,
        }
    }

    #[test]
    fn a_good_definition_validates_and_has_a_stable_version() {
        let d = three_steps();
        d.validate("workflows.order-intake", &caps).unwrap();
        assert_eq!(d.version(), three_steps().version());
        assert_eq!(d.version().len(), 64);
        let mut changed = three_steps();
        changed.steps[2].policy = RecoveryPolicy::Manual;
        assert_ne!(changed.version(), d.version(), "any change is a new version");
    }

    #[test]
    fn each_error_names_its_field() {
        let check = |edit: &dyn Fn(&mut Definition), field: &str| {
            let mut d = three_steps();
            edit(&mut d);
            let e = d.validate("workflows.w", &caps).unwrap_err();
            assert_eq!(e.field, field, "{e}");
        };
        check(&|d| d.steps[1].name = "create_order".into(), "workflows.w.steps[1].name");
        check(&|d| d.steps[1].name = "has:colon".into(), "workflows.w.steps[1].name");
        check(&|d| d.steps[0].connector = Some("nope".into()), "workflows.w.steps[0].connector");
        check(&|d| d.steps[1].policy = RecoveryPolicy::LookupBeforeRedo, "workflows.w.steps[1].policy");
        check(&|d| d.steps[1].policy = RecoveryPolicy::Compensate, "workflows.w.steps[1].policy");
        check(&|d| d.steps[0].action = String::new(), "workflows.w.steps[0].action");
        check(
            &|d| d.steps[0].input = json!({"x": {"from": "/steps/write_back/result"}}),
            "workflows.w.steps[0].input/x",
        );
        check(&|d| d.steps[1].input = json!({"from": "/nowhere"}), "workflows.w.steps[1].input");
        check(&|d| d.steps[1].connector = None, "workflows.w.steps[1].input");
        check(&|d| d.steps.clear(), "workflows.w.steps");
        check(&|d| d.name = "bad name".into(), "workflows.w.name");
    }

    #[test]
    fn a_step_the_caller_performs_has_no_lookup_policy() {
        let mut d = three_steps();
        d.steps[0].connector = None;
        d.steps[0].input = Value::Null;
        let e = d.validate("w", &caps).unwrap_err();
        assert!(e.message.contains("cannot look up"), "{e}");
        d.steps[0].policy = RecoveryPolicy::Manual;
        d.validate("w", &caps).unwrap();
    }

    #[test]
    fn the_default_policy_depends_on_a_lookup() {
        assert_eq!(RecoveryPolicy::default_for(true), RecoveryPolicy::LookupBeforeRedo);
        assert_eq!(RecoveryPolicy::default_for(false), RecoveryPolicy::Manual);
    }
}
