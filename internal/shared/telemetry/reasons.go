package telemetry

import (
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// ReasonOther is the reason label of a refusal whose reason is not in the
// fixed set (a new reason added without updating refusalReasons).
const ReasonOther = "other"

// refusalReasons is the fixed set of refusal reasons a metric may carry
// (the reasons JoinService, renewal and sessions record, without the
// attestor prefix of a join's event reason).
var refusalReasons = setOf(
	"attestor-unknown", "cert-ca-retired", "cert-chain", "cert-expired", "cert-expired-too-long", "cert-generation",
	"cert-invalid", "cert-missing", "cert-node", "cert-not-expired", "cert-not-yet-valid", "cert-revoked",
	"cert-superseded", "cert-unknown", "chain-missing", "claims-invalid", "client-time", "csr-invalid",
	"discovery-evidence", "discovery-mac", "discovery-role", "evidence-missing", "expect-mismatch", "hello-missing",
	"hello-timeout", "join-request-consumed", "join-request-rejected", "join-requests-pool-limit",
	"join-requests-source-limit", "key-attestation-missing", "node-changed", "node-id-invalid", "node-id-mismatch",
	"node-id-pool", "node-retired", "peer-node", "peer-ca-retired", "peer-chain", "peer-expired", "peer-invalid",
	"peer-missing", "peer-not-yet-valid", "peer-revoked", "peer-superseded", "peer-unknown", "placeholder-hardware",
	"pool-agent", "pool-attestor", "pool-tenant", "pop-invalid", "proof-replayed", "reclaim-key-reused",
	"rejoin-key-reused", "role-invalid", "role-mismatch", "sig-invalid", "token-expired", "token-malformed",
	"token-missing", "token-present", "token-revoked", "token-role", "token-secret", "token-unknown",
	"token-used-up", "vouch-epoch", "vouch-ip", "vouch-missing", "vouch-peer", "vouch-site", "vouch-used",
	"seal-malformed", "seal-algorithm", "seal-header", "seal-csr-mismatch", "seal-request-mismatch",
	"seal-expired", "seal-iat-future", "seal-decrypt", "seal-plaintext", "seal-invalid",
)

// Reason is the label value of a refusal reason: reason itself when it is
// in the fixed set, ReasonOther otherwise.
func Reason(reason string) string {
	if refusalReasons[reason] {
		return reason
	}
	return ReasonOther
}

// Label values of joins' attestors and roles outside the known ones.
var (
	attestors = setOf(append([]string{"unknown"}, wire.Attestors...)...)
	roles     = setOf("", pki.RoleNode, pki.RoleSite, pki.RoleRamdisk, pki.RoleNodeTenant)
)

// Attestor is the label value of an attestor name.
func Attestor(name string) string {
	if attestors[name] {
		return name
	}
	return ReasonOther
}

// Role is the label value of a role.
func Role(role string) string {
	if roles[role] {
		return role
	}
	return ReasonOther
}

func setOf(xs ...string) map[string]bool {
	m := make(map[string]bool, len(xs))
	for _, x := range xs {
		m[x] = true
	}
	return m
}
