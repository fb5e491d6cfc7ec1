/**
 * Receiving the relay's webhooks (`idem-client/webhooks`): verify the Standard Webhooks
 * signature, then claim the `webhook-id` in the inbox, in the transaction that applies the
 * event (README "Receiving webhooks"). Verification uses the `standardwebhooks` package, the
 * specification's own library.
 *
 * The signature is `base64(HMAC-SHA256(key, "{webhook-id}.{webhook-timestamp}.{body}"))` with
 * the key the base64-decoded secret after `whsec_`, one `v1,` entry per secret the sender
 * signs with; a `webhook-timestamp` more than 5 minutes off is refused (Standard Webhooks
 * specification, https://www.standardwebhooks.com). Verify the body's exact bytes, before any
 * JSON parsing; answer 2xx only after your commit.
 */

import { createHash } from "node:crypto";

import { Webhook, WebhookVerificationError as SpecVerificationError } from "standardwebhooks";

import { IdemError, InvalidInputError } from "./errors.js";
import { canonical, toJSON } from "./json.js";

/** No signature matches with any of the secrets, or the timestamp is more than 5 minutes off: answer `401`, apply nothing. */
export class WebhookVerificationError extends IdemError {}

/** `webhook-id`, `webhook-timestamp` or `webhook-signature` is missing: answer `400`. */
export class WebhookHeaderError extends WebhookVerificationError {}

/** A request's headers: a fetch `Headers`, or Node's `IncomingMessage.headers` (any case). */
export type WebhookHeaders = Headers | Readonly<Record<string, string | readonly string[] | undefined>>;

const HEADERS = ["webhook-id", "webhook-timestamp", "webhook-signature"] as const;

function lowerHeaders(headers: WebhookHeaders): Record<string, string> {
  const out: Record<string, string> = {};
  const entries: Iterable<[string, string | readonly string[] | undefined]> =
    headers instanceof Headers ? headers.entries() : Object.entries(headers);
  for (const [k, v] of entries) {
    if (v === undefined) continue;
    out[k.toLowerCase()] = typeof v === "string" ? v : v.join(", ");
  }
  return out;
}

/**
 * Checks the Standard Webhooks signature of `body` (its exact bytes) with each secret (two
 * while rotating: either one verifies) and returns the body's JSON.
 *
 * @param secrets `whsec_...` strings.
 * @throws WebhookHeaderError a signature header is missing.
 * @throws WebhookVerificationError no secret verifies the signature, or the timestamp is off.
 * @throws InvalidInputError a secret is not a `whsec_` base64 key, or the verified body is not JSON.
 */
export function verify(body: string | Uint8Array, headers: WebhookHeaders, secrets: string | readonly string[]): unknown {
  const lower = lowerHeaders(headers);
  const missing = HEADERS.filter((h) => !lower[h]);
  if (missing.length > 0) {
    throw new WebhookHeaderError(`missing ${missing.join(", ")}: not a Standard Webhooks request`);
  }
  let why = "no secret given";
  for (const secret of typeof secrets === "string" ? [secrets] : secrets) {
    let hook: Webhook;
    try {
      hook = new Webhook(secret);
    } catch (e) {
      throw new InvalidInputError(`a webhook secret is not a whsec_ base64 key: ${(e as Error).message}`);
    }
    try {
      hook.verify(body, lower, { jsonParse: false });
    } catch (e) {
      if (!(e instanceof SpecVerificationError)) throw e;
      why = e.message;
      continue;
    }
    const text = typeof body === "string" ? body : new TextDecoder("utf-8", { fatal: false }).decode(body);
    try {
      return JSON.parse(text);
    } catch {
      throw new InvalidInputError("the webhook's signature verifies, but its body is not JSON");
    }
  }
  throw new WebhookVerificationError(`the webhook's signature does not verify: ${why}`);
}

/**
 * The fingerprint of a message's content, as idem's Rust receiver computes it
 * (`idem_outbox::receive`): of the body's JSON (RFC 8785 with NFC, so the sender's formatting
 * does not matter), or SHA-256 of the bytes when the body is not JSON (or has member names
 * equal after NFC). What `idem.inbox_claim(consumer, message_id, fingerprint)` takes.
 */
export function contentFingerprint(body: string | Uint8Array): string {
  const bytes = typeof body === "string" ? Buffer.from(body, "utf8") : Buffer.from(body.buffer, body.byteOffset, body.byteLength);
  let text: string;
  try {
    text = canonical(toJSON(JSON.parse(bytes.toString("utf8")), "body"));
  } catch {
    return createHash("sha256").update(bytes).digest("hex");
  }
  return createHash("sha256").update(text, "utf8").digest("hex");
}
