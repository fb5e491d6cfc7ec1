/**
 * A loopback TCP proxy in front of a real `idem serve` that loses answers or answers 503 on
 * command: the network faults the library must ride out, made on a real connection.
 */

import { type Socket, connect, createServer } from "node:net";

/**
 * What to do with requests whose first line starts with `prefix` (`POST /v1/operations `):
 * `drop` loses the answer after the server processed the request, `unavailable` answers 503
 * from the proxy without forwarding; each for the next `times` matching requests.
 */
export interface Rule {
  readonly prefix: string;
  readonly action: "drop" | "unavailable";
  readonly times: number;
  readonly retryAfter: number;
  hits: number;
}

/** Reads HTTP/1.1 messages (headers and a Content-Length body) off a socket, one at a time. */
class Reader {
  #buf = Buffer.alloc(0);
  #waiting: (() => void) | undefined;
  #ended = false;

  constructor(sock: Socket) {
    sock.on("data", (d: Buffer) => {
      this.#buf = Buffer.concat([this.#buf, d]);
      this.#waiting?.();
    });
    const end = () => {
      this.#ended = true;
      this.#waiting?.();
    };
    sock.on("end", end);
    sock.on("close", end);
    sock.on("error", end);
  }

  async #more(): Promise<boolean> {
    if (this.#ended) return false;
    await new Promise<void>((ok) => {
      this.#waiting = ok;
    });
    this.#waiting = undefined;
    return true;
  }

  /** The next message, or `null` at the end of the stream. */
  async message(): Promise<Buffer | null> {
    for (;;) {
      const headEnd = this.#buf.indexOf("\r\n\r\n");
      if (headEnd >= 0) {
        const head = this.#buf.subarray(0, headEnd).toString("latin1");
        const m = /\r\ncontent-length:\s*(\d+)/i.exec(head);
        const total = headEnd + 4 + (m ? Number(m[1]) : 0);
        if (this.#buf.length >= total) {
          const msg = this.#buf.subarray(0, total);
          this.#buf = this.#buf.subarray(total);
          return msg;
        }
      }
      if (!(await this.#more())) return null;
    }
  }
}

/** The proxy (see the module docs); `seen` has the first line of every request. */
export class FaultProxy {
  readonly rules: Rule[] = [];
  readonly seen: string[] = [];
  readonly #upstream: { host: string; port: number };
  readonly #sockets = new Set<Socket>();
  readonly #server = createServer((client) => {
    this.#sockets.add(client);
    client.on("close", () => this.#sockets.delete(client));
    void this.#serve(client);
  });
  #url = "";

  private constructor(upstream: { host: string; port: number }) {
    this.#upstream = upstream;
  }

  /** A proxy in front of `url` (`http://127.0.0.1:PORT`). */
  static async for(url: string): Promise<FaultProxy> {
    const u = new URL(url);
    const proxy = new FaultProxy({ host: u.hostname, port: Number(u.port) });
    await new Promise<void>((ok) => proxy.#server.listen(0, "127.0.0.1", ok));
    const address = proxy.#server.address();
    if (address === null || typeof address === "string") throw new Error("no address");
    proxy.#url = `http://127.0.0.1:${address.port}`;
    return proxy;
  }

  get url(): string {
    return this.#url;
  }

  rule(prefix: string, action: Rule["action"], times = 1, retryAfter = 1): Rule {
    const r: Rule = { prefix, action, times, retryAfter, hits: 0 };
    this.rules.push(r);
    return r;
  }

  #match(request: Buffer): Rule | undefined {
    const first = request.subarray(0, request.indexOf("\r\n")).toString("latin1");
    this.seen.push(first);
    const r = this.rules.find((x) => first.startsWith(x.prefix) && x.hits < x.times);
    if (r) r.hits += 1;
    return r;
  }

  async #serve(client: Socket): Promise<void> {
    const upstream = connect(this.#upstream);
    const fromClient = new Reader(client);
    const fromUpstream = new Reader(upstream);
    try {
      for (;;) {
        const request = await fromClient.message();
        if (request === null) return;
        const rule = this.#match(request);
        if (rule?.action === "unavailable") {
          const body =
            '{"type":"/problems/unavailable","title":"The store is unavailable","status":503,' +
            '"detail":"the database did not answer"}';
          client.write(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n" +
              `retry-after: ${rule.retryAfter}\r\nx-request-id: proxy-${rule.hits}\r\n` +
              `content-length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
          );
          continue;
        }
        upstream.write(request);
        const answer = await fromUpstream.message();
        if (answer === null) return;
        if (rule?.action === "drop") return; // the server acted; its answer never reaches the client
        client.write(answer);
      }
    } finally {
      client.destroy();
      upstream.destroy();
    }
  }

  /** Stops listening and drops every connection (the client's pool keeps some open). */
  close(): Promise<void> {
    const closed = new Promise<void>((ok) => this.#server.close(() => ok()));
    for (const s of this.#sockets) s.destroy();
    return closed;
  }
}
