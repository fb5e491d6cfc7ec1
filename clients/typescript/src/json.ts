/**
 * JSON as idem keeps it: what may be stored, and the fingerprint any client can recompute.
 *
 * idem stores payloads and results as JSON values and refuses what does not interoperate
 * (I-JSON, RFC 7493): duplicate member names (also names equal after Unicode NFC), numbers an
 * IEEE 754 double does not carry exactly or beyond ±2^53, more than 64 levels of nesting
 * (README "Request fields"). {@link toJSON} checks a value against those rules before anything
 * is sent, so a bad value fails early with the path to it — and it refuses what
 * `JSON.stringify` would silently change: `undefined` members, a `Date`, a `Map` or `Set`
 * (written as `{}`), class instances, `BigInt`, `NaN`.
 */

import { createHash } from "node:crypto";

import { NotJSONError } from "./errors.js";
import type { JSONValue } from "./records.js";

/** Largest integer magnitude I-JSON (RFC 7493 §2.2) carries exactly: 2^53. */
export const MAX_SAFE_MAGNITUDE = 2 ** 53;
/** Deepest nesting of arrays and objects idem stores (README "Request fields"). */
export const MAX_DEPTH = 64;

function fail(path: string, why: string): NotJSONError {
  return new NotJSONError(`${path.trimEnd() || "/"}: ${why}`);
}

function pointer(name: string): string {
  return name.replaceAll("~", "~0").replaceAll("/", "~1");
}

function kindOf(v: object): string {
  const proto: unknown = Object.getPrototypeOf(v);
  const ctor = proto && typeof proto === "object" ? (proto as { constructor?: { name?: unknown } }).constructor : undefined;
  return typeof ctor?.name === "string" && ctor.name ? `a ${ctor.name}` : "an object without a plain prototype";
}

function isPlainObject(v: object): boolean {
  const proto: unknown = Object.getPrototypeOf(v);
  return proto === Object.prototype || proto === null;
}

/**
 * `value` as the JSON idem would store, checked (a copy; `undefined` at the top is `null`).
 *
 * Accepted: `null`, booleans, strings (well-formed UTF-16), finite numbers within ±2^53, arrays
 * of those, plain objects (no two member names equal after NFC), at most 64 levels deep.
 *
 * @throws NotJSONError naming `what` and the JSON pointer of the first value that breaks a rule.
 */
export function toJSON(value: unknown, what = "value"): JSONValue {
  return value === undefined ? null : convert(value, `${what} `, 0);
}

function convert(v: unknown, path: string, depth: number): JSONValue {
  switch (typeof v) {
    case "string":
      if (!v.isWellFormed()) {
        throw fail(path, "a string with a lone surrogate is not Unicode text; JSON cannot carry it");
      }
      return v;
    case "boolean":
      return v;
    case "number":
      if (!Number.isFinite(v)) throw fail(path, `${v} is not a JSON number`);
      if (Math.abs(v) > MAX_SAFE_MAGNITUDE) {
        throw fail(path, `the number ${v} is beyond ±2^53 (I-JSON, RFC 7493 §2.2); send it as a string`);
      }
      return v;
    case "bigint":
      throw fail(
        path,
        `a bigint (${v}n) is not JSON; send it as a string` +
          (v >= -BigInt(MAX_SAFE_MAGNITUDE) && v <= BigInt(MAX_SAFE_MAGNITUDE) ? " or a number" : ""),
      );
    case "undefined":
      throw fail(path, "undefined is not JSON; leave the member out or use null");
    case "function":
    case "symbol":
      throw fail(path, `a ${typeof v} is not JSON`);
    default:
      break;
  }
  if (v === null) return null;
  const obj = v as object;
  if (depth >= MAX_DEPTH) throw fail(path, `nested deeper than ${MAX_DEPTH} levels of arrays and objects`);
  if (Array.isArray(obj)) {
    const out: JSONValue[] = [];
    for (let i = 0; i < obj.length; i++) out.push(convert(obj[i], `${path}/${i}`, depth + 1));
    return out;
  }
  if (!isPlainObject(obj)) {
    const hint = obj instanceof Date ? " (use its toISOString())" : "";
    throw fail(path, `${kindOf(obj)} is not JSON${hint}; use plain objects, arrays, strings, numbers, booleans or null`);
  }
  const out: Record<string, JSONValue> = {};
  const seen = new Set<string>();
  for (const [k, x] of Object.entries(obj)) {
    if (!k.isWellFormed()) throw fail(path, "a member name with a lone surrogate is not Unicode text");
    const nfc = k.normalize("NFC");
    if (seen.has(nfc)) {
      throw fail(path, `two member names are ${JSON.stringify(nfc)} after Unicode NFC (I-JSON duplicate names)`);
    }
    seen.add(nfc);
    out[k] = convert(x, `${path}/${pointer(k)}`, depth + 1);
  }
  return out;
}

/**
 * RFC 8785 canonical JSON of `value` with every string (and member name) in Unicode NFC (UAX
 * #15): member names sorted by their UTF-16 code units, numbers as ECMAScript prints their
 * double, no whitespace. What idem fingerprints (README "Request fields").
 */
export function canonical(value: JSONValue): string {
  if (value === null || typeof value === "boolean") return JSON.stringify(value);
  if (typeof value === "number") return String(value); // Number::toString; -0 is "0"
  if (typeof value === "string") return JSON.stringify(value.normalize("NFC"));
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  const members = Object.entries(value).map(([k, x]) => [k.normalize("NFC"), canonical(x)] as const);
  members.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)); // UTF-16 code units
  return `{${members.map(([k, x]) => `${JSON.stringify(k)}:${x}`).join(",")}}`;
}

/**
 * SHA-256 (64 lowercase hex digits) of the canonical JSON of `content`: the digest idem
 * computes for a payload, and the one idem's SQL functions and relay expect for a message or
 * key claim (`idem_outbox::inbox::content_fingerprint`).
 *
 * @throws NotJSONError `content` cannot be stored as JSON (see {@link toJSON}).
 */
export function fingerprint(content: unknown): string {
  return createHash("sha256").update(canonical(toJSON(content, "content")), "utf8").digest("hex");
}
