//! What makes the served OpenAPI document a complete contract (issue 15 §2), applied to the
//! document utoipa generates from the handlers' annotations:
//!
//! - every operation answers with a unique `operationId` (generated clients name their
//!   functions after it);
//! - every status a route can answer is documented, also those that middleware and
//!   extractors answer for every route of a kind ([`COMMON`]): `400` for a malformed path
//!   or query, `401` without a valid API key, `408`/`413`/`415` for a body, `503` when the
//!   database does not answer or the node holds its in-flight body budget;
//! - every rule on a field that JSON Schema can state is stated ([`FIELD_RULES`],
//!   [`PARAMETER_RULES`]): ranges, lengths, patterns, enums — the same rules the handlers
//!   enforce, so a client generated from the document sends what the server accepts.
//!
//! It works on the document as JSON, so routes added later get the common statuses and a
//! unique `operationId` without a change here.

use serde_json::{Value, json};
use std::collections::BTreeSet;

/// A printable-ASCII idempotency key without surrounding spaces, 1-255 characters (the
/// key rules of `idem_core::key`; keys that hold personal data are refused on top).
const KEY_PATTERN: &str = "^[!-~]([ -~]{0,253}[!-~])?$";
/// The `Idempotency-Key` header (IETF httpapi Idempotency-Key draft §2.1: an RFC 8941
/// string): a key bare (without spaces, quotes or backslashes) or quoted.
const KEY_HEADER_PATTERN: &str = "^([!#-\\[\\]-~]{1,255}|\"[!#-\\[\\]-~]([ !#-\\[\\]-~]{0,253}[!#-\\[\\]-~])?\")$";
/// A workflow instance id (`idem_core::flow::validate_instance_id`: the key rules, no `/`).
const INSTANCE_PATTERN: &str = "^[!-.0-~]([ -.0-~]{0,190}[!-.0-~])?$";
/// A step name (`idem_core::flow::validate_step_name`).
const STEP_PATTERN: &str = "^[A-Za-z0-9_.-]{1,48}$";
/// Text without control characters (C0, DEL, C1) that is not blank: evidence, provider
/// references.
const NO_CONTROL_NOT_BLANK: &str =
    "^[^\\u0000-\\u001f\\u007f-\\u009f]*[^\\s\\u0000-\\u001f\\u007f-\\u009f][^\\u0000-\\u001f\\u007f-\\u009f]*$";
/// A lease holder: a UUID of version 1, 4, 6 or 7 with the RFC 9562 variant
/// (`idem_core::holder`; the age and key rules JSON Schema cannot state).
const HOLDER_PATTERN: &str =
    "^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[1467][0-9A-Fa-f]{3}-[89ABab][0-9A-Fa-f]{3}-[0-9A-Fa-f]{12}$";

/// (schema, property, rules merged into the property's schema).
fn field_rules() -> Vec<(&'static str, &'static str, Value)> {
    // An operator's reason: 1-2000 bytes, not blank, no NUL.
    let reason = json!({"minLength": 1, "maxLength": 2000, "pattern": "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"});
    let lease = json!({"minimum": 100, "maximum": 3_600_000});
    vec![
        ("AcquireBody", "key", json!({"pattern": KEY_PATTERN, "minLength": 1, "maxLength": 255})),
        ("AcquireBody", "action", json!({"pattern": "^[A-Za-z0-9_.:-]{1,128}$"})),
        ("AcquireBody", "lease_ms", lease.clone()),
        ("AcquireBody", "wait_ms", json!({"minimum": 0, "maximum": 30_000})),
        ("AcquireBody", "holder", json!({"pattern": HOLDER_PATTERN})),
        (
            "AcquireBody",
            "fingerprint_fields",
            json!({"minItems": 1, "uniqueItems": true, "items": {"type": "string", "pattern": "^(/[^/]*)*$"}}),
        ),
        ("RenewBody", "lease_ms", lease.clone()),
        ("StepAcquireBody", "lease_ms", lease),
        ("StepAcquireBody", "holder", json!({"pattern": HOLDER_PATTERN})),
        (
            "StepAcquireBody",
            "fingerprint_fields",
            json!({"minItems": 1, "uniqueItems": true, "items": {"type": "string", "pattern": "^(/[^/]*)*$"}}),
        ),
        ("NewKeyBody", "role", json!({"enum": ["client", "operator", "admin"]})),
        (
            "NewKeyBody",
            "principal",
            json!({"pattern": "^[A-Za-z0-9._-]{1,64}$", "not": {"enum": ["system", "executor"]}}),
        ),
        ("ResolveBody", "to", json!({"enum": ["SUCCEEDED", "PENDING", "FAILED"]})),
        ("ResolveBody", "reason", reason.clone()),
        ("ResolveBody", "evidence", json!({"minLength": 1, "maxLength": 512, "pattern": NO_CONTROL_NOT_BLANK})),
        ("CompensateBody", "reason", reason.clone()),
        ("RerunBody", "reason", reason.clone()),
        (
            "ResolveBody",
            "expected_state",
            json!({"enum": ["PENDING", "EXECUTING", "SUCCEEDED", "FAILED", "UNKNOWN", null]}),
        ),
        ("StartBody", "instance_id", json!({"pattern": INSTANCE_PATTERN})),
        ("StartBody", "workflow", json!({"pattern": "^[A-Za-z0-9_.-]{1,64}$"})),
        ("StartBody", "trace_id", json!({"pattern": "^[A-Za-z0-9._:-]{1,128}$"})),
        ("StartBody", "source_event", json!({"pattern": "^[^\\s\\u0000-\\u001f\\u007f-\\u009f]{1,255}$"})),
        ("StartBody", "steps", json!({"minItems": 1, "maxItems": 64})),
        ("StepDeclBody", "name", json!({"pattern": STEP_PATTERN})),
        ("StepDeclBody", "group", json!({"pattern": STEP_PATTERN})),
        ("StepDeclBody", "action", json!({"pattern": "^[A-Za-z0-9_.:-]{1,128}$"})),
        // Steps declared in the request are performed by the caller's code: idem cannot
        // look them up, and a request cannot give a compensation.
        ("StepDeclBody", "policy", json!({"enum": ["manual", "redo_safe", null]})),
        ("StartBody", "groups", json!({"maxItems": 64})),
        ("GroupDeclBody", "name", json!({"pattern": STEP_PATTERN})),
        ("GroupDeclBody", "on_failure", json!({"enum": ["pause", "compensate", null]})),
        // idem_core::flow::definition::MAX_STEPS: more could never be in flight.
        ("GroupDeclBody", "max_concurrency", json!({"minimum": 1, "maximum": 64})),
        ("CompleteBody", "outcome", json!({"enum": ["succeeded", "retryable_failure", "final_failure", "unknown"]})),
        ("CompleteBody", "error_class", json!({"pattern": "^[A-Za-z0-9_.-]{1,64}$"})),
        ("CompleteBody", "retry_after_ms", json!({"minimum": 0, "maximum": 86_400_000})),
    ]
}

/// (schema, rules merged into the schema itself): rules across fields.
fn schema_rules() -> Vec<(&'static str, Value)> {
    let when = |outcome: &str, required: &[&str], absent: &[&str]| {
        let mut properties = serde_json::Map::new();
        for a in absent {
            properties.insert((*a).into(), json!({"type": "null"}));
        }
        for r in required {
            let rule = match *r {
                "provider_ref" => {
                    json!({"type": "string", "minLength": 1, "maxLength": 512, "pattern": NO_CONTROL_NOT_BLANK})
                }
                _ => json!({"type": "string", "minLength": 1}),
            };
            properties.insert((*r).into(), rule);
        }
        json!({"if": {"properties": {"outcome": {"const": outcome}}, "required": ["outcome"]},
               "then": {"required": required, "properties": properties}})
    };
    vec![
        // An operator's compensation, and a re-run that is not a dry run, need a reason
        // (400 missing-reason otherwise): it is audited with who asked.
        ("CompensateBody", json!({"required": ["reason"], "properties": {"reason": {"type": "string"}}})),
        (
            "RerunBody",
            json!({"if": {"not": {"properties": {"dry_run": {"const": true}}, "required": ["dry_run"]}},
                   "then": {"required": ["reason"], "properties": {"reason": {"type": "string"}}}}),
        ),
        (
            "ResolveBody",
            // SUCCEEDED needs evidence (DESIGN.md §2 invariant 2).
            json!({"if": {"properties": {"to": {"const": "SUCCEEDED"}}, "required": ["to"]},
                   "then": {"required": ["evidence"], "properties": {"evidence": {"type": "string"}}}}),
        ),
        (
            "CompleteBody",
            json!({"allOf": [
                when("succeeded", &["provider_ref"], &["error_class", "retry_after_ms", "message"]),
                when("retryable_failure", &["error_class"], &["provider_ref", "result"]),
                when("final_failure", &["error_class"], &["provider_ref", "retry_after_ms"]),
                when("unknown", &[], &["provider_ref", "result", "error_class", "retry_after_ms"]),
            ]}),
        ),
    ]
}

/// Members that hold a client's JSON (any value, I-JSON: no duplicate names, numbers a
/// double carries exactly within ±2^53), which utoipa can only call an object.
const CLIENT_JSON: &[&str] = &["payload", "result", "input"];

/// (schema, property) that utoipa marks required but may be left out (default `null`).
const OPTIONAL: &[(&str, &str)] = &[("AcquireBody", "payload"), ("StartBody", "input"), ("StepAcquireBody", "payload")];

/// (path, method, parameter, rules merged into its schema).
fn parameter_rules() -> Vec<(&'static str, &'static str, &'static str, Value)> {
    let states = json!({"enum": ["PENDING", "EXECUTING", "SUCCEEDED", "FAILED", "UNKNOWN"]});
    let instance_states = json!({"enum": ["RUNNING", "SUCCEEDED", "FAILED", "PAUSED", "COMPENSATING", "COMPENSATED"]});
    let page = json!({"minimum": 1, "maximum": 500});
    let instant = json!({"format": "date-time"});
    vec![
        ("/v1/operations", "get", "state", states),
        ("/v1/operations", "get", "limit", page.clone()),
        ("/v1/operations", "get", "created_after", instant.clone()),
        ("/v1/operations", "get", "created_before", instant.clone()),
        ("/v1/workflows", "get", "state", instance_states),
        ("/v1/workflows", "get", "limit", page),
        ("/v1/workflows", "get", "created_after", instant.clone()),
        ("/v1/workflows", "get", "created_before", instant),
    ]
}

/// Statuses documented on every operation of a kind: (when it applies, status, what).
struct Common {
    applies: fn(&Value) -> bool,
    status: &'static str,
    description: &'static str,
}

const COMMON: &[Common] = &[
    Common {
        applies: has_body,
        status: "400",
        description: "Malformed body (not JSON, unknown fields, a value out of range or of the wrong type)",
    },
    Common {
        applies: has_body,
        status: "408",
        description: "The body did not arrive within `--body-read-timeout-ms` (`request-timeout`); the connection is closed",
    },
    Common {
        applies: has_body,
        status: "413",
        description: "The body is larger than `--max-body-bytes` (`payload-too-large`)",
    },
    Common {
        applies: has_body,
        status: "415",
        description: "The body is not sent as `Content-Type: application/json` (`unsupported-media-type`)",
    },
    Common {
        applies: has_path_or_query_parameters,
        status: "400",
        description: "A malformed path segment or query parameter (`invalid-request`, `invalid-idempotency-key`)",
    },
    Common {
        applies: has_path_parameters,
        status: "404",
        description: "Nothing with this id in the caller's tenant (`not-found`)",
    },
    Common { applies: is_authenticated, status: "401", description: "Missing or invalid API key (`unauthorized`)" },
    Common {
        applies: is_authenticated,
        status: "503",
        description: "The database did not answer (`unavailable`), this node cannot make writes durable and must be restarted (`not-durable`), or this node holds its limit of request bodies in flight (`overloaded`); header `Retry-After`",
    },
    Common {
        applies: has_body,
        status: "503",
        description: "This node holds its limit of request bodies in flight (`overloaded`), the database did not answer (`unavailable`), or this node cannot make writes durable and must be restarted (`not-durable`); header `Retry-After`",
    },
];

fn has_body(op: &Value) -> bool {
    op.get("requestBody").is_some()
}

fn parameters_in(op: &Value, place: &str) -> bool {
    op["parameters"].as_array().is_some_and(|ps| ps.iter().any(|p| p["in"] == place))
}

fn has_path_parameters(op: &Value) -> bool {
    parameters_in(op, "path")
}

fn has_path_or_query_parameters(op: &Value) -> bool {
    parameters_in(op, "path") || parameters_in(op, "query")
}

fn is_authenticated(op: &Value) -> bool {
    op["security"].as_array().is_some_and(|s| !s.is_empty())
}

/// The `operationId` of each route: (path, method, id). A generated client's function
/// names; routes not listed keep utoipa's (the handler's name) unless it is taken.
const OPERATION_IDS: &[(&str, &str, &str)] = &[
    ("/v1/operations", "post", "acquire_operation"),
    ("/v1/operations", "get", "list_operations"),
    ("/v1/operations/{key}", "get", "get_operation"),
    ("/v1/operations/{key}/complete", "post", "complete_operation"),
    ("/v1/operations/{key}/renew", "post", "renew_lease"),
    ("/v1/operations/{key}/resolve", "post", "resolve_operation"),
    ("/v1/operations/{key}/reconcile", "post", "reconcile_operation"),
    ("/v1/workflows", "post", "start_workflow"),
    ("/v1/workflows", "get", "list_workflows"),
    ("/v1/workflows/{instance}", "get", "get_workflow"),
    ("/v1/workflows/{instance}/steps/{step}", "post", "acquire_step"),
    ("/v1/workflows/{instance}/steps/{step}/complete", "post", "complete_step"),
    ("/v1/keys", "post", "create_key"),
    ("/v1/keys", "get", "list_keys"),
    ("/v1/keys/{id}", "delete", "revoke_key"),
    ("/metrics", "get", "metrics"),
    ("/openapi.json", "get", "openapi_document"),
    ("/problems/{slug}", "get", "describe_problem"),
];

/// Completes `doc` (the utoipa document as JSON) as the module docs say; `connectors` are
/// the names a request's `connector` may take on this node.
pub fn complete(mut doc: Value, connectors: &[String]) -> Value {
    let mut names: Vec<Value> = connectors.iter().map(|c| Value::String(c.clone())).collect();
    names.push(Value::Null);
    if let Some(p) = doc.pointer_mut("/components/schemas/AcquireBody/properties/connector") {
        merge(p, &json!({"enum": names}));
    }
    for (path, method, id) in OPERATION_IDS {
        if let Some(op) = doc.pointer_mut(&format!("/paths/{}/{method}", path.replace('~', "~0").replace('/', "~1")))
            && let Some(op) = op.as_object_mut()
        {
            op.insert("operationId".into(), Value::String((*id).into()));
        }
    }
    for (schema, property, rules) in field_rules() {
        if let Some(p) = doc.pointer_mut(&format!("/components/schemas/{schema}/properties/{property}")) {
            merge(p, &rules);
        }
    }
    if let Some(schemas) = doc.pointer_mut("/components/schemas").and_then(Value::as_object_mut) {
        for schema in schemas.values_mut() {
            for name in CLIENT_JSON {
                if let Some(p) = schema.pointer_mut(&format!("/properties/{name}")).and_then(Value::as_object_mut) {
                    // Any JSON value.
                    p.remove("type");
                }
            }
        }
    }
    for (schema, property) in OPTIONAL {
        if let Some(required) =
            doc.pointer_mut(&format!("/components/schemas/{schema}/required")).and_then(Value::as_array_mut)
        {
            required.retain(|r| r != property);
        }
    }
    for (schema, rules) in schema_rules() {
        if let Some(s) = doc.pointer_mut(&format!("/components/schemas/{schema}")) {
            merge(s, &rules);
        }
    }
    if let Some(paths) = doc["paths"].as_object_mut() {
        for (path, item) in paths.iter_mut() {
            let Some(item) = item.as_object_mut() else { continue };
            for (method, op) in item.iter_mut() {
                for (p, m, name, rules) in parameter_rules() {
                    if p == path && m == method {
                        for param in op.get_mut("parameters").and_then(Value::as_array_mut).into_iter().flatten() {
                            if param["name"] == name {
                                merge(&mut param["schema"], &rules);
                            }
                        }
                    }
                }
                for param in op.get_mut("parameters").and_then(Value::as_array_mut).into_iter().flatten() {
                    if param["in"] == "path" && param["name"] == "key" {
                        merge(&mut param["schema"], &json!({"pattern": KEY_PATTERN, "minLength": 1, "maxLength": 255}));
                    }
                    // Only ids a start could have stored name an instance or a step; any
                    // other (a control character, padding) is 400 before a query.
                    if param["in"] == "path" && param["name"] == "instance" {
                        merge(&mut param["schema"], &json!({"pattern": INSTANCE_PATTERN}));
                    }
                    if param["in"] == "path" && param["name"] == "step" {
                        merge(&mut param["schema"], &json!({"pattern": STEP_PATTERN}));
                    }
                    if param["in"] == "header" && param["name"] == "Idempotency-Key" {
                        merge(&mut param["schema"], &json!({"pattern": KEY_HEADER_PATTERN}));
                    }
                }
                for c in COMMON {
                    if (c.applies)(op) {
                        let Some(responses) = op.get_mut("responses").and_then(Value::as_object_mut) else { continue };
                        responses.entry(c.status).or_insert_with(|| problem_response(c.description));
                    }
                }
            }
        }
    }
    unique_operation_ids(&mut doc);
    doc
}

fn problem_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    })
}

/// Merges `rules` into `schema` (objects member by member, anything else replaced).
fn merge(schema: &mut Value, rules: &Value) {
    match (schema, rules) {
        (Value::Object(s), Value::Object(r)) => {
            for (k, v) in r {
                merge(s.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (s, r) => *s = r.clone(),
    }
}

/// Gives every operation whose `operationId` is missing or taken one made of its method and
/// path (`get_v1_outbox_events`), so the document stays valid when routes are added.
fn unique_operation_ids(doc: &mut Value) {
    let mut seen = BTreeSet::new();
    let Some(paths) = doc["paths"].as_object_mut() else { return };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else { continue };
        for (method, op) in item.iter_mut() {
            let Some(op) = op.as_object_mut() else { continue };
            let current = op.get("operationId").and_then(Value::as_str).map(str::to_owned);
            let id = match current {
                Some(id) if !seen.contains(&id) => id,
                _ => {
                    let slug: String = path
                        .chars()
                        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                        .collect::<String>()
                        .split('_')
                        .filter(|s| !s.is_empty())
                        .collect::<Vec<_>>()
                        .join("_");
                    format!("{method}_{slug}")
                }
            };
            seen.insert(id.clone());
            op.insert("operationId".into(), Value::String(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taken_operation_ids_are_replaced_by_method_and_path() {
        let doc = json!({"paths": {
            "/v1/a": {"get": {"operationId": "list", "responses": {}}},
            "/v1/b/{id}": {"get": {"operationId": "list", "responses": {}}, "delete": {"responses": {}}},
        }});
        let doc = complete(doc, &[]);
        assert_eq!(doc["paths"]["/v1/a"]["get"]["operationId"], "list");
        assert_eq!(doc["paths"]["/v1/b/{id}"]["get"]["operationId"], "get_v1_b_id");
        assert_eq!(doc["paths"]["/v1/b/{id}"]["delete"]["operationId"], "delete_v1_b_id");
    }
}
