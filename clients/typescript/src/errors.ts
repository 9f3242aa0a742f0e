// ComputeError: every failed call, with the product's code.
import { Code, ConnectError } from "@connectrpc/connect";
import { ErrorDetailSchema } from "./gen/bettercompute/v1/error_detail_pb.js";

/** The product's error codes, as the API and the CLI name them. */
export type ComputeErrorCode =
  | "NOT_FOUND"
  | "INVALID_STATE"
  | "CONFLICT"
  | "ALREADY_EXISTS"
  | "ACCESS_DENIED"
  | "INVALID_CONFIG"
  | "INVALID_ARGUMENT"
  | "UNAUTHENTICATED"
  | "RESOURCE_EXHAUSTED"
  | "UNAVAILABLE"
  | "INTERNAL";

/**
 * A call that failed. `code` is the product code the server put in the
 * error's ErrorDetail; `field` names the offending request field for
 * INVALID_ARGUMENT when the server named one.
 */
export class ComputeError extends Error {
  readonly code: ComputeErrorCode;
  readonly field: string | undefined;
  /** The Connect code the error travelled with (e.g. "not_found"). */
  readonly connectCode: string;

  constructor(code: ComputeErrorCode, message: string, opts: { field?: string; connectCode?: string; cause?: unknown } = {}) {
    super(`${code}: ${message}`, { cause: opts.cause });
    this.name = "ComputeError";
    this.code = code;
    this.field = opts.field || undefined;
    this.connectCode = opts.connectCode ?? "";
  }
}

// The product code for a Connect error that carries no ErrorDetail (an
// error of the transport or a proxy): the server's own mapping, reversed
// (internal/shared/wire).
const fromConnect: Partial<Record<Code, ComputeErrorCode>> = {
  [Code.InvalidArgument]: "INVALID_ARGUMENT",
  [Code.ResourceExhausted]: "RESOURCE_EXHAUSTED",
  [Code.DeadlineExceeded]: "UNAVAILABLE",
  [Code.Canceled]: "UNAVAILABLE",
  [Code.Unauthenticated]: "UNAUTHENTICATED",
  [Code.NotFound]: "NOT_FOUND",
  [Code.Unimplemented]: "NOT_FOUND",
  [Code.Unavailable]: "UNAVAILABLE",
  [Code.PermissionDenied]: "ACCESS_DENIED",
  [Code.AlreadyExists]: "ALREADY_EXISTS",
  [Code.Aborted]: "CONFLICT",
  [Code.FailedPrecondition]: "INVALID_STATE",
};

// A TLS failure of Node's (an untrusted, expired or misnamed server
// certificate): connect-node reports it as Code.Internal, though nothing
// went wrong inside the server. Its Node error codes.
const tlsCode = /^(ERR_TLS_|ERR_SSL_|CERT_|UNABLE_TO_|DEPTH_ZERO_SELF_SIGNED_CERT$|SELF_SIGNED_CERT_IN_CHAIN$|HOSTNAME_MISMATCH$)/;

// tlsFailure returns the Node error code of a TLS failure in err's causes.
function tlsFailure(err: unknown): string | undefined {
  for (let e = err, i = 0; e && typeof e === "object" && i < 8; e = (e as { cause?: unknown }).cause, i++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && tlsCode.test(code)) return code;
  }
  return undefined;
}

/** toComputeError turns anything a call threw into a ComputeError. */
export function toComputeError(err: unknown): ComputeError {
  if (err instanceof ComputeError) return err;
  const ce = ConnectError.from(err);
  const connectCode = Code[ce.code] ?? String(ce.code);
  const [detail] = ce.findDetails(ErrorDetailSchema);
  if (!detail && tlsFailure(err)) {
    // As the CLI: the control plane is unavailable to this client until
    // its certificate is trusted.
    return new ComputeError("UNAVAILABLE",
      `${ce.rawMessage}: the control plane's certificate is not trusted (${tlsFailure(err)}); give its CA with { ca } or { caFile } (default $BETTER_COMPUTE_CA_FILE, as better-compute dev's dev.env sets)`,
      { connectCode: Code[Code.Unavailable], cause: err });
  }
  const code = (detail?.code as ComputeErrorCode | undefined) || fromConnect[ce.code] || "INTERNAL";
  return new ComputeError(code, ce.rawMessage, { field: detail?.field, connectCode, cause: err });
}
