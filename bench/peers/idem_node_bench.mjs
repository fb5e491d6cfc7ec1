#!/usr/bin/env node
/**
 * idem over HTTP from Node.js worker processes: the shape of idem_py_bench.py (first-time
 * calls: acquire -> (no-op effect) -> complete; replays: acquire of one completed key), so a
 * Node user's two choices are measured the way a Python user's are.
 *
 * --client http (default): two hand-written requests per pair with the runtime's `fetch`
 * (undici, keep-alive), the least a client on `fetch` can spend. --client http-module: the
 * same two requests over `node:http` (a keep-alive Agent): Node's core client, which spends
 * several times less CPU per request than `fetch` (undici over WHATWG streams), the least a
 * Node client can spend. --client library: idem's Node.js client (clients/typescript, built
 * into clients/typescript/dist by setup.sh; it is on `fetch`), a function guarded with
 * `client.makeIdempotent` as a user would write it (holder per attempt, lease and heartbeat
 * timers, checked payload, result and answers): what a user pays per pair.
 *
 * N worker processes (child_process.fork), each with --inflight concurrent calls on its event
 * loop (default 1, the shape of the Python benches; `--workers 2 --inflight 16` is 32 clients
 * the way a Node service runs them, an event loop a core, whose V8 is warm: a fresh process
 * spends 2-3 times the CPU per call of one after ~1000 calls, its JIT still compiling, and 32
 * processes × 1 on two cores make ~100 calls each in 8 s); all are warmed up (--warmup calls
 * a loop), then released together at one instant of CLOCK_MONOTONIC (process.hrtime, shared
 * by the processes) and start calls until a common deadline. ops/s = calls / (start .. last call's
 * end). Client CPU: each worker's process.cpuUsage() (user + system, all its threads) over
 * its window. Server CPU: /proc/PID/stat of `idem serve` (user, system) read around the
 * window. Starts its own `idem serve` (SQLite file in a temp dir, or a fresh PostgreSQL
 * database). One JSON line per run on stdout, appended to --out if given (idem_py_bench.py's
 * fields, `concurrency` = processes × inflight, plus `client`: "node-http", "node-http-module"
 * or "node-library", `processes` and `inflight`).
 *   node idem_node_bench.mjs --idem /path/to/idem --backend sqlite --mode first --workers 32
 */
import { execFileSync, fork, spawn, spawnSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import { appendFileSync, mkdtempSync, openSync, readFileSync } from "node:fs";
import http from "node:http";
import { connect, createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const KEY = "peer-bench-admin-key-0123456789abcdef-0123";
const LIBRARY = new URL("../../clients/typescript/dist/index.js", import.meta.url);
const PAYLOAD = { scope: "t1", to: "+15550100", body: "hello" };
const RESULT = { provider_message_id: "m1", state: "SENT" };

/** CLOCK_MONOTONIC in ns (libuv's uv_hrtime): one clock for every process of the machine. */
const now = () => process.hrtime.bigint();

/** A pair by hand over `fetch`. */
function httpPair(base) {
  const headers = { authorization: `Bearer ${KEY}`, "content-type": "application/json" };
  async function post(path, body) {
    const r = await fetch(base + path, { method: "POST", headers, body: JSON.stringify(body) });
    const text = await r.text();
    return [r.status, text ? JSON.parse(text) : null];
  }
  return pairOver(post);
}

/** acquire, then complete on a 201, over `post(path, body) -> [status, body]`; true when it ended as expected. */
function pairOver(post) {
  return async (key) => {
    const [st, b] = await post("/v1/operations", { key, action: "send_sms", payload: PAYLOAD });
    if (st === 201) {
      const [st2] = await post(`/v1/operations/${key}/complete`, {
        fencing_token: b.fencing_token, outcome: "succeeded", provider_ref: "m1", result: RESULT,
      });
      return st2 === 200;
    }
    return st === 200 && b?.provider_ref === "m1";
  };
}

/** httpPair's requests over node:http: up to `sockets` keep-alive connections, the body read whole. */
function httpModulePair(port, sockets) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: sockets });
  function post(path, body) {
    const data = JSON.stringify(body);
    const headers = { authorization: `Bearer ${KEY}`, "content-type": "application/json", "content-length": Buffer.byteLength(data) };
    return new Promise((resolve, reject) => {
      const req = http.request({ host: "127.0.0.1", port, path, method: "POST", agent, headers }, (res) => {
        let text = "";
        res.setEncoding("utf8");
        res.on("data", (chunk) => (text += chunk));
        res.on("end", () => resolve([res.statusCode, text ? JSON.parse(text) : null]));
        res.on("error", reject);
      });
      req.on("error", reject);
      req.end(data);
    });
  }
  return pairOver(post);
}

/** A pair through idem-client: the guarded no-op effect, as a user would write it. */
async function libraryPair(base) {
  const { Client } = await import(LIBRARY);
  const client = new Client({ url: base, apiKey: KEY });
  const sendSms = client.makeIdempotent(async (_key) => ({ ...RESULT }), {
    key: (key) => key,
    action: "send_sms",
    providerRef: "provider_message_id",
    payload: (_key) => PAYLOAD,
  });
  return async (key) => (await sendSms(key)).provider_message_id === "m1";
}

/** One worker process: `cfg.inflight` loops of pairs on one event loop, each one call at a time. */
async function worker(cfg) {
  const base = `http://127.0.0.1:${cfg.port}`;
  const pair =
    cfg.client === "library" ? await libraryPair(base) : cfg.client === "http-module" ? httpModulePair(cfg.port, cfg.inflight) : httpPair(base);
  const nonce = randomUUID().slice(0, 10);
  const loops = (body) => Promise.all(Array.from({ length: cfg.inflight }, (_, j) => body(j)));
  await loops(async (j) => {
    for (let i = 0; i < cfg.warmup; i++) await pair(cfg.replayKey ?? `W-${nonce}-${cfg.wid}-${j}-${i}`);
  });
  const start = await new Promise((resolve) => {
    process.once("message", (m) => resolve(BigInt(m.start)));
    process.send({ ready: true });
  });
  const wait = Number(start - now()) / 1e6;
  if (wait > 0) await sleep(wait);
  const deadline = start + BigInt(Math.round(cfg.duration * 1e9));
  const cpu0 = process.cpuUsage();
  let n = 0;
  let err = 0;
  await loops(async () => {
    while (now() < deadline) {
      const key = cfg.replayKey ?? `B-${nonce}-${cfg.wid}-${n}`;
      n += 1;
      try {
        if (!(await pair(key))) err += 1;
      } catch (e) {
        err += 1;
        if (err < 3) console.error(`worker ${cfg.wid}: ${e?.stack ?? e}`);
      }
    }
  });
  const end = now();
  const cpu = process.cpuUsage(cpu0); // µs, since cpu0
  process.send({ n, err, end: String(end), cpuMs: (cpu.user + cpu.system) / 1000 }, () => process.exit(0));
}

const CLK_TCK = () => Number(execFileSync("getconf", ["CLK_TCK"], { encoding: "utf8" }).trim());

/** [user, system] CPU time of process `pid` so far, in ms (/proc/PID/stat fields 14, 15). */
function procCpuMs(pid, tick) {
  const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(")").pop().trim().split(/\s+/);
  return [(1000 * Number(fields[11])) / tick, (1000 * Number(fields[12])) / tick];
}

/** Percent of all CPUs busy over `ms` (100 = every core busy): _cpu.busy_pct. */
async function busyPct(ms) {
  const stat = () => {
    const v = readFileSync("/proc/stat", "utf8").split("\n")[0].split(/\s+/).slice(1).map(Number);
    return [v.reduce((a, b) => a + b, 0), v[3] + v[4]]; // total, idle + iowait
  };
  const [t0, i0] = stat();
  await sleep(ms);
  const [t1, i1] = stat();
  return Math.round(1000 * (1 - (i1 - i0) / Math.max(t1 - t0, 1))) / 10;
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = createServer().listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
    s.on("error", reject);
  });
}

/** Waits up to 20 s for a listener on `port`; throws at once when `gone()` says why there will be none. */
async function waitForPort(port, gone) {
  for (let i = 0; i < 200; i++) {
    if (gone()) throw new Error(gone());
    const up = await new Promise((resolve) => {
      const c = connect(port, "127.0.0.1", () => { c.destroy(); resolve(true); });
      c.on("error", () => resolve(false));
    });
    if (up) return;
    await sleep(100);
  }
  throw new Error(`idem serve did not listen on ${port}`);
}

const psql = (sql) => spawnSync("psql", ["-h", "127.0.0.1", "-U", "postgres", "-qc", sql], { stdio: "inherit" });
const round3 = (x) => Math.round(x * 1000) / 1000;

async function main() {
  const { values: a } = parseArgs({
    options: {
      idem: { type: "string" },
      backend: { type: "string", default: "sqlite" },
      pg: { type: "string", default: "postgres://postgres@127.0.0.1:5432" },
      mode: { type: "string", default: "first" },
      workers: { type: "string", default: "32" },
      inflight: { type: "string", default: "1" },
      duration: { type: "string", default: "10" },
      warmup: { type: "string", default: "20" },
      out: { type: "string" },
      client: { type: "string", default: "http" },
      help: { type: "boolean", short: "h", default: false },
    },
  });
  if (a.help) {
    console.log("usage: node idem_node_bench.mjs --idem PATH [--backend sqlite|postgres] [--pg ADMIN_URL] [--mode first|replay]\n" +
      "  [--workers N] [--inflight K] [--duration S] [--warmup CALLS] [--client http|http-module|library] [--out FILE]\n" +
      "(the file's header comment says what each measures)");
    return;
  }
  const bad = (what) => { throw new Error(what); };
  if (!a.idem) bad("--idem PATH is required");
  if (!["sqlite", "postgres"].includes(a.backend)) bad("--backend sqlite|postgres");
  if (!["first", "replay"].includes(a.mode)) bad("--mode first|replay");
  if (!["http", "http-module", "library"].includes(a.client)) bad("--client http|http-module|library");
  const workers = Number(a.workers), inflight = Number(a.inflight), duration = Number(a.duration), warmup = Number(a.warmup);
  const tmp = mkdtempSync(join(tmpdir(), "idem-peer-"));
  const port = await freePort();
  let db = null, url;
  if (a.backend === "sqlite") {
    url = `sqlite://${tmp}/idem.db`;
  } else {
    db = `idem_peer_node_${process.pid}`;
    if (psql(`create database ${db}`).status !== 0) bad(`could not create database ${db}`);
    url = `${a.pg}/${db}?sslmode=disable`;
  }
  const log = openSync(join(tmp, "serve.log"), "w");
  const srv = spawn(a.idem, ["serve", "--listen", `127.0.0.1:${port}`, "--database-url", url], {
    cwd: tmp, env: { ...process.env, IDEM_BOOTSTRAP_KEY: KEY, RUST_LOG: "warn" }, stdio: ["ignore", log, log],
  });
  let gone = null; // why idem serve is not running, once it is not
  const exited = new Promise((resolve) => {
    srv.once("exit", (code, signal) => { gone = `idem serve exited (${code ?? signal}), see ${tmp}/serve.log`; resolve(); });
    srv.once("error", (e) => { gone = `idem serve did not start: ${e.message}`; resolve(); });
  });
  const children = [];
  try {
    await waitForPort(port, () => gone);
    let replayKey = null;
    if (a.mode === "replay") {
      replayKey = `R-${randomUUID().slice(0, 10)}`;
      if (!(await httpPair(`http://127.0.0.1:${port}`)(replayKey))) bad("could not complete the replay key");
    }
    const busy = await busyPct(1000);
    const ready = [], results = [];
    for (let wid = 0; wid < workers; wid++) {
      const cfg = { port, wid, client: a.client, inflight, duration, warmup, replayKey };
      const c = fork(fileURLToPath(import.meta.url), ["--worker", JSON.stringify(cfg)], { stdio: ["ignore", "inherit", "inherit", "ipc"] });
      children.push(c);
      ready.push(new Promise((resolve, reject) => {
        c.once("message", resolve);
        c.once("exit", (code) => reject(new Error(`worker ${wid} exited with ${code} before it was ready`)));
      }));
      results.push(new Promise((resolve, reject) => {
        c.on("message", (m) => { if (m.n !== undefined) resolve(m); });
        // "close", not "exit": a message sent just before the exit can be delivered after
        // the "exit" event, never after "close" (the IPC channel is closed by then).
        c.once("close", (code) => reject(new Error(`worker ${wid} exited with ${code} without a result`)));
      }));
    }
    results.forEach((p) => p.catch(() => {})); // awaited below; no unhandled rejection meanwhile
    await Promise.all(ready);
    const start = now() + 20_000_000n; // 20 ms: every worker has the message before it
    for (const c of children) c.send({ start: String(start) });
    const tick = CLK_TCK();
    const cpu0 = procCpuMs(srv.pid, tick);
    const limit = sleep((duration + 120) * 1000, "timeout");
    const got = await Promise.race([Promise.all(results), limit]);
    if (got === "timeout") bad("the workers did not report in time");
    const cpu1 = procCpuMs(srv.pid, tick);
    const total = got.reduce((s, g) => s + g.n, 0), errors = got.reduce((s, g) => s + g.err, 0);
    const window = Number(got.reduce((m, g) => (BigInt(g.end) > m ? BigInt(g.end) : m), start) - start) / 1e9;
    const per = (x) => round3(x / Math.max(total, 1));
    const out = {
      system: { http: "idem-http-node", "http-module": "idem-http-module-node", library: "idem-client-node" }[a.client],
      client: `node-${a.client}`,
      backend: a.backend, op: a.mode, concurrency: workers * inflight, processes: workers, inflight, duration_s: duration,
      window_s: round3(window), ops: total, errors,
      ops_per_s: Math.round((10 * total) / window) / 10,
      client_cpu_ms_per_op: per(got.reduce((s, g) => s + g.cpuMs, 0)),
      server_user_ms_per_op: per(cpu1[0] - cpu0[0]),
      server_sys_ms_per_op: per(cpu1[1] - cpu0[1]),
      cpu_busy_pct_before: busy,
    };
    console.log(JSON.stringify(out));
    if (a.out) appendFileSync(a.out, JSON.stringify(out) + "\n");
  } finally {
    for (const c of children) if (c.exitCode === null) c.kill();
    srv.kill("SIGTERM");
    await Promise.race([exited, sleep(10_000)]);
    if (db) psql(`drop database if exists ${db}`);
  }
}

if (process.argv[2] === "--worker") {
  process.on("disconnect", () => process.exit(1)); // the parent is gone
  worker(JSON.parse(process.argv[3])).catch((e) => { console.error(e); process.exit(1); });
} else {
  main().then(() => process.exit(0), (e) => { console.error(e?.stack ?? e); process.exit(1); });
}
