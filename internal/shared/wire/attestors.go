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

// Attestors are every attestor name, in the order messages list them: what
// a server's [join] attestors and a pool policy's joinAttestors may name.
var Attestors = []string{AttestorJoinToken, AttestorX509Pop, AttestorDiscovery, AttestorTPM}
