package join

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// Renewal windows (R13.2).
const (
	// RenewClockSkew is how far the daemon's client_time may be from the
	// server's clock.
	RenewClockSkew = 60 * time.Second
	// RenewProofWindow is how long a used proof is remembered. A proof is
	// acceptable only while the server's clock is within RenewClockSkew of
	// its client_time, a window of twice RenewClockSkew, so remembering it
	// that long from its first use covers every later use the clock check
	// would let through.
	RenewProofWindow = 2 * RenewClockSkew
)

// TPMAKStatementPrefix starts the statement naming the TPM attestation key
// that holds the node key (R7.2, R13.3).
const TPMAKStatementPrefix = tpmverify.StatementPrefix

// Refusal reasons of security.renew.refused that the attestation checks use
// (R13.3). The others are named where they are decided.
const (
	ReasonKeyAttestationMissing = "key-attestation-missing"
	ReasonKeyAttestationAK      = "key-attestation-ak"
)

// errRenewRefused is the only refusal a renewing daemon ever sees (R13.5).
var errRenewRefused = errs.New(errs.AccessDenied, "Renew refused")

// Renew issues a node its next certificate (R13). The presented leaf goes
// through the identity core's one check (ForRenew): byte for byte a
// node_certs row, of the node's current identity generation, unrevoked,
// unexpired and the node's newest, with the caller's proof of possession
// (pop_sig over the new CSR, the node id and client_time under the leaf's
// key). The caller's mTLS certificate (peer.Cert, as the gateway relays
// it) must pass the same check for a session, of the same node. The new
// certificate supersedes the leaf, keeps the stored row's role, allowed
// kinds and statements (never the CSR's), and is recorded, audited and
// announced in one transaction. Every refusal is ACCESS_DENIED "Renew
// refused" with the reason in a security.renew.refused event.
func (s *Service) Renew(ctx context.Context, req *agentv1.RenewRequest, peer Peer) (*agentv1.RenewResponse, error) {
	if s.core.Bundle() == nil {
		return nil, nodeident.ErrNotConfigured
	}
	csrHash := pki.CSRHash(req.GetCsr())
	var role string // the leaf's, once checked (metrics)
	refuse := func(r *nodeident.Refusal) (*agentv1.RenewResponse, error) {
		s.cfg.Metrics.Renewal(role, telemetry.OutcomeRefused, r.Reason)
		s.core.Refused(ctx, nodeident.Refused{Kind: nodeident.KindRenew, Refusal: r, Data: map[string]any{"csrSha256": hex.EncodeToString(csrHash)}})
		return nil, errRenewRefused
	}
	// Parsing needs no database, so it runs before the transaction.
	pub, err := pki.ParseCSR(req.GetCsr())
	if err != nil {
		return refuse(nodeident.Refuse("csr-invalid", ""))
	}
	chain := req.GetChain()
	if len(chain) == 0 {
		return refuse(nodeident.Refuse("chain-missing", ""))
	}
	// SECURITY: replays are recognised by the signed message, not by the
	// signature bytes: an ECDSA signature can be re-encoded into another
	// valid one (s -> n-s) by anyone who saw it, e.g. a gateway.
	proof := sha256.Sum256(pki.RenewPoPMessage(req.GetCsr(), req.GetNodeId(), req.GetClientTimeUnixMs()))

	var res *agentv1.JoinResponse
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		now := s.clock.Now()
		c, err := s.core.Check(ctx, tx, nodeident.Presented{
			DER: chain[0],
			Prove: func(pub crypto.PublicKey) error {
				return pki.VerifyRenewPoP(pub, req.GetCsr(), req.GetNodeId(), req.GetClientTimeUnixMs(), req.GetPopSig())
			},
		}, nodeident.ForRenew)
		if err != nil {
			return err
		}
		n, row := c.Node, c.Row
		role = row.Role
		// From here the caller proved the key of this node's newest
		// certificate: refusals go to the node's owner.
		ref := func(reason string) error {
			return &nodeident.Refusal{Reason: reason, TenantID: n.TenantID, NodeID: n.ID, Serial: row.Serial}
		}
		if req.GetNodeId() != n.ID {
			return ref("node-id-mismatch")
		}
		// The caller's mTLS identity is this node (R13.2): a stored, valid
		// certificate of it (the leaf itself, or one in its session
		// overlap).
		if !bytes.Equal(peer.Cert, chain[0]) {
			pc, err := s.core.Check(ctx, tx, nodeident.Presented{DER: peer.Cert, Proven: true}, nodeident.ForSession)
			var pr *nodeident.Refusal
			if errors.As(err, &pr) {
				return ref("peer-" + strings.TrimPrefix(pr.Reason, "cert-"))
			} else if err != nil {
				return err
			}
			if pc.Node.ID != n.ID {
				return ref("peer-node")
			}
		}
		if skew := now.Sub(time.UnixMilli(req.GetClientTimeUnixMs())); skew > RenewClockSkew || skew < -RenewClockSkew {
			return ref("client-time")
		}
		// R13.3/R13.4: the statements come from the stored row, never from
		// the CSR, so a TPM-held key cannot be renewed into a software key.
		statements, err := stringList(row.Statements)
		if err != nil {
			return fmt.Errorf("read the leaf's statements: %w", err)
		}
		kinds, err := stringList(row.AllowedKinds)
		if err != nil {
			return fmt.Errorf("read the leaf's allowed kinds: %w", err)
		}
		if reason := checkKeyAttestation(statements, req, pub); reason != "" {
			return ref(reason)
		}
		fresh, err := tx.UseRenewProof(ctx, proof[:], n.ID, now, RenewProofWindow)
		if err != nil {
			return err
		}
		if !fresh {
			return ref("proof-replayed")
		}
		if err := ackRenewPins(ctx, tx, n.ID, c.Leaf.PublicKey, req); err != nil {
			return err
		}
		// R13.2: the new certificate supersedes the leaf. Of two renewals
		// racing from one leaf, only one supersedes it.
		if ok, err := tx.SupersedeNodeCert(ctx, row.Serial, now); err != nil {
			return err
		} else if !ok {
			return ref("cert-superseded")
		}
		// An attestor may have shortened the first certificate; a renewal
		// never lengthens it.
		issued, err := s.core.Issue(ctx, tx, nodeident.IssueParams{Pub: pub, CSRSHA256: csrHash, Node: n, Role: row.Role,
			Statements: statements, AllowedKinds: kinds, MaxTTL: row.NotAfter.Sub(row.NotBefore)})
		if err != nil {
			return err
		}
		if err := s.recordRenewal(ctx, tx, n, row, issued, peer); err != nil {
			return err
		}
		res = issued.Response
		return nil
	})
	var rr *nodeident.Refusal
	if errors.As(err, &rr) {
		return refuse(rr)
	}
	if err != nil {
		s.cfg.Metrics.Renewal(role, telemetry.OutcomeError, "")
		return nil, err
	}
	s.cfg.Metrics.Renewal(role, telemetry.OutcomeAdmitted, "")
	return &agentv1.RenewResponse{Body: res.GetBody(), Sig: res.GetSig(), SigningCertificate: res.GetSigningCertificate()}, nil
}

// ackRenewPins records the pins the renewing daemon says it holds (R21.2)
// when its current key signed them over this request's CSR; anything else
// is not recorded and refuses nothing (pki status keeps counting the node
// behind, the safe side).
func ackRenewPins(ctx context.Context, tx *store.Tx, nodeID string, pub crypto.PublicKey, req *agentv1.RenewRequest) error {
	if pki.VerifyPinsAck(pub, pki.CSRHash(req.GetCsr()), req.GetPins(), req.GetPinsSig()) != nil {
		return nil
	}
	return tx.AckNodePins(ctx, nodeID, req.GetPins())
}

// checkKeyAttestation is R13.3: a leaf that names the TPM attestation key
// holding the node key renews only a new key certified by that very AK
// (never downgraded to a software key). It returns the refusal reason, ""
// when the request may renew.
func checkKeyAttestation(statements []string, req *agentv1.RenewRequest, pub *ecdsa.PublicKey) string {
	for _, st := range statements {
		if !tpmverify.IsStatement(st) {
			continue
		}
		if len(req.GetKeyAttestation()) == 0 {
			return ReasonKeyAttestationMissing
		}
		ka, err := tpmverify.ParseKeyAttestation(req.GetKeyAttestation())
		if err != nil {
			return tpmverify.ReasonOf(err)
		}
		akName, err := tpmverify.Verify(ka, req.GetCsr(), pub)
		if err != nil {
			return tpmverify.ReasonOf(err)
		}
		if want, ok := tpmverify.ParseStatement(st); !ok || !bytes.Equal(akName, want) {
			return ReasonKeyAttestationAK
		}
	}
	return ""
}

// recordRenewal writes the node.certificate-renewed event and its audit
// row, in the renewal's transaction.
func (s *Service) recordRenewal(ctx context.Context, tx *store.Tx, n store.Node, row store.NodeCert, issued *nodeident.Issued, peer Peer) error {
	data, err := json.Marshal(renewedData{
		NodeID: n.ID, SiteID: n.SiteID, Role: row.Role, CertSerial: issued.Cert.Serial, PreviousSerial: row.Serial,
		IdentityGeneration: n.IdentityGeneration, NotAfter: issued.Cert.Cert.NotAfter.UTC().Format(time.RFC3339), Peer: peer.Addr,
	})
	if err != nil {
		return fmt.Errorf("marshal renew event: %w", err)
	}
	if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.certificate-renewed", Subject: n.ID, Data: json.RawMessage(data)}); err != nil {
		return err
	}
	return events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: "node:" + n.ID, Action: "node.certificate-renewed", Resource: "compute-node/" + n.ID, Data: json.RawMessage(data)})
}

// renewedData is the data of a node.certificate-renewed event and of its
// audit row, its fields in the order of their JSON names (the bytes of the
// map it replaces).
type renewedData struct {
	CertSerial         string `json:"certSerial"`
	IdentityGeneration int    `json:"identityGeneration"`
	NodeID             string `json:"nodeId"`
	NotAfter           string `json:"notAfter"`
	Peer               string `json:"peer"`
	PreviousSerial     string `json:"previousSerial"`
	Role               string `json:"role"`
	SiteID             string `json:"siteId"`
}

// stringList decodes a stored JSON array of strings; most are empty.
func stringList(b []byte) ([]string, error) {
	if string(b) == "[]" {
		return nil, nil
	}
	var s []string
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, err
	}
	return s, nil
}
