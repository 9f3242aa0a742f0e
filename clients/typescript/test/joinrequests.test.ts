// docs/typescript.md's joinRequests snippet, as written: dev's site agent vouches for
// a network boot, the booted machine joins with the discovery attestor and
// waits, and the snippet approves it.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { compute, ComputeError } from "@better-compute/client";
import { startDev, until } from "./dev.js";
import type { Dev } from "./dev.js";

let dev: Dev;

before(async () => {
  dev = await startDev();
  Object.assign(process.env, dev.env);
});
after(async () => dev?.stop());

// R18.1, R10.1: docs/typescript.md's join-request snippet, as written.
test("the documented joinRequests.list and approve run as written", async () => {
  const site = join(dev.dir, "site/config.toml");
  // The site token comes on standard input, as the README pipes it.
  const siteJoin = dev.run("bcd", ["join", "--config", site, "--role", "site"], readFileSync(join(dev.dir, "secrets/site.token"), "utf8"));
  if (siteJoin.code !== 0) assert.fail(siteJoin.stderr);
  const agent = dev.start("bcd", ["run", "--config", site]);
  await until("the site agent's vouch", () => {
    if (agent.exited() !== undefined) assert.fail(`bcd run exited: ${agent.output()}`);
    return dev.run("bcd", ["site", "vouch", "--config", site, "--mac", "00:1b:21:0a:0b:0c", "--ip", "127.0.0.1", "--lease-epoch", "1"]).code === 0;
  });
  // bcd run reports the vouch within seconds, with nothing to watch for:
  // until it has, the join is refused (discovery:vouch-missing), so boot
  // again until the join waits for approval.
  const boot = () => dev.start("bcd", ["join", "--config", join(dev.dir, "ramdisk/config.toml"), "--attestor", "discovery", "--role", "ramdisk",
    "--boot-mac", "00:1b:21:0a:0b:0c", "--boot-ip", "127.0.0.1", "--boot-lease-epoch", "1"], join(dev.dir, "secrets/ramdisk.token"));
  let booted = boot();
  await until("the join request", () => {
    if (booted.exited() !== undefined) {
      assert.match(booted.output(), /Join refused/);
      booted = boot();
    }
    return /join request jreq_\S+ is waiting for approval/.test(booted.output());
  });

  const credential = dev.env.BETTER_COMPUTE_API_KEY;
  const client = compute.client(credential);
  const tenantId = dev.env.TENANT;
  const poolId = dev.env.POOL;

  // ---- verbatim from docs/typescript.md ("The snippets")
  const { items } = await client.joinRequests.list({ tenantId, poolId });
  for (const request of items) {
    console.log(request.id, request.attestor, request.mac, request.vouchedBy, request.claims);
  }

  await client.joinRequests.approve({
    tenantId,
    poolId,
    requestId: items[0].id,
    ttlSeconds: 900,
    reason: 'rack B7 intake, ticket 4411',
  });
  // ---- end of the documented code

  assert.equal(items.length, 1);
  assert.equal(items[0].attestor, "discovery");
  assert.equal(items[0].mac, "00:1b:21:0a:0b:0c");
  assert.match(items[0].vouchedBy ?? "", /^node_/);
  // R22.1, R22.2: the attestor's evidence apart from the claims, the
  // effect of approving, and the version an approval may name. The documented
  // approval names no version: a new node's request accepts that.
  assert.equal(items[0].evidence?.vouchedBy, items[0].vouchedBy);
  assert.equal(items[0].evidence?.vouchedMac, "00:1b:21:0a:0b:0c");
  assert.equal(items[0].evidence?.bootLeaseEpoch, "1");
  assert.equal(items[0].evidence?.ekSha256, "");
  assert.equal(items[0].effect?.kind, "new-node");
  assert.match(items[0].version, /^v1-[0-9a-f]{32}$/);
  const got = await client.joinRequests.get({ tenantId, poolId, requestId: items[0].id });
  assert.equal(got.version, items[0].version);
  assert.equal(got.acknowledgedReclaimNodeId, "");
  await until("the approved join", () => /joined as node_/.test(booted.output()), 30_000);
  const { items: all } = await client.joinRequests.list({ tenantId, poolId, state: ["all"] });
  assert.equal(all[0].state, "consumed");
  assert.equal(all[0].reason, "rack B7 intake, ticket 4411");

  // Only a pending request is decided.
  await assert.rejects(client.joinRequests.reject({ tenantId, poolId, requestId: items[0].id, reason: "late" }),
    (err: unknown) => err instanceof ComputeError && err.code === "INVALID_STATE");
  await assert.rejects(client.joinRequests.approve({ tenantId, poolId, requestId: "jreq_" + "0".repeat(26), ttlSeconds: 900, reason: "x" }),
    (err: unknown) => err instanceof ComputeError && err.code === "NOT_FOUND");
});
