// Package ca is the control plane's half of the machine PKI: the bundle of
// CAs and JoinService keys (written by `better-compute pki init`, private
// keys encrypted at rest with BETTER_COMPUTE_SECRET), its public half for
// `pki pins` and the install script, certificate signing (gateway serving
// certificates, node client certificates built TBS by TBS), and opening
// sealed join tokens, whose refusal reasons are machine strings the caller
// records and never shows to an agent. What bcd needs too (pins, sealing,
// signature purposes, CSR parsing) is internal/shared/pki.
//
// Everything here is pure but Init, Load and LoadPublic, which read and
// write the bundle directory; callers pass the time.
//
// Security edges are flagged in comments with "SECURITY:".
package ca
