// src/gen is what scripts/gen makes from proto/ today: regenerate into a
// temp dir and compare, so an edited .proto with stale TypeScript fails.
import { fileURLToPath } from "node:url";
import { test } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative, resolve } from "node:path";

const pkg = resolve(dirname(fileURLToPath(import.meta.url)), "../..");

function files(dir: string): Map<string, string> {
  const out = new Map<string, string>();
  for (const e of readdirSync(dir, { recursive: true, withFileTypes: true })) {
    if (!e.isFile()) continue;
    const p = join(e.parentPath, e.name);
    out.set(relative(dir, p), readFileSync(p, "utf8"));
  }
  return out;
}

test("src/gen is up to date with proto/ (run npm run gen)", () => {
  const tmp = mkdtempSync(join(tmpdir(), "bc-ts-gen-"));
  try {
    const r = spawnSync("sh", ["scripts/gen"], { cwd: pkg, env: { ...process.env, OUT: join(tmp, "gen") }, encoding: "utf8" });
    assert.equal(r.status, 0, r.stderr);
    const want = files(join(tmp, "gen"));
    const got = files(join(pkg, "src/gen"));
    assert.deepEqual([...got.keys()].sort(), [...want.keys()].sort(), "generated files differ: run npm run gen");
    for (const [name, text] of want) assert.ok(got.get(name) === text, `src/gen/${name} is stale: run npm run gen`);
  } finally {
    rmSync(tmp, { recursive: true, force: true });
  }
});
