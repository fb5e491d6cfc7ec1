/**
 * `Symbol.asyncDispose` and `Symbol.dispose` where the runtime lacks them.
 *
 * A claim is `AsyncDisposable` (ECMAScript explicit resource management, TC39 proposal, in
 * TypeScript since 5.2): `await using claim = await idem.claim(...)`. TypeScript compiles
 * `await using` for runtimes without the syntax (Node.js 20 and 22) into a helper that looks
 * the method up under `Symbol.asyncDispose` at run time. Node.js defines that symbol since
 * 20.4 (and 18.18); Node.js 20.0-20.3 do not, and there the helper throws "Symbol.asyncDispose
 * is not defined". So this module, imported before the claim class is defined, defines each
 * symbol **only where it is missing**, as a registered symbol (`Symbol.for`) so that other
 * copies of such a polyfill agree with it, read-only like a well-known symbol. Where the
 * runtime has the symbol (every supported Node.js but 20.0-20.3) nothing is changed.
 */

/** The symbols a polyfill adds where missing, under their registered names. */
const MISSING: readonly (readonly ["asyncDispose" | "dispose", string])[] = [
  ["asyncDispose", "Symbol.asyncDispose"],
  ["dispose", "Symbol.dispose"],
];

/**
 * Defines `target.asyncDispose` and `target.dispose` (the `Symbol` constructor by default)
 * where they are missing; returns the names it defined (none on current runtimes).
 */
export function ensureDisposeSymbols(target: object = Symbol): string[] {
  const defined: string[] = [];
  for (const [name, registered] of MISSING) {
    if (typeof (target as Record<string, unknown>)[name] === "symbol") continue;
    Object.defineProperty(target, name, {
      value: Symbol.for(registered),
      writable: false,
      enumerable: false,
      configurable: true,
    });
    defined.push(name);
  }
  return defined;
}

ensureDisposeSymbols();
