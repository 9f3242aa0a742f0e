// The facade: one object per API group with docs/typescript.md's method names, plain
// JSON in and out (the API's own JSON: camelCase, RFC 3339 timestamps).
import { fromJson, toJson } from "@bufbuild/protobuf";
import type { DescMessage, DescService, Message, MessageJsonType, MessageShape } from "@bufbuild/protobuf";
import type { FieldMask, Timestamp } from "@bufbuild/protobuf/wkt";
import { createClient as createConnectClient } from "@connectrpc/connect";
import type { Transport } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-node";
import { readFileSync } from "node:fs";
import * as pb from "./gen/bettercompute/v1/api_pb.js";
import { ComputeError, toComputeError } from "./errors.js";

/** An API key (bck_<id>.<secret>), as a string or as { apiKey }. */
export type Credential = string | { apiKey: string };

/** Where the API is. */
export interface ConnectionOptions {
  /**
   * The control plane, e.g. https://compute.example.com; /api/compute is
   * added unless the URL has a path. Default: $BETTER_COMPUTE_URL.
   */
  url?: string;
  /** PEM of the CAs that verify the server. Default: none (the system's). */
  ca?: string | Buffer;
  /** A file holding ca. Default: $BETTER_COMPUTE_CA_FILE. */
  caFile?: string;
  /** A transport of your own (tests, proxies); url and ca are then unused. */
  transport?: Transport;
}

/**
 * Plain is an answer as the API's JSON: every scalar and list present
 * (zero values included), an unset message field absent, timestamps as
 * RFC 3339 strings, 64-bit integers as decimal strings.
 */
export type Plain<T> = T extends Timestamp | FieldMask | bigint
  ? string
  : T extends Uint8Array
    ? string
    : T extends readonly (infer E)[]
      ? Plain<E>[]
      : T extends Message
        ? { [K in keyof T as K extends "$typeName" | "$unknown" ? never : K]: Plain<T[K]> }
        : T;

/** A request is the API's JSON; every field may be left out. */
type In<D extends DescMessage> = MessageJsonType<D>;
type Out<D extends DescMessage> = Plain<MessageShape<D>>;
type Method<I extends DescMessage, O extends DescMessage> = { input: I; output: O };
type Unbound<M> = M extends Method<infer I, infer O> ? (credential: Credential, request?: In<I>) => Promise<Out<O>> : never;
type Bound<M> = M extends Method<infer I, infer O> ? (request?: In<I>) => Promise<Out<O>> : never;

// The groups: facade name -> the service and facade method -> rpc.
const groups = {
  tenants: { service: pb.TenantService, methods: { create: "createTenant", get: "getTenant", list: "listTenants" } },
  sites: { service: pb.SiteService, methods: { create: "createSite", get: "getSite", list: "listSites" } },
  pools: {
    service: pb.PoolService,
    methods: { create: "createPool", get: "getPool", list: "listPools", updatePolicy: "updatePoolPolicy" },
  },
  apiKeys: { service: pb.ApiKeyService, methods: { create: "createApiKey", list: "listApiKeys", revoke: "revokeApiKey" } },
  joinTokens: {
    service: pb.JoinTokenService,
    methods: { create: "createJoinToken", list: "listJoinTokens", revoke: "revokeJoinToken" },
  },
  joinRequests: {
    service: pb.JoinRequestService,
    methods: { list: "listJoinRequests", get: "getJoinRequest", approve: "approveJoinRequest", reject: "rejectJoinRequest" },
  },
  nodes: { service: pb.NodeService, methods: { create: "createNode", list: "listNodes", get: "getNode", retire: "retireNode" } },
  commands: { service: pb.CommandService, methods: { enqueue: "enqueueCommand", list: "listCommands", get: "getCommand" } },
  events: { service: pb.EventService, methods: { list: "listEvents", audit: "listAudit" } },
} as const;

type Groups = typeof groups;
type ServiceMethods<G extends keyof Groups> = Groups[G]["service"] extends { method: infer M } ? M : never;
type GroupOf<G extends keyof Groups, B extends boolean> = {
  [K in keyof Groups[G]["methods"]]: Groups[G]["methods"][K] extends keyof ServiceMethods<G>
    ? B extends true
      ? Bound<ServiceMethods<G>[Groups[G]["methods"][K]]>
      : Unbound<ServiceMethods<G>[Groups[G]["methods"][K]]>
    : never;
};

/** Every call takes the credential first: compute.api.joinTokens.create(credential, {...}). */
export type Api = { [G in keyof Groups]: GroupOf<G, false> };
/** A client bound to one credential: client.joinRequests.list({...}). */
export type Client = { [G in keyof Groups]: GroupOf<G, true> };

/** The API base URL for a control-plane URL (internal/client.BaseURL). */
export function baseUrl(url: string): string {
  const u = url.replace(/\/+$/, "");
  const rest = u.includes("://") ? u.slice(u.indexOf("://") + 3) : u;
  return rest.includes("/") ? u : u + "/api/compute";
}

function apiKeyOf(credential: Credential): string {
  const key = typeof credential === "string" ? credential : credential?.apiKey;
  if (!key) throw new ComputeError("UNAUTHENTICATED", "no API key: pass a credential (bck_…)");
  return key;
}

function makeTransport(opts: ConnectionOptions): Transport {
  if (opts.transport) return opts.transport;
  const url = opts.url ?? process.env.BETTER_COMPUTE_URL;
  if (!url) throw new ComputeError("INVALID_CONFIG", "no control plane URL: set BETTER_COMPUTE_URL or pass { url }");
  const caFile = opts.caFile ?? process.env.BETTER_COMPUTE_CA_FILE;
  let ca = opts.ca;
  if (ca === undefined && caFile) {
    try {
      ca = readFileSync(caFile);
    } catch (err) {
      throw new ComputeError("INVALID_CONFIG", `read CA file: ${(err as Error).message}`, { cause: err });
    }
  }
  return createConnectTransport({
    baseUrl: baseUrl(url),
    httpVersion: "1.1",
    nodeOptions: ca === undefined ? {} : { ca },
  });
}

type AnyCall = (credential: Credential | undefined, request?: unknown) => Promise<unknown>;
type Rpc = (input: unknown, options: { headers: Record<string, string> }) => Promise<never>;

// call is one facade method: JSON in, the API key as a bearer header, JSON
// out, and any failure as a ComputeError.
function call(transport: () => Transport, service: DescService, rpc: string): AnyCall {
  const method = service.method[rpc];
  if (!method || method.methodKind !== "unary") throw new Error(`no unary rpc ${service.typeName}.${rpc}`);
  return async (credential, request = {}) => {
    try {
      const headers = { Authorization: "Bearer " + apiKeyOf(credential as Credential) };
      let input;
      try {
        input = fromJson(method.input, request as never);
      } catch (err) {
        throw new ComputeError("INVALID_ARGUMENT", `${method.input.typeName}: ${(err as Error).message}`, { cause: err });
      }
      const client = createConnectClient(service, transport()) as unknown as Record<string, Rpc>;
      return toJson(method.output, await client[method.localName](input, { headers }), { alwaysEmitImplicit: true });
    } catch (err) {
      throw toComputeError(err);
    }
  };
}

function build(transport: () => Transport, credential: Credential | undefined, bound: boolean): Record<string, Record<string, unknown>> {
  const out: Record<string, Record<string, unknown>> = {};
  for (const [name, group] of Object.entries(groups)) {
    const methods: Record<string, unknown> = {};
    for (const [facade, rpc] of Object.entries(group.methods)) {
      const fn = call(transport, group.service as DescService, rpc);
      methods[facade] = bound ? (request?: unknown) => fn(credential, request) : fn;
    }
    out[name] = methods;
  }
  return out;
}

/** A connection to one control plane. */
export interface Compute {
  /** Every call takes the credential first. */
  readonly api: Api;
  /** A client whose calls all use one credential. */
  client(credential: Credential): Client;
}

/**
 * createCompute connects to one control plane. The transport is made at
 * the first call, so $BETTER_COMPUTE_URL may be set after import.
 */
export function createCompute(opts: ConnectionOptions = {}): Compute {
  let t: Transport | undefined;
  const transport = () => (t ??= makeTransport(opts));
  return {
    api: build(transport, undefined, false) as unknown as Api,
    client: (credential) => {
      apiKeyOf(credential);
      return build(transport, credential, true) as unknown as Client;
    },
  };
}

/** createClient is createCompute(opts).client(credential). */
export function createClient(opts: ConnectionOptions & { credential: Credential }): Client {
  return createCompute(opts).client(opts.credential);
}

/** The control plane of $BETTER_COMPUTE_URL (and $BETTER_COMPUTE_CA_FILE). */
export const compute: Compute = createCompute();
