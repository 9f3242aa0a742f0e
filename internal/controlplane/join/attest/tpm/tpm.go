// Package tpm is the tpm attestor (R9.2): a machine with a TPM 2.0 joins
// with no token. Leg 1 carries the EK (and its certificate) as evidence and
// the AK's TPM2_Certify of the CSR's key over sha256(csr) as the request's
// key_attestation; the attestor checks the certify (internal/shared/tpmverify) and
// answers a credential challenge for the EK and the AK. Leg 2 repeats the
// request with the activated secret: only the TPM holding both the EK and
// the AK recovers it, so the node key is proven to live, fixedTPM, in the
// EK's TPM. Then the EK's trust decides: a trusted EK (manufacturer CA or
// EK-hash allow-list of a pool) joins its pool with nodeKey "tpm" and the
// statement urn:bc:tpm-ak:…; an unknown EK becomes a join request
// (enrollment) in the first pool that allows it, and is otherwise refused.
//
// SECURITY: what binds each field a relay could change (R15.1). The
// request digest (pki.JoinRequestDigest: protocol, attestor, role, node id,
// CSR, claims, evidence, key attestation; never the answer) is signed on
// every leg by the node key (request_sig, purpose tpm-join), and the
// certify and the activation prove that key lives, fixedTPM, in the EK's
// TPM: a relay that changes any field of either leg, or both legs alike,
// breaks that signature. The challenge is stateless: its secret is an
// HMAC, under a key derived from the join-encryption key, of that same
// digest and its expiry, so an answer admits only the request it was made
// for, briefly. The answer itself is left out of the digest, so a leg 2
// that arrives again, whatever encoding its answer has, gets the answer
// stored for its request digest (R4.9) and never makes a second node.
//
// The role is the server's, never the machine's (R15.2): a tpm join makes
// a node; a request for site or ramdisk is refused (role-not-allowed),
// since those roles come only from tokens minted by the site's modules.
package tpm

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
	"github.com/better-compute/better-compute/internal/shared/wire"
	"github.com/google/go-tpm/tpm2"
)

// Name of the attestor.
const Name = wire.AttestorTPM

// ChallengeTTL is how long a challenge may be answered.
const ChallengeTTL = 2 * time.Minute

// NodeKeyTPM is the admission's NodeKey: the key is proven to be in the TPM.
const NodeKeyTPM = "tpm"

// Refusal reasons decided here (the certify's come from tpmverify).
const (
	ReasonTokenPresent     = "token-present"
	ReasonEvidenceMissing  = "evidence-missing"
	ReasonAnswerInvalid    = "activation-answer-invalid"
	ReasonChallengeExpired = "challenge-expired"
	ReasonActivation       = "activation-failed"
	ReasonEKUnknown        = "ek-not-allowed"
	ReasonRole             = "role-not-allowed"
	ReasonRequestSig       = "request-signature"
)

// Role is the role of every tpm join's certificate (R15.2).
const Role = pki.RoleNode

// Pool is one pool's EK trust (the serve config's [[join.tpm.pools]]).
type Pool struct {
	PoolID string
	// Trust holds the manufacturer CAs and the EK-hash allow-list.
	Trust tpmverify.Trust
	// Enrollment turns an unknown EK into a join request in this pool.
	Enrollment bool
	// AllowReclaim lets a machine whose EK and AK already belong to a node
	// of this pool's tenant take that node back (a wiped disk, a reset
	// bcd: R15.3), as its next identity generation.
	AllowReclaim bool
}

// Config lists the attestor's dependencies.
type Config struct {
	// Pools are tried in order: an EK joins the first pool that trusts it;
	// an unknown one enrolls in the first pool with enrollment.
	Pools []Pool
	// ChallengeKey keys the challenge HMAC; every API replica must share
	// it (ChallengeKeyFrom derives it from the join-encryption key).
	ChallengeKey []byte
	Clock        clock.Clock
}

// Attestor is the tpm attestor.
type Attestor struct {
	cfg Config
}

// New returns the attestor.
func New(cfg Config) (*Attestor, error) {
	if len(cfg.ChallengeKey) < 32 {
		return nil, errors.New("tpm attestor: a 32-byte challenge key is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	return &Attestor{cfg: cfg}, nil
}

// Name implements attest.Attestor.
func (*Attestor) Name() string { return Name }

// proven is what a leg proved before any challenge: the EK, the AK's
// name and the evidence.
type proven struct {
	ek     *tpm2.TPMTPublic
	akName []byte
	ev     *agentv1.TPMEvidence
}

// check is what both legs check before the challenge: no token, the role,
// the evidence, the EK, the certify of the CSR's key by the AK, and the node
// key's signature over the whole request (R15.1).
func (a *Attestor) check(in *attest.Input) (*proven, error) {
	if in.Token != "" {
		return nil, attest.Refuse(ReasonTokenPresent, "")
	}
	if in.Role != Role {
		return nil, attest.Refuse(ReasonRole, "")
	}
	var ev agentv1.TPMEvidence
	if len(in.Evidence) == 0 || proto.Unmarshal(in.Evidence, &ev) != nil {
		return nil, attest.Refuse(ReasonEvidenceMissing, "")
	}
	ek, err := tpmverify.ParseEK(ev.GetEkPublic())
	if err != nil {
		return nil, refusal(err)
	}
	if len(in.KeyAttestation) == 0 {
		return nil, attest.Refuse("key-attestation-missing", "")
	}
	ka, err := tpmverify.ParseKeyAttestation(in.KeyAttestation)
	if err != nil {
		return nil, refusal(err)
	}
	csrKey, err := pki.ParseCSR(in.CSR)
	if err != nil {
		return nil, attest.Refuse("csr-invalid", "")
	}
	akName, err := tpmverify.Verify(ka, in.CSR, csrKey)
	if err != nil {
		return nil, refusal(err)
	}
	// R15.1: the node key binds the whole request, on this leg and the
	// next.
	if pki.VerifyJoinRequest(csrKey, in.RequestDigest, in.RequestSig) != nil {
		return nil, attest.Refuse(ReasonRequestSig, "")
	}
	return &proven{ek: ek, akName: akName, ev: &ev}, nil
}

// Challenge implements attest.Challenger: leg 1. It answers a request that
// carries no answer yet with a credential challenge that only the TPM
// holding both the EK and the AK can activate, bound to the request digest
// and ChallengeTTL.
func (a *Attestor) Challenge(_ context.Context, in *attest.Input) ([]byte, error) {
	pr, err := a.check(in)
	if err != nil {
		return nil, err
	}
	expires := a.cfg.Clock.Now().Add(ChallengeTTL).UnixMilli()
	blob, encSecret, err := tpmverify.MakeCredential(nil, pr.ek, pr.akName, a.secret(in.RequestDigest, expires))
	if err != nil {
		return nil, refusal(err)
	}
	return proto.Marshal(&agentv1.TPMChallenge{CredentialBlob: blob, EncryptedSecret: encSecret, ExpiresUnixMs: expires})
}

// Admit implements attest.Attestor: leg 2, the request again with the
// activated secret. Proven, the EK's trust decides.
func (a *Attestor) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	pr, err := a.check(in)
	if err != nil {
		return nil, err
	}
	now := a.cfg.Clock.Now()
	var ans agentv1.TPMChallengeAnswer
	if len(in.Answer) == 0 || proto.Unmarshal(in.Answer, &ans) != nil {
		return nil, attest.Refuse(ReasonAnswerInvalid, "")
	}
	exp := ans.GetExpiresUnixMs()
	if exp <= now.UnixMilli() || exp > now.Add(ChallengeTTL).UnixMilli() {
		return nil, attest.Refuse(ReasonChallengeExpired, "")
	}
	if subtle.ConstantTimeCompare(ans.GetSecret(), a.secret(in.RequestDigest, exp)) != 1 {
		return nil, attest.Refuse(ReasonActivation, "")
	}
	stmt, err := tpmverify.Statement(pr.akName)
	if err != nil {
		return nil, attest.Refuse(tpmverify.ReasonAKAttributes, "")
	}
	ekHash, err := tpmverify.EKHash(pr.ek)
	if err != nil {
		return nil, refusal(err)
	}
	for _, p := range a.cfg.Pools {
		ok, err := p.Trust.Trusted(pr.ek, pr.ev.GetEkCertificate(), now)
		if err != nil {
			return nil, refusal(err)
		}
		if ok {
			return a.admission(ctx, tx, p, in, stmt, ekHash, nil)
		}
	}
	for _, p := range a.cfg.Pools {
		if p.Enrollment {
			ap := &attest.Approval{MachineKey: attest.MachineKeyFor(hwid.HardwareKey{}, ekHash, "", ""), EKHash: ekHash, AKName: pr.akName}
			ap.EKCert, ap.EKCertSubject, ap.EKCertIssuer = ekCertificate(pr.ev.GetEkCertificate())
			return a.admission(ctx, tx, Pool{PoolID: p.PoolID}, in, stmt, ekHash, ap)
		}
	}
	return nil, attest.Refuse(ReasonEKUnknown, "")
}

func (a *Attestor) admission(ctx context.Context, tx *store.Tx, p Pool, in *attest.Input, stmt string, ekHash []byte, approval *attest.Approval) (*attest.Admission, error) {
	pool, site, err := tx.GetPoolWithSite(ctx, p.PoolID)
	if err != nil {
		return nil, fmt.Errorf("tpm attestor: read pool %s: %w", p.PoolID, err)
	}
	if approval != nil {
		approval.MachineKey = attest.MachineKeyFor(hwid.HardwareKey{}, approval.EKHash, site.ID, "")
	}
	tenant := pool.OwnerTenantID
	adm := &attest.Admission{
		TenantID: tenant, PoolID: pool.ID, SiteID: site.ID, Role: Role,
		NodeKey: NodeKeyTPM, Statements: []string{stmt}, Approval: approval,
		// The AK is this TPM's (a primary of its endorsement seed, which
		// survives a TPM clear): the node admitted is the one it names.
		Bind: func(ctx context.Context, tx *store.Tx, nodeID string) error {
			return tx.SetNodeTPMAK(ctx, tenant, stmt, nodeID, ekHash)
		},
	}
	if p.AllowReclaim && approval == nil {
		// R15.3: the same EK (trusted above) and the same AK as a node
		// of this tenant is proof of the same machine, whatever its
		// claims say now.
		switch n, err := tx.NodeByTPMAK(ctx, tenant, stmt); {
		case err == nil:
			adm.ReclaimNodeID, adm.AllowReclaim = n.ID, true
		case !errors.Is(err, store.ErrNotFound):
			return nil, err
		}
	}
	return adm, nil
}

// MaxCertName bounds the EK certificate's subject and issuer a join
// request records, in bytes: the machine chose them.
const MaxCertName = 256

// ekCertificate is the standing of an enrolling EK's certificate, for its
// join request (R22.1): absent, or untrusted with the subject and issuer
// the machine sent. No pool's manufacturer CAs anchored it (a trusted EK
// joins without a request), so nothing in it is verified; a person reads
// it as a claim, beside the EK hash the TPM proved.
func ekCertificate(der []byte) (standing, subject, issuer string) {
	if len(der) == 0 {
		return store.EKCertAbsent, "", ""
	}
	c, err := tpmverify.ParseEKCertificate(der)
	if err != nil {
		return store.EKCertUntrusted, "", ""
	}
	return store.EKCertUntrusted, clip(c.Subject.String()), clip(c.Issuer.String())
}

// clip cuts s to MaxCertName bytes, on a rune boundary.
func clip(s string) string {
	if len(s) <= MaxCertName {
		return s
	}
	s = s[:MaxCertName]
	for !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// refusal turns a tpmverify failure into a refusal with its reason.
func refusal(err error) error {
	if r := tpmverify.ReasonOf(err); r != "" {
		return attest.Refuse(r, "")
	}
	return err
}

// secret is the challenge's secret for a request digest and an expiry.
func (a *Attestor) secret(leg []byte, expiresMS int64) []byte {
	m := hmac.New(sha256.New, a.cfg.ChallengeKey)
	m.Write([]byte("better-compute tpm challenge v2\x00"))
	m.Write(leg)
	m.Write(binary.BigEndian.AppendUint64(nil, uint64(expiresMS)))
	return m.Sum(nil)
}

// ChallengeKeyFrom derives the challenge key from the join-encryption
// key's private scalar, which every API replica holds.
func ChallengeKeyFrom(joinEncryptionKey []byte) []byte {
	m := hmac.New(sha256.New, joinEncryptionKey)
	m.Write([]byte("better-compute tpm challenge key v1"))
	return m.Sum(nil)
}
