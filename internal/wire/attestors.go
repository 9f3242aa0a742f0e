package wire

// Attestor names: in join requests (empty means AttestorJoinToken), pool
// policy (joinAttestors), the server's [join] attestors, events and audit.
// bcd, the CLI and the API refer to these, never to their own copies.
const (
	AttestorJoinToken = "join-token"
	AttestorX509Pop   = "x509pop"
	AttestorTPM       = "tpm"
	AttestorDiscovery = "discovery"
)
