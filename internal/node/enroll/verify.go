package enroll

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"fmt"
	"slices"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Check names one of the checks of a join response, in the order R4.6
// makes them.
type Check string

// The checks of a join response, in order. CheckBundle comes last: the
// command-signing bundle must hold certificates for the identity to be
// usable.
const (
	CheckSignature Check = "signature"
	CheckCSR       Check = "csr_sha256"
	CheckLeafKey   Check = "leaf key"
	CheckSPIFFEID  Check = "SPIFFE ID"
	CheckRole      Check = "role"
	CheckBundle    Check = "command bundle"
	// CheckDeferral: a signed deferral (R10.1) for this join.
	CheckDeferral Check = "deferral"
)

// ResponseError is a join response that failed a check. It unwraps to an
// *errs.E (UNAUTHENTICATED) with the message the user reads.
type ResponseError struct {
	Check Check
	err   *errs.E
}

func (e *ResponseError) Error() string { return e.err.Error() }
func (e *ResponseError) Unwrap() error { return e.err }

func badResponse(check Check, format string, args ...any) error {
	return &ResponseError{Check: check, err: errs.New(errs.Unauthenticated,
		"refusing the join response (%s check): %s; nothing was saved. The control plane may have spent a use of the token: if a retry is refused, create a new token",
		check, fmt.Sprintf(format, args...))}
}

// bad is badResponse for the answer want describes: a renewal's says that
// the current identity was kept.
func (want expectation) bad(check Check, format string, args ...any) error {
	if want.rejoin {
		return &ResponseError{Check: check, err: errs.New(errs.Unauthenticated,
			"refusing the re-join response (%s check): %s; nothing was saved, the expired identity is kept",
			check, fmt.Sprintf(format, args...))}
	}
	if !want.renewal {
		return badResponse(check, format, args...)
	}
	return &ResponseError{Check: check, err: errs.New(errs.Unauthenticated,
		"refusing the renewal response (%s check): %s; nothing was saved, the current identity is kept",
		check, fmt.Sprintf(format, args...))}
}

// expectation is what a join response must match.
type expectation struct {
	// signingPins is the join-signing pin set (R16.2): the answer's key
	// must hash to one of them. livePins, when set, is asked instead at
	// verification time (a send may have learned keys meanwhile).
	signingPins []string
	livePins    func() []string
	// retired are the keys the daemon knows retired (R21.3), and
	// vouchers statements from outside the signed answer (the answer's
	// own unsigned field, or a Keys answer): a signing key not pinned yet
	// is accepted when a chain of them from a pinned key vouches for it
	// (R21.1). liveRetired, when set, is asked instead of retired.
	retired     []string
	liveRetired func() []string
	vouchers    [][]string
	// docCert is the well-known document's signing certificate when it was
	// fetched and matched the pin; used when the response carries none.
	docCert *x509.Certificate
	csrHash []byte
	nodeKey crypto.PublicKey
	siteID  string
	// nodeID, when set, is the node the join must land on (--node-id).
	nodeID string
	// role is the requested role.
	role string
	// allowDeferral accepts a signed deferral (a join waiting on a join
	// request, R10.1) instead of a certificate: a join's first answer may
	// be one, never a renewal's or a re-join's.
	allowDeferral bool
	// renewal: the answer to a Renew. The role must then be exactly role
	// (a renewal keeps it), and trustDomain, when set, the current one.
	renewal     bool
	trustDomain string
	// rejoin: the answer to an x509pop join (R10.5), which re-joins this
	// node (nodeID) keeping its role: the role must be exactly role.
	rejoin bool
}

// verifyResponse checks a JoinResponse in the order of R4.6 and returns its
// body: (1) the signature under the pinned join-signing key, (2) csr_sha256
// is this join's CSR, (3) the leaf certifies this join's key, (4) the SPIFFE
// SAN names the body's trust domain, our site and the body's node (and the
// --node-id node), (5) the role is the one requested (or node-tenant, which
// JoinService gives a node joined through a hosted token). Nothing in the
// body is looked at before (1) passed.
func verifyResponse(res *agentv1.JoinResponse, want expectation) (*agentv1.JoinResponseBody, error) {
	want.vouchers = append([][]string{res.GetKeyStatements()}, want.vouchers...)
	return verifySigned(res.GetBody(), res.GetSig(), res.GetSigningCertificate(), want)
}

// verifySigned is verifyResponse on the three fields a JoinResponse and a
// RenewResponse share.
func verifySigned(rawBody, sig, signingCert []byte, want expectation) (*agentv1.JoinResponseBody, error) {
	// (1) Signature. bcd holds only the pin, so the key comes with the
	// answer (signing_certificate) or from the well-known document, and is
	// used only when it hashes to the pin.
	if want.livePins != nil {
		want.signingPins = want.livePins()
	}
	if want.liveRetired != nil {
		want.retired = want.liveRetired()
	}
	var key crypto.PublicKey
	var sawCert bool
	if der := signingCert; len(der) > 0 {
		sawCert = true
		if cert, err := x509.ParseCertificate(der); err == nil && want.vouched(cert.PublicKey) {
			key = cert.PublicKey
		}
	}
	if key == nil && want.docCert != nil {
		key = want.docCert.PublicKey
	}
	if key == nil {
		if sawCert {
			return nil, want.bad(CheckSignature, "its signing certificate does not match join_signing_key_pin")
		}
		return nil, want.bad(CheckSignature, "it carries no signing certificate, so its signature cannot be checked against join_signing_key_pin (pass --server to read the certificate from the well-known document)")
	}
	if err := pki.VerifyResponse(key, rawBody, sig); err != nil {
		return nil, want.bad(CheckSignature, "the signature does not verify under the pinned join-signing key")
	}

	// (2) The answer is for this CSR.
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(rawBody, &body); err != nil {
		return nil, want.bad(CheckCSR, "the signed body does not parse")
	}
	if !bytes.Equal(body.GetCsrSha256(), want.csrHash) {
		return nil, want.bad(CheckCSR, "it answers another certificate request")
	}
	if d := body.GetDeferral(); d != nil {
		if err := checkDeferral(&body, d, want); err != nil {
			return nil, err
		}
		return &body, nil
	}

	// (3) The leaf certifies this join's key.
	chain := body.GetCertChain()
	if len(chain) == 0 {
		return nil, want.bad(CheckLeafKey, "it carries no certificate")
	}
	certs := make([]*x509.Certificate, len(chain))
	for i, der := range chain {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, want.bad(CheckLeafKey, "certificate %d of its chain does not parse", i)
		}
		certs[i] = c
	}
	leaf := certs[0]
	if k, ok := leaf.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); !ok || !k.Equal(want.nodeKey) {
		return nil, want.bad(CheckLeafKey, "its certificate is for another key than this machine's")
	}

	// (4) The SPIFFE SAN.
	ni, err := checkSPIFFEID(&body, leaf, want)
	if err != nil {
		return nil, err
	}

	// (5) The role.
	okRole := body.GetRole() == want.role ||
		// A hosted token lowers a node to node-tenant (the token decides,
		// never the machine), and never raises anything.
		!want.renewal && !want.rejoin && want.role == pki.RoleNode && body.GetRole() == pki.RoleNodeTenant
	switch {
	case !okRole:
		if want.renewal || want.rejoin {
			return nil, want.bad(CheckRole, "it grants role %q, not this node's %q", body.GetRole(), want.role)
		}
		return nil, want.bad(CheckRole, "it grants role %q, not the requested %q", body.GetRole(), want.role)
	case ni.Role != body.GetRole():
		return nil, want.bad(CheckRole, "the certificate's role %s is not the answer's %s", ni.Role, body.GetRole())
	}

	// The command-signing trust bundle the node will check commands with.
	if len(body.GetCommandBundle()) == 0 {
		return nil, want.bad(CheckBundle, "it carries no command-signing certificate")
	}
	for i, der := range body.GetCommandBundle() {
		if _, err := x509.ParseCertificate(der); err != nil {
			return nil, want.bad(CheckBundle, "command-signing certificate %d does not parse", i)
		}
	}
	return &body, nil
}

// vouched reports whether pub may sign an answer: it hashes to a pinned
// join-signing key, or a chain of statements (want.vouchers) from a pinned
// key vouches for it and retired did not rule it out (R21.1, R21.3). The
// statements are only previewed here: the caller learns them once the
// answer passed every check.
func (want expectation) vouched(pub crypto.PublicKey) bool {
	if pki.PinIn(want.signingPins, pub) {
		return true
	}
	for _, st := range want.vouchers {
		if len(st) == 0 {
			continue
		}
		if set, _ := pki.ApplyStatements(pki.KindJoinSigning, want.signingPins, want.retired, st); pki.PinIn(set, pub) {
			return true
		}
	}
	return false
}

// checkDeferral is verifySigned's check of a signed deferral: for this
// CSR (checked before), site and role, naming a join request, and carrying
// nothing else.
func checkDeferral(body *agentv1.JoinResponseBody, d *agentv1.JoinDeferral, want expectation) error {
	switch {
	case !want.allowDeferral:
		return want.bad(CheckDeferral, "it defers to a join request, which only a join's answer may do")
	case !ids.Valid(ids.JoinRequest, d.GetRequestId()):
		return want.bad(CheckDeferral, "the join request id %q is not valid", d.GetRequestId())
	case body.GetSiteId() != want.siteID:
		return want.bad(CheckDeferral, "it defers a join to site %s, not this machine's site %s", body.GetSiteId(), want.siteID)
	case body.GetRole() != want.role:
		return want.bad(CheckDeferral, "it defers a join for role %q, not the requested %q", body.GetRole(), want.role)
	case body.GetNodeId() != "" || len(body.GetCertChain()) > 0:
		return want.bad(CheckDeferral, "it defers the join and carries a certificate")
	}
	return nil
}

// checkSPIFFEID is verifySigned's check of the leaf's SPIFFE ID against
// the answer and what this machine expects: trust domain, site, node.
func checkSPIFFEID(body *agentv1.JoinResponseBody, leaf *x509.Certificate, want expectation) (pki.NodeIdentity, error) {
	ni, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		return ni, want.bad(CheckSPIFFEID, "its certificate is not a node certificate: %v", err)
	}
	switch {
	case pki.ValidateTrustDomain(body.GetTrustDomain()) != nil:
		return ni, want.bad(CheckSPIFFEID, "the trust domain %q is not valid", body.GetTrustDomain())
	case ni.TrustDomain != body.GetTrustDomain():
		return ni, want.bad(CheckSPIFFEID, "the certificate's trust domain %s is not the answer's %s", ni.TrustDomain, body.GetTrustDomain())
	case want.trustDomain != "" && ni.TrustDomain != want.trustDomain:
		return ni, want.bad(CheckSPIFFEID, "the certificate's trust domain %s is not this node's %s", ni.TrustDomain, want.trustDomain)
	case body.GetSiteId() != want.siteID:
		return ni, want.bad(CheckSPIFFEID, "it places the node in site %s, not in this machine's site %s", body.GetSiteId(), want.siteID)
	case ni.SiteID != want.siteID:
		return ni, want.bad(CheckSPIFFEID, "the certificate names site %s, not this machine's site %s", ni.SiteID, want.siteID)
	case !ids.Valid(ids.Node, body.GetNodeId()):
		return ni, want.bad(CheckSPIFFEID, "the node id %q is not valid", body.GetNodeId())
	case ni.NodeID != body.GetNodeId():
		return ni, want.bad(CheckSPIFFEID, "the certificate names node %s, the answer %s", ni.NodeID, body.GetNodeId())
	case want.nodeID != "" && body.GetNodeId() != want.nodeID:
		if want.renewal {
			return ni, want.bad(CheckSPIFFEID, "it renews node %s, not this node %s", body.GetNodeId(), want.nodeID)
		}
		if want.rejoin {
			return ni, want.bad(CheckSPIFFEID, "it joined node %s, not this node %s", body.GetNodeId(), want.nodeID)
		}
		return ni, want.bad(CheckSPIFFEID, "it joined node %s, not the node %s that --node-id names", body.GetNodeId(), want.nodeID)
	}
	return ni, nil
}

// Expectation is what a join answer must match, for callers outside bcd
// that check answers exactly as bcd does (the load generator).
type Expectation struct {
	// SigningPins is the join-signing pin set; SigningPin, when set, is
	// added to it (callers that know one pin).
	SigningPins []string
	SigningPin  string
	CSRHash     []byte
	NodeKey     crypto.PublicKey
	SiteID      string
	Role        string
}

// VerifyResponse checks a JoinResponse in the order of R4.6 (see
// verifyResponse) and returns its body.
func VerifyResponse(res *agentv1.JoinResponse, e Expectation) (*agentv1.JoinResponseBody, error) {
	return verifyResponse(res, expectation{signingPins: pinSet(e.SigningPins, e.SigningPin), csrHash: e.CSRHash, nodeKey: e.NodeKey, siteID: e.SiteID, role: e.Role})
}

// RenewExpectation is what a renewal answer must match: the same node, in
// the same site and trust domain, with the same role, for the new key.
type RenewExpectation struct {
	// SigningPins is the join-signing pin set; SigningPin, when set, is
	// added to it.
	SigningPins []string
	SigningPin  string
	CSRHash     []byte
	NodeKey     crypto.PublicKey
	TrustDomain string
	SiteID      string
	NodeID      string
	Role        string
	// Retired are the keys known retired (R21.3); Vouchers, statements
	// from elsewhere than the answer (a Keys answer) that may vouch for
	// its signing key, as the answer's own key_statements do (R21.1).
	Retired  []string
	Vouchers []string
}

// VerifyRenewResponse checks a RenewResponse exactly like a join answer
// (verifyResponse, R4.6): the signature under the pinned join-signing key
// or one a chain of statements from it vouches for (the answer's
// key_statements or e.Vouchers, R21.1), from the answer's signing
// certificate only, csr_sha256, the leaf key,
// the SPIFFE ID (this node, site and trust domain), the role (exactly the
// current one), the command bundle. It returns the body.
func VerifyRenewResponse(res *agentv1.RenewResponse, e RenewExpectation) (*agentv1.JoinResponseBody, error) {
	if e.NodeID == "" || e.SiteID == "" || e.Role == "" {
		return nil, errs.New(errs.InvalidArgument, "verify renewal: the current node, site and role are required")
	}
	return verifySigned(res.GetBody(), res.GetSig(), res.GetSigningCertificate(), expectation{
		signingPins: pinSet(e.SigningPins, e.SigningPin), csrHash: e.CSRHash, nodeKey: e.NodeKey, siteID: e.SiteID, nodeID: e.NodeID, role: e.Role,
		renewal: true, trustDomain: e.TrustDomain, retired: e.Retired, vouchers: [][]string{res.GetKeyStatements(), e.Vouchers},
	})
}

// pinSet is pins plus pin when set and missing.
func pinSet(pins []string, pin string) []string {
	out := slices.Clone(pins)
	if pin != "" && !slices.Contains(out, pin) {
		out = append(out, pin)
	}
	return out
}
