// Package pki is what bcd and the control plane both know of the machine
// PKI: pins (and their one computation), node certificate names and roles
// (the SPIFFE ID, statements, parsing a node certificate), strict CSR
// parsing and the CSR hash, the join request digest, sealing a join token
// to the JoinService encryption key, the encryption key's JWK, and every
// signature purpose (join response, renewal, x509pop, tpm join, sessions,
// commands, site reports) with its sign and verify.
//
// What only the control plane holds is in internal/controlplane/ca: the
// bundle of CAs and private keys, signing certificates, and opening seals.
//
// Everything here is pure: no package-level mutable state, no wall clock
// (callers pass the time), no I/O. Errors that reach a caller carry an
// internal/shared/errs code.
//
// Security edges are flagged in comments with "SECURITY:".
package pki
