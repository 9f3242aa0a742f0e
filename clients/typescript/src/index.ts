/**
 * @better-compute/client: the operator API of better-compute from
 * TypeScript. `compute.api.<group>.<method>(credential, request)` or
 * `createClient({ url, credential }).<group>.<method>(request)`; requests
 * and answers are the API's JSON, failures are ComputeError with the
 * product's code.
 */
export { compute, createCompute, createClient, baseUrl } from "./client.js";
export type { Api, Client, Compute, ConnectionOptions, Credential, Plain } from "./client.js";
export { ComputeError, toComputeError } from "./errors.js";
export type { ComputeErrorCode } from "./errors.js";
export type * from "./gen/bettercompute/v1/api_pb.js";
export type * from "./gen/bettercompute/v1/error_detail_pb.js";
