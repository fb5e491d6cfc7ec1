/**
 * Test support: real `idem serve` processes (SQLite and PostgreSQL) on loopback.
 *
 * The binary comes from `IDEM_BIN` (scripts/test.sh builds it with `cargo build -p idem`).
 * PostgreSQL databases are made with `psql` on `IDEM_TEST_PG_URL` (default
 * `postgres://postgres@127.0.0.1:5432/postgres`), one per server, named
 * `idem_tsclient_<UUIDv7 hex>` so that scripts/test.sh drops those a killed run left behind,
 * and dropped when the server stops.
 */

import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { accessSync, constants, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { after, before } from "node:test";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";

import { Client, type ClientOptions } from "idem-client";

export const ADMIN_KEY = "test-admin-key-0123456789abcdef0123456789";
export const PG_ADMIN_URL = process.env["IDEM_TEST_PG_URL"] ?? "postgres://postgres@127.0.0.1:5432/postgres";
/** The repository's root (this file is clients/typescript/build/test/support/server.js). */
export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../../..");
/** clients/typescript. */
export const PACKAGE = join(REPO, "clients/typescript");

/** The idem binary of this tree (`IDEM_BIN`). */
export function idemBin(): string {
  const path = process.env["IDEM_BIN"];
  try {
    if (!path) throw new Error("unset");
    accessSync(path, constants.X_OK);
  } catch {
    throw new Error(
      `IDEM_BIN=${JSON.stringify(path)} is not an idem binary: run ./scripts/test.sh, or ` +
        "`cargo build -p idem` and set IDEM_BIN=$CARGO_TARGET_DIR/debug/idem",
    );
  }
  return path;
}

/** A UUIDv7's 32 hex digits (RFC 9562 §5.7): its first 48 bits date it, as scripts/test.sh expects. */
export function uuid7Hex(): string {
  const ms = Date.now().toString(16).padStart(12, "0");
  const r = randomBytes(10).toString("hex");
  const variant = ((Number.parseInt(r.slice(3, 4), 16) & 0x3) | 0x8).toString(16);
  return `${ms}7${r.slice(0, 3)}${variant}${r.slice(4, 19)}`;
}

function psql(sql: string): void {
  execFileSync("psql", ["-X", "-q", "-v", "ON_ERROR_STOP=1", PG_ADMIN_URL, "-c", sql], { stdio: ["ignore", "ignore", "pipe"] });
}

/** A database of its own on the test server; {@link drop} removes it (and its connections). */
export class PgDatabase {
  readonly name: string;
  readonly url: string;

  constructor(prefix = "idem_tsclient") {
    this.name = `${prefix}_${uuid7Hex()}`;
    psql(`CREATE DATABASE ${this.name}`);
    this.url = `${PG_ADMIN_URL.slice(0, PG_ADMIN_URL.lastIndexOf("/"))}/${this.name}`;
  }

  drop(): void {
    psql(`DROP DATABASE IF EXISTS ${this.name} WITH (FORCE)`);
  }
}

/** A free loopback port (bound, then released). */
export async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const address = server.address();
  await new Promise<void>((ok) => server.close(() => ok()));
  if (address === null || typeof address === "string") throw new Error("no port");
  return address.port;
}

const running = new Set<ChildProcess>();
process.on("exit", () => {
  for (const p of running) p.kill("SIGKILL");
});

/** What a test uses of a running server. */
export interface RunningServer {
  readonly url: string;
  client(options?: ClientOptions): Client;
  stop(): Promise<void>;
}

/** A running `idem serve` on a free loopback port (killed with SIGKILL by {@link stop}). */
export class IdemServer implements RunningServer {
  readonly url: string;
  readonly #proc: ChildProcess;
  readonly #cleanup: () => void;

  private constructor(url: string, proc: ChildProcess, cleanup: () => void) {
    this.url = url;
    this.#proc = proc;
    this.#cleanup = cleanup;
  }

  /** Starts `idem serve` on `backend` ("sqlite": a fresh file; "postgres": a fresh database). */
  static async start(backend: "sqlite" | "postgres", listen = "127.0.0.1:0"): Promise<IdemServer> {
    const db = freshDatabase(backend);
    return IdemServer.serve(db.url, listen, db.remove);
  }

  /** Starts `idem serve` on an existing database (kept when it stops). */
  static async serve(databaseUrl: string, listen: string, cleanup: () => void = () => {}): Promise<IdemServer> {
    const proc = spawn(
      idemBin(),
      ["serve", "--listen", listen, "--sweep-interval-ms", "50", "--database-url", databaseUrl],
      { env: { ...process.env, IDEM_BOOTSTRAP_KEY: ADMIN_KEY, RUST_LOG: "error" }, stdio: ["ignore", "pipe", "inherit"] },
    );
    running.add(proc);
    const url = await new Promise<string>((ok, fail) => {
      const timer = setTimeout(() => fail(new Error("idem serve did not start within 30 s")), 30_000);
      const lines = createInterface({ input: proc.stdout! });
      lines.on("line", (line) => {
        if (line.startsWith("idem: listening on ")) {
          clearTimeout(timer);
          ok(line.slice("idem: listening on ".length).trim());
        }
      });
      proc.on("exit", (code) => {
        clearTimeout(timer);
        fail(new Error(`idem serve exited with ${code} before listening`));
      });
    });
    return new IdemServer(url, proc, cleanup);
  }

  /** A client of this server with the admin key. */
  client(options: ClientOptions = {}): Client {
    return new Client({ url: this.url, apiKey: ADMIN_KEY, ...options });
  }

  /** Kills the server (SIGKILL) and removes its database. */
  async stop(): Promise<void> {
    if (this.#proc.exitCode === null && this.#proc.signalCode === null) {
      const exited = new Promise((ok) => this.#proc.once("exit", ok));
      this.#proc.kill("SIGKILL");
      await exited;
    }
    running.delete(this.#proc);
    this.#cleanup();
  }
}

/** A fresh database on `backend` (a SQLite file in a directory of its own, or a PostgreSQL database) and how to remove it. */
export function freshDatabase(backend: "sqlite" | "postgres"): { url: string; remove: () => void } {
  if (backend === "sqlite") {
    const dir = mkdtempSync(join(tmpdir(), "idem-tsclient-"));
    return { url: `sqlite://${join(dir, "idem.db")}`, remove: () => rmSync(dir, { recursive: true, force: true }) };
  }
  const db = new PgDatabase();
  return { url: db.url, remove: () => db.drop() };
}

/**
 * `idem serve` on a fixed port and database, killed (SIGKILL) and started again: what a
 * client meets when idem restarts during an effect.
 */
export class Restarting {
  readonly url: string;
  readonly #db: { url: string; remove: () => void };
  readonly #listen: string;
  readonly #servers: IdemServer[] = [];
  #back: Promise<void> = Promise.resolve();

  private constructor(db: { url: string; remove: () => void }, port: number) {
    this.#db = db;
    this.#listen = `127.0.0.1:${port}`;
    this.url = `http://${this.#listen}`;
  }

  static async start(backend: "sqlite" | "postgres"): Promise<Restarting> {
    const r = new Restarting(freshDatabase(backend), await freePort());
    r.#servers.push(await IdemServer.serve(r.#db.url, r.#listen));
    return r;
  }

  /** A client of the server with the admin key. */
  client(options: ClientOptions = {}): Client {
    return new Client({ url: this.url, apiKey: ADMIN_KEY, ...options });
  }

  /** Kills the server (SIGKILL) and starts it again on the same port and database `ms` later. */
  async downFor(ms: number): Promise<void> {
    await this.#servers.at(-1)?.stop();
    this.#back = sleep(ms).then(async () => {
      this.#servers.push(await IdemServer.serve(this.#db.url, this.#listen));
    });
    this.#back.catch(() => {}); // reported by back() and stop()
  }

  /** Resolves when the server is up again. */
  back(): Promise<void> {
    return this.#back;
  }

  /** Stops every server and removes the database. */
  async stop(): Promise<void> {
    try {
      await this.#back;
    } finally {
      for (const s of this.#servers) await s.stop();
      this.#db.remove();
    }
  }
}

/**
 * A server on `backend` for the tests of the enclosing `describe` (or file): started in its
 * `before` hook, stopped in its `after` hook.
 */
export function useServer(backend: "sqlite" | "postgres"): RunningServer {
  let server: IdemServer | undefined;
  before(async () => {
    server = await IdemServer.start(backend);
  });
  after(async () => {
    await server?.stop();
  });
  const started = (): IdemServer => {
    if (server === undefined) throw new Error("the server starts in the before hook");
    return server;
  };
  return {
    get url() {
      return started().url;
    },
    client: (options) => started().client(options),
    stop: () => started().stop(),
  };
}

/** `GET` or `POST` with the admin key, bypassing the library: status, headers, JSON body. */
export async function raw(
  url: string,
  method: string,
  path: string,
  body?: unknown,
): Promise<{ status: number; headers: Headers; body: unknown }> {
  const init: RequestInit = { method, headers: { authorization: `Bearer ${ADMIN_KEY}`, "content-type": "application/json" } };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(url + path, init);
  const text = await r.text();
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    parsed = text;
  }
  return { status: r.status, headers: r.headers, body: parsed };
}

/** A key of this test's own: `T-<hex>`. */
export function newKey(prefix = "T"): string {
  return `${prefix}-${randomBytes(8).toString("hex")}`;
}
