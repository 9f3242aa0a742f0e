// Package pki owns the machine PKI: the bundle of CAs and JoinService keys
// (written by `better-compute pki init`, private keys encrypted at rest with
// BETTER_COMPUTE_SECRET), certificate signing (gateway serving certificates
// and node client certificates), pins, sealing of join tokens to the
// JoinService encryption key, and the signed join response.
//
// Everything here is pure: no package-level mutable state, no wall clock
// (callers pass the time), no I/O except Init and Load on the bundle
// directory. Errors that reach a caller carry an internal/shared/errs code; the
// join path's refusal reasons (seal opening) are machine strings the caller
// records and never shows to an agent.
//
// Security edges are flagged in comments with "SECURITY:".
package pki
