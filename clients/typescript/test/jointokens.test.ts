// docs/typescript.md's join-token snippet, as written, against `better-compute dev`,
// then the rest of the group and the product's error codes.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { join } from "node:path";
import { compute, createClient, ComputeError } from "@better-compute/client";
import type { ComputeErrorCode } from "@better-compute/client";
import { startDev } from "./dev.js";
import type { Dev } from "./dev.js";

let dev: Dev;
let credential: string;
let rootTenantId: string;
let poolId: string;

before(async () => {
  dev = await startDev();
  // What `source bc-dev/dev.env` sets: the default client reads the URL
  // and the CA file from it.
  Object.assign(process.env, dev.env);
  credential = dev.env.BETTER_COMPUTE_API_KEY;
  rootTenantId = dev.env.TENANT;
  poolId = dev.env.POOL;
});
after(async () => dev?.stop());

async function rejects(code: ComputeErrorCode, p: Promise<unknown>): Promise<ComputeError> {
  try {
    await p;
  } catch (err) {
    assert.ok(err instanceof ComputeError, `not a ComputeError: ${err}`);
    assert.equal(err.code, code, err.message);
    return err;
  }
  assert.fail(`no ${code}`);
}

// R18.1, R2.1: docs/typescript.md's first snippet, as written.
test("the documented joinTokens.create runs as written, and the token joins a machine", async () => {
  // ---- verbatim from docs/typescript.md ("The snippets")
  const created = await compute.api.joinTokens.create(credential, {
    tenantId: rootTenantId,
    poolId,
    ttlSeconds: 3600,
    maxUses: 1,
    expect: { serial: 'SN-7701' },
    idempotencyKey: 'adopt-rack-b7-u12',
  });

  // `bcjt_jt_….…`: hand it to the machine out of band. It is never shown again.
  console.log(created.token);
  // ---- end of the documented code

  assert.match(created.token ?? "", /^bcjt_jt_[0-9a-z]+\.[A-Za-z0-9_-]{43}$/);
  assert.equal(created.poolId, poolId);
  assert.equal(created.role, "node");
  assert.equal(created.usesLeft, 1);
  assert.deepEqual(created.expect, { productUuid: "", serial: "SN-7701", mac: "", gpuUuid: "" });
  // expiresAt is the API's JSON: an RFC 3339 string, about an hour ahead.
  const ttl = Date.parse(created.expiresAt ?? "") - Date.now();
  assert.ok(ttl > 3500_000 && ttl <= 3600_000, `expiresAt ${created.expiresAt}`);

  // A retry with the same key answers the record without the token.
  const again = await compute.api.joinTokens.create(credential, {
    tenantId: rootTenantId, poolId, ttlSeconds: 3600, maxUses: 1, expect: { serial: "SN-7701" }, idempotencyKey: "adopt-rack-b7-u12",
  });
  assert.equal(again.id, created.id);
  assert.equal(again.token, "");
  // The same key with another expect is a CONFLICT.
  await rejects("CONFLICT", compute.api.joinTokens.create(credential, {
    tenantId: rootTenantId, poolId, ttlSeconds: 3600, expect: { serial: "SN-0000" }, idempotencyKey: "adopt-rack-b7-u12",
  }));

  // The machine joins with it (bcd through dev's gateway), and is a node.
  const fake = dev.run("bcd", ["fake-machine", "--out", "./fake-sys", "--serial", "SN-7701"]);
  assert.equal(fake.code, 0, fake.stderr);
  const joined = dev.run("bcd", ["join", "--config", join(dev.dir, "bcd/config.toml"), "--sysfs-root", "./fake-sys"], created.token);
  assert.equal(joined.code, 0, joined.stderr + joined.stdout);
  const client = compute.client(credential);
  const { items: nodes } = await client.nodes.list({ tenantId: rootTenantId, poolId });
  assert.equal(nodes.length, 1);
  assert.equal(nodes[0].attestor, "join-token");
  const node = await client.nodes.get({ tenantId: rootTenantId, nodeId: nodes[0].id });
  assert.equal(node.certs.length, 1);

  // Used up: not listed as live, listed with includeInactive.
  const live = await client.joinTokens.list({ tenantId: rootTenantId, poolId });
  assert.ok(!live.items.some((t) => t.id === created.id));
  const all = await client.joinTokens.list({ tenantId: rootTenantId, poolId, includeInactive: true });
  assert.equal(all.items.find((t) => t.id === created.id)?.state, "used-up");
});

test("joinTokens.list and revoke; events", async () => {
  const client = compute.client(credential);
  const t = await client.joinTokens.create({ tenantId: rootTenantId, poolId, ttlSeconds: 600 });
  const { items } = await client.joinTokens.list({ tenantId: rootTenantId, poolId });
  const listed = items.find((i) => i.id === t.id);
  assert.equal(listed?.state, "live");
  assert.equal(listed?.token, "", "a list never shows a secret");
  const revoked = await client.joinTokens.revoke({ tenantId: rootTenantId, poolId, tokenId: t.id });
  assert.equal(revoked.state, "revoked");
  // Revoking twice is not an error.
  assert.equal((await client.joinTokens.revoke({ tenantId: rootTenantId, poolId, tokenId: t.id })).state, "revoked");

  const { events } = await client.events.list({ tenantId: rootTenantId, typePrefix: "security.join-token." });
  const types = events.filter((e) => e.subject?.includes(t.id ?? "-") || JSON.stringify(e.data).includes(t.id ?? "-")).map((e) => e.type);
  assert.deepEqual(types, ["security.join-token.created", "security.join-token.revoked"]);

  const sites = await client.sites.list({ tenantId: rootTenantId });
  assert.ok(sites.items.some((s) => s.id === dev.env.SITE));
  const pool = await client.pools.get({ tenantId: rootTenantId, poolId });
  assert.equal(pool.agent, "bcd");
});

test("errors carry the product's codes", async () => {
  const client = compute.client(credential);
  // A pool of another tenant is NOT_FOUND, not ACCESS_DENIED.
  const acme = await client.tenants.create({ name: "acme" });
  const acmeSite = await client.sites.create({ tenantId: acme.id, name: "acme-lab", region: "eu" });
  const acmePool = await client.pools.create({ tenantId: acme.id, siteId: acmeSite.id, name: "gpus", agent: "bcd" });
  await rejects("NOT_FOUND", client.joinTokens.create({ tenantId: rootTenantId, poolId: acmePool.id, ttlSeconds: 600 }));
  // A pool whose machines run no daemon: INVALID_STATE.
  const bare = await client.pools.create({ tenantId: rootTenantId, siteId: dev.env.SITE, name: "no-daemon", agent: "ipmi" });
  await rejects("INVALID_STATE", client.joinTokens.create({ tenantId: rootTenantId, poolId: bare.id, ttlSeconds: 600 }));
  // A bad field: INVALID_ARGUMENT, naming it.
  const bad = await rejects("INVALID_ARGUMENT", client.joinTokens.create({ tenantId: rootTenantId, poolId, ttlSeconds: 5 }));
  assert.ok(bad.field, `no field in ${bad.message}`);
  // A field the API does not have is refused before it is sent.
  await rejects("INVALID_ARGUMENT", client.joinTokens.create({ tenantId: rootTenantId, poolId, ttl: 600 } as never));
  // A wrong key, and no key at all.
  await rejects("UNAUTHENTICATED", compute.api.joinTokens.list("bck_key_0.nope", { tenantId: rootTenantId, poolId }));
  await rejects("UNAUTHENTICATED", compute.api.joinTokens.list("", { tenantId: rootTenantId, poolId }));
  // A key without the grant.
  const reader = await client.apiKeys.create({
    tenantId: rootTenantId, name: "reader", grants: [{ action: "compute:nodes:read", resource: "*" }],
  });
  await rejects("ACCESS_DENIED", compute.api.joinTokens.create(reader.key ?? "", { tenantId: rootTenantId, poolId, ttlSeconds: 600 }));
});

// A control plane whose certificate this client does not trust (dev's
// private CA, without its CA file) is UNAVAILABLE, as in the CLI, and the
// message says what to give; with the CA file the same call goes through.
test("an untrusted server certificate is UNAVAILABLE", async () => {
  const untrusted = createClient({ url: dev.env.BETTER_COMPUTE_URL, credential, caFile: "" }); // the system roots only
  const err = await rejects("UNAVAILABLE", untrusted.tenants.get({ tenantId: rootTenantId }));
  assert.match(err.message, /certificate/);
  assert.match(err.message, /BETTER_COMPUTE_CA_FILE/);
  const trusted = createClient({ url: dev.env.BETTER_COMPUTE_URL, credential, caFile: dev.env.BETTER_COMPUTE_CA_FILE });
  assert.equal((await trusted.tenants.get({ tenantId: rootTenantId })).id, rootTenantId);
});
