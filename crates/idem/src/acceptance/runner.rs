//! `idem scenarios run FILE`: executes an acceptance matrix against a running idem and the
//! provider double (`idem scenarios provider`), and prints, per scenario, what was
//! expected, what happened, the evidence, and PASS / FAIL / SKIP.
//!
//! File format (TOML; `scenarios/acceptance.toml` encodes S1–S8, C1–C2 of the retry
//! scenarios, and S4b: an error answer after the provider acted):
//!
//! ```toml
//! connector = "orders"                 # the idem connector that points at the provider
//!
//! [[scenario]]
//! id = "S6"
//! title = "explicit retryable failure"
//! key = "INQ-006:confirmation:v1"
//! provider = ["503:1", "503", "ok"]    # provider steps for this key (see the provider)
//! triggers = [ { wait_ms = 1000, expect_status = [202] } ]
//! expect = { state = "SUCCEEDED", effects = 1, calls = 3 }
//! ```
//!
//! A scenario may set its `action` (default `acceptance`; e.g. one with a short retention
//! in the server's config). A trigger may name another `key` (and its own `provider` steps
//! come from `[scenario.providers]`), a `payload` (default `{"to": "customer-42"}`),
//! `wait_ms` (default 5000), `delay_ms` (wait before it), `copies` (concurrent identical
//! triggers, default 1), `created` (how many of the copies must get 201; for these connector operations
//! never one: a trigger that gets 201 fails the scenario) and `performed` (how many must get `200` with
//! `Idem-Performed-By: connector`, idem's attempt during that request). `expect` checks the final state of the
//! scenario's key (waited for up to `timeout_s`, default 20), and the provider's counts of
//! calls and side effects over all the scenario's keys. `skip = "why"` reports SKIP.
//! Every key gets a run suffix, so runs against the same idem never see each other.
//!
//! A workflow scenario (W1…) names a `workflow` declared in idem's configuration instead
//! of triggers: its `starts` start instance `key` (with an `input`, default
//! `{"customer": "C-1"}`; `copies`, `created`, `expect_status`, `delay_ms` as for
//! triggers), `providers` scripts the provider per *step name* (`create_order`, or
//! `create_order:compensate` for its compensation), and `expect.state` is the instance's
//! final state; calls and effects are counted over the instance's steps (branches and
//! the items of a step for each item included) and their
//! compensations.
//!
//! ```toml
//! [[scenario]]
//! id = "W2"
//! title = "a step's reply is lost: the lookup finds it, the workflow goes on"
//! workflow = "acceptance-intake"
//! key = "ORD-W2"
//! providers = { confirm = ["effect_then_hang"] }
//! starts = [ { expect_status = [201] } ]
//! expect = { state = "SUCCEEDED", effects = 3, calls = 3 }
//! ```

use anyhow::{Context, bail};
use reqwest::Url;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A scenario file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// The connector idem uses to reach the provider.
    pub connector: String,
    /// The scenarios, in order.
    pub scenario: Vec<Scenario>,
}

/// One row of the matrix.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Short id (`S1`).
    pub id: String,
    /// What it shows.
    pub title: String,
    /// The operation key.
    #[serde(default = "default_key")]
    pub key: String,
    /// Provider steps for `key`.
    #[serde(default)]
    pub provider: Vec<String>,
    /// Provider steps for other keys the triggers use.
    #[serde(default)]
    pub providers: BTreeMap<String, Vec<String>>,
    /// The triggers, in order.
    #[serde(default)]
    pub triggers: Vec<Trigger>,
    /// The action of its triggers (default `acceptance`).
    #[serde(default = "default_action")]
    pub action: String,
    /// What must hold afterwards.
    #[serde(default)]
    pub expect: Expect,
    /// Report SKIP with this reason instead of running.
    pub skip: Option<String>,
    /// A workflow scenario: the declared workflow whose instance `key` is started.
    pub workflow: Option<String>,
    /// The starts of a workflow scenario, in order.
    #[serde(default)]
    pub starts: Vec<Start>,
}

/// One start of a workflow instance (or `copies` concurrent identical ones).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    /// The input (default `{"customer": "C-1"}`).
    pub input: Option<Value>,
    /// Concurrent identical starts (default 1).
    #[serde(default = "one")]
    pub copies: usize,
    /// Statuses each answer may have.
    pub expect_status: Vec<u16>,
    /// How many of the copies must get 201.
    pub created: Option<usize>,
    /// Wait this long before starting (ms).
    #[serde(default)]
    pub delay_ms: u64,
}

fn default_key() -> String {
    "scenario".into()
}

fn default_action() -> String {
    "acceptance".into()
}

/// One trigger (or `copies` concurrent identical ones).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trigger {
    /// Another key than the scenario's.
    pub key: Option<String>,
    /// The payload (default `{"to": "customer-42"}`).
    pub payload: Option<Value>,
    /// `wait_ms` of the request (default 5000).
    pub wait_ms: Option<u64>,
    /// Concurrent identical triggers (default 1).
    #[serde(default = "one")]
    pub copies: usize,
    /// Statuses each answer may have.
    pub expect_status: Vec<u16>,
    /// How many of the copies must get 201.
    pub created: Option<usize>,
    /// How many of the copies must get idem's own outcome: `200` with
    /// `Idem-Performed-By: connector` (the connector performed it during that request).
    pub performed: Option<usize>,
    /// Wait this long before triggering (ms).
    #[serde(default)]
    pub delay_ms: u64,
}

fn one() -> usize {
    1
}

/// Final expectations.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Final state of the scenario's key.
    pub state: Option<String>,
    /// Side effects the provider saw, over all the scenario's keys.
    pub effects: Option<usize>,
    /// Calls the provider got, over all the scenario's keys.
    pub calls: Option<u64>,
    /// `evidence_source` of the final record.
    pub evidence_source: Option<String>,
    /// How long to wait for `state` (s, default 20).
    pub timeout_s: Option<u64>,
}

/// Where to run.
#[derive(Debug, Clone)]
pub struct Target {
    /// idem's base URL.
    pub server: Url,
    /// An API key of idem.
    pub api_key: String,
    /// The provider double's base URL.
    pub provider: Url,
}

/// The outcome of one scenario.
#[derive(Debug, Clone)]
pub struct Row {
    /// Scenario id.
    pub id: String,
    /// Title.
    pub title: String,
    /// What was expected.
    pub expected: String,
    /// What happened.
    pub actual: String,
    /// The evidence idem kept.
    pub evidence: String,
    /// PASS, FAIL or SKIP.
    pub result: &'static str,
    /// HTTP statuses of every trigger it sent, in order.
    pub statuses: Vec<u16>,
    /// HTTP statuses of every workflow start it sent, in order.
    pub starts: Vec<u16>,
    /// Side effects idem has not recorded yet: made by a step whose outcome is UNKNOWN and
    /// waits for a person (no completion or lookup has recorded them).
    pub unrecorded: usize,
    /// Calls the provider got for its keys.
    pub calls: u64,
    /// Side effects the provider made for its keys.
    pub effects: usize,
}

struct Run {
    http: reqwest::Client,
    target: Target,
    connector: String,
    suffix: String,
}

impl Run {
    fn url(&self, base: &Url, segments: &[&str]) -> anyhow::Result<Url> {
        let mut u = base.clone();
        u.path_segments_mut()
            .map_err(|()| anyhow::anyhow!("{base} cannot be a base URL"))?
            .pop_if_empty()
            .extend(segments);
        Ok(u)
    }

    fn key(&self, key: &str) -> String {
        format!("{key}#{}", self.suffix)
    }

    async fn script(&self, key: &str, steps: &[String]) -> anyhow::Result<()> {
        self.script_raw(&self.key(key), steps).await
    }

    /// Scripts the provider for a full (already suffixed) operation key.
    async fn script_raw(&self, key: &str, steps: &[String]) -> anyhow::Result<()> {
        let url = self.url(&self.target.provider, &["_control", "script"])?;
        let r = self
            .http
            .post(url)
            .json(&json!({"key": key, "steps": steps}))
            .send()
            .await
            .context("cannot reach the provider")?;
        if !r.status().is_success() {
            bail!("the provider refused the script for {key}: {}", r.text().await.unwrap_or_default());
        }
        Ok(())
    }

    async fn stats(&self, key: &str) -> anyhow::Result<(u64, usize)> {
        self.stats_raw(&self.key(key)).await
    }

    /// POSTs `body` to idem at `segments`: the status, the JSON answer, and whether a
    /// connector performed the effect during the request (`Idem-Performed-By`).
    async fn post(&self, segments: &[&str], body: &Value) -> anyhow::Result<(u16, Value, bool)> {
        let url = self.url(&self.target.server, segments)?;
        let r = self
            .http
            .post(url)
            .bearer_auth(&self.target.api_key)
            .json(body)
            .send()
            .await
            .context("cannot reach idem")?;
        let status = r.status().as_u16();
        refuse_auth(status)?;
        let performed = r.headers().contains_key("idem-performed-by");
        Ok((status, r.json().await.unwrap_or(Value::Null), performed))
    }

    /// GETs idem's JSON at `segments`.
    async fn get(&self, segments: &[&str]) -> anyhow::Result<Value> {
        let url = self.url(&self.target.server, segments)?;
        let r = self.http.get(url).bearer_auth(&self.target.api_key).send().await.context("cannot reach idem")?;
        refuse_auth(r.status().as_u16())?;
        Ok(r.json().await?)
    }

    async fn trigger(
        &self,
        key: &str,
        action: &str,
        payload: &Value,
        wait_ms: u64,
    ) -> anyhow::Result<(u16, Value, bool)> {
        let body = json!({"key": self.key(key), "action": action, "connector": self.connector, "payload": payload, "wait_ms": wait_ms});
        self.post(&["v1", "operations"], &body).await
    }

    async fn record(&self, key: &str) -> anyhow::Result<Value> {
        self.get(&["v1", "operations", &self.key(key)]).await
    }

    async fn start(&self, s: &Scenario, workflow: &str, input: &Value) -> anyhow::Result<(u16, Value)> {
        let body = json!({"workflow": workflow, "instance_id": self.key(&s.key), "input": input});
        self.post(&["v1", "workflows"], &body).await.map(|(status, v, _)| (status, v))
    }

    async fn instance(&self, key: &str) -> anyhow::Result<Value> {
        self.get(&["v1", "workflows", &self.key(key)]).await
    }

    /// A workflow scenario: starts, then the instance's final state and its steps' counts.
    async fn workflow_scenario(&self, s: &Scenario, workflow: &str) -> anyhow::Result<Outcome> {
        for (step, steps) in &s.providers {
            self.script_raw(&format!("{}:{step}", self.key(&s.key)), steps).await?;
        }
        let (mut ok, mut statuses, mut all_statuses) = (true, Vec::new(), Vec::new());
        for t in &s.starts {
            let input = t.input.clone().unwrap_or_else(|| json!({"customer": "C-1"}));
            tokio::time::sleep(Duration::from_millis(t.delay_ms)).await;
            let answers = futures_util::future::join_all((0..t.copies).map(|_| self.start(s, workflow, &input))).await;
            let got = answers.into_iter().map(|a| a.map(|(s, _)| s)).collect::<anyhow::Result<Vec<u16>>>()?;
            all_statuses.extend(&got);
            ok &= got.iter().all(|s| t.expect_status.contains(s));
            if let Some(n) = t.created {
                ok &= got.iter().filter(|s| **s == 201).count() == n;
            }
            statuses.push(summarize(&got));
        }
        let timeout = Duration::from_secs(s.expect.timeout_s.unwrap_or(20));
        let start = Instant::now();
        let inst = loop {
            let v = self.instance(&s.key).await?;
            let reached = s.expect.state.as_deref().is_none_or(|want| v["state"] == want);
            if reached || start.elapsed() > timeout {
                break v;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (mut calls, mut effects, mut unrecorded) = (0, 0, 0);
        for step in inst["steps"].as_array().into_iter().flatten() {
            let key = step["operation_key"].as_str().unwrap_or_default();
            let (c, e) = self.stats_raw(key).await?;
            calls += c;
            effects += e;
            if step["state"] == "UNKNOWN" {
                unrecorded += e;
            }
            // Its compensation, which the provider sees as an effect of its own.
            let comp = step["compensation_key"].as_str().unwrap_or_default();
            let (c, e) = self.stats_raw(comp).await?;
            calls += c;
            effects += e;
            if step["compensation"]["state"] == "UNKNOWN" {
                unrecorded += e;
            }
            // A step for each item: each item's operation and its compensation's.
            for item in step["items"].as_array().into_iter().flatten() {
                let key = item["operation_key"].as_str().unwrap_or_default();
                for k in [key.to_owned(), format!("{key}:compensate")] {
                    let (c, e) = self.stats_raw(&k).await?;
                    calls += c;
                    effects += e;
                }
                if item["state"] == "UNKNOWN" {
                    unrecorded += self.stats_raw(key).await?.1;
                }
            }
        }
        let state = inst["state"].as_str().unwrap_or("-").to_owned();
        ok &= s.expect.state.as_deref().is_none_or(|w| w == state);
        ok &= s.expect.effects.is_none_or(|w| w == effects);
        ok &= s.expect.calls.is_none_or(|w| w == calls);
        let steps: Vec<String> = inst["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{} {}", c["step"].as_str().unwrap_or("-"), c["state"].as_str().unwrap_or("-")))
            .collect();
        let actual = format!("{state}; {effects} effect(s), {calls} call(s); starts {}", statuses.join(" then "));
        Ok(Outcome {
            actual,
            evidence: steps.join(", "),
            ok,
            statuses: Vec::new(),
            starts: all_statuses,
            unrecorded,
            calls,
            effects,
        })
    }

    /// Provider counts for a full (already suffixed) operation key.
    async fn stats_raw(&self, key: &str) -> anyhow::Result<(u64, usize)> {
        let mut url = self.url(&self.target.provider, &["_control", "stats"])?;
        url.query_pairs_mut().append_pair("key", key);
        let v: Value = self.http.get(url).send().await.context("cannot reach the provider")?.json().await?;
        Ok((v["calls"].as_u64().unwrap_or(0), v["effects"].as_u64().unwrap_or(0) as usize))
    }

    async fn scenario(&self, s: &Scenario) -> anyhow::Result<Outcome> {
        if let Some(w) = &s.workflow {
            return self.workflow_scenario(s, w).await;
        }
        let mut keys = vec![s.key.clone()];
        self.script(&s.key, &s.provider).await?;
        for (k, steps) in &s.providers {
            self.script(k, steps).await?;
            keys.push(k.clone());
        }
        let mut ok = true;
        let mut statuses = Vec::new();
        let mut all_statuses = Vec::new();
        for t in &s.triggers {
            let key = t.key.clone().unwrap_or_else(|| s.key.clone());
            if !keys.contains(&key) {
                keys.push(key.clone());
            }
            let payload = t.payload.clone().unwrap_or_else(|| json!({"to": "customer-42"}));
            let wait = t.wait_ms.unwrap_or(5_000);
            tokio::time::sleep(Duration::from_millis(t.delay_ms)).await;
            let answers = futures_join(self, &key, &s.action, &payload, wait, t.copies).await?;
            let got: Vec<u16> = answers.iter().map(|(s, _, _)| *s).collect();
            let performed = answers.iter().filter(|(_, _, p)| *p).count();
            all_statuses.extend(&got);
            ok &= got.iter().all(|s| t.expect_status.contains(s));
            if let Some(n) = t.created {
                ok &= got.iter().filter(|s| **s == 201).count() == n;
            }
            ok &= t.performed.is_none_or(|n| n == performed);
            // A connector op is never handed to the caller: a 201 there is the bug of
            // issue 28 (a caller following the table would perform it again).
            ok &= !got.contains(&201);
            statuses.push(summarize_performed(&got, performed));
        }
        let timeout = Duration::from_secs(s.expect.timeout_s.unwrap_or(20));
        let start = Instant::now();
        let record = loop {
            let r = self.record(&s.key).await?;
            let reached = s.expect.state.as_deref().is_none_or(|want| r["state"] == want);
            if reached || start.elapsed() > timeout {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (mut calls, mut effects) = (0, 0);
        for k in &keys {
            let (c, e) = self.stats(k).await?;
            calls += c;
            effects += e;
        }
        let state = record["state"].as_str().unwrap_or("-").to_owned();
        ok &= s.expect.state.as_deref().is_none_or(|w| w == state);
        ok &= s.expect.effects.is_none_or(|w| w == effects);
        ok &= s.expect.calls.is_none_or(|w| w == calls);
        ok &= s.expect.evidence_source.as_deref().is_none_or(|w| record["evidence_source"] == w);
        let actual = format!("{state}; {effects} effect(s), {calls} call(s); answers {}", statuses.join(" then "));
        let evidence = match (record["provider_ref"].as_str(), record["evidence_source"].as_str()) {
            (Some(r), Some(src)) => format!("{r} ({src})"),
            _ => match record["error"]["class"].as_str() {
                Some(c) => format!("error class {c}"),
                None => "-".into(),
            },
        };
        Ok(Outcome { actual, evidence, ok, statuses: all_statuses, starts: Vec::new(), unrecorded: 0, calls, effects })
    }
}

/// Stops the run at once when idem refuses the API key: no scenario can pass then.
fn refuse_auth(status: u16) -> anyhow::Result<()> {
    match status {
        401 => bail!("idem answered 401: the API key is unknown or revoked (--api-key / IDEM_API_KEY)"),
        403 => bail!("idem answered 403: the API key's role does not allow this"),
        _ => Ok(()),
    }
}

/// What one scenario's run showed.
struct Outcome {
    actual: String,
    evidence: String,
    ok: bool,
    statuses: Vec<u16>,
    starts: Vec<u16>,
    unrecorded: usize,
    calls: u64,
    effects: usize,
}

/// Runs `copies` identical triggers at once.
async fn futures_join(
    run: &Run,
    key: &str,
    action: &str,
    payload: &Value,
    wait: u64,
    copies: usize,
) -> anyhow::Result<Vec<(u16, Value, bool)>> {
    let all = futures_util::future::join_all((0..copies).map(|_| run.trigger(key, action, payload, wait))).await;
    all.into_iter().collect()
}

/// [`summarize`], with the `performed` 200s (idem's attempt during the request) apart
/// from the replays: `200 performed+15×409`.
fn summarize_performed(statuses: &[u16], performed: usize) -> String {
    let mut rest = statuses.to_vec();
    for _ in 0..performed {
        if let Some(i) = rest.iter().position(|s| *s == 200) {
            rest.remove(i);
        }
    }
    let head = match performed {
        0 => None,
        1 => Some("200 performed".to_owned()),
        n => Some(format!("{n}×200 performed")),
    };
    head.into_iter().chain((!rest.is_empty()).then(|| summarize(&rest))).collect::<Vec<_>>().join("+")
}

/// `201` or `201 + 15×409` for a list of statuses.
fn summarize(statuses: &[u16]) -> String {
    let mut counts: BTreeMap<u16, usize> = BTreeMap::new();
    for s in statuses {
        *counts.entry(*s).or_default() += 1;
    }
    counts.iter().map(|(s, n)| if *n == 1 { s.to_string() } else { format!("{n}×{s}") }).collect::<Vec<_>>().join("+")
}

fn expected_text(s: &Scenario) -> String {
    let counted = |created: Option<usize>, performed: Option<usize>| match (created, performed) {
        (_, Some(p)) => Some((p, "200 performed")),
        (Some(c), None) => Some((c, "201")),
        (None, None) => None,
    };
    let answers = s.triggers.iter().map(|t| (t.copies, counted(t.created, t.performed), &t.expect_status));
    let starts = s.starts.iter().map(|t| (t.copies, counted(t.created, None), &t.expect_status));
    let statuses: Vec<String> = answers
        .chain(starts)
        .map(|(copies, counted, expect)| {
            let set = expect.iter().map(u16::to_string).collect::<Vec<_>>().join("|");
            match (copies, counted) {
                (1, Some((1, what))) => what.to_owned(),
                (1, _) => set,
                (n, Some((c, what))) => format!("{n}× ({c}×{what}, rest {set})"),
                (n, None) => format!("{n}× {set}"),
            }
        })
        .collect();
    let mut parts = vec![s.expect.state.clone().unwrap_or_else(|| "any state".into())];
    if let Some(e) = s.expect.effects {
        parts.push(format!("{e} effect(s)"));
    }
    if let Some(c) = s.expect.calls {
        parts.push(format!("{c} call(s)"));
    }
    format!("{}; answers {}", parts.join(", "), statuses.join(" then "))
}

/// Reads a scenario file.
///
/// # Errors
/// Unreadable or malformed files, with the TOML error.
pub fn load(path: &std::path::Path) -> anyhow::Result<File> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {}", path.display(), e.to_string().replace('\n', " ")))
}

/// Runs every scenario of `file` against `target`.
///
/// # Errors
/// Only when idem or the provider cannot be reached; scenario failures are rows.
pub async fn run(file: &File, target: Target) -> anyhow::Result<Vec<Row>> {
    let suffix: String =
        format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_micros());
    let run = Run {
        http: reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?,
        target,
        connector: file.connector.clone(),
        suffix,
    };
    let mut rows = Vec::new();
    for s in &file.scenario {
        let expected = expected_text(s);
        let row = match &s.skip {
            Some(why) => Row {
                id: s.id.clone(),
                title: s.title.clone(),
                expected,
                actual: format!("skipped: {why}"),
                evidence: "-".into(),
                result: "SKIP",
                statuses: vec![],
                starts: vec![],
                unrecorded: 0,
                calls: 0,
                effects: 0,
            },
            None => {
                let o = run.scenario(s).await?;
                Row {
                    id: s.id.clone(),
                    title: s.title.clone(),
                    expected,
                    actual: o.actual,
                    evidence: o.evidence,
                    result: if o.ok { "PASS" } else { "FAIL" },
                    statuses: o.statuses,
                    starts: o.starts,
                    unrecorded: o.unrecorded,
                    calls: o.calls,
                    effects: o.effects,
                }
            }
        };
        rows.push(row);
    }
    Ok(rows)
}

/// The matrix as text, one scenario per block.
pub fn render(rows: &[Row]) -> String {
    let mut out = String::new();
    for r in rows {
        out.push_str(&format!(
            "{:<4} {:<5} {}\n     expected: {}\n     actual:   {}\n     evidence: {}\n",
            r.id, r.result, r.title, r.expected, r.actual, r.evidence
        ));
    }
    let count = |w: &str| rows.iter().filter(|r| r.result == w).count();
    out.push_str(&format!("{} passed, {} failed, {} skipped\n", count("PASS"), count("FAIL"), count("SKIP")));
    out.push_str(&totals(rows));
    out
}

/// One line with what the run did, to compare with idem's `/metrics`:
/// `totals: triggers 13 (200=3 201=5 202=2 410=1 422=2); starts 12 (200=10 201=2); provider
/// calls 17, effects 9, unrecorded 1` (effects no completion or lookup recorded yet: a step
/// UNKNOWN and waiting for a person).
pub fn totals(rows: &[Row]) -> String {
    let by_status = |statuses: Vec<u16>| {
        let mut by: BTreeMap<u16, usize> = BTreeMap::new();
        for s in &statuses {
            *by.entry(*s).or_default() += 1;
        }
        let by: Vec<String> = by.iter().map(|(s, n)| format!("{s}={n}")).collect();
        format!("{} ({})", statuses.len(), by.join(" "))
    };
    let triggers = by_status(rows.iter().flat_map(|r| r.statuses.iter().copied()).collect());
    let starts = by_status(rows.iter().flat_map(|r| r.starts.iter().copied()).collect());
    let calls: u64 = rows.iter().map(|r| r.calls).sum();
    let effects: usize = rows.iter().map(|r| r.effects).sum();
    let unrecorded: usize = rows.iter().map(|r| r.unrecorded).sum();
    format!(
        "totals: triggers {triggers}; starts {starts}; provider calls {calls}, effects {effects}, unrecorded {unrecorded}\n"
    )
}
