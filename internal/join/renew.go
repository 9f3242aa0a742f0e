package join

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/events"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
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
const TPMAKStatementPrefix = pki.StatementPrefix + "tpm-ak:"

// Refusal reasons of security.renew.refused that the attestation checks use
// (R13.3). The others are named where they are decided.
const (
	ReasonKeyAttestationMissing = "key-attestation-missing"
	ReasonKeyAttestationAK      = "key-attestation-ak"
)

// errRenewRefused is the only refusal a renewing daemon ever sees (R13.5).
var errRenewRefused = errs.New(errs.AccessDenied, "Renew refused")

// renewRefusal is a refused renewal with what its event needs. tenantID is
// the node's owner once the caller proved the current key, else "" (the
// root tenant). nodeID and serial are set only once the presented leaf
// matched a stored row: before that they would be the caller's own text.
type renewRefusal struct {
	reason, tenantID, nodeID, serial string
}

func (r *renewRefusal) Error() string { return "renew refused: " + r.reason }

// Renew issues a node its next certificate (R13). The caller proves
// possession of its current key (pop_sig over the new CSR, the node id and
// client_time, under the presented leaf's key); the presented leaf must be
// byte for byte a node_certs row of the node's current identity generation,
// unrevoked and unexpired; the caller's mTLS certificate (peer.Cert, as the
// gateway relays it) must be a stored, valid certificate of the same node.
// The new certificate keeps the stored row's role, allowed kinds and
// statements (never the CSR's), and is recorded, audited and announced in
// one transaction. Every refusal is ACCESS_DENIED "Renew refused" with the
// reason in a security.renew.refused event.
func (s *Service) Renew(ctx context.Context, req *agentv1.RenewRequest, peer Peer) (*agentv1.RenewResponse, error) {
	b := s.cfg.Bundle
	if b == nil {
		return nil, errs.New(errs.InvalidConfig, "JoinService is not configured: the server has no machine PKI (pki.dir)")
	}
	csrHash := pki.CSRHash(req.GetCsr())
	refuse := func(r *renewRefusal) (*agentv1.RenewResponse, error) {
		s.renewRefused(ctx, r, csrHash)
		return nil, errRenewRefused
	}
	// Parsing and the signature checks need no database, so they run before
	// the transaction; their verdicts count only where the transaction
	// reaches them, in order.
	pub, err := pki.ParseCSR(req.GetCsr())
	if err != nil {
		return refuse(&renewRefusal{reason: "csr-invalid"})
	}
	chain := req.GetChain()
	if len(chain) == 0 {
		return refuse(&renewRefusal{reason: "chain-missing"})
	}
	leaf, err := x509.ParseCertificate(chain[0])
	if err != nil {
		return refuse(&renewRefusal{reason: "leaf-invalid"})
	}
	popOK := pki.VerifyRenewPoP(leaf.PublicKey, req.GetCsr(), req.GetNodeId(), req.GetClientTimeUnixMs(), req.GetPopSig()) == nil
	// SECURITY: replays are recognised by the signed message, not by the
	// signature bytes: an ECDSA signature can be re-encoded into another
	// valid one (s -> n-s) by anyone who saw it, e.g. a gateway.
	proof := sha256.Sum256(pki.RenewPoPMessage(req.GetCsr(), req.GetNodeId(), req.GetClientTimeUnixMs()))
	var peerCert *x509.Certificate
	var peerID pki.NodeIdentity
	peerErr := "peer-missing"
	if len(peer.Cert) > 0 {
		peerErr = "peer-invalid"
		if c, err := x509.ParseCertificate(peer.Cert); err == nil {
			if id, err := pki.NodeIdentityOf(c); err == nil {
				peerCert, peerID, peerErr = c, id, ""
			}
		}
	}

	var body *agentv1.JoinResponseBody
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		now := s.clock.Now()
		row, err := tx.GetNodeCert(ctx, pki.SerialHex(leaf))
		if errors.Is(err, store.ErrNotFound) || err == nil && !bytes.Equal(row.DER, chain[0]) {
			// Not a certificate JoinService issued, or a re-signed or
			// altered copy of one.
			return &renewRefusal{reason: "leaf-unknown"}
		} else if err != nil {
			return err
		}
		n, err := tx.GetNode(ctx, row.NodeID)
		if err != nil {
			return fmt.Errorf("read the leaf's node: %w", err)
		}
		if !popOK {
			return &renewRefusal{reason: "pop-invalid", nodeID: n.ID, serial: row.Serial}
		}
		// From here the caller proved the key of one of this node's
		// certificates: refusals go to the node's owner.
		ref := func(reason string) error {
			return &renewRefusal{reason: reason, tenantID: n.TenantID, nodeID: n.ID, serial: row.Serial}
		}
		switch {
		case req.GetNodeId() != n.ID:
			return ref("node-id-mismatch")
		case n.State == store.NodeRetired:
			return ref("node-retired")
		case row.IdentityGeneration != n.IdentityGeneration:
			return ref("leaf-generation")
		case row.RevokedAt != nil:
			return ref("leaf-revoked")
		case !now.Before(row.NotAfter):
			return ref("leaf-expired")
		case now.Before(row.NotBefore):
			return ref("leaf-not-yet-valid")
		}
		// The caller's mTLS identity is this node (R13.2).
		if peerErr != "" {
			return ref(peerErr)
		}
		if peerID.NodeID != n.ID {
			return ref("peer-node")
		}
		prow := row
		if !bytes.Equal(peer.Cert, row.DER) {
			prow, err = tx.GetNodeCert(ctx, pki.SerialHex(peerCert))
			if errors.Is(err, store.ErrNotFound) || err == nil && !bytes.Equal(prow.DER, peer.Cert) {
				return ref("peer-unknown")
			} else if err != nil {
				return err
			}
		}
		switch {
		case prow.NodeID != n.ID:
			return ref("peer-node")
		case prow.IdentityGeneration != n.IdentityGeneration:
			return ref("peer-generation")
		case prow.RevokedAt != nil:
			return ref("peer-revoked")
		case !now.Before(prow.NotAfter) || now.Before(prow.NotBefore):
			return ref("peer-expired")
		}
		if skew := now.Sub(time.UnixMilli(req.GetClientTimeUnixMs())); skew > RenewClockSkew || skew < -RenewClockSkew {
			return ref("client-time")
		}
		// R13.3/R13.4: the statements come from the stored row, never from
		// the CSR, so a TPM-held key cannot be renewed into a software key.
		var statements []string
		if err := json.Unmarshal(row.Statements, &statements); err != nil {
			return fmt.Errorf("read the leaf's statements: %w", err)
		}
		for _, st := range statements {
			if strings.HasPrefix(st, TPMAKStatementPrefix) {
				// TPM2_Certify checking is not built yet: refuse rather than
				// renew without the proof (never downgrade).
				if len(req.GetKeyAttestation()) == 0 {
					return ref(ReasonKeyAttestationMissing)
				}
				return ref(ReasonKeyAttestationAK)
			}
		}
		fresh, err := tx.UseRenewProof(ctx, proof[:], n.ID, now, RenewProofWindow)
		if err != nil {
			return err
		}
		if !fresh {
			return ref("proof-replayed")
		}

		id, err := pki.NodeIdentityOf(leaf)
		if err != nil {
			return fmt.Errorf("read the stored leaf: %w", err)
		}
		role := row.Role
		ttl := s.cfg.CertTTL
		if role == pki.RoleRamdisk {
			ttl = min(ttl, MaxRamdiskCertTTL)
		}
		// An attestor may have shortened the first certificate; a renewal
		// never lengthens it.
		if prior := row.NotAfter.Sub(row.NotBefore); prior > 0 {
			ttl = min(ttl, prior)
		}
		nb := now.Add(-backdateFor(ttl))
		cert, err := pki.SignNodeCertKey(b.NodeCA, b.NodeCAKey, pub, pki.NodeCertParams{
			TrustDomain: b.TrustDomain, SiteID: id.SiteID, NodeID: n.ID, Role: role, Statements: statements,
			NotBefore: nb, NotAfter: nb.Add(ttl),
		})
		if err != nil {
			return fmt.Errorf("sign node certificate: %w", err)
		}
		if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: cert.Serial, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Role: role,
			SPKISHA256: cert.SPKISHA256, DER: cert.DER, AllowedKinds: row.AllowedKinds, Statements: row.Statements,
			NotBefore: cert.Cert.NotBefore, NotAfter: cert.Cert.NotAfter}); err != nil {
			return err
		}
		data, err := json.Marshal(map[string]any{
			"nodeId": n.ID, "siteId": id.SiteID, "role": role, "certSerial": cert.Serial, "previousSerial": row.Serial,
			"identityGeneration": n.IdentityGeneration, "notAfter": cert.Cert.NotAfter.UTC().Format(time.RFC3339), "peer": peer.Addr,
		})
		if err != nil {
			return fmt.Errorf("marshal renew event: %w", err)
		}
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.certificate-renewed", Subject: n.ID, Data: json.RawMessage(data)}); err != nil {
			return err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: "node:" + n.ID, Action: "node.certificate-renewed", Resource: "compute-node/" + n.ID, Data: json.RawMessage(data)}); err != nil {
			return err
		}
		body = &agentv1.JoinResponseBody{
			NodeId: n.ID, CertChain: [][]byte{cert.DER, b.NodeCA.Raw}, CommandBundle: [][]byte{b.CommandSigningCert.Raw},
			CsrSha256: csrHash, TrustDomain: b.TrustDomain, SiteId: id.SiteID, Role: role, IdentityGeneration: int64(n.IdentityGeneration),
		}
		return nil
	})
	var rr *renewRefusal
	if errors.As(err, &rr) {
		return refuse(rr)
	}
	if err != nil {
		return nil, err
	}
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("marshal renew response: %w", err)
	}
	sig, err := pki.SignResponse(b.JoinSigningKey, raw)
	if err != nil {
		return nil, fmt.Errorf("sign renew response: %w", err)
	}
	return &agentv1.RenewResponse{Body: raw, Sig: sig, SigningCertificate: b.JoinSigningCert.Raw}, nil
}

// renewRefused records a refused renewal (R13.5) in its own transaction,
// rate-limited per reason like join refusals (R4.7).
func (s *Service) renewRefused(ctx context.Context, r *renewRefusal, csrHash []byte) {
	ok, suppressed := s.limiter.Allow("renew:" + r.reason)
	s.log.Info("renew refused", "reason", r.reason, "tenant", r.tenantID, "node", r.nodeID, "csr_sha256", hex.EncodeToString(csrHash),
		"suppressed", suppressed, "recorded", ok)
	if !ok {
		return
	}
	data := map[string]any{"reason": r.reason, "csrSha256": hex.EncodeToString(csrHash), "suppressed": suppressed}
	if r.nodeID != "" {
		data["nodeId"] = r.nodeID
	}
	if r.serial != "" {
		data["certSerial"] = r.serial
	}
	s.recordRefusal(ctx, r.tenantID, events.Event{Type: "security.renew.refused", Subject: r.nodeID, Data: data})
}
