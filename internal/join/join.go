// Package join is JoinService: it checks a machine's evidence through an
// attestor, creates or reclaims the node row, and signs its certificate, all
// in one database transaction, so any refusal leaves nothing behind and
// spends no token use. The daemon learns only "Join refused"; the reason is
// recorded as a security.join.refused event, rate-limited per attestor and
// reason, routed to the token's tenant once its secret verified and to the
// root tenant before.
package join

import (
	"context"
	"crypto/ecdsa"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/clock"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/events"
	"github.com/better-compute/better-compute/internal/hwid"
	"github.com/better-compute/better-compute/internal/ids"
	"github.com/better-compute/better-compute/internal/join/attest"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/tenancy"
)

// DefaultAttestor is the attestor of a request that names none.
const DefaultAttestor = "join-token"

// UnknownAttestor names, in refusal events, a request for an attestor that
// is not configured.
const UnknownAttestor = "unknown"

// Certificate lifetimes.
const (
	MaxCertTTL        = 24 * time.Hour
	MaxRamdiskCertTTL = 2 * time.Hour
	// backdate allows for node clocks a little behind the server's.
	backdate = 5 * time.Minute
)

// backdateFor is how far before now a certificate of lifetime ttl starts:
// backdate, but at most a tenth of the lifetime, so that a short-lived
// certificate (cert_ttl_seconds down to 60) is still valid when issued and
// bcd's renewal at 60% of the lifetime lies ahead, not behind.
func backdateFor(ttl time.Duration) time.Duration { return min(backdate, ttl/10) }

// Work kinds queued for the controllers.
const WorkAdopt = "adopt"

// Config lists JoinService's dependencies.
type Config struct {
	DB *store.DB
	// Bundle is the machine PKI; nil makes every join INVALID_CONFIG.
	Bundle    *pki.Bundle
	Attestors attest.Registry
	Clock     clock.Clock
	Log       *slog.Logger
	Hub       *events.Hub
	// CertTTL is certTtlSeconds: default and maximum 24 h.
	CertTTL time.Duration
	// Limiter bounds refusal events (default 60 per attestor and reason per
	// minute).
	Limiter *events.Limiter
}

// Service is JoinService.
type Service struct {
	cfg     Config
	db      *store.DB
	log     *slog.Logger
	clock   clock.Clock
	limiter *events.Limiter
	bundle  []byte // the command-signing trust bundle (DER certs), precomputed
	// root caches the root tenant's id: it never changes once bootstrap set
	// it, and every join needs it.
	root atomic.Pointer[string]
}

// New returns JoinService.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil {
		return nil, errors.New("join: a store is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.CertTTL == 0 {
		cfg.CertTTL = MaxCertTTL
	}
	if cfg.CertTTL < time.Minute || cfg.CertTTL > MaxCertTTL {
		return nil, errs.New(errs.InvalidConfig, "certTtlSeconds must be from 60 to 86400")
	}
	if cfg.Limiter == nil {
		cfg.Limiter = events.NewLimiter(cfg.Clock, 60, time.Minute)
	}
	return &Service{cfg: cfg, db: cfg.DB, log: cfg.Log, clock: cfg.Clock, limiter: cfg.Limiter}, nil
}

// Peer is what the gateway says about the daemon's connection.
type Peer struct {
	Addr string
	// Cert is the DER leaf the daemon presented on its TLS connection to
	// the gateway (Renew only), nil when none. It is trusted as the
	// caller's mTLS identity only because the agent listener authenticates
	// the gateway; Renew still matches it against node_certs.
	Cert []byte
}

// errRefused is the only refusal the daemon ever sees.
var errRefused = errs.New(errs.AccessDenied, "Join refused")

// errRace is the answer to the loser of two racing joins of one machine.
var errRace = errs.New(errs.Conflict, "This machine joined concurrently; retry")

// refusal carries what the refusal event needs.
type refusal struct {
	attestor, reason, tenantID, role string
	csrHash                          []byte
	hwKey                            hwid.HardwareKey
}

// Join admits a machine (R4).
func (s *Service) Join(ctx context.Context, req *agentv1.JoinRequest, peer Peer) (*agentv1.JoinResponse, error) {
	b := s.cfg.Bundle
	if b == nil {
		return nil, errs.New(errs.InvalidConfig, "JoinService is not configured: the server has no machine PKI (pki.dir)")
	}
	in, pub, ref := s.check(req)
	if ref != nil {
		s.refused(ctx, ref)
		return nil, errRefused
	}
	att := s.cfg.Attestors[ref0(req.GetAttestor())]
	res, err := s.admit(ctx, att, in, pub, req, peer)
	var r *attest.Refusal
	switch {
	case err == nil:
		return res, nil
	case errors.As(err, &r):
		s.refused(ctx, &refusal{attestor: att.Name(), reason: r.Reason, tenantID: r.TenantID, role: in.Role, csrHash: in.CSRSHA256, hwKey: in.Key})
		return nil, errRefused
	case errors.Is(err, errRace):
		return nil, errRace
	default:
		return nil, err
	}
}

func ref0(a string) string {
	if a == "" {
		return DefaultAttestor
	}
	return a
}

// check parses and checks the request's shape before any database work. It
// returns the CSR's key, whose signature it verified, for the certificate.
func (s *Service) check(req *agentv1.JoinRequest) (*attest.Input, *ecdsa.PublicKey, *refusal) {
	name := ref0(req.GetAttestor())
	role := req.GetRole()
	if role == "" {
		role = pki.RoleNode
	}
	sum := sha256.Sum256(req.GetCsr())
	in := &attest.Input{Role: role, CSRSHA256: sum[:], CSR: req.GetCsr()}
	if ev := req.GetX509Pop(); ev != nil {
		in.X509Pop = &attest.X509Pop{Chain: ev.GetChain(), ClientTimeMS: ev.GetClientTimeUnixMs(), Sig: ev.GetSig()}
	}
	ref := func(reason string) *refusal {
		return &refusal{attestor: name, reason: reason, role: role, csrHash: in.CSRSHA256, hwKey: in.Key}
	}
	if _, ok := s.cfg.Attestors[name]; !ok {
		// The requested name is the caller's text: recording it would let
		// a caller pick its own rate-limit key (and write what it likes
		// into the root tenant's stream), so the refusal is filed under
		// one fixed name.
		name = UnknownAttestor
		return nil, nil, ref("attestor-unknown")
	}
	if role != pki.RoleNode && role != pki.RoleSite && role != pki.RoleRamdisk {
		// Like the attestor name, the caller's text is not recorded.
		role = "invalid"
		return nil, nil, ref("role-invalid")
	}
	if req.GetNodeId() != "" && !ids.Valid(ids.Node, req.GetNodeId()) {
		return nil, nil, ref("node-id-invalid")
	}
	pub, err := pki.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, nil, ref("csr-invalid")
	}
	c := req.GetClaims()
	norm, err := hwid.Normalize(hwid.Claims{
		ProductUUID: c.GetProductUuid(), ProductSerial: c.GetProductSerial(), BoardSerial: c.GetBoardSerial(), ChassisSerial: c.GetChassisSerial(),
		MACs: c.GetMacs(), GPUUUIDs: c.GetGpuUuids(), Hostname: c.GetHostname(),
	})
	if err != nil {
		var ce *hwid.ClaimError
		if errors.As(err, &ce) {
			return nil, nil, ref(ce.Reason)
		}
		return nil, nil, ref("claims-invalid")
	}
	in.Claims, in.Key = norm, norm.Key()
	if sealed := req.GetSealedToken(); sealed != "" {
		tok, err := pki.Open(s.cfg.Bundle.JoinEncryptionKey, sealed, req.GetCsr())
		if err != nil {
			reason, ok := pki.SealReason(err)
			if !ok {
				reason = "seal-invalid"
			}
			return nil, nil, ref(reason)
		}
		in.Token = tok
	}
	return in, pub, nil
}

// admit runs the admission transaction. Its statements are ordered for the
// hot token row (PostgreSQL): reads and checks, then the certificate is
// signed, then the inserts, and the attestor's spend last, so the token row
// is locked only from the spend to the commit and never while signing.
func (s *Service) admit(ctx context.Context, att attest.Attestor, in *attest.Input, pub *ecdsa.PublicKey, req *agentv1.JoinRequest, peer Peer) (*agentv1.JoinResponse, error) {
	b := s.cfg.Bundle
	// Neither depends on the transaction, and a retried transaction reuses
	// them.
	claims := in.Claims.Claims()
	claimsJSON, err := json.Marshal(claims)
	if err != nil {
		return nil, fmt.Errorf("marshal claims: %w", err)
	}
	var body *agentv1.JoinResponseBody
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		adm, err := att.Admit(ctx, tx, in)
		if err != nil {
			return err
		}
		tenant := adm.TenantID
		pool, site, err := tx.GetPoolWithSite(ctx, adm.PoolID)
		if err != nil {
			return fmt.Errorf("read pool: %w", err)
		}
		if pool.OwnerTenantID != tenant {
			return attest.Refuse("pool-tenant", tenant)
		}
		if pool.Agent != tenancy.AgentBCD {
			return attest.Refuse("pool-agent", tenant)
		}
		policy, err := tenancy.ParsePolicy(pool.Policy)
		if err != nil {
			return err
		}
		if !policy.AllowsAttestor(att.Name()) {
			return attest.Refuse("pool-attestor", tenant)
		}
		// R10.5: an admission naming a node re-joins it (x509pop). The
		// attestor named the node from a certificate JoinService issued to
		// it, so the expect binding, the placeholder rule and the
		// hardware-key reclaim rules below do not apply: they decide which
		// node a machine's claims make it, and the certificate already
		// decided that. The node keeps its hardware key.
		rejoin := adm.NodeID != ""
		// R5: the expect binding; a mismatch spends nothing (rollback).
		if !rejoin && !adm.Expect.Empty() && !adm.Expect.Matches(in.Claims) {
			return attest.Refuse("expect-mismatch", tenant)
		}
		// R6.2: placeholder hardware needs an expect binding.
		if !rejoin && in.Key.PlaceholderHardware() && adm.Expect.Empty() {
			return attest.Refuse("placeholder-hardware", tenant)
		}
		// Placeholder hardware admitted by an expect binding joins with an
		// untrusted key (R6.2), so it never reclaims: a key of two kinds
		// without a product UUID or serial (e.g. MAC + GPU) is trusted by
		// hwid but not here.
		trusted := in.Key.Trusted && !in.Key.PlaceholderHardware()
		root, err := s.rootTenant(ctx, tx)
		if err != nil {
			return err
		}
		role := certRole(adm, policy, pool, site, root)

		// R6.3: a trusted key that already belongs to a node is a reclaim.
		var existing *store.Node
		if rejoin {
			n, err := tx.GetNode(ctx, adm.NodeID)
			if err != nil {
				return fmt.Errorf("read the re-joining node: %w", err)
			}
			existing, trusted = &n, n.HardwareKeyTrusted
		} else if trusted {
			n, err := tx.NodeByHardwareKey(ctx, in.Key.Hash[:])
			if err == nil {
				existing = &n
			} else if !errors.Is(err, store.ErrNotFound) {
				return err
			}
		}
		if want := req.GetNodeId(); want != "" && (existing == nil || existing.ID != want) {
			return attest.Refuse("node-id-mismatch", tenant)
		}
		state := store.NodeAdopting
		n := store.Node{
			TenantID: tenant, SiteID: pool.SiteID, PoolID: pool.ID, Role: role, State: state,
			HardwareKeyTrusted: trusted, NodeKey: adm.NodeKey, Attestor: att.Name(),
			Hostname: claims.Hostname, Claims: claimsJSON, JoinTokenID: adm.JoinTokenID,
		}
		if trusted {
			n.HardwareKey = in.Key.Hash[:]
		}
		reclaim := existing != nil && !rejoin
		if rejoin {
			if existing.State == store.NodeRetired || existing.TenantID != tenant || existing.SiteID != pool.SiteID || existing.PoolID != pool.ID || family(existing.Role) != family(role) {
				return attest.Refuse("rejoin", tenant)
			}
			n.ID, n.HardwareKey = existing.ID, existing.HardwareKey
		} else if reclaim {
			if !adm.AllowReclaim || existing.TenantID != tenant || existing.SiteID != pool.SiteID || existing.PoolID != pool.ID || family(existing.Role) != family(role) {
				return attest.Refuse("reclaim", tenant)
			}
			// A reclaim only ever lowers trust: a node made tenant-controlled
			// by a hosted token stays so.
			if existing.Role == pki.RoleNodeTenant {
				role = pki.RoleNodeTenant
				n.Role = role
			}
			n.ID = existing.ID
		} else {
			n.ID = ids.New(ids.Node, s.clock.Now())
		}

		// Sign before the writes: the certificate needs only the node id,
		// and no lock is held yet.
		now := s.clock.Now()
		ttl := s.cfg.CertTTL
		if role == pki.RoleRamdisk {
			ttl = min(ttl, MaxRamdiskCertTTL)
		}
		if adm.MaxTTL > 0 {
			ttl = min(ttl, adm.MaxTTL)
		}
		nb := now.Add(-backdateFor(ttl))
		cert, err := pki.SignNodeCertKey(b.NodeCA, b.NodeCAKey, pub, pki.NodeCertParams{
			TrustDomain: b.TrustDomain, SiteID: pool.SiteID, NodeID: n.ID, Role: role, Statements: adm.Statements,
			NotBefore: nb, NotAfter: nb.Add(ttl),
		})
		if err != nil {
			return fmt.Errorf("sign node certificate: %w", err)
		}

		var revoked []string
		revokeReason := "reclaimed"
		if rejoin {
			revokeReason = "rejoined"
		}
		if reclaim || rejoin {
			if n, err = tx.ReclaimNode(ctx, n, existing.IdentityGeneration); errors.Is(err, store.ErrNotFound) {
				return errRace
			} else if err != nil {
				return err
			}
			if revoked, err = tx.RevokeNodeCerts(ctx, n.ID, n.IdentityGeneration, revokeReason); err != nil {
				return err
			}
		} else {
			n.IdentityGeneration = 1
			if n, err = tx.InsertNode(ctx, n); err != nil {
				if store.IsUniqueViolation(err) {
					return errRace
				}
				return err
			}
		}
		kinds, _ := json.Marshal(nonNil(adm.AllowedKinds))
		stmts, _ := json.Marshal(nonNil(adm.Statements))
		if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: cert.Serial, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Role: role,
			SPKISHA256: cert.SPKISHA256, DER: cert.DER, AllowedKinds: kinds, Statements: stmts, NotBefore: cert.Cert.NotBefore, NotAfter: cert.Cert.NotAfter}); err != nil {
			return err
		}
		if err := tx.UpsertNodeAuthz(ctx, n.ID, tenant, pool.SiteID, pool.ID, role); err != nil {
			return err
		}
		// R4.5: without acceptance checks the controllers adopt the node now;
		// with them, its first Hello starts acceptance.
		if policy.Acceptance == nil {
			if err := tx.EnqueueWork(ctx, WorkAdopt, n.ID); err != nil {
				return err
			}
		}
		for _, serial := range revoked {
			if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: tenant, Type: "security.certificate-revoked", Subject: n.ID,
				Data: map[string]any{"nodeId": n.ID, "serial": serial, "reason": revokeReason}}); err != nil {
				return err
			}
		}
		joined := map[string]any{
			"nodeId": n.ID, "poolId": pool.ID, "siteId": pool.SiteID, "role": role, "attestor": att.Name(), "reclaim": reclaim,
			"hardwareKeyTrusted": trusted, "certSerial": cert.Serial, "nodeKey": adm.NodeKey, "identityGeneration": n.IdentityGeneration,
			"joinTokenId": adm.JoinTokenID, "hostname": n.Hostname, "peer": peer.Addr,
		}
		if rejoin {
			joined["rejoin"] = true
		}
		data, err := json.Marshal(joined)
		if err != nil {
			return fmt.Errorf("marshal join event: %w", err)
		}
		// The event and the audit row carry the same data: marshal it once.
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: tenant, Type: "node.joined", Subject: n.ID, Data: json.RawMessage(data)}); err != nil {
			return err
		}
		action := "node.joined"
		switch {
		case reclaim:
			action = "node.reclaimed"
		case rejoin:
			action = "node.rejoined"
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: tenant, Actor: "node:" + n.ID, Action: action, Resource: "compute-node/" + n.ID, Data: json.RawMessage(data)}); err != nil {
			return err
		}
		// Last: spending may lock the token row until the commit.
		if adm.Spend != nil {
			if err := adm.Spend(ctx, tx); err != nil {
				return err
			}
		}
		body = &agentv1.JoinResponseBody{
			NodeId: n.ID, CertChain: [][]byte{cert.DER, b.NodeCA.Raw}, CommandBundle: [][]byte{b.CommandSigningCert.Raw},
			CsrSha256: in.CSRSHA256, TrustDomain: b.TrustDomain, SiteId: pool.SiteID, Role: role, IdentityGeneration: int64(n.IdentityGeneration),
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("marshal join response: %w", err)
	}
	sig, err := pki.SignResponse(b.JoinSigningKey, raw)
	if err != nil {
		return nil, fmt.Errorf("sign join response: %w", err)
	}
	return &agentv1.JoinResponse{Body: raw, Sig: sig, SigningCertificate: b.JoinSigningCert.Raw}, nil
}

// rootTenant returns the root tenant's id, reading it until bootstrap has
// set it ("" before) and from the cache after: it never changes then.
func (s *Service) rootTenant(ctx context.Context, tx *store.Tx) (string, error) {
	if id := s.root.Load(); id != nil {
		return *id, nil
	}
	id, err := tx.RootTenantID(ctx)
	if err != nil || id == "" {
		return id, err
	}
	s.root.Store(&id)
	return id, nil
}

// certRole decides the certificate's role (R8): a hosted token makes a
// tenant-controlled node-tenant, unless the pool is platform-operated and
// owned by the platform. The token decides, never the machine's claims.
func certRole(adm *attest.Admission, policy tenancy.Policy, pool store.Pool, site store.Site, root string) string {
	if adm.Hosted == "" || adm.Role != pki.RoleNode {
		return adm.Role
	}
	platformOwned := pool.OwnerTenantID == site.OwnerTenantID && !site.Custom && (root == "" || pool.OwnerTenantID == root)
	if policy.Kubernetes.PlatformOperated && platformOwned {
		return pki.RoleNode
	}
	return pki.RoleNodeTenant
}

// family is the token role behind a certificate role: node-tenant is a node
// that a hosted token made tenant-controlled.
func family(role string) string {
	if role == pki.RoleNodeTenant {
		return pki.RoleNode
	}
	return role
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// refused records a refusal (R4.7) in its own transaction: the join's own
// transaction has rolled back.
func (s *Service) refused(ctx context.Context, r *refusal) {
	reason := r.attestor + ":" + r.reason
	ok, suppressed := s.limiter.Allow(reason)
	s.log.Info("join refused", "reason", reason, "tenant", r.tenantID, "csr_sha256", hex.EncodeToString(r.csrHash), "suppressed", suppressed, "recorded", ok)
	if !ok {
		return
	}
	data := map[string]any{"attestor": r.attestor, "reason": reason, "role": r.role, "csrSha256": hex.EncodeToString(r.csrHash),
		"hardwareKey": r.hwKey.Hex(), "suppressed": suppressed}
	s.recordRefusal(ctx, r.tenantID, events.Event{Type: "security.join.refused", Subject: r.attestor, Data: data})
}

// recordRefusal publishes a refusal event in its own transaction (the
// refused one rolled back) to tenantID, or to the root tenant when it is ""
// (the caller proved nothing yet, so it may not write into a tenant's
// stream).
func (s *Service) recordRefusal(ctx context.Context, tenantID string, e events.Event) {
	// The daemon may hang up; the record is still written.
	ctx = context.WithoutCancel(ctx)
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		e.TenantID = tenantID
		if e.TenantID == "" {
			root, err := s.rootTenant(ctx, tx)
			if err != nil || root == "" {
				return err
			}
			e.TenantID = root
		}
		return events.Publish(ctx, tx, s.cfg.Hub, e)
	})
	if err != nil {
		s.log.Error("record refusal", "type", e.Type, "err", err)
	}
}
