/** The case file's cases as node:test tests on one backend (one test file per backend, so they run side by side). */

import { describe, it } from "node:test";

import { CASES, type Json, Placeholders } from "./casefile.js";
import { runSteps } from "./caserunner.js";
import { useServer } from "./server.js";

export function defineCases(backend: "sqlite" | "postgres"): void {
  describe(`clients/cases/cases.json on ${backend}`, () => {
    const server = useServer(backend);
    for (const c of CASES.cases as Json[]) {
      it(c.name, async () => {
        const ph = new Placeholders();
        await runSteps({ server, client: server.client(), ph, effects: 0 }, ph.apply(c.steps));
      });
    }
  });
}
