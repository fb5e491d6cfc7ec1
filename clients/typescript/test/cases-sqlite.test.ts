import { defineCases } from "./support/cases.js";

defineCases("sqlite");
