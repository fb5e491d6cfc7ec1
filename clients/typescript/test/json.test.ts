/** JSON as idem keeps it: RFC 8785 number forms, NFC, UTF-16 member order, and the values refused before anything is sent. */

import assert from "node:assert/strict";
import { it } from "node:test";

import { NotJSONError, canonical, fingerprint, toJSON } from "idem-client";

it("numbers are written as ECMAScript writes their double (RFC 8785 §3.2.2.3, appendix B)", () => {
  const cases: [number, string][] = [
    [333333333.33333329, "333333333.3333333"],
    [1e30, "1e+30"],
    [4.5, "4.5"],
    [2e-3, "0.002"],
    [0.000000000000000000000000001, "1e-27"],
    [-0, "0"],
    [1e-7, "1e-7"],
    [1.23e-6, "0.00000123"],
    [1e21, "1e+21"],
    [1e20, "100000000000000000000"],
    [5e-324, "5e-324"],
    [1.7976931348623157e308, "1.7976931348623157e+308"],
    [9007199254740992, "9007199254740992"],
    [-1.5, "-1.5"],
    [100, "100"],
  ];
  for (const [n, text] of cases) assert.equal(canonical(n), text);
});

it("members sort by UTF-16 code units and strings are NFC", () => {
  const value = { "\u{1f600}": 1, "\ufb01": 2, z: 3, "Zu\u0308rich": "A\u030a" };
  // U+1F600 is the surrogate pair D83D DE00, which sorts before U+FB01 in UTF-16.
  assert.equal(canonical(value), '{"Z\u00fcrich":"\u00c5","z":3,"\u{1f600}":1,"\ufb01":2}');
  assert.equal(canonical({ t: 'a\tb\u0001\u007f"\\' }), '{"t":"a\\tb\\u0001\u007f\\"\\\\"}');
});

it("the fingerprint does not depend on member order (the server's own is compared in idempotent.test)", () => {
  assert.equal(fingerprint({ b: [1, 2.5, "x"], a: null }), fingerprint({ a: null, b: [1, 2.5, "x"] }));
  assert.match(fingerprint(null), /^[0-9a-f]{64}$/);
  assert.notEqual(fingerprint({ n: 1 }), fingerprint({ n: "1" }));
});

it("values idem cannot store are refused with their path", () => {
  class Mailer {}
  const cases: [unknown, RegExp][] = [
    [{ when: new Date(0) }, /payload \/when: a Date is not JSON \(use its toISOString\(\)\)/],
    [{ ids: new Set([1, 2]) }, /payload \/ids: a Set is not JSON/],
    [{ m: new Map() }, /payload \/m: a Map is not JSON/],
    [{ x: Number.NaN }, /payload \/x: NaN is not a JSON number/],
    [{ x: Number.POSITIVE_INFINITY }, /payload \/x: Infinity is not a JSON number/],
    [{ n: 2 ** 53 + 2 }, /payload \/n: the number 9007199254740994 is beyond ±2\^53/],
    [{ n: 9007199254740993n }, /payload \/n: a bigint \(9007199254740993n\) is not JSON; send it as a string$/],
    [{ n: 7n }, /a bigint \(7n\) is not JSON; send it as a string or a number/],
    [{ u: undefined }, /payload \/u: undefined is not JSON/],
    [[undefined], /payload \/0: undefined is not JSON/],
    [{ f: () => 1 }, /payload \/f: a function is not JSON/],
    [{ "Z\u00fcrich": 1, "Zu\u0308rich": 2 }, /after Unicode NFC/],
    [{ s: "\ud800" }, /lone surrogate/],
    [{ "a/b~c": [0, { d: new Mailer() }] }, /payload \/a~1b~0c\/1\/d: a Mailer is not JSON/],
  ];
  for (const [value, words] of cases) assert.throws(() => toJSON(value, "payload"), (e) => e instanceof NotJSONError && words.test(e.message), String(words));
});

it("nesting deeper than 64 levels is refused", () => {
  let ok: unknown = 1;
  for (let i = 0; i < 64; i++) ok = [ok];
  assert.deepEqual(toJSON(ok), ok);
  assert.throws(() => toJSON([ok]), /deeper than 64/);
});

it("plain objects, null prototypes and undefined at the top are JSON", () => {
  const bare = Object.assign(Object.create(null) as object, { a: 1 });
  assert.deepEqual(toJSON({ bare, list: [true, null, "x", -0.5] }), { bare: { a: 1 }, list: [true, null, "x", -0.5] });
  assert.equal(toJSON(undefined), null);
});
