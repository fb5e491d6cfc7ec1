//! Starting an instance: idempotent by instance id and input (DESIGN.md §8).
//!
//! A declared workflow (`[workflows.NAME]`) pins the configured definition; a workflow your
//! code runs brings its steps in the request, and those steps are its definition. Either
//! way the instance keeps the version it started with: a repeated start with the same
//! input is the same instance (its state is returned), another input is refused (422), and
//! a start after the instance finished and was removed is a late arrival (410).

use crate::{FlowError, Flows};
use idem_core::Actor;
use idem_core::flow::{
    Definition, GroupDef, GroupFailure, RecoveryPolicy, StartDecision, StartInput, StepDef, validate_instance_id,
    validate_workflow_name,
};
use idem_store::flow::{StartOutcome, StartRequest};
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// Longest source event id, in bytes.
pub const MAX_SOURCE_EVENT_LEN: usize = 255;
/// Longest trace id, in bytes.
pub const MAX_TRACE_ID_LEN: usize = 128;

/// One step of a workflow your code runs, as a start request declares it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepDecl {
    /// Step name (`[A-Za-z0-9_.-]`, 1–48 characters, unique).
    pub name: String,
    /// Action of its operation (default: the name).
    #[serde(default)]
    pub action: Option<String>,
    /// `manual` (default: an UNKNOWN outcome waits for a person) or `redo_safe` (an
    /// expired lease is granted to the next worker).
    #[serde(default)]
    pub policy: Option<RecoveryPolicy>,
    /// The parallel group the step is a branch of: consecutive steps naming the same group
    /// may be acquired at once, and the step after them only once all SUCCEEDED. Its key is
    /// `{instance}:{group}:{step}`.
    #[serde(default)]
    pub group: Option<String>,
}

/// A start, as the API (or a library caller) sends it.
#[derive(Debug, Clone)]
pub struct StartCall {
    /// Tenant of the caller.
    pub tenant: String,
    /// Stable business id of the instance (`ORD-7:intake`).
    pub instance_id: String,
    /// Workflow name.
    pub workflow: String,
    /// The input (already parsed with the payload rules: no duplicate members, exact
    /// numbers).
    pub input: Value,
    /// The event the instance comes from (a webhook's event id), if any.
    pub source_event: Option<String>,
    /// Correlation / trace id, if any.
    pub trace_id: Option<String>,
    /// The steps of a workflow your code runs; `None` for a declared workflow.
    pub steps: Option<Vec<StepDecl>>,
    /// Settings of the parallel groups its steps name (`on_failure`, `max_concurrency`),
    /// validated as `[[workflows.NAME.groups]]` are; only with `steps`.
    pub groups: Option<Vec<GroupDef>>,
    /// Who starts it.
    pub actor: Actor,
}

/// Checks an optional text field: 1–`max` bytes of characters `ok` accepts (`allowed`
/// says which, for the message).
fn check_text(name: &str, v: Option<&str>, max: usize, allowed: &str, ok: fn(char) -> bool) -> Result<(), FlowError> {
    match v {
        Some(t) if t.is_empty() || t.len() > max || !t.chars().all(ok) => {
            Err(FlowError::Invalid(format!("{name} must be 1-{max} characters of {allowed}")))
        }
        _ => Ok(()),
    }
}

/// `def` (validated) without group settings that say what the defaults say, the others in
/// the order their groups' first branches come.
fn normalized(mut def: Definition) -> Definition {
    let Definition { steps, groups, .. } = &mut def;
    groups.retain(|g| g.on_failure != GroupFailure::default() || g.max_concurrency.is_some());
    groups.sort_by_key(|g| steps.iter().position(|s| s.group.as_deref() == Some(g.name.as_str())));
    def
}

impl Flows {
    /// The definition a start runs: the declared one, or the caller's steps with its group
    /// settings (`groups`, only with `steps`).
    ///
    /// The caller's definition is the instance's intent (its version is pinned, and a start
    /// again with another one is refused), so group settings that say what the defaults say
    /// are left out and the rest kept in the order their groups run: settings written
    /// differently with one meaning make one definition.
    ///
    /// # Errors
    /// [`FlowError::UnknownWorkflow`], [`FlowError::DeclaredWorkflow`],
    /// [`FlowError::Definition`] (its field named as in the request body: `steps[2].group`,
    /// `groups[0].max_concurrency`), [`FlowError::Invalid`].
    pub fn definition_for(
        &self,
        workflow: &str,
        steps: Option<&[StepDecl]>,
        groups: Option<&[GroupDef]>,
    ) -> Result<Arc<Definition>, FlowError> {
        validate_workflow_name(workflow).map_err(FlowError::Invalid)?;
        match (self.declared.get(workflow), steps) {
            (Some(_), _) if groups.is_some() => Err(FlowError::DeclaredWorkflow(workflow.to_owned())),
            (Some(d), None) => Ok(d.clone()),
            (Some(_), Some(_)) => Err(FlowError::DeclaredWorkflow(workflow.to_owned())),
            (None, None) if groups.is_some() => Err(FlowError::Invalid(
                "groups sets the parallel groups of the steps your code runs: send it with \"steps\"".into(),
            )),
            (None, None) => Err(FlowError::UnknownWorkflow(workflow.to_owned())),
            (None, Some(steps)) => {
                let def = Definition {
                    name: workflow.to_owned(),
                    steps: steps
                        .iter()
                        .map(|s| StepDef {
                            name: s.name.clone(),
                            action: s.action.clone().unwrap_or_else(|| s.name.clone()),
                            connector: None,
                            policy: s.policy.unwrap_or(RecoveryPolicy::Manual),
                            input: Value::Null,
                            compensation: None,
                            group: s.group.clone(),
                            for_each: None,
                        })
                        .collect(),
                    groups: groups.map(<[GroupDef]>::to_vec).unwrap_or_default(),
                };
                // Steps a caller gives never name connectors: nothing to look up.
                def.validate("body", &|_| None).map_err(|mut e| {
                    e.field = e.field.replacen("body.", "", 1);
                    FlowError::Definition(e)
                })?;
                Ok(Arc::new(normalized(def)))
            }
        }
    }

    /// Starts (or finds) an instance. A new instance of a workflow whose steps idem
    /// performs ([`Flows::performs_steps`]) is held for the runner's hold, for the
    /// caller's own first pass ([`Flows::advance_started`] or
    /// [`Flows::advance_started_in_background`]), which must follow; any other new
    /// instance is due at once for the runner.
    ///
    /// # Errors
    /// A [`FlowError`] for a bad request (nothing is written then) or a store failure.
    pub async fn start(&self, call: StartCall) -> Result<StartOutcome, FlowError> {
        validate_instance_id(&call.instance_id).map_err(FlowError::Invalid)?;
        let visible = "text without spaces or control characters";
        check_text("source_event", call.source_event.as_deref(), MAX_SOURCE_EVENT_LEN, visible, |c| {
            !c.is_control() && !c.is_whitespace()
        })?;
        check_text("trace_id", call.trace_id.as_deref(), MAX_TRACE_ID_LEN, "[A-Za-z0-9._:-]", |c| {
            c.is_ascii_alphanumeric() || "._:-".contains(c)
        })?;
        let definition = self.definition_for(&call.workflow, call.steps.as_deref(), call.groups.as_deref())?;
        if let Some(scope) = self.tenants.get(&call.workflow).filter(|t| !t.allows(&call.tenant)) {
            return Err(FlowError::WorkflowNotAllowed {
                workflow: call.workflow,
                tenant: call.tenant,
                tenants: scope.describe(),
            });
        }
        let input_fingerprint =
            idem_core::fingerprint(&call.input, None).map_err(|e| FlowError::Invalid(e.to_string()))?.0;
        let definition_version = match (&call.steps, self.versions.get(&call.workflow)) {
            (None, Some(version)) => version.clone(),
            _ => definition.version(),
        };
        let hold_ms = match self.performs_steps(&call.workflow) {
            true => self.start_hold_ms.load(std::sync::atomic::Ordering::Relaxed),
            false => 0,
        };
        let input = StartInput {
            tenant: call.tenant,
            instance_id: call.instance_id,
            workflow: call.workflow,
            definition_version,
            definition_given: call.steps.is_some(),
            source_event: call.source_event,
            input: call.input,
            input_fingerprint,
            hold_ms,
            trace_id: call.trace_id,
            actor: call.actor,
        };
        let out = self.store.flows().start_instance(StartRequest { input, definition: (*definition).clone() }).await?;
        if out.decision == StartDecision::Created {
            metrics::counter!("idem_workflows_started_total").increment(1);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn def(groups: Value) -> Definition {
        serde_json::from_value(json!({
            "name": "driven",
            "steps": [
                {"name": "a", "action": "a", "policy": "manual", "group": "first"},
                {"name": "b", "action": "b", "policy": "manual", "group": "second"}
            ],
            "groups": groups
        }))
        .unwrap()
    }

    /// Settings written differently with one meaning make one definition (one version):
    /// the defaults written out are none, and the order is the groups'.
    #[test]
    fn settings_with_one_meaning_make_one_definition() {
        let plain = normalized(def(json!([])));
        let defaults = normalized(def(json!([{"name": "first", "on_failure": "pause"}, {"name": "second"}])));
        assert_eq!(defaults.version(), plain.version());
        let set = |order: Value| normalized(def(order)).version();
        let one = json!([{"name": "first", "max_concurrency": 1}, {"name": "second", "on_failure": "compensate"}]);
        let other = json!([{"name": "second", "on_failure": "compensate"}, {"name": "first", "max_concurrency": 1}]);
        assert_eq!(set(one.clone()), set(other));
        assert_ne!(set(one), plain.version(), "settings that differ from the defaults are kept");
        let two = json!([{"name": "first", "max_concurrency": 2}, {"name": "second", "on_failure": "compensate"}]);
        assert_ne!(
            set(two),
            set(json!([{"name": "first", "max_concurrency": 1}, {"name": "second", "on_failure": "compensate"}]))
        );
    }
}
