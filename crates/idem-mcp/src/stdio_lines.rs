//! The host's stdio, line by line, in front of rmcp: malformed messages get a JSON-RPC error
//! instead of silence.
//!
//! rmcp's stdio transport skips a line it cannot parse (and a message nested deeper than
//! serde_json's 128 levels) without answering, so a host waits for an answer until its own
//! timeout; and a `tools/call` whose `arguments` is not an object comes back as "method not
//! found". Here each line from the host is read first: a line that is not JSON is answered
//! `-32700` (parse error, `id: null`, JSON-RPC 2.0 §5.1), a `tools/call` whose `params` or
//! `arguments` is not an object `-32602` (invalid params) with the request's id; the rest
//! goes to rmcp unchanged. Nothing refused here reaches the ledger or the tool server.
//! The answers are written between rmcp's own lines, never inside one.

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;

/// Longest line read from the host, bytes (a longer one is answered `-32700` and skipped).
/// Above the largest `max_argument_bytes` one would configure; the guard refuses large
/// arguments itself with a tool error.
pub const MAX_LINE_BYTES: usize = 64 * 1024 * 1024;

/// What to do with one line from the host: pass it on, or answer it here.
fn judge(line: &str) -> Option<Value> {
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => {
            let why = if e.to_string().contains("recursion limit") {
                "the message is nested deeper than 128 levels".to_owned()
            } else {
                format!("the line is not JSON ({})", category(&e))
            };
            return Some(error(Value::Null, -32700, &format!("Parse error: {why}")));
        }
    };
    if v.get("method").and_then(Value::as_str) == Some("tools/call") && v.get("id").is_some() {
        let params = v.get("params");
        let bad = match params {
            Some(Value::Object(p)) => p.get("arguments").is_some_and(|a| !a.is_object() && !a.is_null()),
            _ => true,
        };
        if bad {
            return Some(error(
                v["id"].clone(),
                -32602,
                "Invalid params: tools/call takes params {\"name\": string, \"arguments\": object}",
            ));
        }
    }
    None
}

/// serde_json's category of a parse error, in words.
fn category(e: &serde_json::Error) -> &'static str {
    match e.classify() {
        serde_json::error::Category::Io => "unreadable",
        serde_json::error::Category::Syntax => "a syntax error",
        serde_json::error::Category::Data => "a wrong value",
        serde_json::error::Category::Eof => "it ends too early",
    }
}

fn error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// The transport rmcp serves on: the host's stdin and stdout, with malformed lines answered
/// here (see the module docs). Spawns two tasks that end with stdin and with rmcp's output.
pub fn transport() -> (DuplexStream, DuplexStream) {
    let (to_rmcp, rmcp_in) = tokio::io::duplex(1 << 20);
    let (rmcp_out, from_rmcp) = tokio::io::duplex(1 << 20);
    let (answers, mut answered) = mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        let mut to_rmcp = to_rmcp;
        let mut stdin = BufReader::new(tokio::io::stdin());
        let mut line = Vec::new();
        loop {
            line.clear();
            match (&mut stdin).take(MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.len() > MAX_LINE_BYTES && line.last() != Some(&b'\n') {
                // Skip the rest of the line, then answer once.
                let mut rest = Vec::new();
                let _ = stdin.read_until(b'\n', &mut rest).await;
                let _ = answers.send(error(Value::Null, -32700, "Parse error: the line is longer than 64 MiB"));
                continue;
            }
            let text = String::from_utf8_lossy(&line);
            if text.trim().is_empty() {
                continue;
            }
            match judge(text.trim_end_matches(['\n', '\r'])) {
                Some(answer) => {
                    let _ = answers.send(answer);
                }
                None => {
                    if to_rmcp.write_all(&line).await.is_err() {
                        break;
                    }
                    if line.last() != Some(&b'\n') && to_rmcp.write_all(b"\n").await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_rmcp.shutdown().await;
    });
    tokio::spawn(async move {
        let mut from_rmcp = BufReader::new(from_rmcp);
        let mut stdout = tokio::io::stdout();
        let mut line = Vec::new();
        loop {
            line.clear();
            tokio::select! {
                read = from_rmcp.read_until(b'\n', &mut line) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                },
                Some(answer) = answered.recv() => {
                    line.extend_from_slice(answer.to_string().as_bytes());
                    line.push(b'\n');
                }
            }
            if stdout.write_all(&line).await.is_err() || stdout.flush().await.is_err() {
                break;
            }
        }
    });
    (rmcp_in, rmcp_out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_lines_are_answered_and_the_rest_passed_on() {
        let e = judge("this is not json").unwrap();
        assert_eq!((e["id"].clone(), e["error"]["code"].as_i64()), (Value::Null, Some(-32700)));
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(judge(&deep).unwrap()["error"]["message"].as_str().unwrap().contains("deeper than 128"));
        for params in [r#""x""#, "[1]", r#"{"name":"t","arguments":[1]}"#, r#"{"name":"t","arguments":"a"}"#] {
            let line = format!(r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{params}}}"#);
            let e = judge(&line).unwrap();
            assert_eq!((e["id"].as_i64(), e["error"]["code"].as_i64()), (Some(7), Some(-32602)), "{params}");
        }
        for fine in [
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"t","arguments":{"a":1}}}"#,
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"t"}}"#,
            r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
        ] {
            assert_eq!(judge(fine), None, "{fine}");
        }
    }
}
